"""Where documents come from: local files of any common kind, directories and globs of shards,
`datasets` `save_to_disk` directories, and Hugging Face dataset ids resolved offline from the
local cache. Each source is read as a stream of records (bounded memory: one batch of rows at a
time), each record labelled with where it came from ("FILE:LINE", "FILE: row N", "ID/split: row N")
for error messages, and fingerprinted by its bytes for the cache key.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's escape of a UTF-16 surrogate
_BATCH_ROWS = 256  # rows per chunk: a worker's task


class SourceError(ValueError):
    """A source that cannot be read at all (no such file, unsupported kind, dataset not cached)."""


@dataclass
class Source:
    """One resolved entry of data.train / data.validation."""

    label: str                      # how messages name it
    kind: str                       # files | disk | hub
    files: list[Path] = field(default_factory=list)   # files / disk: the shards, in order
    dataset: str = ""
    subset: str = ""
    split: str = ""
    revision: str = ""
    columns: dict = field(default_factory=dict)
    weight: float | None = None
    format: str = ""
    ignored: list[Path] = field(default_factory=list)  # files of a directory that are not data

    def fingerprint(self, memo: Path | None = None) -> str:
        """The bytes this source reads, as a digest (a renamed file keeps its digest). `memo`: a
        directory remembering each file's digest by its identity (device, inode, size, times),
        so that a cached corpus is not read in full at every start."""
        h = hashlib.sha256(json.dumps({"kind": self.kind, "columns": sorted(self.columns.items()),
                                       "subset": self.subset, "split": self.split}).encode())
        for f in self.files if self.kind != "hub" else _hub_files(self):
            h.update(b"file\0" + file_digest(f, memo).encode())
        return h.hexdigest()

    def chunks(self, limit: int = 0) -> Iterator["Chunk"]:
        """The source as chunks of about _BATCH_ROWS records, in order; at most `limit` records
        when > 0. A chunk carries the raw rows (JSONL lines as bytes, Arrow record batches): the
        worker that tokenises it decodes it too."""
        left = limit or -1
        for chunk in self._all():
            if left == 0:
                return
            if left > 0 and len(chunk) >= left:
                yield chunk.head(left)
                return
            yield chunk
            left -= len(chunk) if left >= 0 else 0

    def _all(self):
        if self.kind == "hub":
            yield from _arrow_chunks(_hub_dataset(self).data.to_batches(_BATCH_ROWS), self.label)
            return
        for f in self.files:
            suffix = f.suffix.lower()
            if suffix == ".jsonl" or (suffix == ".json" and not _starts_with_array(f)):
                yield from _jsonl(f)
            elif suffix == ".json":
                yield from _objects(_json_array(f), f"{f}: element ")
            elif suffix == ".csv":
                yield from _objects(_csv(f), f"{f}: row ")
            elif suffix == ".parquet":
                yield from _arrow_chunks(_parquet_batches(f), str(f))
            else:
                yield from _arrow_chunks(_arrow_batches(f), str(f))


class Chunk:
    """Rows of one source: `kind` jsonl (raw lines, with their line numbers), arrow (one record
    batch of at most _BATCH_ROWS rows as Arrow IPC bytes — only its own rows, however large the
    batch it was cut from — numbered from `first`) or objects (decoded records, numbered from
    `first`)."""

    def __init__(self, kind: str, rows, label: str, first: int = 1, numbers: list[int] | None = None,
                 n: int | None = None):
        self.kind, self.rows, self.label, self.first, self.numbers = kind, rows, label, first, numbers
        self.n = len(rows) if n is None else n

    def __len__(self) -> int:
        return self.n

    def head(self, n: int) -> "Chunk":
        if self.kind == "arrow":
            return Chunk("arrow", _ipc(_batch(self.rows).slice(0, n)), self.label, self.first, n=n)
        return Chunk(self.kind, self.rows[:n], self.label, self.first, self.numbers[:n] if self.numbers else None)

    def where(self, k: int) -> str:
        if self.kind == "jsonl":
            return f"{self.label}:{self.numbers[k]}"
        return f"{self.label}{self.first + k}"

    def records(self) -> list:
        """The decoded records (a BadRecord for a row that cannot be decoded)."""
        if self.kind == "arrow":
            return [_drop_none(r) for r in _batch(self.rows).to_pylist()]
        if self.kind == "objects":
            return self.rows
        out = []
        for k, raw in enumerate(self.rows):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                out.append(BadRecord(f"not UTF-8 text (byte {e.start + 1} of the line: {e.reason})", fatal=True))
                continue
            if self.numbers[k] == 1 and line.startswith("\ufeff"):  # a byte-order mark opens the file
                line = line[1:]
            try:
                rec = json.loads(line)
                if _SURROGATE_ESCAPE.search(raw):
                    no_lone_surrogates(rec)
                out.append(rec)
            except ValueError as e:
                out.append(BadRecord(str(e)))
            except RecursionError:
                out.append(BadRecord("nested too deeply to decode"))
        return out


def file_digest(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a file's bytes; with `memo`, remembered under the file's identity (any write
    changes its modification and change times, so a changed file is read again)."""
    note = None
    if memo is not None:
        st = os.stat(path)
        ident = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
        note = memo / hashlib.sha256(ident.encode()).hexdigest()[:40]
        try:
            known = note.read_text().strip()
            if len(known) == 64:
                return known
        except OSError:
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if note is not None and os.stat(path).st_size >= 1 << 20:  # worth remembering
        try:
            note.parent.mkdir(exist_ok=True)
            tmp = note.with_name(f".{note.name}.{os.getpid()}")
            tmp.write_text(h.hexdigest())
            os.replace(tmp, note)
        except OSError:  # a read-only cache: read the file again next time
            pass
    return h.hexdigest()


