"""The `automoe` console script: runs the C++ command that ships inside the package."""

from __future__ import annotations

import importlib.util
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
    env = dict(os.environ)
    # The binary finds LibTorch next to it when torch and automoe share a site-packages; point it
    # at the torch Python would import otherwise (found without importing it).
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        torch_lib = str(Path(spec.origin).parent / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)
    os.execve(exe, [str(exe), *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
