"""`automoe report RUN_DIR`: the loss curve and the expert-load heat map of a training run, drawn
from its metrics.jsonl into RUN_DIR/loss.png and RUN_DIR/expert_load.png."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _valid(rec) -> bool:
    """A record the plots can use: an object; a train/eval record with a numeric step and loss."""
    if not isinstance(rec, dict):
        return False
    kind = rec.get("type")
    num = (int, float)
    if kind == "train":
        loads = rec.get("expert_load", [])
        return (isinstance(rec.get("step"), int) and isinstance(rec.get("loss"), num) and isinstance(loads, list)
                and all(isinstance(l, dict) and isinstance(l.get("layer"), int) and isinstance(l.get("counts"), list)
                        and all(isinstance(c, num) for c in l["counts"]) for l in loads))
    if kind == "eval":
        return isinstance(rec.get("step"), int) and isinstance(rec.get("eval_loss"), num)
    return True


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    recipe = run / "recipe.json"
    if recipe.exists():
        try:
            custom = json.loads(recipe.read_text(encoding="utf-8")).get("log", {}).get("jsonl")
        except (ValueError, AttributeError, OSError) as e:
            raise SystemExit(f"automoe report: {recipe}: unreadable ({e}); it names where the metrics are") from None
        if custom:
            path = Path(custom)
    if not path.exists():
        raise SystemExit(f"automoe report: {path}: no metrics (is {run} a training run directory?)")
    records, bad = [], []
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SystemExit(f"automoe report: {path}: cannot read: {e.strerror or e}") from None
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            rec = None
        if _valid(rec):
            records.append(rec)
        else:
            bad.append(n)
    if bad:
        # A run killed mid-write leaves at most its last line incomplete; more is damage.
        lines = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        print(f"automoe report: {path}: unreadable or malformed line(s) {lines} skipped", file=sys.stderr)
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