def resolve(spec, what: str, role: str = "train") -> Source:
    """A recipe source (a string, or the mapping the engine's recipe parser validated) resolved
    against the file system; raises SourceError naming `what` when there is nothing to read.
    `role` (train | validation) picks the default split of a DatasetDict or a dataset id."""
    if isinstance(spec, str):
        spec = {"path": spec}
    common = dict(columns=dict(spec.get("columns") or {}), weight=spec.get("weight"),
                  format=spec.get("format") or "", split=spec.get("split") or "")
    default_split = "validation" if role == "validation" else "train"
    if spec.get("dataset"):
        return _hub_source(spec["dataset"], spec.get("subset") or "", spec.get("revision") or "", what,
                           common, default_split)
    text = spec["path"]
    p = Path(text)
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return _disk_source(p, what, common, default_split)
        return _directory_source(p, text, what, common)
    if p.is_file():
        return _files_source(text, [p], what, common)
    if any(c in text for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(text, recursive=True) if Path(f).is_file())
        if not files:
            raise SourceError(f"{what}: {text}: the pattern matches no file")
        return _files_source(text, files, what, common)
    if _HUB_ID.fullmatch(text) and p.suffix.lower() not in SUFFIXES and not text.startswith("."):
        try:
            return _hub_source(text, "", "", what, common, default_split)
        except SourceError as e:
            raise SourceError(f"{e} ({text} is no file or directory here either)") from None
    raise SourceError(f"{what}: {text}: no such file")


def _files_source(label: str, files: list[Path], what: str, common: dict) -> Source:
    for f in files:
        if f.suffix.lower() not in SUFFIXES:
            raise SourceError(f"{what}: {f}: unsupported file type \"{f.suffix}\" (data files are "
                              f"{', '.join(SUFFIXES)})")
    if common["split"]:
        raise SourceError(f"{what}: {label}: split: names a split of a dataset (dataset: or a "
                          "save_to_disk directory); files have none")
    return Source(label=label, kind="files", files=files, **common)


def _directory_source(p: Path, text: str, what: str, common: dict) -> Source:
    """Every data file under a directory, sorted by path. Other files (a README, a license) are
    named in `ignored`; compressed shards and save_to_disk directories inside are refused."""
    files, ignored = [], []
    for f in sorted(p.rglob("*")):
        if f.is_dir() and ((f / "state.json").exists() or (f / "dataset_dict.json").exists()):
            raise SourceError(f"{what}: {f}: a datasets save_to_disk directory inside the directory {text}; give "
                              "it as a source of its own")
        if not f.is_file():
            continue
        if f.suffix.lower() in SUFFIXES:
            files.append(f)
        elif any(f.name.lower().endswith(s + z) for s in SUFFIXES for z in (".gz", ".bz2", ".xz", ".zst", ".lz4")):
            raise SourceError(f"{what}: {f}: compressed data files are not read; decompress the shards")
        else:
            ignored.append(f)
    if not files:
        raise SourceError(f"{what}: {text}: a directory without data files ({', '.join(SUFFIXES)})")
    src = _files_source(text, files, what, common)
    src.ignored = ignored
    return src


def _disk_source(p: Path, what: str, common: dict, default_split: str) -> Source:
    """A `datasets` save_to_disk directory: a Dataset (state.json) or a DatasetDict
    (dataset_dict.json, one directory per split). Its Arrow shards are read directly."""
    split = common["split"]
    if (p / "dataset_dict.json").exists():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (ValueError, KeyError, OSError) as e:
            raise SourceError(f"{what}: {p / 'dataset_dict.json'}: not a datasets DatasetDict ({e})") from None
        want = split or default_split
        if want not in splits:
            raise SourceError(f"{what}: {p}: no split \"{want}\" (it has: {', '.join(splits)}); name one with "
                              "split:")
        d = p / want
    else:
        if split:
            raise SourceError(f"{what}: {p}: split: \"{split}\", but this save_to_disk directory holds one "
                              "Dataset, not a DatasetDict")
        d = p
    try:
        state = json.loads((d / "state.json").read_text())
        files = [d / f["filename"] for f in state["_data_files"]]
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise SourceError(f"{what}: {d / 'state.json'}: not a datasets save_to_disk directory ({e})") from None
    for f in files:
        if not f.is_file():
            raise SourceError(f"{what}: {f}: missing (listed in {d / 'state.json'})")
    common["split"] = d.name if d != p else ""
    return Source(label=str(d), kind="disk", files=files, **common)


