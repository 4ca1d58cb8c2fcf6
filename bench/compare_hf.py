#!/usr/bin/env python
"""Side-by-side training-step benchmark: AutoMoE against Transformers v5, in one run.

    python bench/compare_hf.py --preset cpu-small
    python bench/compare_hf.py --preset qwen3-30b-a3b-L4 --device cuda --fake-balanced-gate

The model has random weights and a config.json from `automoe bench --print-config` (a named
Qwen3-MoE preset) or --config FILE, so both sides build the same model. For a type the engine
implements (`automoe bench --list-types`: Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, Kimi-K2, Mixtral,
Qwen2-MoE, OLMoE, GPT-OSS; bench/configs/*.json holds small ones) the AutoMoE side is the native
engine (`automoe bench`); for any other MoE type it is what `automoe.AutoModelForCausalLM` returns
for that type: Transformers' model with AutoMoE's fused experts and RMSNorm. Each side runs in its own process
(peak memory is per process): the same batch of random tokens, dtype and AdamW, warm-up steps then
timed steps. Transformers runs with attn_implementation="sdpa" and each experts_implementation in
--impls that runs; the best of them is the baseline.

Reported per side: tokens/s = tokens / (forward + loss + backward) (NeMo AutoModel's definition),
step tokens/s = tokens / (forward + backward + optimizer) (the whole training step; AutoMoE's is
the trainer's own step: fused AdamW over float32 masters), forward/backward/optimizer ms (medians over timed steps), TFLOP/s and MFU from one analytic FLOPs
formula (csrc/automoe/train/flops.h, the same number for both sides; the engine's types only), peak memory (GPU:
max_memory_allocated; CPU: the process's peak RSS, and the part of it above the RSS before the
model was built), and the ratios AutoMoE / baseline. MFU is against the bf16/fp32 matmul
throughput measured in the same run (large at::mm), and on GPU against the datasheet peak too.

--lora R: LoRA fine-tuning on both sides — rank-R adapters (alpha 2R) on q/k/v/o_proj and on the
routed experts (PEFT's target_parameters mlp.experts.gate_up_proj / down_proj), float32 adapters,
the base frozen, AdamW over the adapters only. Transformers runs PEFT's own get_peft_model; AutoMoE
runs its engine (`automoe bench --lora R`, and with --dropin PEFT's get_peft_model on the drop-in);
AutoMoE's full fine-tune runs beside them for the memory comparison (--no-full-finetune leaves it out
where it does not fit).

Writes OUT/results.json, OUT/results.md and OUT/chart.png; prints the Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as recorder  # noqa: E402  (bench/record.py: --record's tables)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BIN = REPO / "python" / "automoe" / "bin" / "automoe"
HF_IMPLS = ("eager", "grouped_mm", "batched_mm")
# Dense bf16 tensor-core peak from NVIDIA's datasheets (TFLOP/s), keyed by a substring of the name.
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}

# Every per-side record has these fields (tested).
SIDE_FIELDS = (
    "side", "impl", "device", "dtype", "batch", "seq", "tokens_per_step", "warmup", "steps",
    "fake_balanced_gate", "num_parameters", "forward_ms", "backward_ms", "optimizer_ms",
    "step_ms", "tokens_per_s", "train_flops_per_token", "tflops", "mfu_measured",
    "mfu_datasheet", "peak_memory_bytes", "peak_memory_kind", "model_memory_bytes",
    "loss_first", "loss_last", "speedup_vs_baseline", "step_time_vs_baseline",
    "memory_vs_baseline", "cpu_kernels", "allocator", "error",
)

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# ---------------------------------------------------------------------------------------------
# The Python sides (each in a child process: `compare_hf.py --python-side transformers|automoe ...`)
# ---------------------------------------------------------------------------------------------
def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def _patch_round_robin_router() -> None:
    """Round-robin routing for Transformers' Qwen3-MoE router, as `automoe bench` does it."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    def forward(self, hidden_states):
        hs = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hs, self.weight)
        T = hs.shape[0]
        idx = (torch.arange(T * self.top_k, device=hs.device) % self.num_experts).view(T, self.top_k)
        scores = (logits[:, :1] * 0 + 1.0 / self.top_k).expand(T, self.top_k).to(logits.dtype)
        return logits, scores, idx

    m.Qwen3MoeTopKRouter.forward = forward


