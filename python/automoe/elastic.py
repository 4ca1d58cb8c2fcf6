"""Process groups that survive torchrun's restarts: each attempt's keys in a namespace of its own.

torchrun's elastic agent hosts one TCPStore for the whole job and hands it to every attempt's
workers (TORCHELASTIC_USE_AGENT_STORE=True, the default since PyTorch 2.4) without a per-attempt
prefix: the keys a group writes when it forms (Gloo's peer addresses, NCCL's unique id, a
collective save's rounds) are still there when the restarted workers form theirs, and a worker
that reads the previous attempt's address before its peer has written the new one connects to a
dead process ("Gloo connectFullMesh failed ... Connection refused": PyTorch issue 135712). The
agent's restart count cannot name the attempt either: it is per agent (an agent started again
after its node was lost counts from 0) and a restart for a membership change does not advance it.

So the attempt is named by its own workers: global rank 0 publishes a fresh random token, and
every other rank takes it only once rank 0 has answered the rank's own fresh nonce under that
token — proof that the token is this attempt's, since no earlier process has seen the nonce. The
store torch.distributed's `env://` rendezvous returns is then wrapped in a PrefixStore named by
the token, so the default group, every group made from it (the mesh's EP / DP groups) and every
key written through it (the drop-in's collective saves) belong to this attempt alone.

`install()` (run by `import automoe` and by `automoe train`'s ranks under torchrun) puts this in
front of torch.distributed's `env://` handler — the one `init_process_group()`, accelerate and the
Transformers Trainer use — only when the agent's store is shared; elsewhere nothing changes.
AUTOMOE_ELASTIC_SCOPE=0 turns it off.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

PREFIX = "automoe/attempt/"
_POLL_S = 0.2


class RendezvousError(RuntimeError):
    pass


def _shared_agent_store() -> bool:
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("AUTOMOE_ELASTIC_SCOPE", "1") != "0")


def attempt_token(store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The token every rank of this attempt agrees on (see the module's doc). Raises
    RendezvousError naming the ranks that did not arrive within `timeout`."""
    deadline = time.monotonic() + timeout.total_seconds()
    current = PREFIX + "current"
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(current, token)
        hello = [f"{PREFIX}{token}/hello/{r}" for r in range(1, world_size)]
        if hello:  # one wait and one answer for all ranks: O(1) store calls from rank 0 at any scale
            try:
                store.wait(hello, timeout)
            except Exception:  # the store's timeout (its error types differ between versions)
                missing = [r for r, k in enumerate(hello, 1) if not store.check([k])]
                raise RendezvousError(
                    f"rank(s) {missing} of this torchrun attempt did not join within {timeout.total_seconds():.0f} s "
                    "(they died or hang before torch.distributed.init_process_group)") from None
            nonces = store.multi_get(hello)
            store.multi_set([f"{PREFIX}welcome/{n.decode()}" for n in nonces], [token] * len(nonces))
        return token
    nonce = uuid.uuid4().hex
    welcome = f"{PREFIX}welcome/{nonce}"
    said_hello_to = None
    while True:
        if store.check([current]):
            token = store.get(current).decode()
            if token != said_hello_to:  # a new token (or a stale one: then nobody answers)
                store.set(f"{PREFIX}{token}/hello/{rank}", nonce)
                said_hello_to = token
        if store.check([welcome]):
            return store.get(welcome).decode()
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0 of this torchrun attempt did not answer rank {rank} within "
                f"{timeout.total_seconds():.0f} s (it died or hangs before torch.distributed.init_process_group)")
        time.sleep(_POLL_S)


def scoped_store(store, rank: int, world_size: int, timeout: timedelta):
    import torch.distributed as dist

    token = attempt_token(store, rank, world_size, timeout)
    return dist.PrefixStore(f"{PREFIX}{token}", store)


def warn_if_a_lost_node_cannot_rejoin() -> None:
    """torchrun's agents share one store across rendezvous rounds, and an agent started again on a
    lost node then waits for the store's address under the new round, which the surviving rank-0
    agent never writes again (it keeps the first round's): the node cannot rejoin, and the job
    stops at the rendezvous timeout. Without the shared store each round has its own."""
    if (int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("RANK") == "0"):
        import logging

        logging.getLogger("automoe").warning(
            "automoe: several torchrun nodes with --max-restarts and the agents' shared store: a node that is "
            "lost and started again cannot rejoin (PyTorch's agents keep the first round's store address). Set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node (docs/parallelism.md, Faults and restarts)")


def accept_indexed_cpu_locations() -> None:
    """torch.load(map_location=torch.device("cpu", i)): the Transformers Trainer resumes a
    multi-process run on CPUs with map_location=args.device, which accelerate names "cpu:<local
    rank>", and torch's deserializer accepts only "cpu" (every rank's resume fails). Storages
    restored to "cpu:<i>" stay on the CPU."""
    import re

    import torch.serialization

    indexed = re.compile(r"cpu:\d+")

    def deserialize(obj, location):
        return obj if indexed.fullmatch(location) else None

    if not getattr(torch.serialization, "_automoe_indexed_cpu", False):
        torch.serialization.register_package(11, lambda obj: None, deserialize)
        torch.serialization._automoe_indexed_cpu = True


def install() -> bool:
    """Puts the attempt scoping in front of torch.distributed's env:// rendezvous when torchrun's
    agent shares its store with the workers. Idempotent; returns whether it is in place."""
    if not _shared_agent_store():
        return False
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    original = handlers.get("env") if isinstance(handlers, dict) else None
    if original is None:  # another PyTorch: say so rather than fail the import
        import logging

        logging.getLogger("automoe").warning(
            "automoe: torch.distributed's env:// rendezvous is not where this PyTorch kept it; a torchrun "
            "restart may meet the previous attempt's keys (docs/parallelism.md, Faults and restarts)")
        return False
    if getattr(original, "_automoe_scoped", False):
        return True

    def env_handler(url, timeout=None, **kwargs):
        if timeout is None:
            from torch.distributed.constants import default_pg_timeout as timeout
        for store, rank, world_size in original(url, timeout=timeout, **kwargs):
            yield scoped_store(store, rank, world_size, timeout), rank, world_size

    warn_if_a_lost_node_cannot_rejoin()
    env_handler._automoe_scoped = True
    handlers["env"] = env_handler
    return True
