"""Fine-tuning throughput, AutoMoE's trainer against a Transformers v5 training loop, same run.

Both sides fine-tune the same randomly initialised Qwen3-MoE checkpoint (a `automoe bench` preset
geometry, written by Transformers) on the same packed chat batches (examples/data/chat_train.jsonl,
tokenised once by automoe.data, packed in file order with the trainer's rule), float32, AdamW
(fused) with gradient clipping at 1.0 and a constant learning rate:

- AutoMoE: `automoe train` (the C++ loop: data, forward/backward, clipping, AdamW, metrics).
- Transformers: model(input_ids, position_ids, labels, output_router_logits=True, use_cache=False)
  -> backward -> clip_grad_norm_ -> torch.optim.AdamW(fused=True), the experts implementation given
  by --hf-experts (Transformers' own choices: grouped_mm, batched_mm, eager).

Reported per side: tokens/s over the timed steps (non-padding tokens / whole-step wall time, the
warm-up steps excluded) and the process's peak RSS; plus the per-step loss of both sides, which
must agree (same data, same math) — the run fails if they drift apart.

    .venv/bin/python bench/train_vs_hf.py --preset cpu-small --repeats 3 --activation-checkpointing \
        --record docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))
import record as recorder  # noqa: E402  (bench/record.py: --record's tables)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def packed_batches(docs, masks, seq: int, rows: int, steps: int, pad: int):
    """The trainer's packing (csrc/automoe/train/dataset.cpp), file order, as HF inputs."""
    import torch

    batches, i = [], 0
    for _ in range(steps):
        row_docs = []
        used = seq
        while True:
            n = min(len(docs[i % len(docs)]), seq)
            if used + n > seq:
                if len(row_docs) == rows:
                    break
                row_docs.append([])
                used = 0
            row_docs[-1].append(i % len(docs))
            used += n
            i += 1
        L = max(sum(min(len(docs[d]), seq) for d in r) for r in row_docs)
        ids = torch.full((rows, L), pad, dtype=torch.long)
        pos = torch.zeros((rows, L), dtype=torch.long)
        labels = torch.full((rows, L), -100, dtype=torch.long)
        real = 0
        for r, row in enumerate(row_docs):
            c = 0
            for d in row:
                t = torch.as_tensor(docs[d][:seq].astype("int64"))
                m = torch.as_tensor(masks[d][:seq].astype(bool))
                m[0] = False
                ids[r, c:c + len(t)] = t
                pos[r, c:c + len(t)] = torch.arange(len(t))
                labels[r, c:c + len(t)] = torch.where(m, t, torch.tensor(-100))
                c += len(t)
            pos[r, c:] = torch.arange(L - c)  # padding: a document of its own, no loss
            real += c
        batches.append((ids, pos, labels, real))
    return batches


