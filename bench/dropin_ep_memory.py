"""Per-rank memory of the drop-in under expert parallelism, on Transformers' model (a type the
engine does not run natively): `from_pretrained(path, ep_size=N)` under torchrun, one training
step (forward, backward, AdamW), against the same on one process.

    python bench/dropin_ep_memory.py --nproc 1,2,4 [--family granitemoe] [--record docs/performance.md]

Every side runs under torchrun (one process too), so each pays the same runtime. A rank measures
its resident memory after importing torch / Transformers / AutoMoE and joining the process group
(the runtime's own), then its peak (VmHWM) through loading (the safetensors are memory-mapped:
little is resident before the first step) and two steps; the table gives the peak above the
runtime's, the largest over the ranks, and its ratio to one process's. The model is a random
checkpoint Transformers writes, with most parameters in the experts as in released MoE models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import record as recorder  # noqa: E402  (bench/record.py: --record's tables)

SIZES = {"granitemoe": dict(vocab_size=2048, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, num_local_experts=32,
                            num_experts_per_tok=2, max_position_embeddings=512)}


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def worker(ckpt: str, out: str, ep: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import transformers  # noqa: F401  (the runtime's own memory includes the libraries)

    from automoe import AutoModelForCausalLM

    baseline = status_kib("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **({"ep_size": ep} if ep > 1 else {}))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = status_kib("VmHWM")
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, {"baseline": baseline, "peak": peak})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", default="1,2,4")
    p.add_argument("--family", default="granitemoe", choices=sorted(SIZES))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--record", help="put the table into this Markdown file (docs/performance.md)")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args.seq)
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / args.family
        config = AutoConfig.for_model(args.family, **SIZES[args.family])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        model.save_pretrained(ckpt)
        del model
        env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
        for n in (int(x) for x in args.nproc.split(",")):
            out = Path(tmp) / f"mem{n}.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                            __file__, "--seq", str(args.seq), "--worker", str(ckpt), str(out), str(n)],
                           check=True, env=env, capture_output=True, timeout=1800)
            ranks = json.loads(out.read_text())
            rows.append({"ep": n, "above_runtime_kib": max(r["peak"] - r["baseline"] for r in ranks)})
    one = rows[0]["above_runtime_kib"]
    title = (f"{args.family} · float32 · {params / 1e6:.0f} M parameters ({100 * experts / params:.0f} % in the "
             f"experts) · seq {args.seq}")
    how = ("`python bench/dropin_ep_memory.py`: the drop-in's Transformers path under torchrun (Gloo), one "
           "training step twice (AdamW); peak resident memory above the runtime's own, the largest rank.")
    lines = ["| ep_size (processes) | peak above the runtime | vs one process |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ep']} | {r['above_runtime_kib'] / 2**20:.2f} GiB | {r['above_runtime_kib'] / one:.2f}× |")
    print(title, "\n", how, "\n", "\n".join(lines), sep="")
    if args.record:
        stamp = recorder.stamp("cpu")
        body = recorder.table(title, stamp, how, lines)
        recorder.write(Path(args.record), "dropin_ep_memory", f"{args.family}:float32", body, stamp)


if __name__ == "__main__":
    main()
