"""The `automoe` console script: runs the C++ command that ships inside the package."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def binary() -> Path:
    path = Path(__file__).resolve().parent / "bin" / "automoe"
    if not path.exists():
        raise SystemExit(f"automoe: the engine binary is missing ({path}); build with `make` or `pip install .`")
    return path


def main() -> None:
    exe = binary()
    os.execv(exe, [str(exe), *sys.argv[1:]])


if __name__ == "__main__":
    main()
