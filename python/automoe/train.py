"""`automoe train RECIPE.yaml [section.key=value ...]`: the Python half of the command.

It reads the YAML, applies the dotted overrides, has the engine validate the result (the C++
Recipe parser is the one place that knows every key), tokenises the data into the cache
(automoe.data), and then hands over to the C++ trainer (`bin/automoe train --recipe-text ...`),
which runs the loop, writes checkpoints and metrics and exports the Hugging Face checkpoint.
The engine is started by exec, with the resolved recipe inline (`--recipe-text`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

USAGE = """usage: automoe train RECIPE.yaml [section.key=value ...] [--nproc-per-node N]
                     [--max-restarts N] [--resume-from step-N] [--force]

Fine-tunes model.path on data.train and exports a Hugging Face checkpoint to
<checkpoint.dir>/export; re-running on the same checkpoint.dir resumes. Overrides use YAML
values: train.max_steps=100 optimizer.lr=2e-5 data.packing=false. See docs/recipes.md.
--nproc-per-node N runs N processes on this machine (torchrun); under torchrun or Slurm each
process is one rank. The recipe's `parallel` section sets ep and dp (docs/parallelism.md).
--max-restarts N lets torchrun restart the processes N times after one fails; each restart
resumes from the last checkpoint.
--resume-from step-N resumes from that checkpoint of checkpoint.dir instead of the latest
(checkpoint.resume_from). SIGTERM, SIGINT or SIGHUP stop the run after its current step with a
checkpoint (exit status 4); a second signal stops it at once.
Before loading the model, the run's memory plan (`automoe plan`) is compared with the memory each
rank has; a run that cannot fit stops with exit status 1 and what would fit. --force
(train.force=true) starts it anyway.
"""


def split_resume_from(argv: list[str]) -> list[str]:
    """argv with `--resume-from step-N` (or `--resume-from=step-N`) turned into the override
    checkpoint.resume_from=step-N, and `--force` into train.force=true (after the recipe and its
    other overrides, wherever they were given)."""
    out, extra, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--force":
            extra.append("train.force=true")
            i += 1
            continue
        if a == "--resume-from" or a.startswith("--resume-from="):
            value = a.partition("=")[2] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value:
                raise RecipeError("--resume-from: expected a checkpoint name, e.g. --resume-from step-100")
            extra.append(f"checkpoint.resume_from={value}")
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out + extra


class RecipeError(ValueError):
    pass


def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2 core-schema scalars. PyYAML follows YAML 1.1, where
    `2e-5` is a string (1.1 wants `2.0e-5`), yes/no/on/off are booleans (`progress: off`),
    `017` is octal and `1:30` is 90; here only true/false are booleans and numbers are decimal."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    replaced = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
    Loader.yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in rs if tag not in replaced]
        for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                   r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))
    Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node), 10))

    def construct_mapping(self, node, deep=False):
        # YAML forbids a key twice in one mapping; PyYAML keeps the last silently (a section
        # written twice would lose the first one's values).
        first = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = first.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if line != key_node.start_mark.line + 1:
                raise DuplicateKey(key, line, key_node.start_mark.line + 1)
        return yaml.SafeLoader.construct_mapping(self, node, deep=deep)

    Loader.construct_mapping = construct_mapping
    return Loader


class DuplicateKey(Exception):
    def __init__(self, key, first: int, again: int):
        super().__init__(f"key {key!r} appears twice (lines {first} and {again}); YAML forbids "
                         "duplicate keys, and the first one's values would be lost: merge them")
        self.line = again


def yaml_load(text: str):
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)


def load_recipe(path: str, overrides: list[str]) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        doc = yaml_load(p.read_text(encoding="utf-8"))
    except DuplicateKey as e:
        raise RecipeError(f"{path}:{e.line}: {e}") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections (model, data, train, ...)")
    return apply_overrides(doc, overrides)


def apply_overrides(doc: dict, overrides) -> dict:
    """`section.key=value` overrides (values read as YAML) applied to the recipe `doc`, in order."""
    import yaml

    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(f"override \"{ov}\": expected section.key=value")
        try:
            parsed = yaml_load(value) if value else ""
        except DuplicateKey as e:
            raise RecipeError(f"override \"{ov}\": {e}") from None
        except yaml.YAMLError as e:
            raise RecipeError(f"override \"{ov}\": bad value: {e}") from None
        node = doc
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                if part in node and node[part] is not None:
                    raise RecipeError(f"override \"{ov}\": {part} is not a mapping")
                node[part] = {}
            node = node[part]
        node[parts[-1]] = parsed
    return doc


def _non_finite(node, path=""):
    """The dotted key of the first inf/nan number in `node`, or None."""
    import math

    if isinstance(node, float) and not math.isfinite(node):
        return path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def resolve(doc: dict, origin: str) -> dict:
    from automoe import _C

    bad = _non_finite(doc)
    if bad:
        raise RecipeError(f"{origin}: {bad}: expected a finite number")
    return json.loads(_C.resolve_recipe(json.dumps(doc, default=str, allow_nan=False), origin))


def prepare(recipe: dict, log=sys.stderr) -> list[str]:
    """Tokenises the data (or finds it cached); returns the engine's data arguments."""
    from automoe import data

    d = recipe["data"]
    model_path = recipe["model"]["path"]
    if not (Path(model_path) / "config.json").exists():
        raise RecipeError(f"model.path: {model_path} is not a Hugging Face checkpoint directory (no config.json)")
    from automoe import _C

    _C.check_config(model_path)  # the engine's message (file and key), not Transformers' traceback
    kw = dict(tokenizer=None, model_path=model_path, fmt=d["format"], train_on=d["train_on"],
              on_error=d["on_error"], cache_dir=d["cache_dir"] or None, log=log, num_proc=d["num_proc"],
              max_samples=d["max_samples"], seed=recipe["train"]["seed"])
    train, held_out = data.build_split(d["train"], what="data.train", validation_split=d["validation_split"], **kw)
    _report(train, "train", log)
    args = ["--train-data", str(train.path), "--train-key", train.key]
    val = held_out
    if d["validation"]:
        val = data.build(d["validation"], what="data.validation", **kw)
    if val is not None:
        _report(val, "validation", log)
        args += ["--validation-data", str(val.path)]
    return args


