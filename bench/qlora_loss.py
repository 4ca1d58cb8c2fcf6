"""How much a quantised base costs LoRA's loss: the demo's LoRA fine-tune (examples/lora.yaml on the
tiny demo Qwen3-MoE: adapters on every linear layer and the routed experts, 200 steps) with the base
in bf16 and with its routed experts held nf4 / fp4 / int8 (`model.quantize`), every run in bf16,
same data and seed. Reports the training loss (mean of the last 20 steps) and the validation loss
at the last step, each against the bf16 base's.

    python bench/qlora_loss.py                      # 200 steps, nf4 / fp4 / int8
    python bench/qlora_loss.py --record docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))


def run(ckpt: Path, work: Path, quantize: str, steps: int) -> dict:
    out = work / f"run-{quantize}"
    shutil.rmtree(out, ignore_errors=True)  # every run from scratch
    cmd = [sys.executable, "-m", "automoe.cli", "train", str(REPO / "examples" / "lora.yaml"),
           f"model.path={ckpt}", f"checkpoint.dir={out}", f"data.cache_dir={work / 'datasets'}",
           "model.dtype=bfloat16", f"train.max_steps={steps}", f"train.eval_every={steps}",
           "log.every=1", "log.progress=off"]
    if quantize != "none":
        cmd.append(f"model.quantize={quantize}")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO / "python")))
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r["loss"] for r in recs if r["type"] == "train"]
    evals = [r["eval_loss"] for r in recs if r["type"] == "eval"]
    return {"quantize": quantize, "train": sum(train[-20:]) / len(train[-20:]), "eval": evals[-1], "wall": wall}


def table(rows: list[dict], title: str) -> str:
    ref = rows[0]
    out = [title, "", "| base experts | training loss (last 20 steps) | vs bf16 | validation loss | vs bf16 | wall s |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['quantize'] if r['quantize'] != 'none' else 'bf16'} | {r['train']:.4f} | "
                   f"{r['train'] / ref['train']:.4f} | {r['eval']:.4f} | {r['eval'] / ref['eval']:.4f} | {r['wall']:.0f} |")
    return "\n".join(out) + "\n"


def record(doc: Path, text: str) -> None:
    import record as rec

    rec.replace_marked(doc, "qlora_loss", "demo", text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quantize", default="nf4,fp4,int8")
    p.add_argument("--work", default=str(REPO / ".cache" / "automoe" / "qlora_loss"))
    p.add_argument("--record", help="write the table into this Markdown file")
    args = p.parse_args()
    from automoe.demo import demo_checkpoint

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = demo_checkpoint(REPO / ".cache" / "automoe", "qwen3_moe")
    rows = [run(ckpt, work, q, args.steps) for q in ["none", *args.quantize.split(",")]]
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "CPU")
    title = (f"**demo LoRA (examples/lora.yaml), bf16, {args.steps} steps** · {cpu}, {os.cpu_count()} cores · "
             f"{time.strftime('%Y-%m-%d')}")
    text = table(rows, title)
    print(text)
    if args.record:
        record(Path(args.record), text)


if __name__ == "__main__":
    main()
