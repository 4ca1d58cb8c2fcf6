"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): small valid inputs
and near-valid ones, each a step from an accepted input. Deterministic; rerun after a format
change with the repo's .venv (it has transformers and safetensors):

    .venv/bin/python tests/fuzz/make_corpus.py

Files the fuzzers found (reproducers) are kept by hand next to these; this script never deletes.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

HERE = Path(__file__).resolve().parent


def put(target: str, name: str, data: bytes | str) -> None:
    d = HERE / "corpus" / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data.encode() if isinstance(data, str) else data)


def compact(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---- safetensors_header: [u64 N][N bytes JSON][data] ----

def raw_safetensors(header: dict, data: bytes, pad: bool = False) -> bytes:
    text = compact(header).encode()
    if pad:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_header() -> None:
    t = "safetensors_header"
    put(t, "valid_two.safetensors", save({"w": torch.arange(6, dtype=torch.float32).view(2, 3),
                                          "b": torch.ones(4, dtype=torch.bfloat16)},
                                         metadata={"format": "pt"}))
    dtypes = [torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    put(t, "valid_dtypes.safetensors",
        save({str(d).removeprefix("torch."): torch.zeros(2, dtype=d) for d in dtypes}))
    put(t, "valid_scalar_empty.safetensors",
        save({"s": torch.tensor(3.0), "e": torch.zeros(0, 5), "r": torch.zeros(3, 0, 2)}))
    # Unpadded header: the data area starts at an odd offset, tensors map misaligned (copied).
    put(t, "valid_misaligned.safetensors",
        raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "I16", "shape": [1, 1], "data_offsets": [8, 10]}},
                        bytes(range(10))))
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    near = {
        "overlap": ({"a": entry, "b": {**entry, "data_offsets": [4, 12]}}, 12),
        "gap": ({"a": {**entry, "data_offsets": [4, 12]}}, 12),
        "trailing": ({"a": entry}, 12),
        "size_mismatch": ({"a": {**entry, "shape": [3]}}, 8),
        "negative_dim": ({"a": {**entry, "shape": [-2]}}, 8),
        "float_dim": ({"a": {**entry, "shape": [2.0]}}, 8),
        "huge_dims": ({"a": {**entry, "shape": [4294967296, 4294967296]}}, 8),
        # no bytes, strides past int64 (found by the fuzzer: PyTorch's error escaped get())
        "empty_stride_overflow": ({"a": {**entry, "shape": [0, 9223372036854775807, 2],
                                         "data_offsets": [0, 0]}}, 0),
        "offsets_reversed": ({"a": {**entry, "data_offsets": [8, 0]}}, 8),
        "offsets_past_end": ({"a": {**entry, "data_offsets": [0, 8]}}, 4),
        "unknown_dtype": ({"a": {**entry, "dtype": "F4"}}, 8),
        "metadata_not_string": ({"__metadata__": {"k": 1}, "a": entry}, 8),
        "entry_not_object": ({"a": [1, 2]}, 0),
    }
    for name, (header, n) in near.items():
        put(t, f"near_{name}.safetensors", raw_safetensors(header, bytes(n)))
    text = b'{"a":' + compact(entry).encode() + b',"a":' + compact(entry).encode() + b"}"
    put(t, "near_duplicate.safetensors", struct.pack("<Q", len(text)) + text + bytes(8))
    put(t, "near_length_past_end.safetensors", struct.pack("<Q", 1000) + b"{}")
    put(t, "near_short.safetensors", b"\x02\x00\x00")


# ---- safetensors_index: model.safetensors.index.json of fuzz_safetensors_index's fixture ----

def safetensors_index() -> None:
    t = "safetensors_index"
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    put(t, "valid_two_shards.json", json.dumps(
        {"metadata": {"total_size": 15}, "weight_map": {"a": s1, "b": s1, "c": s2}}, indent=2))
    put(t, "valid_other_name.json", compact({"weight_map": {"s": "other.safetensors"}}))
    put(t, "valid_partial.json", compact({"weight_map": {"c": s2}}))
    put(t, "near_wrong_file.json", compact({"weight_map": {"a": s2}}))
    put(t, "near_missing_file.json", compact({"weight_map": {"a": "model-00003-of-00003.safetensors"}}))
    put(t, "near_not_string.json", compact({"weight_map": {"a": 1}}))
    put(t, "near_no_weight_map.json", compact({"metadata": {}}))
    put(t, "near_escape_parent.json", compact({"weight_map": {"x": "../outside.safetensors"}}))
    put(t, "near_subdir.json", compact({"weight_map": {"c": f"../ckpt/{s2}"}}))
    put(t, "near_tensor_twice.json", compact({"weight_map": {"a": s1, "s": "other.safetensors",
                                                             "c": s2, "x": s1}}))


# ---- config: config.json as Transformers writes it, one per architecture ----

CONFIGS = {
    "qwen3_moe": dict(vocab_size=97, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      num_experts=5, num_experts_per_tok=2, mlp_only_layers=[1],
                      use_sliding_window=True, sliding_window=4),
    "deepseek_v3": dict(vocab_size=89, hidden_size=20, intermediate_size=36, moe_intermediate_size=12,
                        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                        q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                        v_head_dim=5, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                        topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        max_position_embeddings=64,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                                         "mscale_all_dim": 1.0,
                                         "original_max_position_embeddings": 16,
                                         "rope_theta": 10000.0}),
    "glm4_moe": dict(vocab_size=91, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
                     use_qk_norm=True),
    "mixtral": dict(vocab_size=83, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5,
                    num_experts_per_tok=2, sliding_window=4,
                    rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    "qwen2_moe": dict(vocab_size=79, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                      shared_expert_intermediate_size=20, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=5,
                      num_experts_per_tok=2, decoder_sparse_step=2, use_sliding_window=True,
                      sliding_window=4, max_window_layers=2),
    "olmoe": dict(vocab_size=73, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=5, num_experts_per_tok=2,
                  clip_qkv=0.5, pad_token_id=0),
    "gpt_oss": dict(vocab_size=71, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5,
                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64),
}


