"""A torchrun worker that gives one rank its own environment, then runs the automoe command line:
    rank_env_worker.py RANK:NAME=VALUE[,NAME=VALUE...] automoe-args...
(torchrun gives every rank the same environment; machines of a real job can differ)."""

import os
import runpy
import sys

rank, assignments = sys.argv[1].split(":", 1)
if os.environ["RANK"] == rank:
    for item in assignments.split(","):
        name, value = item.split("=", 1)
        os.environ[name] = value
sys.argv = ["automoe", *sys.argv[2:]]
runpy.run_module("automoe.cli", run_name="__main__")
