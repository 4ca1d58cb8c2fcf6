"""`--record FILE` for every benchmark script: the table goes into FILE's section of the hardware
class it was measured on, stamped with the date, the machine, its ISA and the commit, replacing
the previous table of the same benchmark and configuration in that class.

docs/performance.md has one `## <class>` section per hardware class and, in it, a slot per
benchmark between `<!-- slot CLASS BENCHMARK -->` and `<!-- /slot CLASS BENCHMARK -->`; a table
sits between `<!-- bench CLASS BENCHMARK CONFIG -->` and `<!-- /bench CLASS BENCHMARK CONFIG -->`
inside its slot. An empty slot holds the line `Not measured yet.`, which its first table replaces;
a class with no table at all may hold that line alone, without slots. A missing slot is created
(under a `### ` heading) at the end of its class section, a missing class section at the end of
the file, so a fresh file works too.

The class is the device's: a CUDA device is `nvidia-gpu`; on a CPU, /proc/cpuinfo's flags decide
(amx_bf16: `amx`, else avx512_bf16: `avx512-bf16`, else `avx2`), as the CPU kernels pick their
path (docs/ops.md).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# class id -> the heading of its section in docs/performance.md
CLASSES = {
    "avx2": "AVX2 CPU",
    "avx512-bf16": "AVX-512-BF16 CPU",
    "amx": "AMX CPU",
    "nvidia-gpu": "NVIDIA GPU",
}
# benchmark id -> the heading of its slot inside a class section
BENCHMARKS = {
    "compare_hf": "Training steps against Transformers",
    "lora": "LoRA against Transformers + PEFT",
    "train_vs_hf": "Fine-tuning loop against Transformers",
    "ops_bench": "Fused ops against their references",
    "parallel": "Expert and data parallelism",
    "dropin_ep_memory": "The drop-in under expert parallelism: memory per rank",
}
NOT_MEASURED = "Not measured yet."


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's flags."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware_class(device: str, flags: set[str]) -> str:
    if str(device).startswith("cuda"):
        return "nvidia-gpu"
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    return "avx2"


def isa_text(flags: set[str]) -> str:
    """The instruction sets that decide which CPU kernels run, widest first."""
    names = [name for name, flag in (("AMX", "amx_bf16"), ("AVX-512-BF16", "avx512_bf16"),
                                     ("AVX-512", "avx512f"), ("AVX2", "avx2")) if flag in flags]
    return " + ".join(names) or "no AVX2"


def commit(repo: Path = REPO) -> str:
    """`git rev-parse --short HEAD`, "+dirty" when tracked files other than Markdown differ from
    it (the tables a run of regenerations has already written do not change what is measured)."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                 "--untracked-files=no", "--", ".", ":(exclude)*.md"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if status.strip() else "")


def gpu_description(device: str) -> tuple[str, str]:
    """(name, "CUDA sm_XY") of the CUDA device, from torch."""
    try:
        import torch

        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return torch.cuda.get_device_name(index), f"CUDA sm_{major}{minor}"
    except Exception:  # noqa: BLE001  (no torch, no driver: still record what ran)
        return "NVIDIA GPU", "CUDA"


@dataclass
class Stamp:
    """Where and when a table was measured."""

    hw_class: str
    date: str
    machine: str
    isa: str
    commit: str

    def text(self) -> str:
        return f"{self.date} · {self.machine} · {self.isa} · commit {self.commit}"


def stamp(device: str = "cpu", cpuinfo: str | None = None, date: str | None = None,
          git_commit: str | None = None) -> Stamp:
    """The stamp of a run on `device` on this machine (cpuinfo, date and commit can be given)."""
    info = read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = cpu_flags(info)
    cls = hardware_class(device, flags)
    machine = f"{cpu_model(info)}, {os.cpu_count()} cores"
    isa = isa_text(flags)
    if cls == "nvidia-gpu":
        gpu, isa = gpu_description(device)
        machine = f"{gpu} (host: {machine})"
    return Stamp(hw_class=cls, date=date or _dt.date.today().isoformat(), machine=machine,
                 isa=isa, commit=git_commit or commit())


