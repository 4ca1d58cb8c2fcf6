"""Checkpoints under expert parallelism written by rank 0 alone: the save service.

The Transformers Trainer (and any script that saves "on the main process") writes the model and
the optimizer from rank 0 while the other ranks go on to the next step, where they wait in its
first collective until rank 0 comes back. Rank 0 holds only its own experts, so it asks the
other ranks of its EP group for theirs:

- each of those ranks runs a service thread (a daemon) that polls torch.distributed's store for
  rank 0's requests and answers each over a Gloo group of its own, never a group training uses
  (whose collectives the rank's main thread may be waiting in);
- the thread reads the rank's tensors only between optimizer steps: a global optimizer step hook
  holds a lock during every step, so rank 0 gets the values after the step it saves at;
- a request is either a model's expert parameters (save_pretrained) or an optimizer's state of
  them: `Optimizer.state_dict()` on rank 0 holds every expert's moments, [E, ...] as a one-process
  run's, and `Optimizer.load_state_dict` of such a state on any rank keeps this rank's experts.

Every other rank's `save_pretrained` returns once rank 0 has written that directory (or raises
its error), so a script that saves on every rank works as one that saves on rank 0 only."""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from datetime import timedelta

import torch

from automoe.arguments import AutoMoEError

_STEP_LOCK = threading.RLock()  # held by the main thread during every optimizer step
_SERVICES: "weakref.WeakSet[SaveService]" = weakref.WeakSet()
_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its EP params
_hooks_installed = False


