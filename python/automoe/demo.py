"""`make demo`: a real fine-tune on the CPU, end to end, in a few minutes.

1. Builds (once, cached) a tiny Qwen3-MoE checkpoint with Transformers, with a byte-level BPE
   tokenizer trained on examples/data/corpus.txt and a ChatML chat template.
2. Runs `automoe train examples/demo.yaml` on examples/data/chat_train.jsonl: a few hundred steps
   of packed chat fine-tuning, checkpoints, metrics, and a Hugging Face export.
3. Loads the export in Transformers and in AutoMoE, and shows that both give the same loss on a
   held-out batch (examples/data/chat_valid.jsonl), and how far it fell from the start.

`python -m automoe.demo --model deepseek_v3` (or glm4_moe, mixtral, qwen2_moe, olmoe, gpt_oss, nemotron_h, qwen3_next) does the same
for a tiny model of that family with examples/<model_type>.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

DEMO_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    max_position_embeddings=512,
    router_aux_loss_coef=0.01,
)
DEMO_VERSION = "qwen3-moe-tiny-chat-v1"
# The other natively implemented families, as tiny chat models of about the same size:
# model_type -> (Transformers config class, config, cache directory name, the recipe to train).
FAMILY_DEMOS = {
    "qwen3_moe": ("Qwen3MoeConfig", DEMO_CONFIG, DEMO_VERSION, "demo.yaml"),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
        "deepseek-v3-tiny-chat-v1", "deepseek_v3.yaml"),
    "glm4_moe": ("Glm4MoeConfig", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
        max_position_embeddings=512), "glm4-moe-tiny-chat-v1", "glm4_moe.yaml"),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=128, max_position_embeddings=512, router_aux_loss_coef=0.01),
        "mixtral-tiny-chat-v1", "mixtral.yaml"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        max_position_embeddings=512, router_aux_loss_coef=0.01), "qwen2-moe-tiny-chat-v1",
        "qwen2_moe.yaml"),
    "olmoe": ("OlmoeConfig", dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, clip_qkv=8.0,
        max_position_embeddings=512, router_aux_loss_coef=0.01), "olmoe-tiny-chat-v1",
        "olmoe.yaml"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=64, max_position_embeddings=512, router_aux_loss_coef=0.01,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "rope_theta": 150000.0}), "gpt-oss-tiny-chat-v1", "gpt_oss.yaml"),
    "nemotron_h": ("NemotronHConfig", dict(
        hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention", "moe",
                                           "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, routed_scaling_factor=2.5,
        max_position_embeddings=512), "nemotron-h-tiny-chat-v1", "nemotron_h.yaml"),
    "qwen3_next": ("Qwen3NextConfig", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        max_position_embeddings=512, router_aux_loss_coef=0.01), "qwen3-next-tiny-chat-v1",
        "qwen3_next.yaml"),
}
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Path, vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on `corpus`, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_checkpoint(path: Path, tokenizer, seed: int = 0, family: str = "qwen3_moe", **overrides) -> Path:
    """A randomly initialised model of `family` (Qwen3-MoE by default) written by Transformers,
    with `tokenizer` saved beside."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, config, _, _ = FAMILY_DEMOS[family]
    cfg = dict(config, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def demo_checkpoint(cache: Path, family: str = "qwen3_moe") -> Path:
    path = cache / FAMILY_DEMOS[family][2]
    if not (path / "config.json").exists():
        build_checkpoint(path, build_tokenizer(EXAMPLES / "data" / "corpus.txt"), family=family)
    return path


def num_experts(config: dict) -> int | None:
    """The routed experts a config.json declares, under whichever key its family writes:
    `num_experts` (Qwen2-MoE, OLMoE), `n_routed_experts` (DeepSeek-V3, GLM-4.5) or
    `num_local_experts` (Mixtral, GPT-OSS, and Qwen3-MoE as Transformers v5 saves it)."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if config.get(key) is not None:
            return config[key]
    return None


def heldout_batch(model_path: Path, n: int = 16):
    """input_ids / attention_mask / labels of the first n held-out chats, padded (right)."""
    from automoe import data

    tok = data.load_tokenizer(model_path)
    enc = data.Encoder(tok, "chat", "completion")
    rows = []
    with open(EXAMPLES / "data" / "chat_valid.jsonl") as f:
        for line in list(f)[:n]:
            rows.append(enc(json.loads(line)))
    S = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), S), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.long)
    labels = torch.full((len(rows), S), -100, dtype=torch.long)
    for i, (t, m) in enumerate(rows):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
        labels[i, : len(t)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(t), torch.tensor(-100))
    return ids, mask, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.environ.get("AUTOMOE_CACHE", ".cache/automoe"))
    parser.add_argument("--model", default="qwen3_moe", choices=sorted(FAMILY_DEMOS),
                        help="which model family to build and fine-tune (default: qwen3_moe)")
    parser.add_argument("--lora", action="store_true",
                        help="fine-tune with LoRA (examples/lora.yaml; Qwen3-MoE): adapters on every "
                             "linear layer and the routed experts, exported as a PEFT adapter")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=50")
    args = parser.parse_args()
    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)

    import transformers
    from transformers import AutoModelForCausalLM as HFModel

    import automoe

    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    ckpt = demo_checkpoint(cache, args.model)
    recipe = FAMILY_DEMOS[args.model][3]
    run = cache / ("demo-run" if args.model == "qwen3_moe" else f"demo-run-{args.model}")
    if args.lora:
        if args.model != "qwen3_moe":
            raise SystemExit("demo: --lora runs on the Qwen3-MoE demo model")
        recipe, run = "lora.yaml", cache / "demo-run-lora"
    if run.exists():
        shutil.rmtree(run)  # the demo always fine-tunes from scratch
    config = json.loads((ckpt / "config.json").read_text())
    print(f"model       {ckpt} (tiny {config['model_type']}, {num_experts(config)} experts, "
          f"top-{config['num_experts_per_tok']}; ready in {time.perf_counter() - t0:.1f} s)")

    ids, mask, labels = heldout_batch(ckpt)
    with torch.no_grad():
        before = HFModel.from_pretrained(ckpt)(input_ids=ids, attention_mask=mask, labels=labels).loss.item()

    cmd = [sys.executable, "-m", "automoe.cli", "train", str(EXAMPLES / recipe),
           f"model.path={ckpt}", f"checkpoint.dir={run}", f"data.cache_dir={cache / 'datasets'}",
           *args.overrides]
    print("train       " + " ".join(["automoe", *cmd[3:]]), flush=True)
    t1 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=REPO)
    if rc != 0:
        raise SystemExit(f"demo: automoe train failed (exit status {rc})")
    train_s = time.perf_counter() - t1
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in records if r["type"] == "train"]
    print(f"trained     {steps[-1]['step']} steps in {train_s:.0f} s; training loss "
          f"{steps[0]['loss']:.3f} (first log) -> {steps[-1]['loss']:.3f} (last)")

    export = run / "export"
    with torch.no_grad():
        if args.lora:  # the export is a PEFT adapter: PEFT puts it on each side's model
            from peft import PeftModel

            hf_model = PeftModel.from_pretrained(HFModel.from_pretrained(ckpt), export)
            our_model = PeftModel.from_pretrained(automoe.AutoModelForCausalLM.from_pretrained(ckpt), export)
        else:
            hf_model = HFModel.from_pretrained(export)
            our_model = automoe.AutoModelForCausalLM.from_pretrained(export)
        hf = hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        ours = our_model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    rel = abs(ours - hf) / abs(hf)
    how = f"Transformers + PEFT adapter {export}" if args.lora else f"Transformers on {export}"
    print(f"held out    {int((labels != -100).sum())} answer tokens: loss {before:.3f} before -> {hf:.3f} after "
          f"fine-tuning ({how})")
    print(f"parity      AutoMoE on the same export: {ours:.6f} vs Transformers {hf:.6f} (relative difference {rel:.1e})")
    command = REPO / ".venv" / "bin" / "automoe"
    command = str(command.relative_to(Path.cwd())) if command.exists() and command.is_relative_to(Path.cwd()) \
        else "automoe"
    print(f"report      {command} report {run}   (loss curve and expert-load heat map)")
    if rel > 1e-4 or not hf < (0.9 if args.lora else 0.7) * before:
        raise SystemExit("demo: the fine-tune did not lower the held-out loss, or AutoMoE and Transformers disagree")


if __name__ == "__main__":
    main()
