"""The tokenised dataset file (.amds) the C++ trainer memory-maps: written as documents arrive
(token ids, loss flags and lengths are spilled to three temporary files, then joined under one
header), so that writing a corpus of any size needs the memory of one document. The layout is
documented in csrc/automoe/train/dataset.h.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

CACHE_FORMAT = "AMDS0001"
_COPY = 1 << 20  # elements copied per chunk when joining


class StoreError(OSError):
    pass


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


class Writer:
    """Appends documents; publish() writes PATH atomically (a killed writer leaves only hidden
    `.NAME.tmp-PID*` files, which remove_dead_temporaries() removes)."""

    def __init__(self, path: Path):
        self.path = path
        self._tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._parts = []
        try:
            self._parts = [open(f"{self._tmp}.{n}", "wb") for n in ("tokens", "mask", "lengths")]
        except OSError as e:
            self._failed(e)
        self.n_docs = 0
        self.n_tokens = 0
        self.loss_tokens = 0
        self.max_token = -1

    def _failed(self, e: OSError):
        self.discard()
        raise StoreError(f"cannot write the tokenised data {self.path}: {e.strerror or e} (data.cache_dir: "
                         "free space there, or choose another directory)") from None

    def _write(self, arrays) -> None:
        try:
            for f, a in zip(self._parts, arrays):
                f.write(a.tobytes())
        except OSError as e:
            self._failed(e)

    def append(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self._write((np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(mask, dtype=np.uint8),
                     np.array([len(ids)], np.int64)))
        self.n_docs += 1
        self.n_tokens += len(ids)
        self.loss_tokens += int(np.count_nonzero(mask))
        if len(ids):
            self.max_token = max(self.max_token, int(ids.max()))

    def append_many(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as one concatenation of their tokens and loss flags, and their lengths."""
        if not len(lengths):
            return
        self._write((np.ascontiguousarray(ids, dtype=np.int32), np.ascontiguousarray(mask, dtype=np.uint8),
                     np.ascontiguousarray(lengths, dtype=np.int64)))
        self.n_docs += len(lengths)
        self.n_tokens += len(ids)
        self.loss_tokens += int(np.count_nonzero(mask))
        if len(ids):
            self.max_token = max(self.max_token, int(ids.max()))

    def publish(self, meta: dict) -> None:
        for f in self._parts:
            f.close()
        header = dict(meta, n_docs=self.n_docs, n_tokens=self.n_tokens)
        offsets_bytes = 8 * (self.n_docs + 1)
        # Section offsets depend on the header's length, which depends on them: fix the point.
        offs = {"offsets_at": 0, "tokens_at": 0, "mask_at": 0}
        for _ in range(4):
            text = json.dumps(dict(header, **offs)).encode()
            start = _align(16 + len(text) + 16)
            new = {"offsets_at": start, "tokens_at": _align(start + offsets_bytes)}
            new["mask_at"] = _align(new["tokens_at"] + 4 * self.n_tokens)
            if new == offs:
                break
            offs = new
        text = json.dumps(dict(header, **offs)).encode()
        try:
            with open(self._tmp, "wb") as f:
                f.write(CACHE_FORMAT.encode() + len(text).to_bytes(8, "little") + text)
                f.write(b"\0" * (offs["offsets_at"] - f.tell()))
                total = 0
                f.write(np.int64(0).tobytes())
                with open(f"{self._tmp}.lengths", "rb") as lengths:  # offsets = running sum
                    for chunk in iter(lambda: lengths.read(8 * _COPY), b""):
                        run = np.cumsum(np.frombuffer(chunk, np.int64)) + total
                        total = int(run[-1])
                        f.write(run.tobytes())
                for at, part in ((offs["tokens_at"], "tokens"), (offs["mask_at"], "mask")):
                    f.write(b"\0" * (at - f.tell()))
                    with open(f"{self._tmp}.{part}", "rb") as src:
                        for chunk in iter(lambda: src.read(_COPY), b""):
                            f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp, self.path)
        except OSError as e:
            self._tmp.unlink(missing_ok=True)
            self._failed(e)
        finally:
            self.discard()

    def discard(self) -> None:
        for f in self._parts:
            try:
                f.close()
            except OSError:  # the buffered tail could not be written: the file goes anyway
                pass
        for n in ("tokens", "mask", "lengths"):
            Path(f"{self._tmp}.{n}").unlink(missing_ok=True)
        self._tmp.unlink(missing_ok=True)  # interrupted while publishing (after os.replace: gone already)


class Docs:
    """A .amds file, memory-mapped: doc(i) -> (ids, mask) views."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            magic = f.read(8)
            if magic != CACHE_FORMAT.encode():
                raise StoreError(f"{path}: not an AutoMoE dataset")
            n = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(n))
        h = self.header
        raw = np.memmap(path, np.uint8, mode="r")
        self.offsets = np.frombuffer(raw, np.int64, h["n_docs"] + 1, h["offsets_at"])
        self.tokens = np.frombuffer(raw, np.int32, h["n_tokens"], h["tokens_at"])
        self.mask = np.frombuffer(raw, np.uint8, h["n_tokens"], h["mask_at"])

    def __len__(self) -> int:
        return int(self.header["n_docs"])

    def doc(self, i: int):
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.mask[a:b]


def read(path: str | os.PathLike) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The documents of a .amds file (token ids, loss flags): for tests and inspection."""
    d = Docs(path)
    docs = [d.doc(i) for i in range(len(d))]
    return [np.array(a) for a, _ in docs], [np.array(m) for _, m in docs]


def remove_dead_temporaries(cache: Path) -> None:
    """Removes the hidden `.NAME.tmp-PID[.part]` files a killed tokenisation left in the cache
    when no lock file guards their key (older caches) and their PID is not running here."""
    for p in cache.glob(".*.tmp-*"):
        m = re.fullmatch(r"\.(.+?)\.(?:amds|json)\.tmp-(\d+)(\.\w+)?", p.name)
        if not m or int(m.group(2)) == os.getpid():
            continue
        if (cache / f".{m.group(1)}.lock").exists():
            continue  # a key written under its lock: the next writer of the key removes them (data._Locked)
        try:
            os.kill(int(m.group(2)), 0)
            continue  # a live process (ours or not): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            p.unlink(missing_ok=True)
        except OSError:  # a read-only cache: nothing to clean there
            pass
