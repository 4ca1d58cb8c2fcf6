#!/usr/bin/env python3
"""Fails when the house outgrows what a reader can hold: a source file over 800 lines in csrc/ or
python/, or a C++/CUDA function over 150 lines in csrc/.

    scripts/check_sizes.py [--max-file-lines N] [--max-function-lines N] [ROOT]   (default: .)

Function extents come from Universal Ctags (`ctags --fields=+e`, Debian's universal-ctags, which
scripts/setup.sh installs); the file limit needs nothing but the standard library. Prints every
file and function over its limit with its length and exits 1; exits 0 with a one-line summary.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

SOURCES = (".cpp", ".h", ".cu", ".cuh", ".inc", ".py")


def long_files(root: Path, limit: int) -> list[tuple[int, str]]:
    out = []
    for top in ("csrc", "python"):
        for path in sorted((root / top).rglob("*")):
            if path.is_file() and path.suffix in SOURCES:
                n = sum(1 for _ in path.open(encoding="utf-8", errors="replace"))
                if n > limit:
                    out.append((n, str(path.relative_to(root))))
    return out


def long_functions(root: Path, limit: int) -> list[tuple[int, str]]:
    ctags = shutil.which("ctags")
    if ctags is None:
        raise SystemExit("check_sizes: ctags (universal-ctags) is not installed: run `make setup`")
    cmd = [ctags, "-R", "--langmap=C++:+.cu.cuh", "--languages=C++", "--kinds-C++=f",
           "--fields=+ne", "-x", "--_xformat=%{line} %{end} %F %N", "csrc"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0 or "--_xformat" in proc.stderr:
        raise SystemExit(f"check_sizes: {' '.join(cmd)} failed (Universal Ctags needed):\n{proc.stderr}")
    out = []
    for line in proc.stdout.splitlines():
        begin, end, path, name = line.split(" ", 3)
        if end.isdigit() and int(end) - int(begin) + 1 > limit:
            out.append((int(end) - int(begin) + 1, f"{path}:{begin} {name}"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".")
    p.add_argument("--max-file-lines", type=int, default=800)
    p.add_argument("--max-function-lines", type=int, default=150)
    args = p.parse_args()
    root = Path(args.root).resolve()
    files = long_files(root, args.max_file_lines)
    functions = long_functions(root, args.max_function_lines)
    for n, where in files:
        print(f"{where}: {n} lines (more than {args.max_file_lines}): split it along its seams")
    for n, where in functions:
        print(f"{where}: {n} lines (more than {args.max_function_lines}): name its steps")
    if files or functions:
        return 1
    print(f"check_sizes: no file in csrc/ or python/ over {args.max_file_lines} lines, no function "
          f"in csrc/ over {args.max_function_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
