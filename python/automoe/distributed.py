"""Multi-process `automoe train`: the torchrun launch convention and torch.distributed's groups.

`automoe train RECIPE --nproc-per-node N` re-runs the command under torch.distributed.run
(torchrun) with N processes on this machine; under torchrun or Slurm (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) every process initialises torch.distributed (NCCL on
GPUs, Gloo on CPUs), builds the mesh's groups (world = dp x ep; the ep ranks of a replica are
consecutive) and runs the C++ trainer in-process on those groups. See docs/parallelism.md.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def split_count(argv: list[str], option: str, least: int) -> tuple[int | None, list[str]]:
    """Takes `--OPTION N` (or `=N`; dashes or underscores) out of argv: (N or None, the rest)."""
    names = {option, "--" + option[2:].replace("-", "_")}
    rest, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        name, eq, attached = a.partition("=")
        if name not in names:
            rest.append(a)
            i += 1
            continue
        if eq:
            text, i = attached, i + 1
        elif i + 1 < len(argv):
            text, i = argv[i + 1], i + 2
        else:
            raise ValueError(f"{a}: expected a number")
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            kind = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"{option}: expected {kind}, got {text!r}")
    return value, rest


def split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """Takes `--nproc-per-node N` (or `=N`) out of argv."""
    return split_count(argv, "--nproc-per-node", 1)


def launched() -> bool:
    """Whether this process is one rank of a torchrun-style launch (a world of one included: then
    the trainer runs in this process, as every rank of a larger world does)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def exec_torchrun(nproc: int, train_argv: list[str], max_restarts: int = 0) -> None:
    """Replaces this process with torchrun running `automoe train` on nproc local processes; with
    max_restarts, torchrun restarts the group that many times after a failure (each restart resumes
    from the last checkpoint)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "automoe.cli", "train", *train_argv]
    sys.stderr.flush()
    os.execv(sys.executable, args)


def collective_device(recipe: dict) -> str:
    """The device this rank trains on (train.device; auto = this rank's GPU under CUDA)."""
    import torch

    want = recipe["train"]["device"]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want.startswith("cuda:") and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise ValueError(f"train.device: {want!r} would put every process of this machine on one GPU; "
                         "use auto or cuda (each process then takes the GPU of its LOCAL_RANK)")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        want = f"cuda:{local}"
    return want


def init(recipe: dict) -> dict:
    """Initialises torch.distributed from the environment and creates the mesh's groups; returns
    the engine's arguments for them."""
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    par = recipe["parallel"]
    ep = int(par["ep"])
    if world % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide the {world} processes (world = dp x ep)")
    dp = world // ep
    if par["dp"] not in ("auto", dp):
        raise ValueError(f"parallel.dp = {par['dp']} but {world} processes with ep = {ep} make dp = {dp}")
    device = collective_device(recipe)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    timeout = timedelta(seconds=float(par["timeout_s"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timeout)
    ep_group, dp_group = mesh_groups(ep, timeout)
    return dict(world_group=dist.group.WORLD.group_name, ep_group=ep_group.group_name if ep_group else "",
                dp_group=dp_group.group_name if dp_group else "", world_size=world, ep=ep,
                collective_device=device)


def mesh_groups(ep: int, timeout=None):
    """This rank's expert-parallel and data-parallel groups of the mesh world = dp x ep (the ep
    ranks of a replica consecutive), each None where it would have one rank. Collective: every
    rank creates every group, in the same order (torch.distributed's rule)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // ep
    kwargs = {} if timeout is None else {"timeout": timeout}
    ep_group = dp_group = None
    if ep > 1:
        for d in range(dp):
            g = dist.new_group(list(range(d * ep, (d + 1) * ep)), **kwargs)
            if rank // ep == d:
                ep_group = g
    if dp > 1:
        for e in range(ep):
            g = dist.new_group(list(range(e, world, ep)), **kwargs)
            if rank % ep == e:
                dp_group = g
    return ep_group, dp_group


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