def _report(ds, name: str, log) -> None:
    s = ds.stats
    how = "cached" if s.get("reused") else "tokenised"
    extra = f", {s['skipped_lines']} malformed records skipped" if s.get("skipped_lines") else ""
    print(f"automoe train: {name} data {how}: {s['documents']:,} documents, {s['tokens']:,} tokens "
          f"({s['loss_tokens']:,} with loss){extra}", file=log)
    composed = s.get("composed")
    if composed and len(s["sources"]) > 1:
        for src, n in zip(s["sources"], composed):
            print(f"automoe train:   {n:,} documents from {src['source']} ({src['documents']:,} tokenised)", file=log)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr, end="")
        raise SystemExit(0 if argv else 2)
    from automoe import data, distributed
    from automoe.engine_binary import exec_engine

    try:
        nproc, argv = distributed.split_nproc(split_resume_from(argv))
        max_restarts, argv = distributed.split_count(argv, "--max-restarts", 0)
        if not argv:
            print(USAGE, file=sys.stderr, end="")
            raise SystemExit(2)
        if max_restarts and not (nproc and nproc > 1):
            raise ValueError("--max-restarts: restarts are torchrun's, for a run of several processes "
                             "(--nproc-per-node N); one process resumes by running the command again")
        if nproc is not None and nproc > 1 and not distributed.launched():
            resolve(load_recipe(argv[0], argv[1:]), argv[0])  # a bad recipe fails here, once
            distributed.exec_torchrun(nproc, argv, max_restarts or 0)
        doc = load_recipe(argv[0], argv[1:])
        recipe = resolve(doc, argv[0])
        if distributed.launched():
            raise SystemExit(_train_rank(recipe, argv[0]))
        engine_args = prepare(recipe)
    except (RecipeError, data.DataError, ValueError, OSError) as e:
        print(f"automoe train: error: {e}", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:  # Ctrl-C while tokenising: nothing trained yet, nothing to save
        print("\nautomoe train: interrupted while preparing the data; nothing was trained",
              file=sys.stderr)
        raise SystemExit(130)
    sys.stderr.flush()
    # The engine validates the recipe again and records it as <checkpoint.dir>/recipe.json.
    exec_engine(["train", "--recipe-text", json.dumps(recipe), "--origin", argv[0], *engine_args])


def _train_rank(recipe: dict, origin: str) -> int:
    """One rank of a distributed run: rank 0 tokenises (the others then find the data cached), and
    every rank runs the C++ trainer in this process on torch.distributed's groups."""
    import io

    import fcntl

    from automoe import _C, data, distributed

    # The data first, before the process group exists (tokenising may take longer than any
    # collective's timeout): the first process of each machine to take the cache's lock tokenises,
    # the others then find the result cached.
    cache = Path(recipe["data"]["cache_dir"] or data.default_cache_dir())
    rank = int(os.environ.get("RANK", "0"))
    log = sys.stderr if rank == 0 else io.StringIO()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / ".automoe-train.lock", "a")
    except OSError:  # a read-only cache: usable if it holds the data (prepare says if it does not)
        engine_args = prepare(recipe, log=log)
    else:
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            engine_args = prepare(recipe, log=log)
    groups = distributed.init(recipe)
    args = dict(zip(engine_args[::2], engine_args[1::2]))
    if groups["collective_device"].startswith("cuda"):  # the GPU's peak, as the engine binary reports it
        import torch

        dev = torch.device(groups["collective_device"])
        groups["peak_memory_bytes"] = lambda: int(torch.cuda.max_memory_allocated(dev))
        groups["reset_peak_memory"] = lambda: torch.cuda.reset_peak_memory_stats(dev)
        groups["available_memory_bytes"] = lambda: int(torch.cuda.mem_get_info(dev)[0])
    sys.stderr.flush()
    try:
        code = _C.train(json.dumps(recipe), origin, args["--train-data"], args.get("--validation-data", ""),
                        args["--train-key"], **groups)
    except Exception as e:  # noqa: BLE001 (the engine's errors, reported per rank)
        print(f"automoe train (rank {rank}): error: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # the other ranks' collectives fail (torchrun stops them, or the timeout does)
    distributed.finish()
    return code
