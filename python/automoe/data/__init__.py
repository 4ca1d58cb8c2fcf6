"""Tokenise JSONL training data once, into a cached, memory-mapped dataset the C++ trainer reads.

Formats (one JSON object per line; `format: auto` picks one per line from its keys):

- chat:              {"messages": [{"role": "user", "content": "..."}, ...]}, rendered with the
                     tokenizer's own chat template; loss on the assistant turns (their content and
                     the template's end-of-turn tokens).
- prompt_completion: {"prompt": "...", "completion": "..."}; loss on the completion and EOS.
- alpaca:            {"instruction": "...", "input": "...", "output": "..."}, in the Alpaca prompt;
                     loss on the output and EOS.
- text:              {"text": "..."}; loss on every token, then EOS.

`train_on: all` puts loss on every token of every format. Rendering and tokenisation go through
Hugging Face `transformers`/`tokenizers`, so the tokens are exactly what Transformers produces.

The cache file is keyed by the inputs' bytes, the tokenizer files, the settings and the library
versions; the layout is documented in csrc/automoe/train/dataset.h.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_FORMAT = "AMDS0001"
ENCODER_VERSION = 1  # bump when the rendering or masking rules change
FORMATS = ("chat", "prompt_completion", "alpaca", "text")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{ctx}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)


class DataError(ValueError):
    """A malformed line or an unusable file; the message names the file and line."""


@dataclass
class Dataset:
    path: Path        # the .amds file
    key: str          # cache key
    stats: dict       # documents, tokens, loss_tokens, skipped lines, reused


def default_cache_dir() -> Path:
    base = os.environ.get("AUTOMOE_CACHE")
    return Path(base) / "datasets" if base else Path.home() / ".cache" / "automoe" / "datasets"


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


def detect_format(rec: dict) -> str:
    if "messages" in rec:
        return "chat"
    if "prompt" in rec and "completion" in rec:
        return "prompt_completion"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "text" in rec:
        return "text"
    raise ValueError("cannot tell the format from the keys " + ", ".join(sorted(rec)) +
                     " (expected messages | prompt+completion | instruction+output | text)")


def _string(rec: dict, key: str, allow_empty: bool = False) -> str:
    if key not in rec:
        raise ValueError(f"missing key \"{key}\"")
    v = rec[key]
    if not isinstance(v, str):
        raise ValueError(f"\"{key}\" must be a string, got {type(v).__name__}")
    if not v and not allow_empty:
        raise ValueError(f"\"{key}\" is empty")
    return v


class Encoder:
    """Turns one record into token ids and a per-token loss flag."""

    def __init__(self, tokenizer, fmt: str, train_on: str):
        self.tok = tokenizer
        self.fmt = fmt
        self.train_on = train_on
        self.eos = tokenizer.eos_token_id

    def __call__(self, rec) -> tuple[list[int], list[int]]:
        if not isinstance(rec, dict):
            raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
        fmt = detect_format(rec) if self.fmt == "auto" else self.fmt
        if fmt == "chat":
            ids, mask = self._chat(rec)
        elif fmt == "prompt_completion":
            ids, mask = self._pair(_string(rec, "prompt"), _string(rec, "completion"))
        elif fmt == "alpaca":
            inp = rec.get("input", "")
            if not isinstance(inp, str):
                raise ValueError(f"\"input\" must be a string, got {type(inp).__name__}")
            prompt = ALPACA_PROMPT.format(
                ctx=", paired with an input that provides further context" if inp else "",
                instruction=_string(rec, "instruction"),
                input_block=f"### Input:\n{inp}\n\n" if inp else "")
            ids, mask = self._pair(prompt, _string(rec, "output"))
        else:
            ids = self.tok(_string(rec, "text"), add_special_tokens=True)["input_ids"]
            if self.eos is not None:
                ids = ids + [self.eos]
            mask = [1] * len(ids)
        if self.train_on == "all":
            mask = [1] * len(ids)
        return ids, mask

    def _prompt_only(self) -> str:
        """What the template renders before a first assistant turn (a default system prompt, the
        generation prompt); empty when the template refuses an empty conversation."""
        try:
            return self.tok.apply_chat_template([], tokenize=False, add_generation_prompt=True)
        except Exception:
            return ""

    def _pair(self, prompt: str, completion: str):
        p = self.tok(prompt, add_special_tokens=True)["input_ids"]
        c = self.tok(completion, add_special_tokens=False)["input_ids"]
        if self.eos is not None:
            c = c + [self.eos]
        return p + c, [0] * len(p) + [1] * len(c)

    def _chat(self, rec):
        msgs = rec["messages"] if "messages" in rec else None
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("\"messages\" must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{\"role\": str, \"content\": str}}")
        if not any(m["role"] == "assistant" for m in msgs) and self.train_on != "all":
            raise ValueError("no assistant message: nothing to train on")
        if getattr(self.tok, "chat_template", None) is None:
            raise DataError("chat data needs a tokenizer with a chat template; the model's tokenizer has none "
                            "(use format prompt_completion, or add a chat_template)")
        if not getattr(self.tok, "is_fast", False):
            raise DataError("chat data needs a fast tokenizer (tokenizer.json) to map the assistant "
                            "turns onto tokens; the model's tokenizer is a slow one")

        def render(m, **kw):
            try:
                return self.tok.apply_chat_template(m, tokenize=False, **kw)
            except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and co.
                raise ValueError(f"the chat template refused this conversation: {e}") from None

        text = render(msgs)
        spans, cursor = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = render(msgs[:i], add_generation_prompt=True) if i else self._prompt_only()
            through = render(msgs[: i + 1])
            if text.startswith(through) and through.startswith(before):
                spans.append((len(before), len(through)))
                cursor = len(through)
            else:  # templates that rewrite earlier turns: fall back to the content itself
                at = text.find(m["content"], cursor)
                if at < 0:
                    raise ValueError(f"messages[{i}]: the chat template does not reproduce the assistant text")
                spans.append((at, at + len(m["content"])))
                cursor = at + len(m["content"])
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        mask = [0] * len(ids)
        for t, (s, e) in enumerate(enc["offset_mapping"]):
            if e > s and any(a <= s < b for a, b in spans):
                mask[t] = 1
        return ids, mask


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(files: list[Path], model_path: str, fmt: str, train_on: str, on_error: str) -> str:
    from importlib.metadata import version  # not importing the libraries: a cached run never needs them

    h = hashlib.sha256()
    h.update(json.dumps({"encoder": ENCODER_VERSION, "format": fmt, "train_on": train_on, "on_error": on_error,
                         "transformers": version("transformers"),
                         "tokenizers": version("tokenizers")}).encode())
    for f in files:
        h.update(b"data\0" + _file_digest(f).encode())
    for name in TOKENIZER_FILES:
        p = Path(model_path) / name
        if p.exists():
            h.update(name.encode() + b"\0" + _file_digest(p).encode())
    return h.hexdigest()[:32]


def _write(path: Path, docs_ids: list[np.ndarray], docs_mask: list[np.ndarray], meta: dict) -> None:
    offsets = np.zeros(len(docs_ids) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs_ids], out=offsets[1:])
    tokens = np.concatenate(docs_ids).astype(np.int32) if docs_ids else np.zeros(0, np.int32)
    mask = np.concatenate(docs_mask).astype(np.uint8) if docs_mask else np.zeros(0, np.uint8)

    def align(n: int) -> int:
        return (n + 63) // 64 * 64

    header = dict(meta, n_docs=len(docs_ids), n_tokens=int(tokens.size))
    # Section offsets depend on the header's length, which depends on them: fix the point.
    offs = {"offsets_at": 0, "tokens_at": 0, "mask_at": 0}
    for _ in range(4):
        text = json.dumps(dict(header, **offs)).encode()
        start = align(16 + len(text) + 16)
        new = {"offsets_at": start, "tokens_at": align(start + offsets.nbytes)}
        new["mask_at"] = align(new["tokens_at"] + tokens.nbytes)
        if new == offs:
            break
        offs = new
    text = json.dumps(dict(header, **offs)).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(CACHE_FORMAT.encode() + len(text).to_bytes(8, "little") + text)
            for at, arr in ((offs["offsets_at"], offsets), (offs["tokens_at"], tokens), (offs["mask_at"], mask)):
                f.write(b"\0" * (at - f.tell()))
                f.write(arr.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write the tokenised data {path}: {e.strerror or e} (data.cache_dir: free "
                        "space there, or choose another directory)") from None


def remove_dead_temporaries(cache: Path) -> None:
    """Removes the hidden `.NAME.tmp-PID` files a killed tokenisation left in the cache."""
    import re

    for p in cache.glob(".*.tmp-*"):
        m = re.fullmatch(r"\..+\.tmp-(\d+)", p.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # a live process (ours or not): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        p.unlink(missing_ok=True)


def _no_lone_surrogates(value) -> None:
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
            _no_lone_surrogates(k)
            _no_lone_surrogates(v)
    elif isinstance(value, list):
        for v in value:
            _no_lone_surrogates(v)


def build(files: list[str], tokenizer, model_path: str, fmt: str = "auto", train_on: str = "completion",
          on_error: str = "fail", cache_dir: str | os.PathLike | None = None,
          what: str = "data.train", log=sys.stderr) -> Dataset:
    """Tokenises `files` (or reuses the cached result) and returns the dataset file. `tokenizer`
    None: the model's own, loaded only if the data is not cached (Transformers takes seconds to
    import)."""
    paths = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise DataError(f"{what}: {f}: no such file")
        paths.append(p)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot create {cache}: {e.strerror or e}") from None
    remove_dead_temporaries(cache)
    key = cache_key(paths, model_path, fmt, train_on, on_error)
    out = cache / f"{key}.amds"
    stats_path = cache / f"{key}.json"
    if out.exists() and stats_path.exists():
        stats = json.loads(stats_path.read_text())
        stats["reused"] = True
        return Dataset(out, key, stats)

    enc = Encoder(tokenizer if tokenizer is not None else load_tokenizer(model_path), fmt, train_on)
    ids_list, mask_list, skipped, short = [], [], [], 0
    for p in paths:
        with open(p, "rb") as fh:  # decoded line by line, so that a bad byte names its own line
            lineno = 0
            for raw in fh:
                lineno += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{p}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line: "
                                    f"{e.reason})") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    _no_lone_surrogates(row)
                    ids, mask = enc(row)
                except DataError:
                    raise
                except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
                    msg = f"{p}:{lineno}: {e}"
                    if on_error == "fail":
                        raise DataError(msg + " (data.on_error: skip would skip such lines)") from None
                    skipped.append(msg)
                    continue
                if len(ids) < 2:
                    short += 1
                    continue
                ids_list.append(np.asarray(ids, dtype=np.int64))
                mask_list.append(np.asarray(mask, dtype=np.uint8))
    for msg in skipped[:10]:
        print(f"automoe train: skipped {msg}", file=log)
    if len(skipped) > 10:
        print(f"automoe train: ... and {len(skipped) - 10} more malformed lines skipped", file=log)
    if not ids_list:
        raise DataError(f"{what}: no usable documents in {', '.join(map(str, paths))}")
    stats = {
        "files": [str(p) for p in paths],
        "documents": len(ids_list),
        "tokens": int(sum(len(d) for d in ids_list)),
        "loss_tokens": int(sum(int(m.sum()) for m in mask_list)),
        "skipped_lines": len(skipped),
        "too_short": short,
        "max_token": int(max(int(d.max()) for d in ids_list)),
    }
    _write(out, ids_list, mask_list, {"key": key, "format": fmt, "train_on": train_on, **{
        k: stats[k] for k in ("documents", "tokens", "loss_tokens")}})
    tmp = stats_path.with_name(f".{stats_path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(stats, indent=2) + "\n")
        os.replace(tmp, stats_path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write {stats_path}: {e.strerror or e} (data.cache_dir: free space there, "
                        "or choose another directory)") from None
    stats["reused"] = False
    return Dataset(out, key, stats)


def read(path: str | os.PathLike) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The documents of a .amds file (token ids, loss flags): for tests and inspection."""
    raw = Path(path).read_bytes()
    if raw[:8] != CACHE_FORMAT.encode():
        raise DataError(f"{path}: not an AutoMoE dataset")
    n = int.from_bytes(raw[8:16], "little")
    h = json.loads(raw[16:16 + n])
    offsets = np.frombuffer(raw, np.int64, h["n_docs"] + 1, h["offsets_at"])
    tokens = np.frombuffer(raw, np.int32, h["n_tokens"], h["tokens_at"])
    mask = np.frombuffer(raw, np.uint8, h["n_tokens"], h["mask_at"])
    return ([tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            [mask[a:b] for a, b in zip(offsets[:-1], offsets[1:])])
