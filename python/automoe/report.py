"""`automoe report RUN_DIR`: the loss curve and the expert-load heat map of a training run, drawn
from its metrics.jsonl into RUN_DIR/loss.png and RUN_DIR/expert_load.png."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    recipe = run / "recipe.json"
    if recipe.exists():
        custom = json.loads(recipe.read_text()).get("log", {}).get("jsonl")
        if custom:
            path = Path(custom)
    if not path.exists():
        raise SystemExit(f"automoe report: {path}: no metrics (is {run} a training run directory?)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves at most its last line incomplete.
            print(f"automoe report: {path}:{n}: unreadable line skipped", file=sys.stderr)
    return records


def expert_share(train: list[dict]):
    """[MoE layers x experts] tokens routed to each expert over the run, relative to a uniform
    split (1.0 = balanced), and the layer numbers."""
    import numpy as np

    sums: dict[int, np.ndarray] = {}
    for rec in train:
        for layer in rec.get("expert_load", []):
            c = np.asarray(layer["counts"], dtype=np.float64)
            sums[layer["layer"]] = sums.get(layer["layer"], 0) + c
    layers = sorted(sums)
    if not layers:
        return None, []
    m = np.stack([sums[l] for l in layers])
    mean = m.mean(axis=1, keepdims=True)
    return np.divide(m, mean, out=np.zeros_like(m), where=mean > 0), layers


def draw(run: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run)
    # A resumed run logs again the steps after its last checkpoint: the later record of a step wins.
    train = sorted({r["step"]: r for r in records if r.get("type") == "train"}.values(), key=lambda r: r["step"])
    evals = sorted({r["step"]: r for r in records if r.get("type") == "eval"}.values(), key=lambda r: r["step"])
    if not train:
        raise SystemExit(f"automoe report: {run}: no training steps logged yet")
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"{run.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run / "loss.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    written.append(out)

    share, layers = expert_share(train)
    if share is not None:
        fig, ax = plt.subplots(figsize=(max(6.5, 0.25 * share.shape[1] + 2), max(2.5, 0.35 * len(layers) + 1.5)))
        im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(l) for l in layers])
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title("expert load: tokens / uniform share (1 = balanced)")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        out = run / "expert_load.png"
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: automoe report RUN_DIR", file=sys.stderr if len(argv) != 1 else sys.stdout)
        raise SystemExit(2 if len(argv) != 1 else 0)
    run = Path(argv[0])
    if not run.is_dir():
        raise SystemExit(f"automoe report: {run}: no such directory")
    for p in draw(run):
        print(p)
