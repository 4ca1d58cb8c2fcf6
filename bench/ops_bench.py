"""Op benchmark: every fused op against its reference composition, measured in the same run.

For each op (forward + backward) it reports the fused and the reference time (best of --reps),
their ratio, and what the fused op achieves against the machine measured in the same run:
GEMM-bound ops in GFLOP/s against the dense matmul peak of the same dtype (at::mm on a square
problem); memory-bound ops in GB/s against the copy bandwidth (a large tensor copy). The MoE
experts block (router excluded: permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> unpermute)
is compared with the `eager` loop and ATen `_grouped_mm` (`torch_mm`); its GFLOP/s counts only
its GEMM FLOPs (3 GEMMs x 2 passes' worth: forward, dX and dW). The fused linear cross-entropy is
also measured for peak memory against the full-logits path, each in a child process whose peak RSS
growth is sampled every millisecond from /proc/self/statm (CPU) or read from the CUDA caching
allocator's peak (GPU).

  python bench/ops_bench.py --preset cpu-small --dtype bf16 --json out.json --markdown out.md
  python bench/ops_bench.py --preset qwen3-30b-a3b --tokens 1024 --ce-tokens 256 --device cpu
  python bench/ops_bench.py --preset qwen3-30b-a3b --only-memory-bound --record docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import automoe  # noqa: E402,F401  (registers torch.ops.automoe)
import record as recorder  # noqa: E402  (bench/record.py: --record's tables)

OPS = torch.ops.automoe

# T tokens, H hidden, E experts, K top-k, I expert intermediate, V vocabulary, N/KV heads, D head dim
PRESETS = {
    "qwen3-30b-a3b": dict(T=4096, H=2048, E=128, K=8, I=768, V=151936, N=32, KV=4, D=128),
    # the benchmark issue's cpu-small geometry (bench/presets in the engine)
    "cpu-small": dict(T=512, H=256, E=16, K=4, I=128, V=8192, N=8, KV=2, D=32),
    # Nemotron 3 Nano's layer geometry (hidden 2688, 128 experts top-6, vocabulary 131072; its
    # Mamba-2 mixer: MH heads of MP, MG groups of state MN, chunk MQ)
    "nemotron-3-nano": dict(T=1024, H=2688, E=128, K=6, I=1856, V=131072, N=32, KV=2, D=128,
                            MH=64, MP=64, MG=8, MN=128, MQ=128),
    # Qwen3-Next-80B-A3B's layer geometry (hidden 2048, 512 experts top-10, vocabulary 151936); its
    # gated DeltaNet: GN value heads (GK key heads) of GDk x GDv, chunk GQ
    "qwen3-next": dict(T=1024, H=2048, E=512, K=10, I=512, V=151936, N=16, KV=2, D=256,
                       GN=32, GK=16, GDk=128, GDv=128, GQ=64),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, device, reps, warmup=True, min_sample_s=2e-3):
    """Best of `reps` samples of fn's time. An op faster than min_sample_s is timed as a batch of
    calls per sample (one sample >= min_sample_s): a single 0.05-0.5 ms call's time is mostly the
    timer's and the scheduler's noise (the router read 0.40-0.53 ms in back-to-back runs)."""
    inner = 1
    if warmup:
        t0 = time.perf_counter()
        fn()  # warm-up (allocator, thread pool, lazy init)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        inner = max(1, min(1000, int(min_sample_s / max(time.perf_counter() - t0, 1e-7))))
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def fwd_bwd(fn, inputs):
    """A closure running fn(*inputs) and a backward of every float output with ones. The upstream
    gradients are made once, outside the timed closure (they are not the op's work)."""
    ones: list[torch.Tensor] = []

    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.grad is not None:
                t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [o for o in outs if o.requires_grad]
        if len(ones) != len(tensors) or any(g.shape != o.shape for g, o in zip(ones, tensors)):
            ones[:] = [torch.ones_like(o) for o in tensors]
        torch.autograd.backward(tensors, ones)

    return run


def leaf(t, grad=True):
    return t.detach().requires_grad_(grad)


def measure_peaks(device, dtype, reps):
    n = 2048 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = best_time(lambda: torch.mm(a, b), device, reps)
    gemm = 2 * n**3 / t / 1e9
    a32, b32 = a.float(), b.float()
    gemm32 = 2 * n**3 / best_time(lambda: torch.mm(a32, b32), device, reps) / 1e9
    big = torch.empty(copy_bytes(device), dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    t = best_time(lambda: dst.copy_(big), device, reps)
    copy = 2 * big.numel() / t / 1e9  # read + write
    return {"matmul_gflops": gemm, "matmul_fp32_gflops": gemm32, "matmul_n": n, "copy_gbs": copy,
            "copy_mib": big.numel() >> 20}


def copy_bytes(device):
    """Bytes per side of the copy that measures the memory bandwidth: past the last-level cache
    (2x it, at least 256 MiB; at most 1 GiB), as the ops' tensors at the Qwen3-30B-A3B layer size
    (16-400 MB) are. A 32 MiB copy on a CPU with a 32 MiB L3 ran partly from the cache: 42 GB/s
    against 22-24 GB/s past it on an AVX2 EPYC, so every op's share came out too low."""
    if device.startswith("cuda"):
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return 2 * max(l2, 128 << 20)
    llc = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            size = (index / "size").read_text().strip()  # e.g. "32768K"
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            llc = max(llc, int(size.rstrip("KMG")) * unit)
        except (OSError, ValueError):
            continue
    return min(max(2 * llc, 256 << 20), 1 << 30)


def routing(T, K, E, device):
    """Balanced-ish random routing (each token K distinct experts), fixed seed; contiguous [T, K]
    as the router emits it (a strided view cost the plan a copy)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.rand(T, E, generator=g).argsort(-1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=g)
    return idx.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def op_rows(p, dtype, device, reps, peaks, include_layer_refs, quick_refs=False,
            layer_refs=("eager", "torch_mm"), memory_bound_only=False):
    T, H, E, K, I, N, KV, D = (p[k] for k in ("T", "H", "E", "K", "I", "N", "KV", "D"))
    es = torch.tensor([], dtype=dtype).element_size()
    mk = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    rows = []

    def add(name, fused, ref, *, flops=None, bytes_=None, extra=None):
        tf = best_time(fused, device, reps)
        slow = quick_refs and flops is not None  # a GEMM-heavy reference: one cold run
        tr = (best_time(ref, device, 1 if slow else reps, warmup=not slow)
              if ref is not None else None)
        row = {"op": name, "fused_ms": tf * 1e3, "reference_ms": tr * 1e3 if tr else None,
               "speedup": tr / tf if tr else None}
        if flops:
            row["gflops"] = flops / tf / 1e9
            row["of_matmul_peak"] = row["gflops"] / peaks["matmul_gflops"]
            row["of_fp32_peak"] = row["gflops"] / peaks["matmul_fp32_gflops"]
        if bytes_:
            row["gbs"] = bytes_ / tf / 1e9
            row["of_copy_bw"] = row["gbs"] / peaks["copy_gbs"]
        row.update(extra or {})
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    x = leaf(mk(T, H))
    w = leaf(1 + mk(H, scale=0.1))
    # fwd reads x, w; writes y; bwd reads dy, x, w; writes dx (+dw): ~5 passes over [T, H]
    add("rmsnorm", fwd_bwd(lambda a, b: OPS.rmsnorm(a, b, 1e-6), [x, w]),
        fwd_bwd(lambda a, b: OPS.rmsnorm_reference(a, b, 1e-6), [x, w]), bytes_=5 * T * H * es)

    q = leaf(mk(1, T, N, D))
    ang = torch.randn(1, T, D // 2).to(device)
    c, s = ang.cos(), ang.sin()
    add("rope (q)", fwd_bwd(lambda a: OPS.rope(a, c, s, False), [q]),
        fwd_bwd(lambda a: OPS.rope_reference(a, c, s, False), [q]), bytes_=4 * T * N * D * es)

    gu = leaf(mk(T * K, 2 * I, scale=2))
    # fwd reads 2I writes I; bwd reads I + 2I writes 2I: 8I per row
    add("swiglu", fwd_bwd(lambda a: OPS.swiglu(a), [gu]),
        fwd_bwd(lambda a: OPS.swiglu_reference(a), [gu]), bytes_=8 * T * K * I * es)

    logits = leaf(torch.randn(T, E, device=device) * 2)
    add("router (softmax top-k)", fwd_bwd(lambda a: OPS.router(a, K)[0], [logits]),
        fwd_bwd(lambda a: OPS.router_reference(a, K)[0], [logits]), bytes_=4 * T * E * 4)

    idx, wts = routing(T, K, E, device)
    plan = OPS.moe_permute_plan(idx, E)
    add("permute plan", lambda: OPS.moe_permute_plan(idx, E),
        lambda: OPS.moe_permute_plan_reference(idx, E), bytes_=3 * T * K * 8)
    add("permute", fwd_bwd(lambda a: OPS.permute(a, *plan), [x]),
        fwd_bwd(lambda a: OPS.permute_reference(a, *plan), [x]), bytes_=4 * T * K * H * es)
    y = leaf(mk(T * K, H))
    wl = leaf(wts.to(dtype))
    add("unpermute", fwd_bwd(lambda a, b: OPS.unpermute(a, *plan, b), [y, wl]),
        fwd_bwd(lambda a, b: OPS.unpermute_reference(a, *plan, b), [y, wl]),
        bytes_=4 * T * K * H * es)

    if "MH" in p:  # Mamba-2's depthwise conv (+ SiLU) over x, B and C, and its gated norm
        MH, MP, MG, MN = (p[k] for k in ("MH", "MP", "MG", "MN"))
        CC, W = MH * MP + 2 * MG * MN, MH * MP
        cx, cw, cb = leaf(mk(1, T, CC)), leaf(mk(CC, 4, scale=0.5)), leaf(mk(CC))
        docs = torch.zeros(1, T, dtype=torch.long, device=device)
        docs[:, T // 3:] = 1
        # fwd reads x writes y; bwd reads dy, x writes dx: 4 passes over [T, C]
        for name, d in (("causal_conv1d + silu", None), ("causal_conv1d + silu, 2 documents", docs)):
            add(name, fwd_bwd(lambda a, b, c, d=d: OPS.causal_conv1d(a, b, c, d, True), [cx, cw, cb]),
                fwd_bwd(lambda a, b, c, d=d: OPS.causal_conv1d_reference(a, b, c, d, True), [cx, cw, cb]),
                bytes_=4 * T * CC * es)
        # as the model calls it: the scan's float32 y, the gate and weight in the dtype; fwd reads y, z
        # writes out (float32); bwd reads dout, y, z, writes dy, dz
        gy, gz = leaf(torch.randn(1, T, W, device=device)), leaf(mk(1, T, W, scale=2))
        gw = leaf(1 + mk(W, scale=0.1))
        add("gated_rms_norm (float32 y)",
            fwd_bwd(lambda a, b, c: OPS.gated_rms_norm(a, b, c, W // MG, 1e-5), [gy, gz, gw]),
            fwd_bwd(lambda a, b, c: OPS.gated_rms_norm_reference(a, b, c, W // MG, 1e-5), [gy, gz, gw]),
            bytes_=T * W * (4 + es + 4 + 4 + 4 + es + 4 + es))

    if memory_bound_only:
        return rows
    if "MH" in p:  # Mamba-2's SSD scan: [1, T] tokens
        MH, MP, MG, MN, MQ = (p[k] for k in ("MH", "MP", "MG", "MN", "MQ"))
        sx, sdt = leaf(mk(1, T, MH, MP)), leaf((torch.rand(1, T, MH) * 0.1).to(device=device, dtype=dtype))
        sA = leaf(-torch.rand(MH, device=device))
        sB, sC, sD = leaf(mk(1, T, MG, MN)), leaf(mk(1, T, MG, MN)), leaf(torch.randn(MH, device=device))
        # The grouped form's products, per token: C·Bᵀ within its chunk once per B/C group (MQ x MN
        # per group, not per head), and per head the decay-weighted x (MQ x MP), the chunk state
        # (MN x MP) and its read-out (MN x MP); fwd + bwd = 3 x the forward.
        ssd_flops = 3 * 2 * T * (MG * MQ * MN + MH * (MQ * MP + 2 * MN * MP))
        add("ssd_scan fwd+bwd (CPU: fused kernels, operands in the dtype, float32 accumulation)",
            fwd_bwd(lambda *a: OPS.ssd_scan(*a, MQ)[0], [sx, sdt, sA, sB, sC, sD]),
            fwd_bwd(lambda *a: OPS.ssd_scan_reference(*a, MQ)[0], [sx, sdt, sA, sB, sC, sD]),
            flops=ssd_flops)
    if "GN" in p:  # the gated delta rule: [1, T] tokens, key heads repeated to the value heads
        GN, GDk, GDv, GQ = (p[k] for k in ("GN", "GDk", "GDv", "GQ"))
        dq, dk, dv = leaf(mk(1, T, GN, GDk)), leaf(mk(1, T, GN, GDk)), leaf(mk(1, T, GN, GDv))
        dg = leaf(-torch.rand(1, T, GN, device=device) * 0.3)
        db = leaf(torch.rand(1, T, GN, device=device).to(dtype))
        # The chunked form's products as executed, per token and head: k_β·kᵀ and q·kᵀ within its
        # chunk (GQ x GDk each), the two triangular solves (GQ/2 x (GDk + GDv)), the new values
        # against the state, its read-out and update (3 x GDk x GDv) and the intra-chunk P·V' (GQ x
        # GDv); fwd + bwd = 3 x the forward.
        dr_flops = 3 * 2 * T * GN * (2 * GQ * GDk + GQ * (GDk + GDv) / 2 + 3 * GDk * GDv + GQ * GDv)
        add("chunk_gated_delta_rule fwd+bwd (hand-derived backward; float32 compute)",
            fwd_bwd(lambda *a: OPS.chunk_gated_delta_rule(*a, GQ)[0], [dq, dk, dv, dg, db]),
            fwd_bwd(lambda *a: OPS.chunk_gated_delta_rule_reference(*a, GQ)[0], [dq, dk, dv, dg, db]),
            flops=dr_flops)
    xp = leaf(mk(T * K, H))
    w_gu = leaf(mk(E, 2 * I, H, scale=0.02))
    gg_flops = 3 * 2 * T * K * H * 2 * I
    add("grouped_gemm (gate_up)", fwd_bwd(lambda a, b: OPS.grouped_gemm(a, b, plan[0]), [xp, w_gu]),
        fwd_bwd(lambda a, b: OPS.grouped_gemm_reference(a, b, plan[0]), [xp, w_gu])
        if include_layer_refs else None, flops=gg_flops)

    w_down = leaf(mk(E, H, I, scale=0.02))
    layer_flops = 3 * 2 * T * K * H * 3 * I
    experts = lambda b: fwd_bwd(  # noqa: E731
        lambda a, g_, d_, w_: OPS.moe_experts(a, idx, w_, g_, d_, b), [x, w_gu, w_down, wl])
    t_fused = None
    for backend in ["grouped"] + (layer_refs if include_layer_refs else []):
        try:
            slow = quick_refs and backend != "grouped"
            t = best_time(experts(backend), device, 1 if slow else reps, warmup=not slow)
        except Exception as e:  # noqa: BLE001  (torch_mm may be missing for a device/dtype)
            print(f"  experts={backend}: not measured ({str(e).splitlines()[0]})", flush=True)
            continue
        row = {"op": f"MoE experts fwd+bwd ({backend})", "fused_ms": t * 1e3,
               "gflops": layer_flops / t / 1e9}
        row["of_matmul_peak"] = row["gflops"] / peaks["matmul_gflops"]
        row["of_fp32_peak"] = row["gflops"] / peaks["matmul_fp32_gflops"]
        if backend == "grouped":
            t_fused = t
        else:
            row["grouped_speedup"] = t / t_fused
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def ce_child(kind, T, H, V, dtype, device, reps):
    """In a fresh child process: time and peak memory growth of one cross-entropy path."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, H, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.02).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    if kind == "fused":
        fn = lambda: OPS.linear_cross_entropy(x, w, labels)[0]  # noqa: E731
    else:  # full logits, upcast, cross-entropy: what Transformers' loss does
        fn = lambda: torch.nn.functional.cross_entropy(  # noqa: E731
            (x @ w.t()).float(), labels, reduction="sum")

    def step():
        x.grad = w.grad = None
        fn().backward()

    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = best_time(step, device, reps)
        peak = torch.cuda.max_memory_allocated() - base
    else:  # RSS sampled every millisecond while the steps run, above the RSS before them
        base = rss_now()
        high, done = [base], threading.Event()

        def sample():
            while not done.is_set():
                high[0] = max(high[0], rss_now())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t = best_time(step, device, reps)
        done.set()
        sampler.join()
        peak = high[0] - base
    print(json.dumps({"ms": t * 1e3, "peak_bytes": peak}))


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ce_rows(p, T, dtype, device, reps, hidden=None):
    H, V = hidden or p["H"], p["V"]
    res = {}
    for kind in ("fused", "full_logits"):
        # A new interpreter, not fork(): OpenMP's thread pool does not survive a fork.
        cmd = [sys.executable, __file__, "--ce-child", kind, "--ce-shape", f"{T},{H},{V}",
               "--dtype", {v: k for k, v in DTYPES.items()}[dtype], "--device", device,
               "--reps", str(reps)]
        paths = OPS._cpu_kernel_paths()  # the parent's forced paths, if any
        cmd += ["--cpu-isa", paths["isa"], "--cpu-gemm", paths["gemm_bf16"]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[kind] = json.loads(out.strip().splitlines()[-1])
    dname = {v: k for k, v in DTYPES.items()}[dtype]
    row = {"op": f"linear cross-entropy fwd+bwd (T={T}, H={H}, V={V}, {dname})",
           "fused_ms": res["fused"]["ms"], "reference_ms": res["full_logits"]["ms"],
           "speedup": res["full_logits"]["ms"] / res["fused"]["ms"],
           "fused_peak_mib": res["fused"]["peak_bytes"] / 2**20,
           "full_logits_peak_mib": res["full_logits"]["peak_bytes"] / 2**20}
    row["peak_ratio"] = row["fused_peak_mib"] / row["full_logits_peak_mib"]
    print(json.dumps(row), flush=True)
    return [row]


def kernel_paths(device):
    """The kernel paths the fused ops ran: CPU instruction-set level and GEMM path, or on CUDA
    whether our kernels or ATen's (ops/cuda_status.h, AUTOMOE_CUDA_KERNELS)."""
    if str(device).startswith("cuda"):
        return {"cuda_kernels": os.environ.get("AUTOMOE_CUDA_KERNELS", "validated table (default)")}
    return dict(OPS._cpu_kernel_paths())


def kernel_paths_text(r):
    return ", ".join(f"{k} = {v}" for k, v in sorted(r.get("kernel_paths", {}).items()))


def measured_text(r):
    """What the run measured the machine at, and the paths the ops took."""
    pk = r["peaks"]
    return (f"Measured in the same run (at::mm, n = {pk['matmul_n']}): {r['dtype']} matmul peak "
            f"{pk['matmul_gflops']:.1f} GFLOP/s, fp32 matmul peak {pk['matmul_fp32_gflops']:.1f} "
            f"GFLOP/s; copy bandwidth {pk['copy_gbs']:.1f} GB/s ({pk.get('copy_mib', '?')} MiB); "
            f"{r['threads']} threads. "
            f"Kernel paths: {kernel_paths_text(r)}; malloc: {r.get('allocator', 'glibc')}.")


def table_lines(r):
    lines = ["| op (fwd+bwd) | fused ms | reference ms | fused speed-up | achieved |",
             "|---|---:|---:|---:|---|"]
    for row in r["rows"]:
        ach = ""
        if "gflops" in row:
            ach = (f"{row['gflops']:.1f} GFLOP/s = {100 * row['of_matmul_peak']:.0f}% of the "
                   f"{r['dtype']} peak, {100 * row['of_fp32_peak']:.0f}% of the fp32 peak")
        elif "gbs" in row:
            ach = f"{row['gbs']:.1f} GB/s = {100 * row['of_copy_bw']:.0f}% of copy bw"
        if "peak_ratio" in row:
            ach = (f"peak mem {row['fused_peak_mib']:.0f} MiB vs {row['full_logits_peak_mib']:.0f} MiB"
                   f" = {row['peak_ratio']:.2f}x")
        ref = f"{row['reference_ms']:.2f}" if row.get("reference_ms") else "-"
        sp = f"{row['speedup']:.2f}x" if row.get("speedup") else (
            f"grouped is {row['grouped_speedup']:.2f}x faster" if "grouped_speedup" in row else "-")
        lines.append(f"| {row['op']} | {row['fused_ms']:.2f} | {ref} | {sp} | {ach} |")
    return lines


def markdown(result):
    r = result
    return "\n".join([f"#### `{r['preset']}` ({r['dtype']}, {r['device']}, T = {r['shape']['T']})", "",
                      measured_text(r), "", *table_lines(r)]) + "\n"


def record_config(r):
    """The configuration a recorded table is filed under: preset, dtype, T and which rows ran."""
    config = f"{r['preset']}:{r['dtype']}:T{r['shape']['T']}"
    if r.get("only_memory_bound"):
        config += ":memory-bound"
    elif r.get("only_ce"):
        config += ":cross-entropy"
    return config


def record_markdown(r, stamp):
    """The table as docs/performance.md holds it."""
    title = f"{r['preset']} · {r['dtype']} · T = {r['shape']['T']}"
    if r.get("only_memory_bound"):
        title += " · memory-bound ops"
    elif r.get("only_ce"):
        title += " · cross-entropy"
    how = f"best of {r['reps']} per op. " + measured_text(r)
    return recorder.table(title, stamp, how, table_lines(r))


def record(result, doc, stamp=None):
    """Files the table in `doc` (docs/performance.md) under the hardware class it ran on,
    replacing the one of the same configuration; returns its key."""
    stamp = stamp or recorder.stamp(result["device"])
    return recorder.write(Path(doc), "ops_bench", record_config(result), record_markdown(result, stamp),
                          stamp)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, help="override T (the large preset on a CPU)")
    ap.add_argument("--ce-tokens", type=int, help="T for the cross-entropy rows (default: T)")
    ap.add_argument("--ce-hidden", type=int, help="H for the cross-entropy rows (default: H)")
    ap.add_argument("--ce-dtype", choices=sorted(DTYPES), help="dtype of the cross-entropy rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-layer-refs", action="store_true",
                    help="skip the GEMM-heavy references (grouped_gemm reference, eager, torch_mm)")
    ap.add_argument("--ce-child", choices=["fused", "full_logits"], help=argparse.SUPPRESS)
    ap.add_argument("--ce-shape", help=argparse.SUPPRESS)
    ap.add_argument("--quick-refs", action="store_true",
                    help="time the GEMM-heavy references once, without warm-up (slow CPUs)")
    ap.add_argument("--layer-refs", default="eager,torch_mm",
                    help="experts backends compared with grouped")
    ap.add_argument("--only-ce", action="store_true", help="only the cross-entropy rows")
    ap.add_argument("--only-memory-bound", action="store_true",
                    help="only the memory-bound ops (no GEMM or cross-entropy rows)")
    ap.add_argument("--cpu-isa", default="",
                    help="cap the CPU kernels' instruction-set level (baseline, avx2, avx512, ...)")
    ap.add_argument("--cpu-gemm", default="",
                    help="force the CPU GEMM path (generic, avx2, avx512, brgemm)")
    ap.add_argument("--allocator", choices=["jemalloc", "system"], default="jemalloc",
                    help="malloc for the whole run: jemalloc as the engine's CLI uses it, or glibc's")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--record", type=Path,
                    help="put the table into this Markdown file (docs/performance.md), in the section "
                         "of this machine's hardware class, replacing the same configuration's")
    a = ap.parse_args(argv)
    OPS._set_cpu_paths(a.cpu_isa, a.cpu_gemm)
    if a.allocator == "jemalloc" and argv is None and not os.environ.get("AUTOMOE_OPS_BENCH_ALLOC"):
        # Run under the allocator the engine runs with (python/automoe/engine_binary.py), fused and
        # reference alike: with glibc's malloc every large output page-faults in afresh.
        from automoe.engine_binary import allocator_env

        env = allocator_env({**os.environ, "AUTOMOE_OPS_BENCH_ALLOC": "1"})
        if "libjemalloc" in env.get("LD_PRELOAD", ""):
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if a.ce_child:
        T, H, V = (int(v) for v in a.ce_shape.split(","))
        ce_child(a.ce_child, T, H, V, DTYPES[a.dtype], a.device, a.reps)
        return
    p = dict(PRESETS[a.preset])
    if a.tokens:
        p["T"] = a.tokens
    dtype = DTYPES[a.dtype]
    torch.manual_seed(0)
    # The peaks are measured before and after the op rows, best of 10 each, and the higher kept:
    # a busy neighbour on a shared machine would otherwise deflate the denominator.
    peaks = measure_peaks(a.device, dtype, max(a.reps, 10))
    print(json.dumps({"peaks": peaks, "kernel_paths": kernel_paths(a.device)}), flush=True)
    rows = [] if a.only_ce else op_rows(p, dtype, a.device, a.reps, peaks, not a.no_layer_refs,
                                        a.quick_refs, a.layer_refs.split(","), a.only_memory_bound)
    if not a.only_memory_bound:
        rows += ce_rows(p, a.ce_tokens or p["T"], DTYPES[a.ce_dtype or a.dtype], a.device,
                        max(1, a.reps - 1), a.ce_hidden)
    again = measure_peaks(a.device, dtype, max(a.reps, 10))
    if any(again[k] > peaks[k] for k in ("matmul_gflops", "matmul_fp32_gflops", "copy_gbs")):
        peaks = {k: max(v, again[k]) for k, v in peaks.items()}
        for row in rows:  # the fractions against the higher peaks
            if "gflops" in row:
                row["of_matmul_peak"] = row["gflops"] / peaks["matmul_gflops"]
                row["of_fp32_peak"] = row["gflops"] / peaks["matmul_fp32_gflops"]
            if "gbs" in row:
                row["of_copy_bw"] = row["gbs"] / peaks["copy_gbs"]
    result = {"preset": a.preset, "dtype": a.dtype, "device": a.device, "shape": p,
              "reps": a.reps, "quick_refs": a.quick_refs, "only_memory_bound": a.only_memory_bound,
              "only_ce": a.only_ce,
              "threads": torch.get_num_threads(), "kernel_paths": kernel_paths(a.device),
              "allocator": "jemalloc" if "libjemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc",
              "peaks": peaks, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    if a.markdown:
        a.markdown.write_text(markdown(result))
    if a.record:
        record(result, a.record)
    print(markdown(result))


if __name__ == "__main__":
    main()
