"""Tokenise training data once, into a cached, memory-mapped dataset the C++ trainer reads.

Sources (automoe.data.sources): JSONL / JSON / Parquet / Arrow / CSV files, directories and globs
of shards, `datasets` save_to_disk directories and Hugging Face dataset ids from the local cache.
Formats and loss masks (automoe.data.encode): chat (with tools and reasoning), prompt_completion,
alpaca, text. The file (automoe.data.store) is written as documents are produced.

Each source is tokenised on its own, streamed in batches through `data.num_proc` worker
processes, into a cache file keyed by its bytes, the tokenizer files, the settings and the
library versions; a recipe's dataset is then that file, or, when sources are mixed by weight,
concatenated or split for validation, a file composed from them (also cached). Memory does not
grow with the corpus: a batch of records per worker, one document per write.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import deque
from itertools import chain
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from automoe.data.encode import ENCODER_VERSION, FORMATS, Encoder, FatalDataError, detect_format
from automoe.data.sources import Source, SourceError, BadRecord, file_digest, resolve
from automoe.data.store import CACHE_FORMAT, Docs, StoreError, Writer, read, remove_dead_temporaries

__all__ = ["CACHE_FORMAT", "DataError", "Dataset", "Encoder", "FORMATS", "build", "build_split",
           "default_cache_dir", "detect_format", "load_tokenizer", "read", "remove_dead_temporaries"]

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
    "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "config.json",
)
TOKENIZER_GLOBS = ("*.tiktoken", "additional_chat_templates/*")


class DataError(ValueError):
    """A malformed record or an unusable source; the message names the source and record."""


@dataclass
class Dataset:
    path: Path        # the .amds file
    key: str          # cache key
    stats: dict       # documents, tokens, loss_tokens, skipped records, reused, per-source counts


def default_cache_dir() -> Path:
    base = os.environ.get("AUTOMOE_CACHE")
    return Path(base) / "datasets" if base else Path.home() / ".cache" / "automoe" / "datasets"


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def load_tokenizer(model_path: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise DataError(f"model.path {path}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                        "the data is tokenised with the model's own tokenizer")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 (Transformers and tokenizers raise many types)
        # Name the file that failed: the tokenizers library's JSON errors name none.
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            f = path / name
            if f.exists():
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                except (ValueError, UnicodeDecodeError) as bad:
                    raise DataError(f"{f}: not valid JSON ({bad}); the data is tokenised with the "
                                    "model's own tokenizer") from None
        raise DataError(f"model.path {path}: cannot load its tokenizer: {type(e).__name__}: {e}") from None


@dataclass
class _Settings:
    tokenizer: object
    model_path: str
    fmt: str
    train_on: str
    on_error: str
    cache: Path
    num_proc: int
    max_samples: int
    log: object

    def base_key(self) -> dict:
        from importlib.metadata import version  # not importing the libraries: a cached run never needs them

        root = Path(self.model_path)
        names = [n for n in TOKENIZER_FILES if (root / n).is_file()]
        names += sorted(str(p.relative_to(root)) for g in TOKENIZER_GLOBS for p in root.glob(g) if p.is_file())
        tok = {n: file_digest(root / n) for n in names}
        return {"encoder": ENCODER_VERSION, "file_format": CACHE_FORMAT, "train_on": self.train_on,
                "on_error": self.on_error, "max_samples": self.max_samples, "transformers": version("transformers"),
                "tokenizers": version("tokenizers"), "tokenizer_files": tok}

    def get_tokenizer(self):
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_path)
        return self.tokenizer


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def _open_cache(cache_dir) -> Path:
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot create {cache}: {e.strerror or e}") from None
    remove_dead_temporaries(cache)
    return cache


class _Locked:
    """An exclusive lock on one cache key: processes on one machine tokenise a source once (the
    others wait, then find it cached). Whoever holds it also removes the key's leftovers of a
    killed writer — a writer holds the lock while it writes, so they can only be a dead one's,
    whatever machine or PID namespace it ran in."""

    def __init__(self, cache: Path, key: str):
        self.cache, self.key = cache, key
        self.path = cache / f".{key}.lock"

    def __enter__(self):
        import fcntl

        try:
            self.f = open(self.path, "a")
        except OSError as e:
            raise DataError(f"data.cache_dir: cannot lock {self.path}: {e.strerror or e} (a cache directory "
                            "must be writable to tokenise into it)") from None
        fcntl.flock(self.f, fcntl.LOCK_EX)
        for leftover in self.cache.glob(f".{self.key}.*.tmp-*"):
            leftover.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        self.f.close()


def _write_stats(path: Path, stats: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(stats, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write {path}: {e.strerror or e} (data.cache_dir: free space there, "
                        "or choose another directory)") from None


def _cached(cache: Path, key: str) -> dict | None:
    out, stats = cache / f"{key}.amds", cache / f"{key}.json"
    if out.exists() and stats.exists():
        try:
            return json.loads(stats.read_text())
        except (OSError, ValueError):  # a damaged statistics file: tokenise again
            return None
    return None


# --- tokenising one source ------------------------------------------------------------------

_WORKER_ENCODER = None


def _init_worker(encoder) -> None:
    global _WORKER_ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per CPU already
    _WORKER_ENCODER = encoder


def _encode(chunk, encoder=None) -> dict:
    """A worker's task: decode and tokenise one chunk of a source. Returns its documents as one
    concatenation (ids, mask, lengths), the records that failed as (index, message, fatal) and
    the number too short to train on."""
    enc = encoder or _WORKER_ENCODER
    records = chunk.records()
    errors, good, where = [], [], []
    for k, rec in enumerate(records):
        if isinstance(rec, BadRecord):
            errors.append((k, rec.reason, rec.fatal))
            continue
        good.append(rec)
        where.append(k)
    ids, masks, short = [], [], 0
    for k, r in zip(where, enc.encode_batch(good)):
        if isinstance(r, Exception):
            errors.append((k, str(r), isinstance(r, FatalDataError)))
        elif len(r[0]) < 2:
            short += 1
        else:
            ids.append(r[0])
            masks.append(r[1])
    errors.sort()
    return {"ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
            "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            "lengths": np.array([len(x) for x in ids], np.int64), "errors": errors, "short": short}


def _tokenise(src: Source, enc: Encoder, s: _Settings, out: Path) -> dict:
    writer = Writer(out)
    skipped, short, records, n_skipped = [], 0, 0, 0

    def take(chunk, res):
        nonlocal short, records, n_skipped
        records += len(chunk)
        short += res["short"]
        for k, msg, fatal in res["errors"]:
            msg = f"{chunk.where(k)}: {msg}"
            if fatal:
                raise DataError(msg)
            if s.on_error == "fail":
                raise DataError(msg + " (data.on_error: skip would skip such records)")
            n_skipped += 1
            if len(skipped) < 10:
                skipped.append(msg)
        writer.append_many(res["ids"], res["mask"], res["lengths"])

    try:
        it = src.chunks(s.max_samples)
        head = [c for _, c in zip(range(2), it)]
        if s.num_proc > 1 and len(head) == 2:
            _tokenise_parallel(chain(head, it), enc, s.num_proc, take)
        else:  # one process asked for, or a small source: no processes to start
            for chunk in chain(head, it):
                take(chunk, _encode(chunk, enc))
    except BaseException:
        writer.discard()
        raise
    for msg in skipped:
        print(f"automoe train: skipped {msg}", file=s.log)
    if n_skipped > len(skipped):
        print(f"automoe train: ... and {n_skipped - len(skipped)} more malformed records skipped", file=s.log)
    stats = {"source": src.label, "records": records, "documents": writer.n_docs, "tokens": writer.n_tokens,
             "loss_tokens": writer.loss_tokens, "skipped_lines": n_skipped, "too_short": short,
             "max_token": writer.max_token}
    try:
        writer.publish({"key": out.stem, "source": src.label, "documents": writer.n_docs,
                        "tokens": writer.n_tokens, "loss_tokens": writer.loss_tokens})
    except StoreError as e:
        raise DataError(str(e)) from None
    return stats


def _tokenise_parallel(chunks, enc, num_proc, take) -> None:
    """Chunks through a pool of forked workers, at most 2 per worker in flight, results taken in
    order: the memory of a few chunks whatever the corpus. The workers decode the rows too, so
    this process only reads bytes and writes tokens. A worker that dies (killed, out of memory)
    stops the tokenisation with an error instead of leaving its chunk waited for forever."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(num_proc, mp_context=mp.get_context("fork"), initializer=_init_worker,
                               initargs=(enc,))
    try:
        pending = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode, chunk)))
            while len(pending) >= 2 * num_proc:
                chunk, res = pending.popleft()
                take(chunk, res.result())
        while pending:
            chunk, res = pending.popleft()
            take(chunk, res.result())
    except BrokenProcessPool:
        raise DataError(f"a tokenising worker process died (killed, or out of memory) while tokenising the "
                        f"records from {pending[0][0].where(0) if pending else chunk.where(0)} on; lower "
                        "data.num_proc if memory is short") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _source_dataset(src: Source, s: _Settings, base: dict) -> tuple[Path, dict]:
    fmt = src.format or s.fmt
    key = _digest({"base": base, "format": fmt, "source": src.fingerprint(s.cache / "digests")})
    out = s.cache / f"{key}.amds"
    stats = _cached(s.cache, key)  # first without the lock: a read-only cache that holds it is usable
    if stats is not None:
        return out, dict(stats, reused=True)
    with _Locked(s.cache, key):
        stats = _cached(s.cache, key)
        if stats is not None:
            return out, dict(stats, reused=True)
        enc = Encoder(s.get_tokenizer(), fmt, s.train_on, src.columns)
        stats = _tokenise(src, enc, s, out)
        _write_stats(s.cache / f"{key}.json", stats)
    return out, dict(stats, reused=False)