def build_python_side(args, raw: dict):
    """The model one Python-side process measures: Transformers' own (experts_implementation
    args.impl), or AutoMoE's drop-in for the config's type (the Transformers-model path with
    AutoMoE's kernels when the type has no native engine model)."""
    import torch
    from transformers import AutoConfig

    raw = dict(raw)
    model_type = raw.pop("model_type")
    for key in ("architectures", "dtype", "transformers_version"):
        raw.pop(key, None)
    config = AutoConfig.for_model(model_type, **raw)
    dtype = getattr(torch, args.dtype)
    if args.python_side == "automoe":
        try:
            import automoe
        except ImportError:  # not installed and not on PYTHONPATH: this checkout's package
            sys.path.insert(0, str(REPO / "python"))
            import automoe

        backend = {"fake_balanced_gate": True} if args.fake_balanced_gate else None
        return automoe.AutoModelForCausalLM.from_config(config, dtype=dtype, backend=backend)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                            attn_implementation=hf_attention(model_type),
                                            experts_implementation=args.impl)


def hf_attention(model_type: str) -> str:
    """sdpa where Transformers' model has it; eager otherwise (GPT-OSS: its attention sinks)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(model_type))]
    return "sdpa" if cls._supports_sdpa else "eager"


def run_python_side(args) -> dict:
    import statistics

    import torch

    raw = json.loads(Path(args.config).read_text())
    device = torch.device(args.device)
    if args.fake_balanced_gate:
        if raw.get("model_type") != "qwen3_moe":
            raise SystemExit("--fake-balanced-gate: implemented for Qwen3-MoE only")
        _patch_round_robin_router()
    rss_before = _rss_now()
    torch.manual_seed(args.seed)
    model = build_python_side(args, raw).to(device)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                                 target_modules=LORA_MODULES,
                                                 target_parameters=LORA_EXPERTS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            weight_decay=0.01)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, raw["vocab_size"], (args.batch, args.seq), generator=g).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fwd, bwd, optim, losses = [], [], [], []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        losses.append(loss.item())
        if step >= args.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
            optim.append((t3 - t2) * 1e3)
    f, b, o = statistics.median(fwd), statistics.median(bwd), statistics.median(optim)
    tokens = args.batch * args.seq
    inner = model.get_base_model() if args.lora else model
    lora = f" + PEFT LoRA r={args.lora}" if args.lora else ""
    if args.python_side == "automoe" and getattr(inner, "automoe_path", None) == "native":
        impl = f"automoe drop-in (native engine, loss=torch){lora}"
    elif args.python_side == "automoe":
        report = getattr(inner, "automoe_accelerated", {})
        impl = f"automoe drop-in ({report.get('experts')}; rms_norm {report.get('rms_norm')}){lora}"
    else:
        impl = f"transformers {args.impl} ({hf_attention(raw['model_type'])}){lora}"
    out = dict(
        side=args.python_side, impl=impl, device=args.device,
        dtype=args.dtype, batch=args.batch, seq=args.seq, tokens_per_step=tokens,
        warmup=args.warmup, steps=args.steps, fake_balanced_gate=args.fake_balanced_gate,
        num_parameters=sum(p.numel() for p in model.parameters()), forward_ms=f, backward_ms=b,
        lora=args.lora, trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        optimizer_ms=o, step_ms=f + b + o, tokens_per_s=tokens / ((f + b) * 1e-3),
        loss_first=losses[0], loss_last=losses[-1], threads=torch.get_num_threads(),
    )
    if device.type == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_memory_kind"] = "cuda max_memory_allocated"
    else:
        out["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["peak_memory_kind"] = "process peak RSS"
        out["baseline_memory_bytes"] = rss_before
    return out


# ---------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------
def side_env(jemalloc: bool) -> dict:
    """The environment a side runs in: AutoMoE's engine with the allocator `automoe` gives it
    (jemalloc keeping freed pages, python/automoe/engine_binary.py); Transformers with glibc's malloc, as a
    user runs it, unless --hf-allocator jemalloc."""
    env = dict(os.environ)
    if not jemalloc:
        return env
    # automoe/engine_binary.py alone (the stdlib only): importing the package would load its
    # extension, which this script does not need to run an engine binary.
    import importlib.util

    path = REPO / "python" / "automoe" / "engine_binary.py"
    spec = importlib.util.spec_from_file_location("_automoe_engine_binary", path)
    engine_binary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_binary)
    return engine_binary.allocator_env(env)


def allocator_of(env: dict) -> str:
    return "jemalloc" if "libjemalloc" in env.get("LD_PRELOAD", "") else "glibc"


def run_json(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = proc.stderr.strip()[-2000:]
        raise RuntimeError(f"{why}: {tail.splitlines()[-1] if tail else 'no message'}\n{' '.join(cmd)}\n{tail}")
    start = proc.stdout.find("{")
    if start < 0:
        raise RuntimeError(f"{' '.join(cmd)} printed no JSON:\n{proc.stdout[-1000:]}{proc.stderr[-1000:]}")
    try:
        return json.loads(proc.stdout[start:])
    except json.JSONDecodeError as e:
        raise RuntimeError(f"{' '.join(cmd)} printed malformed JSON: {e}") from e


def optimizer_flags(setting: str) -> list[str]:
    """--automoe-optimizer's MASTERS/MOMENTS[/in_backward] (e.g. none/bfloat16/in_backward) as
    `automoe bench` flags."""
    parts = setting.split("/")
    if len(parts) > 3 or (len(parts) == 3 and parts[2] != "in_backward"):
        raise SystemExit(f"--automoe-optimizer: {setting!r} is not MASTERS/MOMENTS[/in_backward]")
    flags = ["--master-weights", parts[0], "--state-dtype", parts[1] if len(parts) > 1 else "float32"]
    return flags + (["--optimizer-in-backward"] if len(parts) == 3 else [])


def common_flags(args, lora: bool = True) -> list[str]:
    flags = ["--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup),
             "--steps", str(args.steps), "--dtype", args.dtype, "--device", args.device,
             "--seed", str(args.seed)]
    flags += ["--lora", str(args.lora)] if args.lora and lora else []
    return flags + (["--fake-balanced-gate"] if args.fake_balanced_gate else [])


def finish(record: dict, flops_per_token: float, peak_tflops: float | None,
           datasheet_tflops: float | None) -> dict:
    r = {k: None for k in SIDE_FIELDS}
    r.update(record)
    if r.get("tokens_per_s") and flops_per_token:
        r["train_flops_per_token"] = flops_per_token
        r["tflops"] = flops_per_token * r["tokens_per_s"] / 1e12
        r["mfu_measured"] = r["tflops"] / peak_tflops if peak_tflops else None
        r["mfu_datasheet"] = r["tflops"] / datasheet_tflops if datasheet_tflops else None
    if r.get("baseline_memory_bytes") is not None and r.get("peak_memory_bytes") is not None:
        r["model_memory_bytes"] = r["peak_memory_bytes"] - r["baseline_memory_bytes"]
    elif r.get("peak_memory_bytes") is not None:
        r["model_memory_bytes"] = r["peak_memory_bytes"]  # GPU: allocator peak is the model's
    return r


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def fmt(x, spec: str, unit: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{unit}"


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"**{m['model']}** · batch {m['batch']} × seq {m['seq']} · {m['dtype']} · {m['device']} "
        f"({m['machine']}) · routing {'round-robin (fake balanced gate)' if m['fake_balanced_gate'] else 'real'} "
        f"· {m['steps']} timed steps after {m['warmup']} warm-up"
        + (f" · LoRA r={m['lora']} on q/k/v/o and the experts (baseline: Transformers + PEFT)" if m.get("lora") else "")
        + (f" (best of {m['repeat']} alternating runs per side)" if m.get("repeat", 1) > 1 else "")
        + f" · {m['date']}",
        "",
        f"torch {m['versions']['torch']}, transformers {m['versions']['transformers']}; "
        f"measured matmul peak: bf16 {fmt(m['peak_tflops'].get('bfloat16'), '.3f')} TFLOP/s, "
        f"fp32 {fmt(m['peak_tflops'].get('float32'), '.3f')} TFLOP/s"
        + (f"; datasheet bf16 {m['datasheet_bf16_tflops']} TFLOP/s" if m.get("datasheet_bf16_tflops") else ""),
        "",
    ]
    kernels = next((r["cpu_kernels"] for r in result["sides"] if r.get("cpu_kernels")), None)
    if kernels and m["device"] == "cpu":
        allocs = ", ".join(f"{r['impl']} {r['allocator']}" for r in result["sides"] if r.get("allocator"))
        lines += ["AutoMoE's CPU kernels: " + ", ".join(f"{k} {v}" for k, v in sorted(kernels.items()))
                  + (f". malloc: {allocs}" if allocs else ""), ""]
    return "\n".join(lines + table_lines(result)) + "\n"


def table_lines(result: dict) -> list[str]:
    """The table, one row per side (results.md and the recorded table alike)."""
    lines = [
        "| side | tokens/s | step tokens/s | fwd ms | bwd ms | optim ms | TFLOP/s | MFU (measured peak) | peak memory | model memory | tokens/s vs baseline | step time vs baseline | memory vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["sides"]:
        if r.get("error"):
            lines.append(f"| {r['impl']} | failed: {r['error'].splitlines()[0][:100]} |" + " |" * 11)
            continue
        gib = lambda b: fmt(None if b is None else b / 2**30, ".2f", " GiB")  # noqa: E731
        lines.append(
            f"| {r['impl']}{' (baseline)' if r.get('is_baseline') else ''} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_step'] / (r['step_ms'] * 1e-3):.1f} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | {r['optimizer_ms']:.1f} | "
            f"{fmt(r['tflops'], '.4f')} | {fmt(None if r['mfu_measured'] is None else 100 * r['mfu_measured'], '.1f', ' %')} | "
            f"{gib(r['peak_memory_bytes'])} | {gib(r['model_memory_bytes'])} | "
            f"{fmt(r['speedup_vs_baseline'], '.2f', '×')} | {fmt(r.get('step_time_vs_baseline'), '.2f', '×')} | "
            f"{fmt(r['memory_vs_baseline'], '.2f', '×')} |"
        )
    return lines


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["sides"] if not r.get("error")]
    names = ["AutoMoE" if r["side"] == "automoe" else "HF " + r["impl"].split()[1] for r in ok]
    colors = ["#76b900" if r["side"] == "automoe" else "#888888" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [r["tokens_per_s"] for r in ok], color=colors)
    axes[0].set_title("tokens/s (forward + backward)")
    axes[1].bar(names, [(r["model_memory_bytes"] or 0) / 2**30 for r in ok], color=colors)
    axes[1].set_title("peak memory above start-up (GiB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(result["meta"]["model"] + f" · {result['meta']['device']} · {result['meta']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_config(meta: dict) -> tuple[str, str]:
    """(benchmark, configuration) a recorded table is filed under: a later run of the same model,
    dtype, routing (and LoRA rank) on the same hardware class replaces it. Batch, sequence and the
    sides run (--impls, --automoe-optimizer, --dropin) are the recorded command's, not the key."""
    routing = "fake" if meta["fake_balanced_gate"] else "real"
    config = f"{meta['model']}:{meta['dtype']}:{routing}"
    if meta.get("lora"):
        return "lora", config + f":lora{meta['lora']}"
    return "compare_hf", config