def _timeout_s() -> float:
    return float(os.environ.get("AUTOMOE_EP_SAVE_TIMEOUT_S", "300"))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class SaveService:
    """Rank 0's access to the experts and optimizer moments of the other ranks of its EP group
    (one per set of ranks a model is loaded on: `_ExpertParallel`). Created collectively, at
    load, by every rank in the same order."""

    def __init__(self, parallel) -> None:
        import torch.distributed as dist

        info = parallel.info
        self.rank, self.ep = int(info["rank"]), int(info["ep"])
        self.begin, self.count = int(info["expert_begin"]), int(info["expert_count"])
        self.group = dist.new_group(list(range(self.ep)), backend="gloo",
                                    timeout=timedelta(seconds=_timeout_s()))
        self.store = dist.distributed_c10d._get_default_store()
        self.base = f"automoe/ep-save/{parallel.serial}/"
        self.routed = parallel.routed
        self.models: list[weakref.ref] = []  # in the order attached: the same on every rank
        self.optimizers: list[weakref.ref] = []  # in the order of their first step: the same on every rank
        self.requests = 0
        self.calls: dict[str, int] = {}
        self._stop = threading.Event()
        _install_hooks()
        _SERVICES.add(self)
        if 0 < self.rank < self.ep:
            # The thread holds the service weakly: the service (and its Gloo group) goes when the
            # model does, in the thread that drops the model, never in this one.
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._stop),
                                            name=f"automoe-ep-save-{parallel.serial}", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._stop.set)

    def stop(self) -> None:
        """Ends the service thread (at exit: a thread still inside the store's client while the
        process tears down its C++ objects aborts it)."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def add_model(self, model) -> None:
        self.models.append(weakref.ref(model))

    # -- rank 0 --------------------------------------------------------------------------------
    def gather_model(self, model, names: list[str]) -> dict[str, torch.Tensor]:
        """The full [E, ...] tensors of the parameters `names` of `model` (this rank's part of each
        and the other ranks' of the EP group), on the CPU."""
        index = self._index(self.models, model, "model")
        own = [_local(model.get_parameter(n)) for n in names]
        return dict(zip(names, self._gather({"kind": "model", "index": index, "names": names}, own)))

    def gather_optimizer(self, optimizer, items: list[tuple[int, str]]) -> list[torch.Tensor]:
        """The full moments `optimizer.state[params[i]][key]` for each (i, key) of `items`."""
        index = self._index(self.optimizers, optimizer, "optimizer")
        return self._gather({"kind": "optimizer", "index": index, "items": items},
                            _optimizer_tensors(optimizer, items))

    def _gather(self, request: dict, own: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        self.requests += 1
        n = self.requests
        self.store.set(f"{self.base}req{n}", pickle.dumps(request))
        what = f"the experts of ranks 1..{self.ep - 1} ({request['kind']})"
        try:
            status = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ep)]
            dist.gather(torch.zeros(1, dtype=torch.int64), status, dst=0, group=self.group)
            failed = [r for r, s in enumerate(status) if s.item()]
            dist.broadcast(torch.tensor([len(failed)]), src=0, group=self.group)
            if failed:
                errors = "; ".join(f"rank {r}: {self.store.get(f'{self.base}err{n}/{r}').decode()}" for r in failed)
                raise AutoMoEError(f"saving under expert parallelism: {errors}")
            out = []
            for t in own:
                t = t.detach().cpu().contiguous()
                parts = [torch.empty_like(t) for _ in range(self.ep)]
                dist.gather(t, parts, dst=0, group=self.group)
                out.append(torch.cat(parts, 0))
            return out
        except RuntimeError as e:  # Gloo's timeout: a rank that is gone or stuck
            raise AutoMoEError(f"saving under expert parallelism: rank 0 did not receive {what} within "
                               f"{_timeout_s():.0f} s (AUTOMOE_EP_SAVE_TIMEOUT_S): {e}") from e

    def saved(self, directory: str, error: str = "") -> None:
        """Rank 0 has written `directory` (or failed to: `error`): the other ranks' calls return."""
        key = f"{self.base}saved/{os.path.abspath(directory)}"
        k = self.calls[key] = self.calls.get(key, 0) + 1
        self.store.set(f"{key}/{k}", error)
        self.store.add(key, 1)

    # -- every other rank ----------------------------------------------------------------------
    def wait_saved(self, directory: str) -> None:
        """save_pretrained on a rank other than 0: returns once rank 0 has written `directory` as
        many times as this rank asked for it."""
        key = f"{self.base}saved/{os.path.abspath(directory)}"
        k = self.calls[key] = self.calls.get(key, 0) + 1
        deadline = time.monotonic() + _timeout_s()
        while self.store.add(key, 0) < k:  # polled: see _ExpertParallel.meet_to_save
            if time.monotonic() > deadline:
                raise AutoMoEError(f"save_pretrained({directory!r}) under expert parallelism: rank 0 writes the "
                                   f"checkpoint, and it did not write this directory within {_timeout_s():.0f} s "
                                   "(AUTOMOE_EP_SAVE_TIMEOUT_S); call save_pretrained on rank 0 too")
            time.sleep(0.01)
        error = self.store.get(f"{key}/{k}").decode()
        if error:
            raise AutoMoEError(f"save_pretrained({directory!r}): rank 0 failed to write it: {error}")

    def _answer(self, n: int, request: dict) -> None:
        import torch.distributed as dist

        if not _STEP_LOCK.acquire(timeout=_timeout_s()):
            tensors, error = [], "its optimizer step did not finish"
        else:
            try:
                tensors, error = self._tensors(request), ""
            except Exception as e:
                tensors, error = [], f"{type(e).__name__}: {e}"
            if error:
                _STEP_LOCK.release()
        if error:
            self.store.set(f"{self.base}err{n}/{self.rank}", error)
        dist.gather(torch.tensor([1 if error else 0]), None, dst=0, group=self.group)
        failed = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(failed, src=0, group=self.group)
        if error:
            return
        try:
            if failed.item():
                return
            for t in tensors:
                dist.gather(t.detach().cpu().contiguous(), None, dst=0, group=self.group)
        finally:
            _STEP_LOCK.release()

    def _tensors(self, request: dict) -> list[torch.Tensor]:
        refs = self.models if request["kind"] == "model" else self.optimizers
        target = refs[request["index"]]() if request["index"] < len(refs) else None
        if target is None:
            raise AutoMoEError(f"{request['kind']} #{request['index']} does not exist on this rank")
        if request["kind"] == "model":
            return [_local(target.get_parameter(n)) for n in request["names"]]
        return _optimizer_tensors(target, request["items"])

    @staticmethod
    def _index(refs: list, obj, what: str) -> int:
        for i, r in enumerate(refs):
            if r() is obj:
                return i
        raise AutoMoEError(f"this {what} is not known to AutoMoE's expert parallelism on rank 0")