# --- composing sources: concatenation, weighted mixing, a held-out split -----------------------

def _holdout(n: int, ratio: float, seed: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) document indices of source i, each sorted: a seeded random `ratio`."""
    if ratio <= 0 or n < 2:
        return np.arange(n), np.arange(0)
    k = min(n - 1, max(1, int(round(n * ratio))))
    perm = np.random.default_rng([seed, i, 0x5EED]).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k])


def _mix(parts: list[np.ndarray], weights: list[float], seed: int) -> np.ndarray:
    """Each source's share of an epoch of sum(len(parts)) documents in proportion to its weight
    (largest remainder), as whole passes plus a seeded random subset; the result interleaved by a
    seeded permutation."""
    total = sum(len(p) for p in parts)
    weights = [w if len(p) else 0.0 for p, w in zip(parts, weights)]  # an empty source gets no share
    if not total:
        return np.zeros((0, 2), np.int64)
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for j in sorted(range(len(parts)), key=lambda j: counts[j] - exact[j])[: total - sum(counts)]:
        counts[j] += 1
    rng = np.random.default_rng([seed, 0x313])
    picks = []
    for j, (p, c) in enumerate(zip(parts, counts)):
        if not len(p):
            continue
        chosen = np.concatenate([np.tile(p, c // len(p)), np.sort(rng.choice(p, c % len(p), replace=False))])
        picks.append(np.stack([np.full(len(chosen), j), chosen], 1))
    order = np.concatenate(picks) if picks else np.zeros((0, 2), np.int64)
    return order[rng.permutation(len(order))]


def _in_order(parts) -> np.ndarray:
    """(source, index) rows: every source's documents `parts[j]`, source after source."""
    return np.concatenate([np.stack([np.full(len(p), j), p], 1) for j, p in enumerate(parts)])


