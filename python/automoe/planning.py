"""`automoe plan RECIPE.yaml`: what a training run will need before it starts — per-rank peak
memory broken down, the step's FLOPs and predicted time — and which configurations fit.

The numbers come from the engine (train/plan.h), from the same component declarations the engine
runs; a model is planned from its config.json alone (model.path may name a bare config.json), so a
550B model needs no weights. `automoe train` runs the same check before it loads anything.
"""

from __future__ import annotations

import json
import os
import sys

USAGE = """usage: automoe plan RECIPE.yaml [section.key=value ...] [--nproc-per-node N] [--nnodes M]
                    [--device cpu|cuda] [--gpu-memory GiB] [--memory GiB] [--peak-tflops X]
                    [--mfu X] [--json]

Per-rank peak memory of the recipe's run (weights, master weights, gradients, optimizer state,
activations, the loss's chunk, the runtime, the allocator's overhead), the step's FLOPs and
predicted time, then the configurations that fit, fastest first. model.path may be a checkpoint
directory or a bare config.json. --device cuda plans GPUs of --gpu-memory GiB (80: an H100);
on the CPU the memory is this machine's available memory shared by its ranks (--memory GiB sets
one rank's). --json prints the plan as JSON. See docs/recipes.md#planning-a-run.
"""

_VALUED = ("--nproc-per-node", "--nnodes", "--device", "--gpu-memory", "--memory", "--peak-tflops", "--mfu")


def plan(recipe: str | dict, *overrides: str, nproc_per_node: int = 1, nnodes: int = 1, device: str = "cpu",
         gpu_memory: float | None = None, memory: float | None = None, peak_tflops: float = 0.0,
         mfu: float = 0.0) -> dict:
    """The plan of `recipe` (a YAML path, or the recipe as a dict) as a dict: `plan` (the recipe as
    it is: `memory` items, `peak_bytes`, `available_bytes`, `fits`, `step_s`, `tokens_per_s`, ...),
    `suggestions` (configurations that fit, fastest first), `generation` (KV cache and recurrent
    state sizes), and `text` (the table `automoe plan` prints)."""
    from automoe import _C
    from automoe.train import load_recipe, resolve

    import copy
    import math

    from automoe.train import RecipeError, apply_overrides

    if isinstance(recipe, dict):
        doc, origin = apply_overrides(copy.deepcopy(recipe), overrides), "recipe"
    elif isinstance(recipe, (str, os.PathLike)):
        doc, origin = load_recipe(os.fspath(recipe), list(overrides)), os.fspath(recipe)
    else:
        raise RecipeError(f"plan(): expected a recipe file or a dict, got {type(recipe).__name__}")
    resolved = resolve(doc, origin)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected cpu or cuda, got {device!r}")
    for name, v in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if device == "cpu" and gpu_memory is not None:
        raise ValueError("gpu_memory: for device cuda; a CPU rank's memory is memory=GiB")
    if device == "cuda" and memory is not None:
        raise ValueError("memory: a CPU rank's; with device cuda give gpu_memory=GiB")
    rank_memory = (gpu_memory if device == "cuda" else memory) or 0.0
    for name, v, top in (("memory", rank_memory, math.inf), ("peak_tflops", peak_tflops, math.inf), ("mfu", mfu, 1.0)):
        if not isinstance(v, (int, float)) or not (0 <= v <= top) or math.isnan(v):
            raise ValueError(f"{name}: expected a number in [0, {top}], got {v!r}")
    text_json, text = _C.plan(json.dumps(resolved), origin, nproc_per_node, nnodes, device, float(rank_memory),
                              float(peak_tflops), float(mfu))
    out = json.loads(text_json)
    out["text"] = text
    return out


def _split(argv: list[str]) -> tuple[dict, list[str], bool]:
    opts, rest, as_json, i = {}, [], False, 0
    while i < len(argv):
        a = argv[i]
        name, eq, attached = a.partition("=")
        if a == "--json":
            as_json, i = True, i + 1
            continue
        if name in _VALUED:
            if eq:
                value, i = attached, i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                raise ValueError(f"{name}: expected a value")
            opts[name] = value
            continue
        if a.startswith("--"):
            raise ValueError(f"unknown option {a}")
        rest.append(a)
        i += 1
    return opts, rest, as_json


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr, end="")
        raise SystemExit(0 if argv else 2)
    from automoe import AutoMoEError
    from automoe.train import RecipeError

    try:
        opts, rest, as_json = _split(argv)
        if not rest:
            raise ValueError("expected a recipe file")

        def number(name, kind=float, default=0):
            v = opts.get(name)
            if v is None:
                return default
            try:
                return kind(v)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {v!r}") from None

        out = plan(rest[0], *rest[1:], nproc_per_node=number("--nproc-per-node", int, 1),
                   nnodes=number("--nnodes", int, 1), device=opts.get("--device", "cpu"),
                   gpu_memory=number("--gpu-memory", float, None), memory=number("--memory", float, None),
                   peak_tflops=number("--peak-tflops"), mfu=number("--mfu"))
    except (RecipeError, ValueError, OSError, AutoMoEError) as e:
        print(f"automoe plan: error: {e}", file=sys.stderr)
        raise SystemExit(1)
    if as_json:
        out.pop("text")
        print(json.dumps(out, indent=2))
    else:
        print(out["text"], end="")
    raise SystemExit(0 if out["plan"]["fits"] else 3)
