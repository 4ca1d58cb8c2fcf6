"""Shared fixtures: tiny Qwen3-MoE checkpoints written by Transformers itself (no downloads)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# What AutoMoE caches between processes (a CPU GEMM choice measured by one process, gemm_cpu.cpp;
# tokenised datasets without a data.cache_dir): the tests share a cache of their own, empty at the
# start, never the user's.
_CACHE = tempfile.mkdtemp(prefix="automoe-test-cache-")
os.environ["AUTOMOE_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# Where the `automoe train` tests keep their tokenised data, shared by the session: a dataset is
# tokenised once (Transformers' import and the tokenisation cost seconds a run), not once a test.
SHARED_DATA_CACHE = Path(_CACHE) / "datasets"

REPO = Path(__file__).resolve().parents[2]
AUTOMOE_BIN = REPO / "python" / "automoe" / "bin" / "automoe"

BASE = dict(
    vocab_size=97,
    hidden_size=24,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=5,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    max_position_embeddings=64,
    router_aux_loss_coef=0.01,
)

# Each varies what changes the math: expert count not a power of two, top-k 1 and > 2, norm_topk_prob
# both ways, mlp_only_layers, decoder_sparse_step 2, tied/untied embeddings, GQA ratios, head_dim
# different from hidden / heads, attention bias, RoPE scaling, sliding window.
CONFIGS = {
    "e5_top2_gqa2_untied": dict(pad_token_id=0),  # pad row of the embedding gets no gradient
    "e3_top1_norm_tied": dict(num_experts=3, num_experts_per_tok=1, norm_topk_prob=True,
                              tie_word_embeddings=True, num_key_value_heads=4),
    "e6_top3_norm_mlp_only": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                                  num_hidden_layers=3, mlp_only_layers=[1]),
    "e7_top4_sparse_step2_gqa4": dict(num_experts=7, num_experts_per_tok=4, decoder_sparse_step=2,
                                      num_hidden_layers=4, num_key_value_heads=1),
    "e4_top4_bias_tied_linear_rope": dict(num_experts=4, num_experts_per_tok=4, attention_bias=True,
                                          tie_word_embeddings=True, hidden_size=32, head_dim=12,
                                          rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 500.0}),
    "e9_top2_sliding_window": dict(num_experts=9, use_sliding_window=True, sliding_window=4,
                                   num_attention_heads=3, num_key_value_heads=3, head_dim=6,
                                   norm_topk_prob=True),
}


def qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**BASE, **overrides})


def write_checkpoint(path: Path, config, layout: str, seed: int = 0, dtype=torch.float32,
                     adjust=None) -> Path:
    """Transformers builds a random model from `config` and saves it in `layout`.

    Weights get a larger spread than Transformers' init so that routing is decisive (no near-ties
    between experts that float rounding could flip) and every path carries signal. `adjust(name,
    parameter)`, when given, then changes what a family needs changed (in place, under no_grad).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj_bias"):  # GPT-OSS: reach its SwiGLU's clamp at +-7
                p.normal_(0.0, 4.0)
            else:
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():  # DeepSeek-style routers: a bias that steers the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
        if adjust is not None:
            for name, p in model.named_parameters():
                adjust(name, p)
    model.save_pretrained(path, save_original_format=(layout == "per-expert"))
    return path


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    cache: dict = {}

    def make(name: str, layout: str = "per-expert", **overrides) -> Path:
        key = (name, layout, tuple(sorted(overrides.items())))
        if key not in cache:
            cfg = qwen3_moe_config(**{**CONFIGS.get(name, {}), **overrides})
            path = tmp_path_factory.mktemp(f"{name}-{layout}")
            cache[key] = write_checkpoint(path, cfg, layout)
        return cache[key]

    return make


def left_padded_prompts(vocab_size: int, seed: int = 3):
    """Three prompts of 7, 5 and 3 tokens, left-padded with token 0 (what generate expects)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def padded_batch(vocab_size: int, seed: int = 1):
    """Three rows of length 9: one full, one right-padded, one left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)  # padded with token 0 (the pad_token_id where a config has one)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(AUTOMOE_BIN), *map(str, args)], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"automoe {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE written by Transformers with a byte-level BPE tokenizer and a ChatML chat
    template saved beside it (what Trainer, TRL and pipelines need), router logits on."""
    from automoe.demo import EXAMPLES, build_checkpoint, build_tokenizer

    tokenizer = build_tokenizer(EXAMPLES / "data" / "corpus.txt", vocab_size=300)
    path = tmp_path_factory.mktemp("chat") / "qwen3-moe-chat"
    return build_checkpoint(path, tokenizer, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=5, mlp_only_layers=[], output_router_logits=True,
                            router_aux_loss_coef=0.02)


def chat_rows(n: int, split: str = "train") -> list[dict]:
    from automoe.demo import EXAMPLES

    with open(EXAMPLES / "data" / f"chat_{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_grads_close(ours: torch.nn.Module, ref: torch.nn.Module, tol: float = 1e-4) -> None:
    """Every parameter's gradient of `ours` within `tol` (rel_err) of `ref`'s, by name; None where
    `ref`'s is None."""
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None, name
            continue
        assert rel_err(p.grad, ref_params[name].grad) <= tol, name


def autograd_node_names(loss: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind `loss` (which kernels really ran)."""
    seen, stack, names = set(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names