def heading(title: str, s: Stamp) -> str:
    """The first line of a recorded table: what ran, then where and when."""
    return f"**{title}** · {s.text()}"


def table(title: str, s: Stamp, how: str, lines: list[str]) -> str:
    """A recorded table as docs/performance.md holds it: the heading, how it was measured (the
    same paragraph), then the Markdown table."""
    return "\n".join([heading(title, s), how, "", *lines]) + "\n"


def _markers(kind: str, key: str) -> tuple[str, str]:
    return f"<!-- {kind} {key} -->", f"<!-- /{kind} {key} -->"


def _class_span(text: str, cls: str) -> tuple[int, int] | None:
    """[start, end) of the class's `## ` section: its heading line up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(CLASSES[cls])}$", text, re.MULTILINE)
    if match is None:
        return None
    nxt = re.compile(r"^## ", re.MULTILINE).search(text, match.end())
    return match.start(), (nxt.start() if nxt else len(text))


def _ensure_slot(text: str, cls: str, benchmark: str) -> str:
    """The text with a slot for `benchmark` in the section of `cls`: appended at the end of that
    section (which loses a section-wide `Not measured yet.` line, the mark of a class with no
    table), or in a new section at the end of the file."""
    begin, end = _markers("slot", f"{cls} {benchmark}")
    if begin in text and end in text:
        return text
    slot = f"### {BENCHMARKS[benchmark]}\n\n{begin}\n{NOT_MEASURED}\n{end}\n"
    span = _class_span(text, cls)
    if span is None:
        return text.rstrip("\n") + f"\n\n## {CLASSES[cls]}\n\n" + slot
    start, stop = span
    section = text[start:stop]
    if "<!-- slot " not in section:  # no slot yet: the whole class was not measured
        section = "\n".join(ln for ln in section.split("\n") if ln.strip() != NOT_MEASURED)
    section = section.rstrip("\n") + "\n\n" + slot
    return text[:start] + section + ("\n" + text[stop:] if stop < len(text) else "")


def write(doc: Path, benchmark: str, config: str, body: str, s: Stamp) -> str:
    """Puts `body` (a table headed by `heading(...)`) into the slot of `benchmark` in the
    section of `s.hw_class`, replacing the table recorded before under the same `config`;
    returns the table's key."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"record: unknown benchmark {benchmark!r} (expected one of {sorted(BENCHMARKS)})")
    key = f"{s.hw_class} {benchmark} {config}"
    begin, end = _markers("bench", key)
    section = f"{begin}\n{body.strip(chr(10))}\n{end}"
    text = doc.read_text() if doc.exists() else "# Performance\n"
    if begin in text and end in text:  # the table of this configuration: replaced where it is
        pre, rest = text.split(begin, 1)
        text = pre + section + rest.split(end, 1)[1]
    else:
        text = _ensure_slot(text, s.hw_class, benchmark)
        slot_begin, slot_end = _markers("slot", f"{s.hw_class} {benchmark}")
        pre, rest = text.split(slot_begin, 1)
        inside, post = rest.split(slot_end, 1)
        inside = "\n".join(ln for ln in inside.split("\n") if ln.strip() != NOT_MEASURED).strip("\n")
        inside = (inside + "\n\n" if inside else "") + section + "\n"
        text = pre + slot_begin + "\n" + inside + slot_end + post
    doc.write_text(text)
    return key


def replace_marked(doc: Path, name: str, key: str, text: str) -> None:
    """Puts `text` between `<!-- NAME KEY -->` and `<!-- /NAME KEY -->` in `doc`, replacing what
    was there, or appends the marked block (the tables a script keeps outside the class sections)."""
    begin, end = f"<!-- {name} {key} -->", f"<!-- /{name} {key} -->"
    body = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{text}{end}"
    if begin in body and end in body:
        body = body[: body.index(begin)] + block + body[body.index(end) + len(end):]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(body)
