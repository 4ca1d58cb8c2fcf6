"""One record -> token ids and a per-token loss flag, for each data format.

Formats (`format: auto` picks one per record from its keys):

- chat:              {"messages": [...]} (or ShareGPT's {"conversations": [{"from", "value"}]}),
                     rendered with the tokenizer's own chat template, with the record's `tools`;
                     messages may carry tool_calls, tool results and reasoning content, passed to
                     the template as Transformers' apply_chat_template takes them. Loss on the
                     assistant turns: where the template marks `{% generation %}` when it has such
                     marks (Transformers' return_assistant_tokens_mask), else each assistant
                     turn's rendering (its content, tool calls and end-of-turn tokens).
- prompt_completion: {"prompt": "...", "completion": "..."}; loss on the completion and EOS.
- alpaca:            {"instruction": "...", "input": "...", "output": "..."}, in the Alpaca prompt;
                     loss on the output and EOS.
- text:              {"text": "..."}; loss on every token, then EOS.

`columns` renames a source's columns to these fields first; `train_on: all` puts loss on every
token. Rendering and tokenisation go through Hugging Face `transformers`/`tokenizers`, so the
tokens are exactly what Transformers produces.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

FORMATS = ("chat", "prompt_completion", "alpaca", "text")
ENCODER_VERSION = 2  # bump when the rendering or masking rules change

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{ctx}. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)

# ShareGPT speaker names (LLaMA-Factory's and FastChat's) -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool", "function_call": "assistant"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class FatalDataError(ValueError):
    """Not this record's fault: the tokenizer or template cannot do what the data needs."""


def detect_format(rec: dict) -> str:
    if "messages" in rec or "conversations" in rec:
        return "chat"
    if "prompt" in rec and "completion" in rec:
        return "prompt_completion"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "text" in rec:
        return "text"
    raise ValueError("cannot tell the format from the keys " + ", ".join(sorted(rec)) +
                     " (expected messages | conversations | prompt+completion | instruction+output | text;"
                     " columns: maps other names onto these)")


def _string(rec: dict, key: str, allow_empty: bool = False) -> str:
    if key not in rec:
        raise ValueError(f"missing key \"{key}\"")
    v = rec[key]
    if not isinstance(v, str):
        raise ValueError(f"\"{key}\" must be a string, got {type(v).__name__}")
    if not v and not allow_empty:
        raise ValueError(f"\"{key}\" is empty")
    return v


def map_columns(rec, columns: dict):
    """The record with the source's column names replaced by the format's field names."""
    if not columns or not isinstance(rec, dict):
        return rec
    out = {k: v for k, v in rec.items() if k not in columns.values()}
    for fieldname, col in columns.items():
        if col not in rec:
            raise ValueError(f"no column \"{col}\" (columns: maps {fieldname} to it; the record has: "
                             f"{', '.join(sorted(rec))})")
        out[fieldname] = rec[col]
    return out


def _sharegpt(turns: list, system) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or "value" not in t:
            raise ValueError(f"conversations[{i}] must be {{\"from\": str, \"value\": str}}")
        role = SHAREGPT_ROLES.get(t["from"].lower())
        if role is None:
            raise ValueError(f"conversations[{i}]: unknown speaker \"{t['from']}\" (known: "
                             f"{', '.join(sorted(SHAREGPT_ROLES))})")
        if t["from"].lower() == "function_call":  # LLaMA-Factory: the value is the call as JSON
            try:
                call = json.loads(t["value"])
            except (TypeError, ValueError):
                raise ValueError(f"conversations[{i}]: a function_call's value must be JSON "
                                 "{\"name\": ..., \"arguments\": ...}") from None
            calls = call if isinstance(call, list) else [call]
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": c} for c in calls]})
        else:
            msgs.append({"role": role, "content": t["value"]})
    return msgs


