#!/usr/bin/env python
"""Tokenisation throughput and peak memory: `automoe train`'s data pipeline against
`datasets.map(batched=True, num_proc=N)` with the same tokenizer, in one run.

    python bench/tokenize_bench.py [--docs 20000] [--scale 10] [--format chat|text] [--num-proc 2]

A synthetic corpus of --docs records (chats of a system prompt, a question and a long answer,
or plain text) is written as JSONL, and a --scale times larger one beside it. Each side runs in
its own fresh process with an empty cache, alternating, --repeats times; the best time is kept;
the clock starts once the tokenizer is loaded (Transformers imported) on both sides.
AutoMoE's side is automoe.data.build (num_proc workers, written to the .amds cache as produced);
the reference is datasets.load_dataset("json") + map(batched=True, num_proc) doing the same work
(`tok(texts)` for text; `apply_chat_template(tokenize=True)` for chat, which computes no loss
mask). Peak memory: the tokenising process's peak RSS, and the largest worker's (ru_maxrss).
Prints one table and, with --json, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OURS = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from automoe import data
tok = data.load_tokenizer(sys.argv[3])
t = time.perf_counter()
ds = data.build([sys.argv[2]], tok, sys.argv[3], fmt=sys.argv[5], cache_dir=sys.argv[4], num_proc=int(sys.argv[6]))
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": ds.stats["tokens"], "documents": ds.stats["documents"],
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

REFERENCE = r"""
import json, os, resource, sys, time
os.environ["HF_DATASETS_CACHE"] = sys.argv[4]
import datasets
from transformers import AutoTokenizer
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(sys.argv[3])
fmt, n = sys.argv[5], int(sys.argv[6])
t = time.perf_counter()
ds = datasets.load_dataset("json", data_files=sys.argv[2], split="train", cache_dir=sys.argv[4])
if fmt == "text":
    out = ds.map(lambda b: {"input_ids": tok(b["text"])["input_ids"]}, batched=True, num_proc=n,
                 remove_columns=ds.column_names)
else:
    out = ds.map(lambda b: {"input_ids": tok.apply_chat_template(b["messages"], tokenize=True, return_dict=True)["input_ids"]},
                 batched=True, num_proc=n, remove_columns=ds.column_names)
dt = time.perf_counter() - t
tokens = sum(len(x) for x in out["input_ids"])
print(json.dumps({"seconds": dt, "tokens": tokens, "documents": len(out),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_corpus(path: Path, n: int, fmt: str, words: list[str], seed: int) -> None:
    rng = random.Random(seed)

    def sentence(k):
        return " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            answer = " ".join(sentence(rng.randint(8, 20)) for _ in range(rng.randint(6, 14)))
            if fmt == "text":
                rec = {"text": sentence(12) + " " + answer}
            else:
                rec = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": sentence(rng.randint(6, 16)) + "?"},
                                    {"role": "assistant", "content": answer}]}
            f.write(json.dumps(rec) + "\n")


def run(script: str, corpus: Path, tok: Path, fmt: str, num_proc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tokbench-cache-") as cache:
        out = subprocess.run([sys.executable, "-c", script, str(REPO / "python"), str(corpus), str(tok), cache,
                              fmt, str(num_proc)], capture_output=True, text=True,
                             env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                                      TRANSFORMERS_VERBOSITY="error"))
    if out.returncode:
        raise SystemExit(f"tokenize_bench: a side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--scale", type=int, default=10, help="the larger corpus is this many times --docs (0: none)")
    ap.add_argument("--format", choices=("chat", "text"), default="chat")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "python"))
    from automoe.demo import EXAMPLES, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="tokbench-"))
    tok_dir = work / "tokenizer"
    build_tokenizer(EXAMPLES / "data" / "corpus.txt", vocab_size=2000).save_pretrained(tok_dir)
    words = (EXAMPLES / "data" / "corpus.txt").read_text(encoding="utf-8").split()
    sizes = [args.docs] + ([args.docs * args.scale] if args.scale else [])
    rows = {}
    for n in sizes:
        corpus = work / f"corpus-{n}.jsonl"
        write_corpus(corpus, n, args.format, words, seed=n)
        best = {}
        for _ in range(args.repeats):
            for side, script in (("automoe", OURS), ("datasets.map", REFERENCE)):
                if side == "datasets.map" and n != args.docs:
                    continue  # the throughput comparison runs on the 1x corpus
                r = run(script, corpus, tok_dir, args.format, args.num_proc)
                if side not in best or r["seconds"] < best[side]["seconds"]:
                    best[side] = r
        rows[n] = dict(best, corpus_mib=corpus.stat().st_size / 2**20)
    print(f"tokenisation, {args.format} format, num_proc {args.num_proc}, best of {args.repeats}")
    print(f"{'docs':>9} {'corpus MiB':>10} {'side':>13} {'s':>7} {'tokens/s':>10} {'RSS MiB':>8} {'worker MiB':>10}")
    for n, row in rows.items():
        for side in ("automoe", "datasets.map"):
            if side in row:
                r = row[side]
                print(f"{n:>9} {row['corpus_mib']:>10.1f} {side:>13} {r['seconds']:>7.2f} "
                      f"{r['tokens'] / r['seconds']:>10.0f} {r['rss_mib']:>8.0f} {r['worker_rss_mib']:>10.0f}")
    small = rows[args.docs]
    print(f"throughput automoe / datasets.map: {small['datasets.map']['seconds'] / small['automoe']['seconds']:.2f}x")
    if args.scale:
        big = rows[args.docs * args.scale]["automoe"]
        print(f"peak RSS at {args.scale}x the corpus / at 1x: "
              f"{big['rss_mib'] / small['automoe']['rss_mib']:.2f} (tokenising process), "
              f"{big['worker_rss_mib'] / max(small['automoe']['worker_rss_mib'], 1):.2f} (largest worker)")
    if args.json:
        print(json.dumps({"format": args.format, "num_proc": args.num_proc, "rows": rows}))


if __name__ == "__main__":
    main()
