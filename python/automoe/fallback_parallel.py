"""Expert parallelism on Transformers' own model: from_pretrained(path, ep_size=N) for every MoE
type whose experts use Transformers' experts interface (the types the engine does not run
natively, and native ones with force_transformers=True).

- Loading: the model class gets one hook, `maybe_distribute_model` (Transformers calls it after
  building the model on the meta device and before reading any weight): every parameter of every
  experts module becomes a DTensor sharded on its expert dimension over this rank's EP group
  (`Shard(0)` on a 1-D DeviceMesh). Transformers' loader then reads only this rank's E/N experts
  from disk (byte ranges of a stacked tensor; only the owned files' tensors of a per-expert
  checkpoint), through its own weight conversions, whatever the type.
- Forward: each experts module runs through the engine's dispatcher (`_C.ExpertDispatcher`: the
  `alltoall` / `alltoall_overlap` / `allgather` exchanges the native path uses) with this rank's
  experts on AutoMoE's kernels (`automoe.experts.experts_on_rows`) as the local step.
- Gradients: as on the native path (`automoe.native_parallel._ExpertParallel`): DDP ignores the
  experts, whose gradients are averaged over the world — inside the forward's graph
  (`experts._AverageOverReplicas`), not by a hook on the parameter, which Module.to or accelerate
  may replace; `clip_grad_norm_` and the
  Transformers Trainer's own clipping of DTensor gradients (`_mixed_mesh_grad_norm`) take the norm
  of the whole model, the same on every rank.
- save_pretrained: collective (every rank calls it; a rank that does not is reported by name
  instead of a hang); the experts are gathered and rank 0 writes with Transformers' own writer,
  so the checkpoint is the one a single process writes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from automoe import _engine, experts
from automoe.arguments import AutoMoEError, device_of
from automoe.native_parallel import _ExpertParallel, _ExpertParallelModel, expert_parallel_world

_C = _engine.load()


def _shard_experts(model: nn.Module, mesh, dispatcher_kind: str, ep: int, world: int, dp_group) -> list[str]:
    """Turns every experts module's parameters into DTensors sharded over `mesh` on dim 0 and
    gives the module what it runs with (experts.ExpertParallelRuntime); returns the sharded
    parameters' names."""
    from torch.distributed.tensor import Shard, distribute_tensor

    group = mesh.get_group().group_name
    dispatchers: dict[int, Any] = {}
    names = []
    for module_name, module in model.named_modules():
        if not experts.is_experts_module(module):
            continue
        num = (module.gate_up_proj if module.has_gate else module.up_proj).shape[0]
        if num % ep:
            raise ValueError(f"from_pretrained(ep_size={ep}): {module_name} ({type(module).__name__}) has "
                             f"{num} experts, which do not split evenly over {ep} ranks")
        for pname, p in list(module._parameters.items()):
            if p is None or p.dim() == 0 or p.shape[0] != num:
                continue
            module._parameters[pname] = nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None),
                                                     requires_grad=p.requires_grad)
            names.append(f"{module_name}.{pname}")
        if num not in dispatchers:
            dispatchers[num] = _C.ExpertDispatcher(dispatcher_kind, group, num)
        module._automoe_ep_runtime = experts.ExpertParallelRuntime(dispatchers[num], world, dp_group)
    if not names:
        raise AutoMoEError(f"from_pretrained(ep_size={ep}): {type(model).__name__} ({model.config.model_type}) has "
                           "no experts module that uses Transformers' experts interface; expert parallelism "
                           "shards those modules' experts")
    return names