def _check_message(i: int, m) -> None:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be {{\"role\": str, \"content\": ...}}")
    c = m.get("content")
    if isinstance(c, str):
        return
    if c is None and (m.get("tool_calls") or m["role"] == "assistant" and
                      isinstance(m.get("reasoning_content") or m.get("thinking"), str)):
        return
    if isinstance(c, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in c):
        return
    raise ValueError(f"messages[{i}]: \"content\" must be a string (or a list of content parts, or "
                     f"null beside tool_calls), got {type(c).__name__}")


def _span_mask(encoding, n: int, spans) -> np.ndarray:
    """1 for each token whose first character lies inside one of the (start, end) character
    spans, found through the fast tokenizer's char_to_token (a few calls per span, not an offset
    pair per token)."""
    mask = np.zeros(n, dtype=np.uint8)
    for a, b in spans:
        first = next((t for c in range(a, b) if (t := encoding.char_to_token(c)) is not None), None)
        if first is None:
            continue
        if encoding.token_to_chars(first)[0] < a:  # the span starts inside this token
            first += 1
        last = next(t for c in range(b - 1, a - 1, -1) if (t := encoding.char_to_token(c)) is not None)
        mask[first:last + 1] = 1
    return mask


def _rewritten_turn(text: str, through: str, start: int, limit: int):
    """The span of an assistant turn that the template renders differently inside the whole
    conversation than at its end (Qwen3 drops or adds an empty reasoning block, for example):
    from `start` to the end of the turn's own ending (its last 16+ characters, end-of-turn marker
    included), found before the next message's content (`limit`). None when the ending differs
    too (GPT-OSS ends its last turn with <|return|>, earlier ones with <|end|>)."""
    if through[:start] != text[:start]:
        return None
    turn = through[start:]
    for n in (64, 32, 16):
        if len(turn) < n:
            continue
        at = text.find(turn[-n:], start, limit)
        if at >= 0:
            return start, at + n
    return None


def _content_span(text: str, content, cursor: int):
    at = text.find(content, cursor) if isinstance(content, str) and content else -1
    return (at, at + len(content)) if at >= 0 else None


class Encoder:
    """Turns one record into token ids and a per-token loss flag."""

    def __init__(self, tokenizer, fmt: str, train_on: str, columns: dict | None = None):
        self.tok = tokenizer
        self.fmt = fmt
        self.train_on = train_on
        self.columns = dict(columns or {})
        self.eos = tokenizer.eos_token_id
        self._marks: dict = {}

    @property
    def generation_marks(self) -> bool:
        """Whether the template used without tools marks its generation ({% generation %})."""
        return self._marks_generation(None)

    def _marks_generation(self, tools) -> bool:
        """Whether the template Transformers picks for a conversation (with a dict of templates:
        `tool_use` when there are tools, else `default`) marks its generation."""
        try:
            template = self.tok.get_chat_template(None, tools)
        except Exception:  # no template at all: the chat path refuses the record by name
            return False
        if template not in self._marks:
            self._marks[template] = bool(_GENERATION.search(template))
        return self._marks[template]

    def __call__(self, rec) -> tuple[list[int], list[int]]:
        """One record's token ids and loss flags (encode_batch of one); raises what it refuses."""
        [r] = self.encode_batch([rec])
        if isinstance(r, Exception):
            raise r
        return r[0].tolist(), r[1].tolist()

    def encode_batch(self, records: list) -> list:
        """Each record's (ids int32 array, mask uint8 array), or the exception it raised. Text and
        prompt formats are tokenised in one call of the fast tokenizer for the whole batch."""
        out: list = [None] * len(records)
        plain: list[tuple[int, str, str | None]] = []  # (index, first text, completion or None)
        chats: list[tuple[int, str, list]] = []  # (index, rendered text, assistant spans)
        for i, rec in enumerate(records):
            try:
                if not isinstance(rec, dict):
                    raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
                rec = map_columns(rec, self.columns)
                fmt = detect_format(rec) if self.fmt == "auto" else self.fmt
                if fmt == "chat":
                    marked = self._chat_text(rec)
                    if isinstance(marked[0], list):
                        out[i] = self._arrays(*marked)
                    else:
                        chats.append((i, *marked))
                elif fmt == "text":
                    plain.append((i, _string(rec, "text"), None))
                else:
                    plain.append((i, *self._prompt_and_completion(rec, fmt)))
            except (ValueError, TypeError) as e:
                out[i] = e
            except RecursionError:
                out[i] = ValueError("nested too deeply to render")
        if chats:
            enc = self.tok([c[1] for c in chats], add_special_tokens=False)
            for (i, _, spans), ids, encoding in zip(chats, enc["input_ids"], enc.encodings):
                out[i] = self._arrays(ids, _span_mask(encoding, len(ids), spans))
        if plain:
            firsts = self.tok([p[1] for p in plain], add_special_tokens=True)["input_ids"]
            pairs = [k for k, p in enumerate(plain) if p[2] is not None]
            seconds = self.tok([plain[k][2] for k in pairs], add_special_tokens=False)["input_ids"] if pairs else []
            second_of = dict(zip(pairs, seconds))
            eos = [] if self.eos is None else [self.eos]
            for k, (i, _, completion) in enumerate(plain):
                if completion is None:
                    ids = firsts[k] + eos
                    mask = [1] * len(ids)
                else:
                    c = second_of[k] + eos
                    ids, mask = firsts[k] + c, [0] * len(firsts[k]) + [1] * len(c)
                out[i] = self._arrays(ids, mask)
        return out

    def _arrays(self, ids, mask):
        ids = np.asarray(ids, dtype=np.int32)
        mask = np.ones(len(ids), np.uint8) if self.train_on == "all" else np.asarray(mask, dtype=np.uint8)
        return ids, mask

    @staticmethod
    def _prompt_and_completion(rec: dict, fmt: str) -> tuple[str, str]:
        if fmt == "prompt_completion":
            return _string(rec, "prompt"), _string(rec, "completion")
        inp = rec.get("input", "")
        if not isinstance(inp, str):
            raise ValueError(f"\"input\" must be a string, got {type(inp).__name__}")
        prompt = ALPACA_PROMPT.format(
            ctx=", paired with an input that provides further context" if inp else "",
            instruction=_string(rec, "instruction"),
            input_block=f"### Input:\n{inp}\n\n" if inp else "")
        return prompt, _string(rec, "output")

    def _prompt_only(self, tools) -> str:
        """What the template renders before a first assistant turn (a default system prompt, the
        generation prompt); empty when the template refuses an empty conversation."""
        try:
            return self.tok.apply_chat_template([], tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception:
            return ""

    def _messages(self, rec: dict):
        if "messages" in rec:
            msgs = rec["messages"]
            if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "from" in m and "value" in m
                                                       and "role" not in m for m in msgs):
                msgs = _sharegpt(msgs, rec.get("system"))  # ShareGPT turns under a mapped column
        else:
            turns = rec.get("conversations")
            if not isinstance(turns, list) or not turns:
                raise ValueError("\"conversations\" must be a non-empty list")
            msgs = _sharegpt(turns, rec.get("system"))
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("\"messages\" must be a non-empty list")
        for i, m in enumerate(msgs):
            _check_message(i, m)
        tools = rec.get("tools")
        if isinstance(tools, str):  # columnar datasets keep tool schemas as JSON text
            try:
                tools = json.loads(tools) if tools.strip() else None
            except ValueError:
                raise ValueError("\"tools\" is a string but not JSON") from None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"\"tools\" must be a list of tool definitions, got {type(tools).__name__}")
        return msgs, tools or None

    def _chat_text(self, rec):
        """(rendered text, assistant character spans), or (ids, mask) when the template marks
        its generation itself."""
        msgs, tools = self._messages(rec)
        if not any(m["role"] == "assistant" for m in msgs) and self.train_on != "all":
            raise ValueError("no assistant message: nothing to train on")
        if getattr(self.tok, "chat_template", None) is None:
            raise FatalDataError("chat data needs a tokenizer with a chat template; the model's tokenizer has "
                                 "none (use format prompt_completion, or add a chat_template)")
        if not getattr(self.tok, "is_fast", False):
            raise FatalDataError("chat data needs a fast tokenizer (tokenizer.json) to map the assistant "
                                 "turns onto tokens; the model's tokenizer is a slow one")
        if self._marks_generation(tools):
            try:
                enc = self.tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            except Exception as e:  # jinja's TemplateError and co.
                raise ValueError(f"the chat template refused this conversation: {e}") from None
            return list(enc["input_ids"]), list(enc["assistant_masks"])

        def render(m, **kw):
            try:
                return self.tok.apply_chat_template(m, tools=tools, tokenize=False, **kw)
            except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and co.
                raise ValueError(f"the chat template refused this conversation: {e}") from None

        text = render(msgs)
        spans, cursor = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            # The turn starts where the prompt for it (the conversation so far and the generation
            # prompt) stops agreeing with the whole rendering: DeepSeek's generation prompt ends in
            # "<think>\n", which its rendering of a finished turn does not have.
            before = render(msgs[:i], add_generation_prompt=True) if i else self._prompt_only(tools)
            common = len(before) if text.startswith(before) else len(os.path.commonprefix([before, text]))
            start = max(common, cursor)
            if not i and not before:  # the template renders no prompt alone: start at the content
                first = _content_span(text, m.get("content"), 0)
                start = first[0] if first else start
            if start < len(before) and i:  # never before the end of the messages before the turn
                so_far = render(msgs[:i])
                if text.startswith(so_far):
                    start = max(start, len(so_far))
            through = text if i + 1 == len(msgs) else render(msgs[: i + 1])
            if text.startswith(through) and len(through) > start:
                span = (start, len(through))
            else:  # a turn rendered differently once later turns follow
                # Its ending is searched only before the next message's content: when that is not
                # rendered as it is (a tool result the template drops), only the content is trained.
                nxt = next((x.get("content") for x in msgs[i + 1:] if x["role"] != "assistant"), None)
                limit = text.find(nxt, start) if isinstance(nxt, str) and nxt else -1
                span = ((_rewritten_turn(text, through, start, limit) if limit >= 0 else None)
                        or _content_span(text, m.get("content"), cursor))
            if span is None:
                raise ValueError(f"messages[{i}]: the chat template renders this assistant turn differently "
                                 "once later turns follow, and neither its end nor its content is found in the "
                                 "rendering (a template with {% generation %} marks says where the loss goes)")
            spans.append(span)
            cursor = span[1]
        return text, spans
