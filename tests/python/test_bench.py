"""The side-by-side benchmark harness end to end on a tiny config (1 timed step): both sides run,
the FLOPs formula is the hand-counted one, and the JSON has every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import AUTOMOE_BIN, REPO

TINY = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
    "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
    "mlp_only_layers": [1], "dtype": "float32",
}


def hand_count_train_flops(seq: int) -> float:
    H, N, KV, D, E, K, I, Id, V = 16, 2, 1, 8, 4, 2, 8, 24, 64
    attn = 2 * H * N * D + 2 * 2 * H * KV * D + 2 * N * D * H + 2 * 2 * N * D * (seq + 1) / 2
    moe = 2 * H * E + K * (2 * H * 2 * I + 2 * I * H)
    dense = 2 * H * 2 * Id + 2 * Id * H
    return 3 * (attn + moe + attn + dense + 2 * H * V)


def test_compare_hf_runs_both_sides_and_writes_every_field(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    doc = tmp_path / "performance.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare_hf.py"), "--config", str(cfg), "--batch", "2",
         "--seq", "12", "--warmup", "0", "--steps", "1", "--dtype", "float32", "--impls", "eager",
         "--fake-balanced-gate", "--repeat", "2", "--out", str(out), "--record", str(doc),
         "--automoe", str(AUTOMOE_BIN)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "results.json").read_text())
    sides = {r["side"]: r for r in result["sides"]}
    assert set(sides) == {"transformers", "automoe"}

    sys.path.insert(0, str(REPO / "bench"))
    from compare_hf import SIDE_FIELDS

    for r in result["sides"]:
        assert r["error"] is None, r["error"]
        assert set(SIDE_FIELDS) <= set(r), set(SIDE_FIELDS) - set(r)
        assert r["tokens_per_s"] > 0 and r["forward_ms"] > 0 and r["backward_ms"] > 0
        assert r["peak_memory_bytes"] > 0 and r["tflops"] > 0
        assert r["train_flops_per_token"] == hand_count_train_flops(12)
        assert abs(r["tokens_per_s"] - 24 / ((r["forward_ms"] + r["backward_ms"]) / 1e3)) < 1e-6 * r["tokens_per_s"]
    assert sides["transformers"]["speedup_vs_baseline"] == 1.0
    assert sides["transformers"]["step_time_vs_baseline"] == 1.0
    assert sides["automoe"]["step_time_vs_baseline"] == (
        sides["automoe"]["step_ms"] / sides["transformers"]["step_ms"])
    assert result["meta"]["peak_tflops"]["float32"] > 0
    # the same model on both sides
    assert sides["automoe"]["num_parameters"] == sides["transformers"]["num_parameters"]
    assert (out / "chart.png").stat().st_size > 1000
    assert "| automoe" in (out / "results.md").read_text()
    assert "<!-- bench tiny.json:cpu:float32:fake -->" in doc.read_text()


def test_bench_print_config_gives_the_exact_qwen3_30b_layer_geometry():
    proc = subprocess.run([str(AUTOMOE_BIN), "bench", "--preset", "qwen3-30b-a3b-L4", "--print-config"],
                          capture_output=True, text=True, check=True)
    cfg = json.loads(proc.stdout)["config"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["vocab_size"], cfg["num_hidden_layers"]) == (2048, 32, 4, 128, 128, 8, 768, 151936, 4)
    bad = subprocess.run([str(AUTOMOE_BIN), "bench", "--preset", "nope"], capture_output=True, text=True)
    assert bad.returncode == 1 and "cpu-small" in bad.stderr


def test_compare_hf_runs_a_fallback_type_through_the_drop_in(tmp_path):
    """A GraniteMoE config: the AutoMoE side is Transformers' model with AutoMoE's kernels (the
    drop-in's path for types without a native engine model), the same model on both sides."""
    cfg = tmp_path / "granitemoe.json"
    cfg.write_text(json.dumps({"model_type": "granitemoe", "vocab_size": 64, "hidden_size": 16,
                               "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "num_local_experts": 4,
                               "num_experts_per_tok": 2}))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare_hf.py"), "--config", str(cfg), "--batch", "2",
         "--seq", "12", "--warmup", "0", "--steps", "1", "--dtype", "float32", "--impls", "grouped_mm",
         "--out", str(out), "--automoe", str(AUTOMOE_BIN)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO / "python")},
    )
    assert proc.returncode == 0, proc.stderr
    sides = {r["side"]: r for r in json.loads((out / "results.json").read_text())["sides"]}
    assert sides["automoe"]["error"] is None and sides["transformers"]["error"] is None
    assert "AutoMoE fused experts (2 modules)" in sides["automoe"]["impl"]
    assert sides["automoe"]["num_parameters"] == sides["transformers"]["num_parameters"]
    assert sides["automoe"]["tokens_per_s"] > 0 and sides["automoe"]["tflops"] is None


