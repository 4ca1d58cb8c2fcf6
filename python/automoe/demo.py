"""`make demo`: build (once, cached) a tiny Qwen3-MoE with Transformers, load it in AutoMoE and
print its loss on a sample batch, next to the loss Transformers computes for the same batch.

The trainer issue turns this into a real fine-tune; for now it shows the engine end to end:
Hugging Face checkpoint -> C++ engine -> loss and gradients -> Hugging Face checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

DEMO_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    max_position_embeddings=256,
    router_aux_loss_coef=0.01,
)
DEMO_VERSION = "qwen3-moe-tiny-v1"


def demo_checkpoint(cache: Path) -> Path:
    """A Transformers-written Qwen3-MoE checkpoint, created on first use."""
    path = cache / DEMO_VERSION
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**DEMO_CONFIG))
    tmp = Path(tempfile.mkdtemp(dir=cache))
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.environ.get("AUTOMOE_CACHE", ".cache/automoe"))
    args = parser.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)

    import automoe
    import transformers
    from transformers import AutoModelForCausalLM as HFModel

    transformers.utils.logging.disable_progress_bar()

    path = demo_checkpoint(cache)
    t0 = time.perf_counter()
    model = automoe.AutoModelForCausalLM.from_pretrained(path)
    load_s = time.perf_counter() - t0
    spec = model.spec
    print(f"model       {path} ({spec['model_type']}, {model.num_parameters():,} parameters, "
          f"{sum(spec['layer_is_moe'])} MoE layers x {spec['num_experts']} experts, top-{spec['top_k']}, "
          f"{model.layout} layout) loaded in {load_s * 1e3:.0f} ms")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab_size"], (4, 64), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 48:] = 0
    mask[3, 40:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    out = model(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    print(f"batch       4 x 64 tokens ({int(mask.sum())} real, the rest padding)")
    print(f"loss        {out.loss.item():.6f}  (aux loss {out.aux_loss.item():.6f}, "
          f"grad norm {grad_norm.item():.4f})")

    hf = HFModel.from_pretrained(path)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    rel = abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item())
    print(f"reference   Transformers loss {ref.loss.item():.6f} (relative difference {rel:.1e})")
    if not torch.isfinite(out.loss) or rel > 1e-5:
        raise SystemExit("demo: AutoMoE and Transformers disagree")


if __name__ == "__main__":
    main()