def _compose(files: list[Path], order: np.ndarray, out: Path, meta: dict) -> dict:
    """Writes the documents order[k] = (source, index) of the source files, in that order."""
    docs = [Docs(f) for f in files]
    writer = Writer(out)
    try:
        for j, i in order:
            writer.append(*docs[j].doc(int(i)))
        writer.publish(dict(meta, documents=writer.n_docs, tokens=writer.n_tokens, loss_tokens=writer.loss_tokens))
    except StoreError as e:
        raise DataError(str(e)) from None
    except BaseException:
        writer.discard()
        raise
    return {"documents": writer.n_docs, "tokens": writer.n_tokens, "loss_tokens": writer.loss_tokens,
            "max_token": writer.max_token}


def build_split(sources: list, tokenizer, model_path: str, fmt: str = "auto", train_on: str = "completion",
                on_error: str = "fail", cache_dir: str | os.PathLike | None = None, what: str = "data.train",
                log=sys.stderr, num_proc: int = 0, max_samples: int = 0, seed: int = 42,
                validation_split: float = 0.0, role: str | None = None) -> tuple[Dataset, Dataset | None]:
    """Tokenises `sources` (or reuses the cached result): the dataset, and with `validation_split`
    the seeded share of every source's documents held out of it for validation. `tokenizer` None:
    the model's own, loaded only if some source is not cached (Transformers takes seconds to
    import). `role` (train | validation; default from `what`) picks the default split of a
    DatasetDict or a dataset id."""
    role = role or ("validation" if what.split("[")[0] == "data.validation" else "train")
    cache = _open_cache(cache_dir)
    s = _Settings(tokenizer, model_path, fmt, train_on, on_error, cache,
                  num_proc if num_proc > 0 else usable_cpus(), max_samples, log)
    try:
        srcs = [resolve(spec, what if len(sources) == 1 else f"{what}[{k}]", role) for k, spec in enumerate(sources)]
    except SourceError as e:
        raise DataError(str(e)) from None
    for src in srcs:
        if src.ignored:
            names = ", ".join(p.name for p in src.ignored[:5]) + (", ..." if len(src.ignored) > 5 else "")
            print(f"automoe train: {what}: {src.label}: {len(src.ignored)} files that are not data files "
                  f"left out ({names})", file=log)
    base = s.base_key()
    files, stats = [], []
    for k, src in enumerate(srcs):
        try:
            f, st = _source_dataset(src, s, base)
        except (StoreError, SourceError) as e:
            raise DataError(str(e)) from None
        except OSError as e:
            raise DataError(f"{e.filename or src.label}: {e.strerror or e}") from None
        files.append(f)
        stats.append(st)
    reused = all(st["reused"] for st in stats)
    mixing = any(src.weight is not None for src in srcs) and len(srcs) > 1
    if len(srcs) == 1 and not validation_split:
        if not stats[0]["documents"]:
            raise DataError(f"{what}: no usable documents in {srcs[0].label}")
        return Dataset(files[0], files[0].stem, _summary(stats, reused)), None
    kept, held = zip(*(_holdout(st["documents"], validation_split, seed, j) for j, st in enumerate(stats)))
    weights = [src.weight if src.weight is not None else 1.0 for src in srcs]
    order = _mix(list(kept), weights, seed) if mixing else _in_order(kept)
    train = _composed(files, order, stats, reused, what, {"sources": [f.stem for f in files], "seed": seed,
                      "split": validation_split, "mix": weights if mixing else None, "part": "train"}, s)
    val = None
    if validation_split:
        val = _composed(files, _in_order(held), stats, reused, "data.validation_split", {
            "sources": [f.stem for f in files], "seed": seed, "split": validation_split, "part": "validation"}, s)
    return train, val