def _hub_source(dataset: str, subset: str, revision: str, what: str, common: dict, default_split: str) -> Source:
    src = Source(label=dataset + (f"[{subset}]" if subset else ""), kind="hub", dataset=dataset,
                 subset=subset, revision=revision, **common)
    if not src.split:
        src.split = default_split
    src.label += f"/{src.split}"
    _hub_dataset(src, what)  # fails now, naming the id, when it is not cached
    return src


_HUB_CACHE: dict = {}


def _hub_dataset(src: Source, what: str = "data"):
    """The cached `datasets.Dataset` of a hub source, loaded offline (no network is ever used)."""
    key = (src.dataset, src.subset, src.split, src.revision)
    if key in _HUB_CACHE:
        return _HUB_CACHE[key]
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("0", "false", "no", "off"):
            raise SourceError(f"{what}: {src.dataset}: hub datasets are read offline, from the local cache, but "
                              f"{var}={os.environ[var]} asks for the network; unset it")
        os.environ.setdefault(var, "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()  # not "Using the latest cached version ..." on every run
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True  # also when `datasets` was imported before these variables were set
    try:
        ds = datasets.load_dataset(src.dataset, name=src.subset or None, split=src.split)
    except ConnectionError:
        raise SourceError(
            f"{what}: {src.dataset}: not in the local Hugging Face datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}); AutoMoE reads hub datasets offline. Where a network is "
            f"available, download it once with: python -c \"import datasets; datasets.load_dataset("
            f"'{src.dataset}'{', ' + repr(src.subset) if src.subset else ''}, split='{src.split}')\" "
            "(with the same HF_HOME / HF_DATASETS_CACHE), or save it with save_to_disk and give that "
            "directory as path:") from None
    except (ValueError, KeyError, FileNotFoundError) as e:  # an unknown subset or split of a cached id
        raise SourceError(f"{what}: {src.label}: {e}".replace("\n", " ")) from None
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
    if src.revision:
        cached = sorted({Path(f["filename"]).parent.name for f in ds.cache_files})
        if not all(h.startswith(src.revision) for h in cached):
            raise SourceError(f"{what}: {src.dataset}: revision \"{src.revision}\" is not the cached one "
                              f"({', '.join(cached)}); "
                              "offline, only the cached version can be read: give its commit hash, or leave "
                              "revision out")
    if getattr(ds, "_indices", None) is not None:  # a selection over the cached table: read it as rows
        ds = ds.flatten_indices()
    _HUB_CACHE[key] = ds
    return ds


def _hub_files(src: Source) -> list[Path]:
    return [Path(f["filename"]) for f in _hub_dataset(src).cache_files]


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1] == b"["


def _jsonl(path: Path):
    """Chunks of raw non-blank lines (decoded by the worker that tokenises them)."""
    rows, numbers = [], []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            rows.append(raw)
            numbers.append(lineno)
            if len(rows) == _BATCH_ROWS:
                yield Chunk("jsonl", rows, str(path), numbers=numbers)
                rows, numbers = [], []
    if rows:
        yield Chunk("jsonl", rows, str(path), numbers=numbers)


def _objects(records, label: str):
    rows, first = [], 1
    for rec in records:
        rows.append(rec)
        if len(rows) == _BATCH_ROWS:
            yield Chunk("objects", rows, label, first)
            first += len(rows)
            rows = []
    if rows:
        yield Chunk("objects", rows, label, first)


def _json_array(path: Path):
    """The objects of a JSON array file, decoded one at a time from a sliding buffer (a file of
    any size in the memory of its largest record)."""
    try:
        yield from _json_array_objects(path)
    except UnicodeDecodeError as e:
        yield BadRecord(f"not UTF-8 text (byte {e.start} of a block of the file: {e.reason})", fatal=True)
    except RecursionError:
        yield BadRecord("an element nested too deeply to decode", fatal=True)


_MAX_ELEMENT = 1 << 28  # characters: a larger element of a JSON array is refused, not buffered
_SYNTAX_HORIZON = 1 << 26  # characters read past a failing element (and 8x the largest one) before
                           # it is called invalid rather than incomplete


