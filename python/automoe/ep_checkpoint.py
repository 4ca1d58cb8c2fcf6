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
its error), so a script that saves on every rank works as one that saves on rank 0 only.

A script's last save (`trainer.save_model()` at the end) is rank 0's alone while the other ranks
run on to their exit: so a serving rank keeps its models until rank 0 has let its own go (seen
when the next model loads, or at exit, where it goes on answering until then), and its answers
use the Gloo group's own methods, which work after `destroy_process_group()`."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch

from automoe.arguments import AutoMoEError

# Optimizer steps: how many are under way (the main thread's) and how many have finished (of
# optimizers that train experts); a service thread reads tensors only with none under way and at
# least as many finished as rank 0 had when it asked, holding the condition's lock meanwhile.
_STEPS = threading.Condition(threading.Lock())
_stepping = 0
_stepped = 0
_crashed = False  # an uncaught exception ends this process: no lingering at exit
_SERVING: "set[SaveService]" = set()  # a serving rank's services, kept (with their models) until exit
_STEP_DONE = None  # on a GPU: an event recorded after the last optimizer step's kernels
_COPY_STREAMS: dict = {}  # device -> the service threads' copy stream (one, made once)
_POLL_S = 0.1  # how often a service thread looks for a request
_SERVICES: "weakref.WeakSet[SaveService]" = weakref.WeakSet()
_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (#params, its experts)
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

        _release_finished()
        info = parallel.info
        self.rank, self.ep = int(info["rank"]), int(info["ep"])
        self.begin, self.count = int(info["expert_begin"]), int(info["expert_count"])
        self.group = dist.new_group(list(range(self.ep)), backend="gloo",
                                    timeout=timedelta(seconds=_timeout_s()))
        self.store = dist.distributed_c10d._get_default_store()
        self.base = f"automoe/ep-save/{parallel.serial}/"
        self.routed = parallel.routed
        self.models: list = []  # in the order attached (the same on every rank): weakly on rank 0
        self.optimizers: list[weakref.ref] = []  # in the order of their first step: the same on every rank
        self.requests = 0
        self.calls: dict[str, int] = {}
        self._stop = threading.Event()
        _install_hooks()
        _SERVICES.add(self)
        self.serving = 0 < self.rank < self.ep
        if self.serving:
            _SERVING.add(self)  # (released at exit, in the main thread: _stop_services)
            # The thread holds the service weakly: the service (and its Gloo group) is never freed
            # in the thread.
            self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._stop),
                                            name=f"automoe-ep-save-{parallel.serial}", daemon=True)
            self._thread.start()
        elif self.rank == 0:  # rank 0 can no longer save once its service is gone
            weakref.finalize(self, _finished, self.store, self.base)

    def stop(self) -> None:
        """Ends the service thread (at exit: a thread still inside the store's client while the
        process tears down its C++ objects aborts it)."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def linger(self) -> None:
        """At a serving rank's exit: answer rank 0 until it is finished (exited or let its models
        go), the store is gone, or AUTOMOE_EP_SAVE_TIMEOUT_S has passed."""
        deadline = time.monotonic() + _timeout_s()
        try:
            while not self.store.check([self.base + "finished"]) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        except Exception:  # the store is gone: so is rank 0
            pass

    def add_model(self, model) -> None:
        self.models.append(model if self.serving else weakref.ref(model))

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

    # The group's own methods (not torch.distributed's functions, which look the group up in a
    # registry that destroy_process_group empties): rank 0 of the group is global rank 0.
    def _gather_to_0(self, t: torch.Tensor, parts: list[torch.Tensor] | None = None) -> None:
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.group.gather([parts] if parts is not None else [], [t], opts).wait()

    def _broadcast_from_0(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def _gather(self, request: dict, own: list[torch.Tensor]) -> list[torch.Tensor]:
        broken = [r for r in range(1, self.ep) if self.store.check([f"{self.base}broken{r}"])]
        if broken:
            why = "; ".join(f"rank {r}: {self.store.get(f'{self.base}broken{r}').decode()}" for r in broken)
            raise AutoMoEError(f"saving under expert parallelism: the save service failed earlier ({why}); "
                               "this model can no longer be saved by rank 0 alone")
        with _STEPS:
            request["steps"] = _stepped  # (the other ranks read their tensors after as many steps)
        self.requests += 1
        n = self.requests
        self.store.set(f"{self.base}req{n}", pickle.dumps(request))
        what = f"the experts of ranks 1..{self.ep - 1} ({request['kind']})"
        try:
            status = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ep)]
            self._gather_to_0(torch.zeros(1, dtype=torch.int64), status)
            failed = [r for r, s in enumerate(status) if s.item()]
            self._broadcast_from_0(torch.tensor([len(failed)]))
            if failed:
                errors = "; ".join(f"rank {r}: {self.store.get(f'{self.base}err{n}/{r}').decode()}" for r in failed)
                raise AutoMoEError(f"saving under expert parallelism: {errors}")
            out = []
            for t in own:
                t = t.detach().cpu().contiguous()
                parts = [torch.empty_like(t) for _ in range(self.ep)]
                self._gather_to_0(t, parts)
                out.append(torch.cat(parts, 0))
            return out
        except RuntimeError as e:  # Gloo's timeout: a rank that is gone or stuck
            raise AutoMoEError(f"saving under expert parallelism: rank 0 did not receive {what} within "
                               f"{_timeout_s():.0f} s (AUTOMOE_EP_SAVE_TIMEOUT_S): {e}") from e

    def saving(self, directory: str) -> None:
        """Rank 0 starts writing `directory` (another rank's call for it waits until it is done)."""
        self.store.set(f"{self.base}saving/{os.path.abspath(directory)}", "1")

    def saved(self, directory: str, error: str = "") -> None:
        """Rank 0 has written `directory` (or failed to: `error`): the other ranks' calls return."""
        key = f"{self.base}saved/{os.path.abspath(directory)}"
        k = self.calls[key] = self.calls.get(key, 0) + 1
        self.store.set(f"{key}/{k}", error)
        self.store.add(key, 1)
        self.store.set(f"{self.base}saving/{os.path.abspath(directory)}", "0")

    # -- every other rank ----------------------------------------------------------------------
    def wait_saved(self, directory: str) -> None:
        """save_pretrained on a rank other than 0: returns once rank 0 has written `directory` as
        many times as this rank asked for it and is not writing it now. (Polled: a store.wait that
        times out leaves its request pending in the store's server.)"""
        key = f"{self.base}saved/{os.path.abspath(directory)}"
        busy = f"{self.base}saving/{os.path.abspath(directory)}"
        k = self.calls[key] = self.calls.get(key, 0) + 1
        deadline = time.monotonic() + _timeout_s()
        while self.store.add(key, 0) < k or (self.store.check([busy]) and self.store.get(busy) == b"1"):
            if time.monotonic() > deadline:
                raise AutoMoEError(f"save_pretrained({directory!r}) under expert parallelism: rank 0 writes the "
                                   f"checkpoint, and it did not write this directory within {_timeout_s():.0f} s "
                                   "(AUTOMOE_EP_SAVE_TIMEOUT_S); call save_pretrained on rank 0 too")
            time.sleep(0.01)
        error = self.store.get(f"{key}/{self.store.add(key, 0)}").decode()
        if error:
            raise AutoMoEError(f"save_pretrained({directory!r}): rank 0 failed to write it: {error}")

    def _answer(self, n: int, request: dict) -> None:
        """One request: this rank's tensors once its optimizer has taken as many steps as rank 0's
        and none is under way (the main thread's next step waits meanwhile); whatever fails, the
        exchange with rank 0 runs to its end and the condition is released."""
        with _STEPS:
            ready = _STEPS.wait_for(lambda: _stepping == 0 and _stepped >= request.get("steps", 0),
                                    timeout=_timeout_s())
            tensors, error = [], ""
            if not ready:
                error = (f"its optimizer had taken {_stepped} step(s) and rank 0's {request.get('steps', 0)}"
                         + (" (a step under way did not finish)" if _stepping else ""))
            else:
                try:
                    tensors = self._tensors(request)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            if error:
                self.store.set(f"{self.base}err{n}/{self.rank}", error)
            self._gather_to_0(torch.tensor([1 if error else 0]))
            failed = torch.zeros(1, dtype=torch.int64)
            self._broadcast_from_0(failed)
            if error or failed.item():
                return
            for t in tensors:
                self._gather_to_0(_to_cpu(t))

    def _tensors(self, request: dict) -> list[torch.Tensor]:
        refs = self.models if request["kind"] == "model" else self.optimizers
        target = _deref(refs[request["index"]]) if request["index"] < len(refs) else None
        if target is None:
            raise AutoMoEError(f"{request['kind']} #{request['index']} does not exist on this rank")
        if request["kind"] == "model":
            return [_local(target.get_parameter(n)) for n in request["names"]]
        return _optimizer_tensors(target, request["items"])

    @staticmethod
    def _index(refs: list, obj, what: str) -> int:
        for i, r in enumerate(refs):
            if _deref(r) is obj:
                return i
        raise AutoMoEError(f"this {what} is not known to AutoMoE's expert parallelism on rank 0")


def _deref(r):
    return r() if isinstance(r, weakref.ref) else r


def _finished(store, base: str) -> None:
    """Rank 0 will not save this service's models any more: the serving ranks may exit."""
    try:
        store.set(base + "finished", "1")
    except Exception:  # the store is gone: nobody waits for the key
        pass


def _serve(ref: "weakref.ref[SaveService]", stop: threading.Event) -> None:
    """The service thread: answers rank 0's requests in order until the service is stopped (at
    exit) or the store is gone."""
    n = 0
    while not stop.is_set():
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
            time.sleep(_POLL_S)
            continue
        n += 1
        try:
            service._answer(n, request)
        except Exception as e:  # the exchange broke off: rank 0's next save says so at once
            try:
                service.store.set(f"{service.base}broken{service.rank}", f"{type(e).__name__}: {e}")
            except Exception:
                pass
            return
        del service


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU, read in the service thread. On a GPU the copy runs on a stream of its own
    after the last optimizer step's kernels: the default stream may hold the next step's work,
    which waits for a collective that rank 0, busy saving, has not joined."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.contiguous()
    stream = _COPY_STREAMS.get(t.device)
    if stream is None:  # (NCCL takes its streams from the low-priority pool)
        stream = _COPY_STREAMS[t.device] = torch.cuda.Stream(device=t.device, priority=-1)
    with torch.cuda.stream(stream):
        if _STEP_DONE is not None:
            stream.wait_event(_STEP_DONE)
        return t.to("cpu").contiguous()


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
    previous = sys.excepthook

    def excepthook(*args):
        global _crashed
        _crashed = True
        previous(*args)

    sys.excepthook = excepthook
    _hooks_installed = True


def _release_finished() -> None:
    """Lets a serving rank's earlier models go once rank 0 has let its own go (called as the next
    model loads, in the main thread, so that their groups are freed here)."""
    for service in list(_SERVING):
        try:
            done = service.store.check([service.base + "finished"])
        except Exception:
            done = True
        if done:
            service.stop()
            _SERVING.discard(service)


def _stop_services() -> None:
    """At exit: rank 0 says it is finished; a serving rank answers until rank 0 is, then stops
    its thread and lets its models go (here, while the interpreter is whole)."""
    import gc

    for service in list(_SERVICES):
        if service.rank == 0:
            _finished(service.store, service.base)
    for service in list(_SERVING):
        if not _crashed:  # (a rank that failed exits at once: torchrun then stops the others)
            service.linger()
        service.stop()
    _SERVING.clear()
    gc.collect()


def _before_step(optimizer, args, kwargs) -> None:
    global _stepping
    with _STEPS:  # (waits while a service thread reads this rank's tensors)
        _stepping += 1
    entry = _OPTIMIZERS.get(optimizer)
    if entry is None or entry[0] != len(_params(optimizer)):
        _adopt(optimizer)


def _after_step(optimizer, args, kwargs) -> None:
    global _STEP_DONE, _stepping, _stepped
    if any(p.is_cuda for p in _params(optimizer)[:1]):
        _STEP_DONE = torch.cuda.Event()
        _STEP_DONE.record()
    with _STEPS:
        _stepping = max(0, _stepping - 1)
        if _experts(optimizer):
            _stepped += 1
        _STEPS.notify_all()


def _experts_of(optimizer) -> dict[int, SaveService]:
    """The optimizer's parameters (by index in its param groups) that are experts under expert
    parallelism, with the service of their model."""
    owners = {}
    for service in list(_SERVICES):
        for ref in service.models:
            model = _deref(ref)
            if model is not None:
                for name, p in model.named_parameters():
                    if name in service.routed:
                        owners[id(p)] = service
    return {i: owners[id(p)] for i, p in enumerate(_params(optimizer)) if id(p) in owners}


def _adopt(optimizer) -> None:
    """An optimizer's first step (or first after add_param_group): if it trains experts under
    expert parallelism, its state_dict gathers them on rank 0 and its load_state_dict keeps this
    rank's part (also of a state loaded before this step, as the Trainer's resume does)."""
    experts = _experts_of(optimizer)
    known = optimizer in _OPTIMIZERS
    _OPTIMIZERS[optimizer] = (len(_params(optimizer)), experts)
    if not experts:
        return
    for service in set(experts.values()):
        if not any(r() is optimizer for r in service.optimizers):
            service.optimizers.append(weakref.ref(optimizer))
    if not (known and getattr(optimizer, "_automoe_ep_hooks", False)):
        optimizer.register_state_dict_post_hook(_full_state)
        optimizer.register_load_state_dict_post_hook(_own_state)
        optimizer._automoe_ep_hooks = True
    _own_state(optimizer)


def _experts(optimizer) -> dict:
    entry = _OPTIMIZERS.get(optimizer)
    return entry[1] if entry else {}


def _full_state(optimizer, state_dict: dict) -> dict:
    """Optimizer.state_dict on rank 0: each expert moment with one row per expert ([E, ...] or
    [E, ...] of another trailing shape, as Adafactor's factors) gathered from the EP group, on the
    CPU, as one process holding every expert would save it."""
    by_service: dict[SaveService, list[tuple[int, str]]] = {}
    for i, service in _experts(optimizer).items():
        if service.rank != 0:
            continue
        for key, value in state_dict["state"].get(i, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and _local(value).shape[0] == service.count:
                by_service.setdefault(service, []).append((i, key))
    states = dict(state_dict["state"])
    for service, items in by_service.items():
        for (i, key), full in zip(items, service.gather_optimizer(optimizer, items)):
            states[i] = {**states[i], key: full}
    return {**state_dict, "state": states}


def _own_state(optimizer) -> None:
    """Keeps this rank's rows of every expert moment with one row per expert of the model (a state
    loaded from a checkpoint that rank 0 wrote), a DTensor shard for a DTensor parameter."""
    from torch.distributed.tensor import DTensor, Shard

    params = _params(optimizer)
    for i, service in _experts(optimizer).items():
        p = params[i]
        state = optimizer.state.get(p)
        if not state:
            continue
        for key, value in list(state.items()):
            if (not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0
                    or value.shape[0] != service.count * service.ep):
                continue
            mine = value[service.begin:service.begin + service.count].to(_local(p).device).clone()
            if isinstance(p, DTensor):
                mine = DTensor.from_local(mine, p.device_mesh, [Shard(0)], run_check=False, shape=value.shape,
                                          stride=value.stride())
            state[key] = mine