class _ExpertParallelTransformersModel(_ExpertParallelModel):
    """Transformers' causal LM with its experts spread over the ranks (a subclass made per load,
    named as Transformers' class)."""

    _automoe_ep: _ExpertParallel | None = None

    def __deepcopy__(self, memo):
        """copy.deepcopy (TRL's reference model): torch cannot copy a DTensor parameter, so each
        expert parameter is copied as a DTensor of a copy of its local shard; the rest as usual.
        The copy runs on the same ranks, groups and dispatchers."""
        import copy

        from torch.distributed.tensor import DTensor

        for p in self.parameters():
            if isinstance(p, DTensor) and id(p) not in memo:
                local = DTensor.from_local(p.to_local().detach().clone(), p.device_mesh, p.placements,
                                           run_check=False, shape=p.shape, stride=p.stride())
                memo[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
        return copy._reconstruct(self, memo, *self.__reduce_ex__(4))

    def set_experts_implementation(self, experts_implementation):
        """Only "automoe" (fallback.EXPERTS_IMPLEMENTATION): under expert parallelism the experts run
        AutoMoE's forward, whose dispatcher exchanges the tokens."""
        values = (experts_implementation.values() if isinstance(experts_implementation, dict)
                  else [experts_implementation])
        if any(v != "automoe" for v in values):
            raise ValueError(f"set_experts_implementation({experts_implementation!r}): under expert parallelism "
                             "(ep_size) the experts run AutoMoE's experts with the engine's dispatcher; load "
                             "without ep_size to switch them")
        return super().set_experts_implementation(experts_implementation)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Collective: every rank calls it. The experts are gathered (one tensor at a time) and rank 0
        writes the whole checkpoint with Transformers' writer; every rank returns once it is written."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        ep = self._automoe_ep
        ep.meet_to_save(os.fspath(save_directory))
        if kwargs.get("state_dict") is not None:
            raise ValueError("save_pretrained(state_dict=...) under expert parallelism: the model gathers its "
                             "own experts; save without state_dict")
        writer = ep.info["rank"] == 0
        state = {}
        for name, t in self.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if writer:  # (on the CPU: a GPU holds one gathered tensor at a time)
                state[name] = full.cpu() if isinstance(t, DTensor) else full
        error = None
        if writer:
            try:
                super().save_pretrained(save_directory, *args, state_dict=state, **kwargs)
            except Exception as e:  # every rank fails alike
                error = e
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
        if error is not None:
            raise error
        if failed[0]:
            raise AutoMoEError(f"save_pretrained({os.fspath(save_directory)!r}): rank 0 failed to write the "
                               "checkpoint (its error is in its log)")


def load(model_cls, pretrained_model_name_or_path, *model_args, ep_size: int, dispatcher: str,
         device_map=None, **kwargs):
    """Transformers' `model_cls.from_pretrained` with this rank's share of the experts."""
    for key in ("tp_plan", "tp_size", "distributed_config", "device_mesh"):
        if kwargs.get(key) is not None:
            raise ValueError(f"from_pretrained(ep_size={ep_size}, {key}=...): AutoMoE's expert parallelism "
                             "shards the experts itself; Transformers' tensor / expert parallelism is not combined "
                             "with it")
    if dispatcher == "local":
        raise ValueError(f"from_pretrained(ep_size={ep_size}): backend dispatcher 'local' runs every expert in "
                         "this process; use 'auto', 'alltoall', 'alltoall_overlap' or 'allgather'")
    device = device_of(device_map, ep_size)
    info = expert_parallel_world(ep_size, device)
    ep_group, dp_group = info.pop("_groups")
    world = int(info["world_size"])
    info = {"rank": torch.distributed.get_rank(), "world_size": world, "ep": ep_size, "dp": world // ep_size,
            "device": info["device"]}
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(ep_group, "cuda" if info["device"].startswith("cuda") else "cpu")
    kind = "alltoall" if dispatcher == "auto" else dispatcher
    routed: list[str] = []

    def maybe_distribute_model(cls, model, distributed_config, device_mesh):
        routed.extend(_shard_experts(model, mesh, kind, ep_size, world, dp_group))
        return model

    sub = type(model_cls.__name__, (_ExpertParallelTransformersModel, model_cls),
               {"maybe_distribute_model": classmethod(maybe_distribute_model),
                "__module__": model_cls.__module__, "__qualname__": model_cls.__qualname__})
    if device is not None:
        kwargs["device_map"] = device
    model, info_ = sub.from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True,
                                       **kwargs)
    num = next(m for m in model.modules() if experts.is_experts_module(m)).down_proj.shape[0]
    count = num // ep_size
    info.update(expert_begin=(info["rank"] % ep_size) * count, expert_count=count)
    parallel = _ExpertParallel(info, routed, (ep_group, dp_group))
    # (the gradient rule runs in the experts' forward: experts._AverageOverReplicas)
    parallel.attach(model, [n for n, _ in model.named_parameters()], hook=False)
    return model, info_
