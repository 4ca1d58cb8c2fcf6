"""The `automoe` console script. `train`, `plan` and `report` start in Python (tokenisation, YAML,
plotting); everything else, and the training loop itself, runs in the C++ command that ships
inside the package."""

from __future__ import annotations

import sys

from automoe.engine_binary import exec_engine


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "train" and not any(a.startswith("--recipe-") for a in args):
        from automoe import train

        train.main(args[1:])
    elif args and args[0] == "plan":
        from automoe import planning

        planning.main(args[1:])
    elif args and args[0] == "report":
        from automoe import report

        report.main(args[1:])
    else:
        exec_engine(args)


if __name__ == "__main__":
    main()
