"""The memory plan (`automoe plan`, train/plan.h) against what `automoe train` really uses.

    python bench/plan_accuracy.py --preset cpu-medium
    python bench/plan_accuracy.py --preset qwen3-30b-a3b-L2 --cases bf16-8bit --record docs/performance.md
    python bench/plan_accuracy.py --config bench/configs/nemotron_h-cpu-small.json

For each case (precision, LoRA, activation checkpointing, ranks with ep and ZeRO) it builds the
model once with Transformers (random weights, saved in bf16), runs `automoe train` for a few
steps on generated text and compares the peak the run's metrics record (CPU: the process's
resident high-water mark above its memory when the run started; under torchrun rank 0's) with the
plan the run was started with (the same numbers `automoe plan` prints). `--record FILE` writes the
table into FILE between `<!-- plan_accuracy MODEL -->` markers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

GiB = float(1 << 30)

# name -> recipe overrides (and "nproc"): the configurations the plan must get right. "bf16" cases
# keep float32 masters and moments unless they say otherwise (the default for one process is
# remainders + 8-bit moments: "bf16-8bit").
F32 = {"optimizer.master_weights": "float32", "optimizer.state_dtype": "float32"}
CASES = {
    "fp32": {"model.dtype": "float32"},
    "fp32-ckpt": {"model.dtype": "float32", "train.activation_checkpointing": True},
    "bf16": {"model.dtype": "bfloat16", **F32},
    "bf16-accum": {"model.dtype": "bfloat16", **F32, "train.grad_accumulation_steps": 2},
    "bf16-8bit": {"model.dtype": "bfloat16", "optimizer.master_weights": "remainders",
                  "optimizer.state_dtype": "8bit"},
    "bf16-rem-bf16": {"model.dtype": "bfloat16", "optimizer.master_weights": "remainders",
                      "optimizer.state_dtype": "bfloat16"},
    "bf16-ckpt": {"model.dtype": "bfloat16", **F32, "train.activation_checkpointing": True},
    "bf16-lora": {"model.dtype": "bfloat16", "peft.r": 8, "peft.lora_alpha": 16,
                  "peft.target_modules": "all-linear"},
    "bf16-lora-experts": {"model.dtype": "bfloat16", "peft.r": 8, "peft.lora_alpha": 16,
                          "peft.target_modules": "all-linear",
                          "peft.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                          "train.grad_accumulation_steps": 2},
    "bf16-qlora-nf4": {"model.dtype": "bfloat16", "model.quantize": "nf4", "peft.r": 8, "peft.lora_alpha": 16,
                       "peft.target_modules": "all-linear",
                       "peft.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                       "train.grad_accumulation_steps": 2},
    "bf16-lora-ep2": {"model.dtype": "bfloat16", "peft.r": 8, "peft.lora_alpha": 16,
                      "peft.target_modules": "all-linear",
                      "peft.target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      "nproc": 2, "parallel.ep": 2, "train.grad_accumulation_steps": 2},
    "fp32-ep2-zero1": {"model.dtype": "float32", "nproc": 2, "parallel.ep": 2, "parallel.zero": 1,
                       "train.grad_accumulation_steps": 2},
    "bf16-ep2-zero0": {"model.dtype": "bfloat16", **F32, "nproc": 2, "parallel.ep": 2, "parallel.zero": 0,
                       "train.grad_accumulation_steps": 2},
    "fp32-dp2-zero2": {"model.dtype": "float32", "nproc": 2, "parallel.ep": 1, "parallel.zero": 2,
                       "train.grad_accumulation_steps": 2},
    "fp32-ep4-zero1": {"model.dtype": "float32", "nproc": 4, "parallel.ep": 4, "parallel.zero": 1,
                       "train.grad_accumulation_steps": 4},
}


def automoe_cmd() -> list[str]:
    return [sys.executable, "-m", "automoe.cli"]


def preset_config(preset: str) -> dict:
    exe = REPO / "python" / "automoe" / "bin" / "automoe"
    out = subprocess.run([str(exe), "bench", "--preset", preset, "--print-config"], capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout)["config"]


def build_model(config: dict, cache: Path) -> Path:
    """The model of `config` as Transformers writes it (bf16, random weights), with a small BPE
    tokenizer beside it; cached by the config's content."""
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"model-{config.get('model_type')}-{key}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automoe.demo import build_tokenizer

    tok = build_tokenizer(REPO / "examples" / "data" / "corpus.txt", vocab_size=400)
    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    cfg.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    hf = AutoConfig.for_model(config["model_type"], **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    tmp = path.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    tmp.rename(path)
    return path


def write_data(work: Path, tokens: int) -> Path:
    """Short text documents of random corpus words, at least `tokens` tokens in all (a word is a
    token or more): packing fills every row to seq_len, the case the plan is for."""
    path = work / f"text-{tokens}.jsonl"
    if path.exists():
        return path
    words = (REPO / "examples" / "data" / "corpus.txt").read_text().split()
    rng = random.Random(0)
    with path.open("w") as f:
        n = 0
        while n < tokens:
            k = rng.randint(20, 80)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(k))}) + "\n")
            n += k
    return path