def config() -> None:
    from transformers import AutoConfig

    t = "config"
    for family, kwargs in CONFIGS.items():
        c = json.loads(AutoConfig.for_model(family, **kwargs).to_json_string(use_diff=False))
        c.pop("transformers_version", None)
        put(t, f"valid_{family}.json", compact(c))
    # v4 style (rope_theta + rope_scaling), Kimi-K2's model_type, and a few one-key breaks.
    put(t, "valid_v4_rope_scaling.json", compact({
        "model_type": "mixtral", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 4,
        "num_local_experts": 2, "num_experts_per_tok": 1, "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}}))
    put(t, "valid_kimi_k2.json", compact({
        "model_type": "kimi_k2", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
        "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "moe_intermediate_size": 4, "intermediate_size": 8}))
    put(t, "near_unknown_type.json", compact({"model_type": "llama", "vocab_size": 8}))
    put(t, "near_quantized.json", compact({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "fp8"}}))
    put(t, "near_not_object.json", "[1, 2, 3]")


# ---- recipe: the recipes under examples/, as the Python front hands them over (JSON) ----

def recipe() -> None:
    import yaml

    t = "recipe"
    for name in ("lora", "deepseek_v3", "demo"):
        r = yaml.safe_load((HERE.parents[1] / "examples" / f"{name}.yaml").read_text())
        r["model"]["path"] = "/models/tiny"
        r["checkpoint"]["dir"] = "runs/tiny"
        put(t, f"valid_{name}.json", compact(r))
    full = {"model": {"path": "m", "dtype": "bfloat16", "backend": {"attn": "eager",
                                                                    "experts": "torch_mm",
                                                                    "fake_balanced_gate": True},
                      "router_aux_loss_coef": 0.01},
            "data": {"train": ["a.jsonl", "b.jsonl"], "validation": "v.jsonl", "format": "alpaca",
                     "seq_len": 16, "packing": False, "train_on": "all", "on_error": "skip",
                     "shuffle": False, "cache_dir": "c"},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 3,
                      "epochs": 0.5, "seed": 1, "device": "cuda:1", "threads": 2.0},
            "optimizer": {"lr": 1e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1},
            "schedule": {"type": "linear", "warmup_ratio": 0.1},
            "checkpoint": {"dir": "d", "export_layout": "fused", "export_dtype": "float32"},
            "log": {"jsonl": "m.jsonl", "tensorboard": "tb", "peak_tflops": 100, "progress": "off"},
            "parallel": {"ep": 2, "dp": "auto", "zero": 2, "bucket_mb": 8, "timeout_s": 60},
            "peft": {"r": 4, "target_modules": "q_proj|v_proj", "use_rslora": True}}
    put(t, "valid_every_key.json", compact(full))
    put(t, "near_unknown_key.json", compact({**full, "train": {"micro_batch": 1}}))
    put(t, "near_batch_mismatch.json", compact({**full, "train": {
        "micro_batch_size": 3, "grad_accumulation_steps": 2, "global_batch_size": 8}}))
    put(t, "near_missing_path.json", compact({"data": {"train": "a.jsonl"},
                                              "checkpoint": {"dir": "d"}}))


# ---- dataset: .amds files as automoe.data writes them ----

def dataset() -> None:
    import importlib.util
    import tempfile

    # automoe.data alone (the package itself needs the built extension).
    spec = importlib.util.spec_from_file_location(
        "automoe_data", HERE.parents[1] / "python" / "automoe" / "data.py")
    data = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = data
    spec.loader.exec_module(data)

    t = "dataset"
    cases = {
        "valid_three_docs": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
        "valid_one_token": [[42]],
        "valid_empty": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, docs in cases.items():
            p = Path(tmp) / f"{name}.amds"
            ids = [np.asarray(d, dtype=np.int64) for d in docs]
            masks = [np.asarray([i % 2 for i in range(len(d))], dtype=np.uint8) for d in docs]
            data._write(p, ids, masks, {"source": "fuzz"})
            put(t, f"{name}.amds", p.read_bytes())
    good = (HERE / "corpus" / t / "valid_three_docs.amds").read_bytes()
    hlen = struct.unpack("<Q", good[8:16])[0]
    header = json.loads(good[16:16 + hlen])

    def with_header(**changes) -> bytes:
        text = compact({**header, **changes}).encode().ljust(hlen)
        assert len(text) == hlen
        return good[:16] + text + good[16 + hlen:]

    put(t, "near_bad_magic.amds", b"AMDS0002" + good[8:])
    put(t, "near_truncated.amds", good[:-5])
    put(t, "near_misaligned_tokens.amds", with_header(tokens_at=header["tokens_at"] + 2))
    put(t, "near_tokens_overlap_header.amds", with_header(tokens_at=0))
    put(t, "near_float_count.amds", with_header(n_docs=3.0))
    put(t, "near_too_many_docs.amds", with_header(n_docs=4))
    put(t, "near_header_length.amds", good[:8] + struct.pack("<Q", len(good)) + good[16:])


if __name__ == "__main__":
    for make in (safetensors_header, safetensors_index, config, recipe, dataset):
        make()
