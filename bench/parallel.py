"""Expert parallelism measured: `automoe train` on 1, 2 and 4 processes (torchrun, Gloo on CPUs,
NCCL on GPUs) with ep = processes, on a random Qwen3-MoE preset, and alltoall against
alltoall_overlap.

    python bench/parallel.py --preset cpu-medium --nproc 1,2,4 --steps 6

Every configuration runs the same recipe through torchrun (the one-process run too, so that every
side pays the same per-process runtime), and reports from the trainer's metrics.jsonl: tokens/s
and step time (median of the steps after the first), peak resident memory per rank, and the time
each rank waited in the dispatcher's collectives per step. `--record docs/performance.md` puts
the table there; CPU figures on a 2-core machine show the mechanism, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))
import record as recorder  # noqa: E402  (bench/record.py: --record's tables)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    return ", ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags)


def build(preset: str, work: Path) -> Path:
    """A random checkpoint of the preset (the engine's initialisation) with a small tokenizer."""
    from automoe import _C
    from automoe.demo import build_tokenizer

    exe = REPO / "python" / "automoe" / "bin" / "automoe"
    cfg = json.loads(subprocess.run([str(exe), "bench", "--preset", preset, "--print-config"], check=True,
                                    capture_output=True, text=True).stdout)["config"]
    tok = build_tokenizer(REPO / "examples" / "data" / "corpus.txt", vocab_size=400)
    cfg.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    path = work / preset
    model = _C.init_model(json.dumps(cfg), "bfloat16", {}, 0)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def run(ckpt: Path, work: Path, name: str, nproc: int, dispatcher: str, args, ep: int = 0, zero: int = 1,
        bucket_mb: float = 32) -> dict:
    import yaml

    run_dir = work / name
    recipe = {
        "model": {"path": str(ckpt), "dtype": args.dtype, "backend": {"dispatcher": dispatcher}},
        "data": {"train": str(REPO / "examples" / "data" / "chat_train.jsonl"), "seq_len": args.seq,
                 "cache_dir": str(work / "cache")},
        "train": {"micro_batch_size": args.micro, "grad_accumulation_steps": args.accum,
                  "max_steps": args.steps, "threads": args.threads},
        "optimizer": {"lr": 1e-4},
        "checkpoint": {"dir": str(run_dir)},
        "log": {"every": 1, "progress": "off", "peak_tflops": 1.0},
        "parallel": {"ep": ep or nproc, "zero": zero, "bucket_mb": bucket_mb},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "automoe.cli", "train", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir)  # (checkpoints and the export: gigabytes per run at cpu-medium)
    train = [r for r in recs if r["type"] == "train"][1:]  # the first step warms up
    out = {
        "name": name, "nproc": nproc, "ep": ep or nproc, "zero": zero if nproc > 1 else "-",
        "bucket_mb": bucket_mb if nproc > 1 else "-",
        "dispatcher": dispatcher if (ep or nproc) > 1 else "-",
        "step_s": statistics.median(r["step_time_s"] for r in train),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "loss_last": train[-1]["loss"],
    }
    last = train[-1]
    per_rank = last.get("parallel", {}).get("peak_memory_gib_per_rank") or [last["peak_memory_gib"]]
    out["peak_gib_per_rank"] = max(per_rank)
    if "parallel" in last:
        syncs = [[r["parallel"]["gradient_sync_wait_s"][k] for r in train] for k in range(nproc)]
        out["grad_sync_s_per_step"] = max(statistics.median(w) for w in syncs)
    if "dispatch" in last:
        for key, field in (("wait_s_per_step", "collective_wait_s"),
                           ("backward_wait_s_per_step", "backward_collective_wait_s")):
            waits = [[r["dispatch"][field][k] for r in train] for k in range(nproc)]
            out[key] = max(statistics.median(w) for w in waits)
        out["mb_sent_per_step"] = statistics.median(max(r["dispatch"]["bytes_sent"]) for r in train) / 1e6
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-medium")
    p.add_argument("--nproc", default="1,2,4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step, over all ranks")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--ep", default="all", help="'all' (ep = processes) or 1 (data parallelism only)")
    p.add_argument("--zero", default="1", help="ZeRO stages to compare, e.g. 1,2")
    p.add_argument("--dispatchers", default="alltoall,alltoall_overlap")
    p.add_argument("--bucket-mb", default="32", help="gradient bucket sizes to compare, e.g. 32,100000")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--record", help="put the table into this Markdown file (docs/performance.md), in the "
                   "section of this machine's hardware class, replacing the same configuration's")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="automoe-parallel-") as tmp:
        measure(args, Path(tmp))