def record_markdown(result: dict, stamp) -> str:
    """The table as docs/performance.md holds it: what ran and where, how, then the sides."""
    m = result["meta"]
    title = f"{m['model']} · {m['dtype']} · batch {m['batch']} × {m['seq']}"
    if m.get("lora"):
        title += f" · LoRA r={m['lora']} on q/k/v/o and the experts"
    if m["fake_balanced_gate"]:
        title += " · round-robin routing"
    how = (f"{m['steps']} timed steps after {m['warmup']} warm-up"
           + (f", best of {m['repeat']} alternating runs per side" if m.get("repeat", 1) > 1 else "")
           + f"; torch {m['versions']['torch']}, transformers {m['versions']['transformers']}"
           + f"; measured `at::mm` peak bf16 {fmt(m['peak_tflops'].get('bfloat16'), '.3f')}, "
           f"fp32 {fmt(m['peak_tflops'].get('float32'), '.3f')} TFLOP/s"
           + (f", datasheet bf16 {m['datasheet_bf16_tflops']}" if m.get("datasheet_bf16_tflops") else ""))
    kernels = next((r["cpu_kernels"] for r in result["sides"] if r.get("cpu_kernels")), None)
    if kernels and m["device"] == "cpu":
        how += "; AutoMoE's kernels: " + ", ".join(
            f"{k} {kernels[k]}" for k in ("gemm_bf16", "gemm_fp32", "lm_head_bf16") if k in kernels)
    allocs: dict[str, str] = {}
    for r in result["sides"]:
        if r.get("allocator"):
            who = ("Transformers" if r["side"] == "transformers" else
                   "the drop-in" if r["impl"].startswith("automoe drop-in") else "AutoMoE")
            allocs.setdefault(who, r["allocator"])
    if allocs:
        how += "; malloc: " + ", ".join(f"{who} {a}" for who, a in allocs.items())
    return recorder.table(title, stamp, how, table_lines(result))


