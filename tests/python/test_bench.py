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
    # --record: the table in this machine's hardware-class section, stamped with the commit
    import record

    stamp = record.stamp("cpu")
    recorded = doc.read_text()
    assert f"<!-- bench {stamp.hw_class} compare_hf tiny.json:float32:fake -->" in recorded
    assert f"## {record.CLASSES[stamp.hw_class]}" in recorded and f"commit {stamp.commit}" in recorded


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
    assert "AutoMoE grouped GEMMs (2 modules" in sides["automoe"]["impl"]
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


# ---------------------------------------------------------------------------------------------
# --record: each script's table goes into docs/performance.md's section of the hardware class it
# ran on, stamped, replacing the previous table of the same configuration (bench/record.py).
# ---------------------------------------------------------------------------------------------
ZEN5 = "processor\t: 0\nmodel name\t: AMD EPYC 9R45\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16\n"
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 fma\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def bench_module(name: str):
    import importlib

    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    return importlib.import_module(name)


def class_section(text: str, title: str) -> str:
    """The text of one `## title` section."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def compare_hf_result(tokens_per_s: float, model: str = "cpu-small", lora: int = 0) -> dict:
    compare_hf = bench_module("compare_hf")
    meta = dict(model=model, batch=2, seq=256, dtype="bfloat16", device="cpu", lora=lora, dropin=False,
                machine="?", warmup=1, steps=3, repeat=2, fake_balanced_gate=False,
                versions={"torch": "2.11.0", "transformers": "5.17.0", "python": "3.11"},
                date="2026-12-03", peak_tflops={"bfloat16": 0.826, "float32": 0.185},
                datasheet_bf16_tflops=None, train_flops_per_token=1e6)
    side = dict(tokens_per_step=512, forward_ms=20.0, backward_ms=30.0, optimizer_ms=9.0,
                peak_memory_bytes=2**30, baseline_memory_bytes=2**29, allocator="jemalloc",
                cpu_kernels={"gemm_bf16": "brgemm", "gemm_fp32": "avx512", "lm_head_bf16": "aten"})
    records = [dict(side, side="transformers", impl="transformers grouped_mm (sdpa)", tokens_per_s=1109.6,
                    step_ms=59.0, allocator="glibc"),
               dict(side, side="automoe", impl="automoe (experts=grouped, attn=sdpa, loss=fused_linear_ce)",
                    tokens_per_s=tokens_per_s, step_ms=31.0)]
    return compare_hf.summarize(records, meta, 1e6, 0.826, None)


def test_record_chooses_the_hardware_class_from_the_cpu_flags_and_the_device():
    record = bench_module("record")
    assert record.hardware_class("cpu", record.cpu_flags(SAPPHIRE)) == "amx"
    assert record.hardware_class("cpu", record.cpu_flags(ZEN5)) == "avx512-bf16"
    assert record.hardware_class("cpu", record.cpu_flags(ZEN3)) == "avx2"
    assert record.hardware_class("cpu", {"avx2", "avx512f"}) == "avx2"  # AVX-512 without bf16
    assert record.hardware_class("cuda", record.cpu_flags(SAPPHIRE)) == "nvidia-gpu"
    assert record.hardware_class("cuda:1", set()) == "nvidia-gpu"
    s = record.stamp("cpu", cpuinfo=ZEN5, date="2026-12-03", git_commit="bcce9f2")
    assert (s.hw_class, s.isa) == ("avx512-bf16", "AVX-512-BF16 + AVX-512 + AVX2")
    assert s.machine.startswith("AMD EPYC 9R45, ") and s.machine.endswith(" cores")
    assert record.heading("cpu-small · bfloat16", s) == (
        f"**cpu-small · bfloat16** · 2026-12-03 · {s.machine} · AVX-512-BF16 + AVX-512 + AVX2 · commit bcce9f2")


def test_record_stamps_the_short_commit_and_a_dirty_tree(tmp_path):
    record = bench_module("record")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run(git + ["add", "a.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert record.commit(tmp_path) == head
    (tmp_path / "untracked.json").write_text("{}")  # results beside the tree do not make it dirty
    assert record.commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert record.commit(tmp_path) == head + "+dirty"
    assert record.commit(tmp_path / "missing") == "unknown"


def test_compare_hf_record_replaces_its_table_in_its_class_and_leaves_the_others(tmp_path):
    compare_hf, record = bench_module("compare_hf"), bench_module("record")
    doc = tmp_path / "performance.md"
    zen5 = record.stamp("cpu", cpuinfo=ZEN5, date="2026-12-03", git_commit="aaaaaaa")
    zen3 = record.stamp("cpu", cpuinfo=ZEN3, date="2026-12-03", git_commit="bbbbbbb")
    key = compare_hf.record(compare_hf_result(9542.4), doc, zen5)
    assert key == "avx512-bf16 compare_hf cpu-small:bfloat16:real"
    compare_hf.record(compare_hf_result(1234.5, model="cpu-medium"), doc, zen5)
    compare_hf.record(compare_hf_result(2862.0), doc, zen3)
    compare_hf.record(compare_hf_result(7777.7), doc, record.Stamp(**{**vars(zen5), "commit": "ccccccc+dirty"}))
    text = doc.read_text()
    assert text.count(f"<!-- bench {key} -->") == 1 and text.count(f"<!-- /bench {key} -->") == 1
    zen5_part = class_section(text, "AVX-512-BF16 CPU")
    assert "| 7777.7 |" in zen5_part and "9542.4" not in text  # replaced, not appended
    assert "commit ccccccc+dirty" in zen5_part and "commit aaaaaaa" in zen5_part  # cpu-medium's kept
    assert "| 1234.5 |" in zen5_part and "**cpu-medium · bfloat16 · batch 2 × 256** · 2026-12-03" in zen5_part
    avx2_part = class_section(text, "AVX2 CPU")
    assert "| 2862.0 |" in avx2_part and "7777.7" not in avx2_part and "AVX2 · commit bbbbbbb" in avx2_part
    assert "### Training steps against Transformers" in avx2_part
    # LoRA runs are their own configuration, in their own slot
    lora_key = compare_hf.record(compare_hf_result(48.3, model="qwen3-30b-a3b-L2", lora=8), doc, zen5)
    assert lora_key == "avx512-bf16 lora qwen3-30b-a3b-L2:bfloat16:real:lora8"
    assert "### LoRA against Transformers + PEFT" in class_section(doc.read_text(), "AVX-512-BF16 CPU")


def test_records_land_in_the_documents_own_sections(tmp_path):
    """docs/performance.md has a slot for every benchmark in each measured hardware class and a
    bare 'Not measured yet.' in the others, so a recorded table goes where the document expects
    it: over the table of the same configuration, into an empty slot (whose 'Not measured yet.'
    goes), or as a class's first slot (and the class's 'Not measured yet.' goes)."""
    record, compare_hf = bench_module("record"), bench_module("compare_hf")
    real = (REPO / "docs" / "performance.md").read_text()
    for cls, title in record.CLASSES.items():
        part = class_section(real, title)
        if "<!-- bench " in part:
            for bench in record.BENCHMARKS:
                assert f"<!-- slot {cls} {bench} -->" in part and f"<!-- /slot {cls} {bench} -->" in part, (cls, bench)
        else:
            assert "<!-- slot " not in part and f"\n{record.NOT_MEASURED}\n" in part, cls
    # The cases below must not depend on which classes the real document has measured: the AVX2
    # LoRA slot and the whole AMX class start empty here (a bare 'Not measured yet.').
    amx_measured = class_section(real, "AMX CPU")
    real = real.replace(amx_measured, f"\n## AMX CPU\n\n{record.NOT_MEASURED}\n")
    avx2_lora = real.split("<!-- slot avx2 lora -->")[1].split("<!-- /slot avx2 lora -->")[0]
    real = real.replace(avx2_lora, f"\n{record.NOT_MEASURED}\n")
    doc = tmp_path / "performance.md"
    doc.write_text(real)
    zen5 = record.stamp("cpu", cpuinfo=ZEN5, date="2026-12-05", git_commit="eeeeeee")
    before = real.count("<!-- bench ")
    compare_hf.record(compare_hf_result(9999.9), doc, zen5)  # cpu-small bf16 is there already
    text = doc.read_text()
    assert text.count("<!-- bench ") == before and "| 9999.9 |" in class_section(text, "AVX-512-BF16 CPU")
    assert "| 9542.4 |" not in text
    avx2 = record.Stamp(**{**vars(zen5), "hw_class": "avx2", "isa": "AVX2"})
    compare_hf.record(compare_hf_result(55.5, model="qwen3-30b-a3b-L2", lora=8), doc, avx2)
    slot = doc.read_text().split("<!-- slot avx2 lora -->")[1].split("<!-- /slot avx2 lora -->")[0]
    assert "| 55.5 |" in slot and record.NOT_MEASURED not in slot
    amx = record.stamp("cpu", cpuinfo=SAPPHIRE, date="2026-12-05", git_commit="ddddddd")
    compare_hf.record(compare_hf_result(4321.0), doc, amx)
    text = doc.read_text()
    amx_part = class_section(text, "AMX CPU")
    assert "| 4321.0 |" in amx_part and "AMX + AVX-512-BF16 + AVX-512 + AVX2 · commit ddddddd" in amx_part
    assert record.NOT_MEASURED not in amx_part and "### Training steps against Transformers" in amx_part
    assert f"\n{record.NOT_MEASURED}\n" in class_section(text, "NVIDIA GPU")
    assert text.count("<!-- bench ") == before + 2
    assert text.splitlines()[:5] == real.splitlines()[:5] and text.endswith(real[real.index("## Method"):])


def test_train_vs_hf_ops_bench_and_parallel_record_into_their_slots(tmp_path):
    record = bench_module("record")
    doc = tmp_path / "performance.md"
    zen3 = record.stamp("cpu", cpuinfo=ZEN3, date="2026-12-03", git_commit="fffffff")
    train_vs_hf = bench_module("train_vs_hf")
    res = dict(meta=dict(preset="cpu-small", steps=20, warmup=3, micro=4, seq=256, threads=2, repeats=3,
                         cpu="AMD EPYC 7B13", torch="2.11.0", transformers="5.17.0", date="2026-12-03"),
               sides=[dict(impl="transformers grouped_mm (sdpa)", tokens_per_s=1402.0, peak_rss_bytes=2**30),
                      dict(impl="automoe experts=grouped", tokens_per_s=1751.0, peak_rss_bytes=2**29)],
               max_loss_rel_diff=1.6e-4)
    assert train_vs_hf.record(res, doc, zen3) == "avx2 train_vs_hf cpu-small:float32"
    res["sides"][1]["tokens_per_s"] = 1800.0
    train_vs_hf.record(res, doc, zen3)
    parallel = bench_module("parallel")
    meta = dict(preset="cpu-medium", dtype="bfloat16", accum=4, micro=1, seq=256, threads=1, ep="all", cpu="?")
    rows = [dict(nproc=1, ep=1, zero="-", bucket_mb="-", dispatcher="-", step_s=5.0, tokens_per_s=170.0,
                 peak_gib_per_rank=3.36),
            dict(nproc=2, ep=2, zero=1, bucket_mb=32.0, dispatcher="alltoall", step_s=3.0, tokens_per_s=282.0,
                 peak_gib_per_rank=2.2, wait_s_per_step=0.105, backward_wait_s_per_step=0.238,
                 grad_sync_s_per_step=0.072, mb_sent_per_step=28.7)]
    assert parallel.record(meta, rows, doc, zen3) == "avx2 parallel cpu-medium:bfloat16:ep-all"
    ops_bench = bench_module("ops_bench")
    result = dict(preset="qwen3-30b-a3b", dtype="bf16", device="cpu", shape=dict(T=4096), reps=5,
                  only_memory_bound=True, only_ce=False, threads=2, kernel_paths={"isa": "avx2"},
                  allocator="jemalloc", peaks=dict(matmul_n=1024, matmul_gflops=1.0, matmul_fp32_gflops=180.0,
                                                   copy_gbs=28.8, copy_mib=256),
                  rows=[dict(op="rmsnorm", fused_ms=6.03, reference_ms=46.86, speedup=7.77, gbs=13.9,
                             of_copy_bw=0.48)])
    assert ops_bench.record(result, doc, zen3) == "avx2 ops_bench qwen3-30b-a3b:bf16:T4096:memory-bound"
    text = doc.read_text()
    assert "| 1800 |" in text and "| 1751 |" not in text and text.count("avx2 train_vs_hf cpu-small") == 2
    assert "| 2 (2) | 1 | 32 | alltoall | 282 | 3.00 | 2.20 GiB | 0.65× | 105 / 238 ms | 72 ms | 28.70 |" in text
    assert "| rmsnorm | 6.03 | 46.86 | 7.77x | 13.9 GB/s = 48% of copy bw |" in text
    assert text.count("· AVX2 · commit fffffff") == 3
    for title in record.BENCHMARKS.values():
        assert text.count(f"### {title}") == (0 if title in (record.BENCHMARKS["compare_hf"], record.BENCHMARKS["lora"],
                                                             record.BENCHMARKS["dropin_ep_memory"]) else 1)


def test_compare_hf_refuses_no_full_finetune_without_lora():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "compare_hf.py"), "--preset", "cpu-small",
                        "--no-full-finetune"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--no-full-finetune" in r.stderr and "--lora" in r.stderr
