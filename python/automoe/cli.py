"""The `automoe` console script. `train` and `report` start in Python (tokenisation, plotting);
everything else, and the training loop itself, runs in the C++ command that ships inside the
package."""

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


def engine_env() -> dict:
    env = dict(os.environ)
    # The binary finds LibTorch next to it when torch and automoe share a site-packages; point it
    # at the torch Python would import otherwise (found without importing it).
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        torch_lib = str(Path(spec.origin).parent / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def exec_engine(args: list[str]) -> None:
    """Replaces this process with the C++ command (signals and exit status go straight to it)."""
    exe = binary()
    os.execve(exe, [str(exe), *args], engine_env())


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "train" and not any(a.startswith("--recipe-") for a in args):
        from automoe import train

        train.main(args[1:])
    elif args and args[0] == "report":
        from automoe import report

        report.main(args[1:])
    else:
        exec_engine(args)


if __name__ == "__main__":
    main()