def record(result: dict, doc: Path, stamp=None) -> str:
    """Files this run's table in `doc` (docs/performance.md) under its hardware class, replacing
    the one of the same configuration; returns its key."""
    stamp = stamp or recorder.stamp(result["meta"]["device"])
    benchmark, config = record_config(result["meta"])
    return recorder.write(doc, benchmark, config, record_markdown(result, stamp), stamp)


def cpu_description() -> str:
    """The CPU's model name, cores and the ISA features that decide which kernels run: a figure
    from one kind of CPU says nothing about another."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = [x for x, flag in (("AMX", "amx_bf16"), ("AVX-512-BF16", "avx512_bf16"), ("AVX2", "avx2"))
           if flag in flags]
    return f"{name}, {os.cpu_count()} cores" + (f", {' + '.join(isa)}" if isa else "")


def engine_types(exe: str) -> list[str]:
    """The model types the engine implements natively (`automoe bench --list-types`)."""
    return run_json([exe, "bench", "--list-types"], 60)["model_types"]


def orchestrate(args) -> dict:
    exe = str(args.automoe)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads(Path(args.config).read_text()) if args.config else None
    # The engine's own types run on `automoe bench` (C++); any other through the drop-in.
    native = raw is None or raw.get("model_type") in engine_types(exe)
    config_path = out / "config.json"
    if native:
        source = ["--config", args.config] if args.config else ["--preset", args.preset]
        described = run_json([exe, "bench", *source, "--seq", str(args.seq), "--print-config"], 60)
        config_path.write_text(json.dumps(described["config"], indent=2))
        flops_per_token = described["train_flops_per_token"]
    else:  # Transformers' model with AutoMoE's kernels on one side: no analytic FLOPs formula
        config_path.write_text(json.dumps(raw, indent=2))
        flops_per_token = None
    peak = run_json([exe, "bench", "--peak", "--device", args.device], 600)["matmul_peak"]
    peak_tflops = {k: v["tflops"] for k, v in peak.items()}
    gpu = gpu_name() if args.device == "cuda" else None
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if gpu and k in gpu), None)
    datasheet = datasheet if args.dtype == "bfloat16" else None

    model = args.preset if not args.config else Path(args.config).name
    machine = gpu or cpu_description()
    meta = dict(model=model, batch=args.batch, seq=args.seq, dtype=args.dtype, device=args.device,
                lora=args.lora, dropin=args.dropin,
                machine=machine, warmup=args.warmup, steps=args.steps, repeat=args.repeat,
                fake_balanced_gate=args.fake_balanced_gate, versions=versions(),
                date=_dt.date.today().isoformat(), peak_tflops=peak_tflops,
                datasheet_bf16_tflops=datasheet, train_flops_per_token=flops_per_token)

    # AutoMoE first, then each Transformers implementation; the results files are rewritten after
    # every side, so a run cut short (a time limit on a lent GPU) still leaves what it measured.
    dropin = ("automoe", "automoe drop-in",
              [sys.executable, __file__, "--python-side", "automoe", "--config", str(config_path),
               *common_flags(args)])
    if native:
        runs = [("automoe", f"automoe (experts={b}, optimizer={opt})",
                 [exe, "bench", "--config", str(config_path), "--experts", b, *common_flags(args),
                  *optimizer_flags(opt)])
                for b in args.automoe_experts.split(",") for opt in args.automoe_optimizer.split(",")]
        if args.lora and not args.no_full_finetune:  # AutoMoE's own full fine-tune: what LoRA saves
            runs.append(("automoe", "automoe (full fine-tune)",
                         [exe, "bench", "--config", str(config_path), *common_flags(args, lora=False)]))
        if args.dropin:
            runs.append(dropin)
    else:
        runs = [dropin]
    for impl in args.impls.split(","):
        runs.append(("transformers", f"transformers {impl} ({hf_attention(raw['model_type']) if raw else 'sdpa'})",
                     [sys.executable, __file__, "--python-side", "transformers", "--config",
                      str(config_path), "--impl", impl, *common_flags(args)]))
    # --repeat N: the sides run N times in turn (so that a noisy neighbour hits them alike) and
    # each side keeps its best run.
    best: dict[str, dict] = {}
    result: dict = {}
    for _ in range(args.repeat):
        for side, impl, cmd in runs:
            # the engine binary gets `automoe`'s allocator; Python sides (Transformers, the
            # drop-in) the user's unless --hf-allocator jemalloc
            env = side_env(cmd[0] != sys.executable or args.hf_allocator == "jemalloc")
            try:
                rec = run_json(cmd, args.timeout, env)
                rec["allocator"] = allocator_of(env)
            except subprocess.TimeoutExpired:
                rec = dict(side=side, impl=impl, error=f"timed out after {args.timeout:.0f} s")
            except RuntimeError as e:
                rec = dict(side=side, impl=impl, error=str(e))
            if impl == "automoe (full fine-tune)" and not rec.get("error"):
                rec["impl"] += ", full fine-tune"
            old = best.get(impl)
            if old is None or old.get("error") or (
                    not rec.get("error") and rec["tokens_per_s"] > old["tokens_per_s"]):
                best[impl] = rec
            result = summarize(list(best.values()), meta, flops_per_token,
                               peak_tflops.get(args.dtype), datasheet)
            (out / "results.json").write_text(json.dumps(result, indent=2))
            (out / "results.md").write_text(markdown(result))
    try:
        chart(result, out / "chart.png")
    except ImportError as e:  # matplotlib is in requirements.txt; say so rather than fail the run
        print(f"compare_hf: no chart ({e})", file=sys.stderr)
    if args.record:
        record(result, Path(args.record))
    return result


def summarize(records: list[dict], meta: dict, flops_per_token: float, peak: float | None,
              datasheet: float | None) -> dict:
    """Per-side figures, the baseline (fastest Transformers side) and the ratios against it."""
    sides = [finish(r, flops_per_token, peak, datasheet) for r in records]
    hf_ok = [r for r in sides if r["side"] == "transformers" and not r.get("error")
             and r.get("lora", 0) == meta.get("lora", 0)]
    base = max(hf_ok, key=lambda r: r["tokens_per_s"]) if hf_ok else None
    for r in sides:
        r["is_baseline"] = r is base
        if base and not r.get("error"):
            r["speedup_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["step_time_vs_baseline"] = r["step_ms"] / base["step_ms"]
            if r["model_memory_bytes"] and base["model_memory_bytes"]:
                r["memory_vs_baseline"] = r["model_memory_bytes"] / base["model_memory_bytes"]
    # Table order: the Transformers sides, then AutoMoE.
    sides.sort(key=lambda r: r["side"] == "automoe")
    return dict(meta={**meta, "baseline": base["impl"] if base else None}, sides=sides)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--config", help="a config.json instead of a preset: a type the engine implements "
                   "(`automoe bench --list-types`) runs on it, any other MoE type through "
                   "AutoMoE's drop-in (bench/configs/)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=1, help="run the sides this many times in turn; "
                   "each keeps its best")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fake-balanced-gate", action="store_true")
    p.add_argument("--impls", default=",".join(HF_IMPLS), help="Transformers experts_implementation values")
    p.add_argument("--automoe-experts", default="grouped", help="AutoMoE experts backends to run (grouped,eager)")
    p.add_argument("--automoe-optimizer", default="float32/float32",
                   help="AutoMoE optimizer precisions to run, MASTERS/MOMENTS each "
                        "(optimizer.master_weights / state_dtype), e.g. "
                        "float32/float32,remainders/bfloat16,none/bfloat16,none/8bit; a third "
                        "part in_backward updates in the backward (optimizer.in_backward), "
                        "e.g. none/8bit/in_backward")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank: both sides fine-tune rank-R adapters "
                   "(Transformers with PEFT), AutoMoE's full fine-tune runs beside them")
    p.add_argument("--no-full-finetune", action="store_true",
                   help="with --lora: leave out AutoMoE's full fine-tune beside it (a geometry whose "
                        "full fine-tune does not fit the machine)")
    p.add_argument("--dropin", action="store_true",
                   help="Qwen3-MoE: also time the Python drop-in (automoe.AutoModelForCausalLM) on the engine")
    p.add_argument("--hf-allocator", default="system", choices=["system", "jemalloc"],
                   help="the Transformers sides' malloc (AutoMoE's engine runs with the one `automoe` "
                        "gives it: jemalloc where installed)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--automoe", default=str(DEFAULT_BIN), help="the automoe binary")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    p.add_argument("--record", help="also put the table into this Markdown file (docs/performance.md), in "
                   "the section of this machine's hardware class, replacing the same configuration's")
    # internal: run one Python side ("transformers" or "automoe") and print its JSON
    p.add_argument("--python-side", choices=["transformers", "automoe"], help=argparse.SUPPRESS)
    p.add_argument("--impl", default="eager", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.python_side:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("AUTOMOE_VERBOSITY", "warning")
        print(json.dumps(run_python_side(args), indent=2))
        return 0
    if args.no_full_finetune and not args.lora:
        p.error("--no-full-finetune leaves out the full fine-tune beside a LoRA run: it needs --lora R")
    if not Path(args.automoe).exists():
        p.error(f"{args.automoe} not found: build AutoMoE first (make)")
    result = orchestrate(args)
    print(markdown(result))
    print(f"wrote {Path(args.out) / 'results.json'}, results.md, chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