def test_bench_times_the_trainers_step_and_names_the_cpu_kernels(tmp_path):
    """`automoe bench` runs the trainer's step (train/step.h): float32 masters, fused AdamW; it
    reports tokens/s both as NeMo counts them (forward + backward) and per whole step, and the CPU
    kernel paths that ran."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = subprocess.run([str(AUTOMOE_BIN), "bench", "--config", str(cfg), "--batch", "2", "--seq",
                          "12", "--warmup", "0", "--steps", "2", "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["optimizer_ms"] > 0
    step_ms = r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]
    assert abs(r["tokens_per_s_step"] - 24 / (step_ms / 1e3)) < 1e-6 * r["tokens_per_s_step"]
    assert r["tokens_per_s"] > r["tokens_per_s_step"]
    assert r["trainable_parameters"] == r["num_parameters"]  # every weight has a float32 master
    assert {"isa", "cpu_isa", "gemm_bf16", "gemm_fp32", "elementwise"} <= set(r["cpu_kernels"])


def test_bench_profile_names_where_the_step_time_goes(tmp_path):
    """`--profile N` records the timed steps' ops: ATen's, AutoMoE's own op scopes, the autograd
    backward nodes and the optimizer phases, by self time (nested ops not counted twice), per
    step; the N largest go to stderr as a table, all of them into the JSON."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = subprocess.run([str(AUTOMOE_BIN), "bench", "--config", str(cfg), "--batch", "2", "--seq",
                          "12", "--warmup", "1", "--steps", "2", "--profile", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    rows = {row["name"]: row for row in r["profile"]}
    for name in ("aten::mm", "automoe::grouped_gemm", "automoe::router", "automoe::rmsnorm",
                 "automoe::linear_cross_entropy", "backward: GroupedGemmFn",
                 "automoe::optimizer: AdamW"):
        assert name in rows, sorted(rows)
    assert rows["automoe::router"]["calls"] == 1  # per step: one MoE layer (layer 1 is dense)
    for row in r["profile"]:
        assert 0 <= row["self_ms"] <= row["total_ms"] + 1e-9, row
    # the fused loss's own time excludes its GEMMs (ATen's or the engine's), reported apart
    lce = rows["automoe::linear_cross_entropy"]
    assert lce["self_ms"] < lce["total_ms"]
    step_ms = r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"]
    assert sum(row["self_ms"] for row in r["profile"]) <= 1.05 * step_ms
    assert "gpuGetDeviceCount" not in out.stderr  # Kineto's logs stay quiet unless asked for
    table = out.stderr[out.stderr.index("op (per step, by self time)"):]
    assert len([ln for ln in table.splitlines() if ln and not ln.startswith(("op ", "("))]) == 4


def test_the_automoe_command_runs_the_engine_on_jemalloc_and_reports_it(tmp_path):
    """`automoe` preloads jemalloc (keeping freed pages: glibc's malloc returns every tensor above
    32 MiB to the kernel and the next step page-faults it in again) where it is installed;
    AUTOMOE_ALLOCATOR=system keeps glibc's; another value is refused by name."""
    from automoe.engine_binary import find_jemalloc

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    args = [sys.executable, "-m", "automoe.cli", "bench", "--config", str(cfg), "--batch", "1",
            "--seq", "8", "--warmup", "0", "--steps", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "AUTOMOE_ALLOCATOR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    for choice, want in (("jemalloc", "jemalloc" if find_jemalloc() else "glibc"), ("system", "glibc")):
        out = subprocess.run(args, capture_output=True, text=True, timeout=300,
                             env={**env, "AUTOMOE_ALLOCATOR": choice})
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout[out.stdout.find("{"):])["allocator"] == want
    out = subprocess.run(args, capture_output=True, text=True, timeout=60,
                         env={**env, "AUTOMOE_ALLOCATOR": "tcmalloc"})
    assert out.returncode != 0 and "AUTOMOE_ALLOCATOR='tcmalloc'" in out.stderr


def test_the_allocator_leaves_a_users_preload_alone():
    """A sanitizer must come first in LD_PRELOAD and a user's own allocator must win: with any
    preload set, `automoe` adds nothing; AUTOMOE_ALLOCATOR=system adds nothing either."""
    from automoe.engine_binary import allocator_env

    env = allocator_env({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libasan.so.8"})
    assert env == {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libasan.so.8"}
    assert allocator_env({"AUTOMOE_ALLOCATOR": "system"}) == {"AUTOMOE_ALLOCATOR": "system"}


def test_version_names_the_package_version_libtorch_and_the_cpu_level():
    """`automoe --version`: the build's version is the Python package's (and pyproject's), with
    the LibTorch it runs on and the CPU kernels' instruction-set level."""
    import tomllib

    import torch

    import automoe

    out = subprocess.run([str(AUTOMOE_BIN), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert automoe.__version__ == project
    isa = dict(torch.ops.automoe._cpu_kernel_paths())["isa"]
    assert out.stdout.strip() == (f"automoe {project} (LibTorch {torch.__version__.split('+')[0]}, "
                                  f"CPU kernels {isa})")