def measure(args, work: Path) -> None:
    ckpt = build(args.preset, work)
    results = []
    for n in [int(x) for x in args.nproc.split(",")]:
        ep = n if args.ep == "all" else int(args.ep)
        kinds = args.dispatchers.split(",") if ep > 1 else ["auto"]
        for kind in kinds:
            for zero in ([int(z) for z in args.zero.split(",")] if n > 1 else [1]):
                for mb in ([float(b) for b in args.bucket_mb.split(",")] if n > 1 else [32.0]):
                    results.append(run(ckpt, work, f"n{n}-ep{ep}-{kind}-zero{zero}-b{mb:g}", n, kind, args,
                                       ep, zero, mb))
                    print(json.dumps(results[-1]), file=sys.stderr)
    meta = dict(preset=args.preset, dtype=args.dtype, accum=args.accum, micro=args.micro, seq=args.seq,
                threads=args.threads, ep=args.ep, cpu=f"{cpu_model()} ({isa()}), {os.cpu_count()} cores")
    print("\n" + markdown(meta, results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.record:
        record(meta, results, Path(args.record))


def how(meta: dict) -> str:
    return (f"{meta['accum']} micro-batches of {meta['micro']} × {meta['seq']} tokens per step over all ranks, "
            f"{meta['threads']} thread(s) per process, Gloo; medians of the steps after the first; "
            f"memory is each process's peak RSS (the largest rank's), wait times the slowest rank's")


def table_lines(results: list[dict]) -> list[str]:
    base = results[0]
    lines = ["| processes (ep) | ZeRO | bucket MiB | dispatcher | tokens/s | step s | peak memory per rank | "
             "vs 1 process | dispatcher wait per step, forward / backward | gradient sync wait per step | "
             "dispatch MB sent per rank per step |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        wait = (f"{r['wait_s_per_step'] * 1e3:.0f} / {r['backward_wait_s_per_step'] * 1e3:.0f} ms"
                if "wait_s_per_step" in r else "-")
        sent = f"{r['mb_sent_per_step']:.2f}" if "mb_sent_per_step" in r else "-"
        sync = f"{r['grad_sync_s_per_step'] * 1e3:.0f} ms" if "grad_sync_s_per_step" in r else "-"
        bucket = r["bucket_mb"] if isinstance(r["bucket_mb"], str) else f"{r['bucket_mb']:g}"
        lines.append(f"| {r['nproc']} ({r['ep']}) | {r['zero']} | {bucket} | {r['dispatcher']} | "
                     f"{r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['peak_gib_per_rank']:.2f} GiB | "
                     f"{r['peak_gib_per_rank'] / base['peak_gib_per_rank']:.2f}× | {wait} | {sync} | {sent} |")
    return lines


def title(meta: dict) -> str:
    ep = str(meta["ep"])
    kind = ("ep = processes" if ep == "all" else
            "data parallelism only (ep = 1)" if ep == "1" else f"ep = {ep}")
    return f"{meta['preset']} · {meta['dtype']} · {kind}"


def markdown(meta: dict, results: list[dict]) -> str:
    return "\n".join([f"{title(meta)}; {meta['cpu']}", "", how(meta), "", *table_lines(results)]) + "\n"


def record(meta: dict, results: list[dict], doc: Path, stamp=None) -> str:
    """Files the table in `doc` (docs/performance.md) under this machine's hardware class,
    replacing the one of the same preset, dtype and ep; returns its key."""
    stamp = stamp or recorder.stamp("cpu")
    body = recorder.table(title(meta), stamp, how(meta), table_lines(results))
    return recorder.write(doc, "parallel", f"{meta['preset']}:{meta['dtype']}:ep-{meta['ep']}", body, stamp)


if __name__ == "__main__":
    main()