def _composed(files, order, stats, reused, what, ident, s: _Settings) -> Dataset:
    key = _digest(ident)
    out = s.cache / f"{key}.amds"
    per_source = [int((order[:, 0] == j).sum()) if len(order) else 0 for j in range(len(files))]
    cached = _cached(s.cache, key)
    if cached is not None:
        return Dataset(out, key, dict(cached, reused=reused))
    with _Locked(s.cache, key):
        cached = _cached(s.cache, key)
        if cached is not None:
            return Dataset(out, key, dict(cached, reused=reused))
        if not len(order):
            raise DataError(f"{what}: no usable documents in {', '.join(st['source'] for st in stats)}")
        made = dict(_summary(stats, False), **_compose(files, order, out, {"key": key}), composed=per_source)
        _write_stats(s.cache / f"{key}.json", made)
    return Dataset(out, key, made)


def _summary(stats: list[dict], reused: bool) -> dict:
    return {"sources": [{k: st[k] for k in ("source", "records", "documents", "skipped_lines")} for st in stats],
            "documents": sum(st["documents"] for st in stats), "tokens": sum(st["tokens"] for st in stats),
            "loss_tokens": sum(st["loss_tokens"] for st in stats),
            "skipped_lines": sum(st["skipped_lines"] for st in stats),
            "too_short": sum(st["too_short"] for st in stats),
            "max_token": max(st["max_token"] for st in stats), "reused": reused}


def build(files: list, tokenizer, model_path: str, fmt: str = "auto", train_on: str = "completion",
          on_error: str = "fail", cache_dir: str | os.PathLike | None = None,
          what: str = "data.train", log=sys.stderr, **kw) -> Dataset:
    """The dataset of `files` (sources: paths, globs, dataset ids or recipe mappings), without a
    validation split; see build_split."""
    return build_split(files, tokenizer, model_path, fmt, train_on, on_error, cache_dir, what, log, **kw)[0]
