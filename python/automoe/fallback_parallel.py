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
- save_pretrained: rank 0 writes with Transformers' own writer, the other ranks' experts gathered
  by the save service (automoe.ep_checkpoint), so the checkpoint is the one a single process
  writes; the Transformers Trainer, which saves from rank 0 alone, works unchanged.
"""

from __future__ import annotations

import functools
import os
import sys
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


def _refuse_peft_on_sharded_experts(model) -> None:
    """PEFT's LoRA on the sharded experts (target_parameters) is refused by name: PEFT's
    parametrization adds a whole [E, ...] tensor to the DTensor expert, which torch refuses with an
    error about mixed tensors."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import ParamWrapper
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper) and isinstance(module.get_param(), DTensor):
            raise AutoMoEError(
                f"{name}: PEFT LoRA on the routed experts (target_parameters) of Transformers' "
                f"{type(model).__name__} under expert parallelism (ep_size) is not supported; the "
                "AutoMoE engine's model types run it (docs/lora.md), or adapt only the linear "
                "layers (target_modules) here")


def _checked_forward(forward):
    """Transformers' forward (its signature kept: the Trainer reads it), after the PEFT check."""

    @functools.wraps(forward)
    def checked(self, *args, **kwargs):
        _refuse_peft_on_sharded_experts(self)
        return forward(self, *args, **kwargs)

    return checked


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
        clone = copy._reconstruct(self, memo, *self.__reduce_ex__(4))
        self._automoe_ep.service.add_model(clone)  # (every rank copies it, in the same order)
        return clone

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Module.load_state_dict; also of a state dict named as on disk (what the Trainer's
        resume_from_checkpoint reads back from the files save_pretrained wrote, where Transformers
        reverted its weight conversions): those go through Transformers' own conversions and
        loader, which reads this rank's experts of each tensor."""
        own = self.state_dict(keep_vars=True)
        if all(k in own for k in state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.nn.modules.module import _IncompatibleKeys
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(self), dtype=self.dtype)
        info, _ = convert_and_load_state_dict_in_model(self, dict(state_dict), config)
        keys = _IncompatibleKeys(sorted(info.missing_keys), sorted(info.unexpected_keys))
        problems = {**({"missing": keys.missing_keys} if keys.missing_keys else {}),
                    **({"unexpected": keys.unexpected_keys} if keys.unexpected_keys else {}),
                    **({"mismatched": sorted(map(str, info.mismatched_keys))} if info.mismatched_keys else {}),
                    **({"conversion errors": sorted(info.conversion_errors)} if info.conversion_errors else {})}
        if strict and problems:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: {problems}")
        return keys

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
        """Rank 0 writes the whole checkpoint with Transformers' writer, the other ranks' experts
        gathered through the save service (automoe.ep_checkpoint), so the files equal a one-process
        save. Rank 0 alone may call it (the Transformers Trainer does); another rank's call returns
        once rank 0 has written the directory."""
        from torch.distributed.tensor import DTensor

        if kwargs.pop("state_dict", None) is not None:
            raise ValueError("save_pretrained(state_dict=...) under expert parallelism: the model gathers its "
                             "own experts; save without state_dict")
        service = self._automoe_ep.service
        directory = os.fspath(save_directory)
        if service.rank != 0:
            service.wait_saved(directory)
            return
        service.saving(directory)
        try:
            state = self.state_dict()
            full = service.gather_model(self, [n for n, t in state.items() if isinstance(t, DTensor)])
            state = {n: full.get(n, t) for n, t in state.items()}
            super().save_pretrained(save_directory, *args, state_dict=state, **kwargs)
        except Exception as e:  # the other ranks' calls fail alike
            service.saved(directory, f"{type(e).__name__}: {e}")
            raise
        service.saved(directory)


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
                "forward": _checked_forward(model_cls.forward),
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