def _json_array_objects(path: Path):
    """Strict JSON array syntax, element by element: one comma between elements, the closing
    bracket, nothing but whitespace after it. The buffer grows geometrically while an element is
    incomplete, so an element of n characters costs O(n), and never beyond _MAX_ELEMENT."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8-sig", errors="strict") as fh:
        buf, pos, eof, largest = "", 0, False, 0

        def more(at_least: int = 1 << 20) -> None:
            nonlocal buf, pos, eof
            chunk = fh.read(max(at_least, 1 << 20))
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0

        def skip_space() -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or eof:
                    return
                more()

        def fatal(what: str) -> BadRecord:
            return BadRecord(f"not a valid JSON array: {what}", fatal=True)

        more()
        skip_space()
        if buf[pos:pos + 1] != "[":
            yield fatal("it does not start with [")
            return
        pos += 1
        n = 0
        while True:
            skip_space()
            if pos >= len(buf):
                yield fatal(f"the file ends after element {n} without the closing ]")
                return
            if buf[pos] == "]":
                pos += 1
                skip_space()
                if pos < len(buf):
                    yield fatal("more than whitespace after the closing ]")
                return
            if n:
                if buf[pos] != ",":
                    yield fatal(f"a comma or ] expected after element {n}, found {buf[pos]!r}")
                    return
                pos += 1
                skip_space()
                if pos >= len(buf):
                    yield fatal(f"the file ends after element {n} and a comma, without the closing ]")
                    return
            while True:
                try:
                    rec, end = dec.raw_decode(buf, pos)
                    break
                except ValueError as e:
                    if eof:
                        yield BadRecord(f"not valid JSON: {e}", fatal=True)
                        return
                    held = len(buf) - pos
                    if held > _MAX_ELEMENT or (n and held > max(_SYNTAX_HORIZON, 8 * largest)):
                        yield BadRecord(f"element {n + 1} is not valid JSON ({e}), or larger than any before "
                                        f"it by far", fatal=True)
                        return
                    more(len(buf) - pos)  # double what is held: linear in the element's size
            try:
                no_lone_surrogates(rec)
            except ValueError as e:
                rec = BadRecord(str(e))
            except RecursionError:
                rec = BadRecord("nested too deeply to decode")
            n += 1
            largest = max(largest, end - pos)
            yield rec
            pos = end


def _csv(path: Path):
    csv.field_size_limit(2**31 - 1)  # a long answer is one field; the default stops at 128 KiB
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # Excel writes a byte-order mark
            for rec in csv.DictReader(fh):
                yield BadRecord("more fields than the header names") if None in rec else rec
    except UnicodeDecodeError as e:
        yield BadRecord(f"not UTF-8 text (byte {e.start} of a block of the file: {e.reason})", fatal=True)
    except csv.Error as e:
        yield BadRecord(f"not valid CSV: {e}", fatal=True)


def _parquet_batches(path: Path):
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(path).iter_batches(_BATCH_ROWS)


def _arrow_batches(path: Path):
    import pyarrow as pa

    with pa.OSFile(str(path)) as f:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid:
            f.seek(0)
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader


def no_lone_surrogates(value) -> None:
    """JSON's \\ud800 escapes decode to strings that are not Unicode text: refuse them here, not
    inside the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"a lone surrogate \\u{ord(value[e.start]):04x} in a string (not valid "
                             "Unicode text)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            no_lone_surrogates(k)
            no_lone_surrogates(v)
    elif isinstance(value, list):
        for v in value:
            no_lone_surrogates(v)


def _ipc(batch) -> bytes:
    """A record batch as Arrow IPC stream bytes: only the batch's own rows, so a slice of a large
    batch travels to a worker as its slice, not as the whole batch."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _batch(data: bytes):
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_next_batch()


def _arrow_chunks(batches, label: str):
    """Chunks of at most _BATCH_ROWS rows of an Arrow / Parquet stream, whatever its batches."""
    import pyarrow as pa

    first = 1
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:  # a damaged or truncated Parquet / Arrow file
            raise SourceError(f"{label}: cannot be read as {'Parquet' if label.endswith('.parquet') else 'Arrow'} "
                              f"(after {first - 1} rows): {e}") from None
        for at in range(0, batch.num_rows, _BATCH_ROWS):
            part = batch.slice(at, _BATCH_ROWS)
            yield Chunk("arrow", _ipc(part), f"{label}: row ", first, n=part.num_rows)
            first += part.num_rows


def _drop_none(value):
    """Columnar storage fills the keys a row lacks with null (a message without tool_calls gets
    tool_calls: None): drop them, as if the row had been written as JSON. `content` stays."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None or k == "content"}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


class BadRecord:
    """A record that could not even be decoded; `fatal` errors stop the run even with on_error: skip
    (the file itself is broken, not one record)."""

    def __init__(self, reason: str, fatal: bool = False):
        self.reason, self.fatal = reason, fatal