def _serve(ref: "weakref.ref[SaveService]", stop: threading.Event) -> None:
    """The service thread: answers rank 0's requests in order until the service is gone, the
    process group is destroyed or the process exits."""
    import torch.distributed as dist

    n = 0
    while not stop.is_set() and dist.is_initialized():
        service = ref()
        if service is None:
            return
        key = f"{service.base}req{n + 1}"
        try:
            request = pickle.loads(service.store.get(key)) if service.store.check([key]) else None
        except Exception:  # the store is gone: the job is ending
            return
        if request is None:
            del service
            time.sleep(0.02)
            continue
        n += 1
        try:
            service._answer(n, request)
        except Exception:  # rank 0 reports the failure (its gather times out)
            return
        del service


def _params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_tensors(optimizer, items) -> list[torch.Tensor]:
    params = _params(optimizer)
    out = []
    for i, key in items:
        state = optimizer.state.get(params[i], {})
        if key not in state:
            raise AutoMoEError(f"the optimizer has no {key!r} for parameter #{i} on this rank")
        out.append(_local(state[key]))
    return out


# -- the optimizer's side -------------------------------------------------------------------------
def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    import atexit

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    atexit.register(_stop_services)
    _hooks_installed = True


def _stop_services() -> None:
    for service in list(_SERVICES):
        service.stop()


def _before_step(optimizer, args, kwargs) -> None:
    _STEP_LOCK.acquire()
    if optimizer not in _OPTIMIZERS:
        _adopt(optimizer)


def _after_step(optimizer, args, kwargs) -> None:
    _STEP_LOCK.release()


def _experts_of(optimizer) -> dict[int, SaveService]:
    """The optimizer's parameters (by index in its param groups) that are experts under expert
    parallelism, with the service of their model."""
    owners = {}
    for service in list(_SERVICES):
        for ref in service.models:
            model = ref()
            if model is not None:
                for name, p in model.named_parameters():
                    if name in service.routed:
                        owners[id(p)] = service
    return {i: owners[id(p)] for i, p in enumerate(_params(optimizer)) if id(p) in owners}


def _adopt(optimizer) -> None:
    """First step of an optimizer: if it trains experts under expert parallelism, its state_dict
    gathers them on rank 0 and its load_state_dict keeps this rank's part (also of a state loaded
    before this first step, as the Trainer's resume_from_checkpoint does)."""
    experts = _experts_of(optimizer)
    _OPTIMIZERS[optimizer] = experts
    if not experts:
        return
    for service in set(experts.values()):
        service.optimizers.append(weakref.ref(optimizer))
    optimizer.register_state_dict_post_hook(_full_state)
    optimizer.register_load_state_dict_post_hook(_own_state)
    _own_state(optimizer)


def _full_state(optimizer, state_dict: dict) -> dict:
    """Optimizer.state_dict on rank 0: each expert moment of the full [E, ...] shape (gathered from
    the EP group, on the CPU), as one process holding every expert would save it."""
    experts = _OPTIMIZERS.get(optimizer) or {}
    by_service: dict[SaveService, list[tuple[int, str]]] = {}
    for i, service in experts.items():
        if service.rank != 0:
            continue
        for key, value in state_dict["state"].get(i, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                by_service.setdefault(service, []).append((i, key))
    states = dict(state_dict["state"])
    for service, items in by_service.items():
        for (i, key), full in zip(items, service.gather_optimizer(optimizer, items)):
            states[i] = {**states[i], key: full}
    return {**state_dict, "state": states}


def _own_state(optimizer) -> None:
    """Keeps this rank's experts of every full [E, ...] moment (a state loaded from a checkpoint
    that rank 0 wrote), laid out as the parameter (a DTensor shard for a DTensor parameter)."""
    from torch.distributed.tensor import DTensor

    experts = _OPTIMIZERS.get(optimizer) or {}
    params = _params(optimizer)
    for i, service in experts.items():
        p = params[i]
        state = optimizer.state.get(p)
        if not state:
            continue
        local = _local(p)
        for key, value in list(state.items()):
            if (not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0
                    or value.shape[0] != service.count * service.ep or value.shape[1:] != local.shape[1:]):
                continue
            mine = value[service.begin:service.begin + service.count].to(local.device, local.dtype).clone()
            if isinstance(p, DTensor):
                mine = DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            state[key] = mine