def run_case(model: Path, work: Path, name: str, case: dict, seq: int, micro: int, steps: int,
             threads: int) -> dict:
    """Trains `steps` steps of `case`; returns the planned and measured peaks (bytes)."""
    import yaml

    nproc = int(case.get("nproc", 1))
    rows = micro * int(case.get("train.grad_accumulation_steps", 1)) * steps
    data = write_data(work, 2 ** max(12, (2 * seq * rows).bit_length()))
    run = work / f"run-{name}-{time.monotonic_ns()}"
    recipe = {
        "model": {"path": str(model)},
        "data": {"train": str(data), "format": "text", "seq_len": seq, "cache_dir": str(work / "cache"),
                 "num_proc": 1},
        "train": {"micro_batch_size": micro, "max_steps": steps, "threads": threads},
        "checkpoint": {"dir": str(run)},
        "log": {"every": 1, "progress": "off", "peak_tflops": 1.0},
    }
    path = work / f"recipe-{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in case.items() if k != "nproc"]
    cmd = [*automoe_cmd(), "train", str(path), *overrides]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH") or str(REPO / "python"))
    # The run is stopped (SIGKILL to its process group) once its last step is logged: the step's
    # peak is what the plan predicts, and a large model's checkpoint and export would only cost
    # disk and time.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    metrics = run / "metrics.jsonl"
    start = last = None
    deadline = time.monotonic() + 3600
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
        if not metrics.exists():
            continue
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.endswith("}") else {}
            if rec.get("type") == "start":
                start = rec
            elif rec.get("type") == "train" and rec.get("step") == steps:
                last = rec
        if last is not None:
            break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    err = proc.communicate()[1]
    if last is None or start is None:
        raise RuntimeError(f"case {name}: automoe train failed ({proc.returncode}):\n{err[-4000:]}")
    plan = json.loads((run / "plan.json").read_text())
    shutil.rmtree(run, ignore_errors=True)
    peak = max(last.get("peak_memory_gib_per_rank") or [last["peak_memory_gib"]]) * GiB
    measured = peak - start["memory_baseline_bytes"]
    planned = start["planned_peak_bytes"]
    if start["device"].startswith("cuda"):  # the allocator's peak counts tensors, not the context
        planned -= next(m["bytes"] for m in plan["plan"]["memory"] if m["name"] == "runtime")
    return {"case": name, "planned": planned, "measured": measured, "ratio": planned / measured, "plan": plan,
            "setup": start["setup_peak_bytes"] - start["memory_baseline_bytes"]}


def table(rows: list[dict], title: str) -> str:
    out = [title, "", "| case | planned GiB | measured GiB | planned / measured |", "|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['planned'] / GiB:.3f} | {r['measured'] / GiB:.3f} | {r['ratio']:.3f} |")
    return "\n".join(out) + "\n"


def record(doc: Path, key: str, text: str) -> None:
    import record as rec

    rec.replace_marked(doc, "plan_accuracy", key, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-medium")
    p.add_argument("--config", help="a config.json instead of a preset")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--work", default=str(REPO / ".cache" / "automoe" / "plan_accuracy"))
    p.add_argument("--record", help="write the table into this Markdown file")
    args = p.parse_args()
    config = json.loads(Path(args.config).read_text()) if args.config else preset_config(args.preset)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(config, work)
    rows = []
    for name in args.cases.split(","):
        r = run_case(model, work, name, CASES[name], args.seq, args.micro, args.steps, args.threads)
        print(f"{name}: planned {r['planned'] / GiB:.3f} GiB, measured {r['measured'] / GiB:.3f} GiB, "
              f"ratio {r['ratio']:.3f} (setup {r['setup'] / GiB:.3f}) "
              + " ".join(f"{m['name']}={m['bytes'] / GiB:.3f}" for m in r["plan"]["plan"]["memory"]), flush=True)
        rows.append(r)
    label = Path(args.config).stem if args.config else args.preset
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "CPU")
    title = (f"**{label}** · batch {args.micro} × {args.seq} · {args.steps} steps · {cpu}, "
             f"{os.cpu_count()} cores · {time.strftime('%Y-%m-%d')}")
    text = table(rows, title)
    print(text)
    if args.record:
        record(Path(args.record), label, text)


if __name__ == "__main__":
    main()