def hf_side(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from automoe import data

    torch.set_num_threads(args.threads)
    docs, masks = data.read(args.dataset)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32,
                                                 experts_implementation=args.hf_experts)
    model.train()
    coef = model.config.router_aux_loss_coef
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, fused=True)
    batches = packed_batches(docs, masks, args.seq, args.micro, args.warmup + args.steps,
                             model.config.pad_token_id or 0)
    losses, times, tokens = [], [], []
    for ids, pos, labels, real in batches:
        t0 = time.perf_counter()
        out = model(input_ids=ids, position_ids=pos, labels=labels, output_router_logits=True,
                    use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.item() - coef * out.aux_loss.item())
        tokens.append(real)
    w = args.warmup
    return dict(side="transformers", impl=f"transformers {args.hf_experts} (sdpa)",
                tokens_per_s=sum(tokens[w:]) / sum(times[w:]), losses=losses,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def automoe_side(args, work: Path, ac: bool) -> dict:
    import yaml

    run = work / f"automoe-run-{time.monotonic_ns()}"
    recipe = {
        "model": {"path": str(args.checkpoint), "dtype": "float32",
                  "backend": {"experts": args.automoe_experts}},
        "data": {"train": str(REPO / "examples" / "data" / "chat_train.jsonl"), "format": "chat",
                 "seq_len": args.seq, "packing": True, "shuffle": False,
                 "cache_dir": str(work / "cache")},
        "train": {"micro_batch_size": args.micro, "max_steps": args.warmup + args.steps,
                  "threads": args.threads, "activation_checkpointing": ac},
        "optimizer": {"lr": args.lr, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "schedule": {"type": "constant"},
        "checkpoint": {"dir": str(run)},
        "log": {"every": 1, "progress": "off"},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    subprocess.run([sys.executable, "-m", "automoe.cli", "train", str(path)], check=True, env=env)
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "train"]
    timed = steps[args.warmup:]
    tok = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    return dict(side="automoe", impl=f"automoe experts={args.automoe_experts}"
                + (" + activation checkpointing" if ac else ""),
                tokens_per_s=tok / sum(r["step_time_s"] for r in timed),
                losses=[r["loss"] for r in steps], peak_rss_bytes=int(steps[-1]["peak_memory_gib"] * (1 << 30)))


def prepare(args, work: Path):
    import torch

    from automoe import data
    from automoe.demo import build_checkpoint, build_tokenizer

    tok = build_tokenizer(REPO / "examples" / "data" / "corpus.txt")
    preset = json.loads(subprocess.run(
        [str(REPO / "python" / "automoe" / "bin" / "automoe"), "bench", "--print-config", "--preset", args.preset],
        check=True, capture_output=True, text=True).stdout)["config"]
    cfg = {k: v for k, v in preset.items() if k not in ("architectures", "model_type", "dtype", "transformers_version")}
    cfg["vocab_size"] = max(cfg["vocab_size"], len(tok))
    ckpt = build_checkpoint(work / "model", tok, seed=0, **cfg)
    ds = data.build([str(REPO / "examples" / "data" / "chat_train.jsonl")], tok, str(ckpt), fmt="chat",
                    cache_dir=work / "cache")
    return ckpt, ds.path


def table_lines(res: dict) -> list[str]:
    base = res["sides"][0]
    lines = ["| side | tokens/s | vs Transformers | peak RSS (GiB) | vs Transformers |", "|---|---:|---:|---:|---:|"]
    for s in res["sides"]:
        lines.append(f"| {s['impl']} | {s['tokens_per_s']:.0f} | {s['tokens_per_s'] / base['tokens_per_s']:.2f}× | "
                     f"{s['peak_rss_bytes'] / 2**30:.2f} | {s['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}× |")
    return lines


def how(res: dict) -> str:
    m = res["meta"]
    return (f"{m['steps']} timed steps after {m['warmup']} warm-up, best of {m['repeats']} alternating runs "
            f"per side (all runs' tokens/s in the JSON); packed chat tokens, AdamW + clip 1.0, "
            f"{m['threads']} CPU threads; torch {m['torch']}, transformers {m['transformers']}; "
            f"the two sides' losses agree to {res['max_loss_rel_diff']:.1e} (largest relative difference)")


def markdown(res: dict) -> str:
    m = res["meta"]
    return "\n".join([f"Fine-tuning loop, {m['preset']}: AutoMoE trainer vs Transformers loop, {m['cpu']}, "
                      f"{m['date']}", "", how(res), "", *table_lines(res)]) + "\n"


def record_markdown(res: dict, stamp) -> str:
    """The table as docs/performance.md holds it."""
    m = res["meta"]
    title = f"{m['preset']} · float32 · micro-batch {m['micro']} × {m['seq']}"
    return recorder.table(title, stamp, how(res), table_lines(res))


def record(res: dict, doc: Path, stamp=None) -> str:
    """Files the table in `doc` (docs/performance.md) under this machine's hardware class,
    replacing the one of the same preset; returns its key."""
    stamp = stamp or recorder.stamp("cpu")
    return recorder.write(doc, "train_vs_hf", f"{res['meta']['preset']}:float32",
                          record_markdown(res, stamp), stamp)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-experts", default="grouped_mm")
    p.add_argument("--automoe-experts", default="grouped")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="also run AutoMoE with train.activation_checkpointing")
    p.add_argument("--repeats", type=int, default=1, help="alternate the sides this many times, keep each one's best")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference allowed")
    p.add_argument("--record", help="put the table into this Markdown file (docs/performance.md), in the "
                   "section of this machine's hardware class, replacing the same preset's")
    p.add_argument("--json", help="write the result here")
    # internal: one side in a fresh process
    p.add_argument("--side", choices=["hf"], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side == "hf":
        print(json.dumps(hf_side(args)))
        return 0

    import platform

    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="automoe-train-vs-hf-") as tmp:
        work = Path(tmp)
        args.checkpoint, args.dataset = prepare(args, work)
        cmd = [sys.executable, __file__, "--side", "hf", "--checkpoint", str(args.checkpoint),
               "--dataset", str(args.dataset)] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                  if k in ("steps", "warmup", "micro", "seq", "lr", "threads", "hf_experts")]
        # Sides alternate, `--repeats` times; each reports its best run (this machine is shared, and
        # the slower runs are the ones other tenants slowed down).
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            runs.setdefault("hf", []).append(
                json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
            runs.setdefault("ours", []).append(automoe_side(args, work, False))
            if args.activation_checkpointing:
                runs.setdefault("ours-ac", []).append(automoe_side(args, work, True))
        best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in runs.items()}
        for k, v in runs.items():
            best[k]["all_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in v]
        hf = best["hf"]
        ours = [best["ours"]] + ([best["ours-ac"]] if "ours-ac" in best else [])
    diffs = [abs(a - b) / abs(b) for o in ours for a, b in zip(o["losses"], hf["losses"])]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    res = dict(meta=dict(preset=args.preset, steps=args.steps, warmup=args.warmup, micro=args.micro, seq=args.seq,
                         threads=args.threads, repeats=args.repeats, cpu=cpu, torch=torch.__version__, transformers=transformers.__version__,
                         date=time.strftime("%Y-%m-%d")),
               sides=[hf, *ours], max_loss_rel_diff=max(diffs))
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.record:
        record(res, Path(args.record))
    if max(diffs) > args.tolerance:
        print(f"train_vs_hf: the two sides' losses differ by {max(diffs):.1e} (> {args.tolerance})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
