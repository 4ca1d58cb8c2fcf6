"""Expert parallelism on the drop-in (from_pretrained(ep_size=N)): `expert_parallel_world`, this
rank's place in the mesh over torch.distributed's world; `_ExpertParallel`, the ranks a
model's experts are spread over (the experts' gradient hook, DDP's ignore list, the save
service), and `_ExpertParallelModel`, the causal LM's methods that change under it
(`automoe_parallel`, `clip_grad_norm_`, `generate`)."""

from __future__ import annotations

import functools

import torch

from automoe.arguments import AutoMoEError


def expert_parallel_world(ep_size, device: torch.device | None):
    """from_pretrained(ep_size=N): this rank's place in the mesh world = dp x ep over the
    torch.distributed world the user initialised, as the engine's arguments (None: one process
    holds every expert)."""
    if ep_size is None:
        return None
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"from_pretrained(ep_size={ep_size!r}): expected a positive integer")
    if ep_size == 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise AutoMoEError(
            f"from_pretrained(ep_size={ep_size}): expert parallelism needs torch.distributed initialised "
            "first: launch with torchrun and call torch.distributed.init_process_group() before "
            "from_pretrained (as for DistributedDataParallel); see docs/parallelism.md")
    world = dist.get_world_size()
    if world % ep_size:
        raise ValueError(f"from_pretrained(ep_size={ep_size}): does not divide the {world} processes of "
                         "torch.distributed's world (world = data-parallel replicas x ep_size)")
    backend = dist.get_backend()
    if backend == "nccl":
        current = torch.cuda.current_device()
        if device is None or device.type != "cuda" or device.index not in (None, current):
            raise ValueError(f"from_pretrained(ep_size={ep_size}): the process group is NCCL, whose "
                             f"collectives run on this rank's current GPU (cuda:{current}): load with "
                             "device_map='cuda' or 'auto' after torch.cuda.set_device(LOCAL_RANK), "
                             f"not {device}")
        collective = f"cuda:{current}"
    else:
        if device is not None and device.type != "cpu":
            raise ValueError(f"from_pretrained(ep_size={ep_size}): the process group is {backend}; "
                             f"expert parallelism on {device} needs NCCL")
        collective = "cpu"
    from automoe import distributed

    ep_group, dp_group = distributed.mesh_groups(ep_size)
    return {"world_group": dist.group.WORLD.group_name,
            "ep_group": ep_group.group_name if ep_group else "",
            "dp_group": dp_group.group_name if dp_group else "",
            "world_size": str(world), "ep": str(ep_size), "device": collective,
            "_groups": (ep_group, dp_group)}


class _ExpertParallel:
    """A model whose experts are spread over the ranks (from_pretrained(ep_size=N)): the
    gradients of this rank's experts are averaged over the world as DistributedDataParallel
    averages the dense ones (DDP skips the experts: `_ddp_params_and_buffers_to_ignore`).

    The dispatcher's backward brings each expert the gradient of every loss of its EP group; the
    hook sums that over the data-parallel replicas holding the same experts and divides by the
    world size. So under DDP (each rank its own batch) the experts get the gradient of the mean
    loss, as the dense weights do, and ranks that all feed the same batch without DDP get exactly
    the one-process gradients."""

    loaded = 0  # models loaded with ep_size in this process (the same order on every rank)

    def __init__(self, info: dict, routed: list[str], groups):
        self.info = info
        self.routed = set(routed)
        self.ep_group, self.dp_group = groups
        _ExpertParallel.loaded += 1
        self.serial = _ExpertParallel.loaded
        from automoe.ep_checkpoint import SaveService

        self.service = SaveService(self)  # (collective: every rank loads the model)

    def __deepcopy__(self, memo):
        return self  # a copy of the model shares the ranks and their groups

    def attach(self, model, names: list[str], hook: bool = True) -> None:
        """Makes the causal LM `model` (and its backbone) run on these ranks: DDP's ignore list and
        (`hook`) the gradient hook on this rank's experts."""
        base, prefix = model.base_model, model.base_model_prefix + "."
        model._automoe_ep = base._automoe_ep = self
        self.service.add_model(model)
        # DistributedDataParallel (Trainer, accelerate) all-reduces what it does not ignore:
        # each rank's experts are its own, their gradients are averaged by the hook below.
        # (The causal LM's list is _ExpertParallelModel's property: the names as they are when
        # DDP wraps it, a PEFT model around it included.)
        base._ddp_params_and_buffers_to_ignore = sorted(
            n[len(prefix):] for n in self.routed if n.startswith(prefix))
        if hook:
            self.hook(names, [model.get_parameter(n) if n in self.routed else None for n in names])

    def hook(self, names: list[str], params: list) -> None:
        """The gradient rule on each of this rank's experts; a DTensor expert (the engine's tensor is
        its local shard) also gets the gradient the engine accumulates into that shard as its own
        (DTensor) gradient."""
        from torch.distributed.tensor import DTensor

        for name, p in zip(names, params):
            if p is None or name not in self.routed:
                continue
            local = p._local_tensor if isinstance(p, DTensor) else p
            if getattr(local, "_automoe_ep_hooked", False) or not local.requires_grad:
                continue  # (a frozen expert is hooked once it requires gradients)
            if local is not p:
                # After each accumulation, not on the gradient on its way (a tensor hook): under
                # gradient checkpointing the engine's recomputation takes the experts' gradients
                # with autograd.grad, whose captured gradients pass the tensor hooks too.
                local.register_post_accumulate_grad_hook(functools.partial(_grad_to_dtensor, p, self._average))
            else:
                local.register_hook(self._average)
            local._automoe_ep_hooked = True

    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad / self.info["world_size"]
        if self.dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(grad, group=self.dp_group)
        return grad


def expert_adapter_rows(group, begin: int, count: int, ep: int, factors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's experts' rows of PEFT's expert adapters under expert parallelism: `factors`
    ([E, ...] views of the LoRA factors, every rank holding all E — PEFT makes them replicated,
    dense parameters) cut to [expert_begin, expert_begin + expert_count), for the engine.

    In the backward the rows' gradient returns as the whole factor's: summed over the EP group
    (each rank filled its own rows) and divided by ep. So under DistributedDataParallel (the
    Trainer, accelerate), which averages the adapters as dense parameters over the world, an
    expert's adapter gets the replicas' summed gradient over the world size — the experts' rule —
    and ranks that all feed the same batch without DDP get the one-process gradient on every rank.
    One collective per call, in the backward (where the dispatcher's run). `group`: the EP group,
    whose rank r holds the experts [begin, begin + count), r = begin / count, of ep · count."""
    return list(_ExpertAdapterRows.apply(group, begin, count, ep, *factors))


class _ExpertAdapterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, begin, count, ep, *factors):
        ctx.group, ctx.begin, ctx.count, ctx.ep = group, begin, count, ep
        ctx.shapes = [(f.shape, f.dtype, f.device) for f in factors]
        return tuple(f[begin:begin + count] for f in factors)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        full = []
        for g, (shape, dtype, device) in zip(grads, ctx.shapes):
            t = torch.zeros(shape, dtype=dtype, device=device)
            if g is not None:
                t[ctx.begin:ctx.begin + ctx.count] = g
            full.append(t)
        flat = torch.cat([t.reshape(-1) for t in full])
        dist.all_reduce(flat, group=ctx.group)
        flat /= ctx.ep
        out, at = [], 0
        for t in full:
            out.append(flat[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return (None, None, None, None, *out)


def sharded_parameter(local: torch.Tensor, mesh) -> torch.Tensor:
    """A DTensor parameter sharded on dim 0 over `mesh` (the EP group) whose local shard is the
    tensor `local` itself (the engine's, which its forward reads and its backward fills): so the
    Transformers Trainer's clipping, optimizers and torch's DTensor-aware code see the experts as
    the parts of one [E, ...] tensor, as on Transformers' model under ep_size."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    shape = (local.shape[0] * mesh.size(), *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    param = nn.Parameter(DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False, shape=shape,
                                            stride=stride), requires_grad=local.requires_grad)
    param._local_tensor = local
    return param


def _grad_to_dtensor(param, average, local: torch.Tensor) -> None:
    """After the backward accumulated into an expert's local shard: that gradient, under the
    experts' rule (`average`), becomes (is added to) the DTensor parameter's. (The parameter is
    held strongly: torch.utils.swap_tensors, which Module.to uses on DTensor parameters, refuses
    a tensor that has weak references.)"""
    from torch.distributed.tensor import DTensor

    grad = local.grad
    local.grad = None
    if grad is None:
        return
    grad = average(grad)
    if param.grad is None:
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    else:
        param.grad._local_tensor.add_(grad)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (Transformers' model under expert
    parallelism holds its experts as DTensors), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


_WRAPPER_PREFIXES = ("", "base_model.model.", "model.", "pretrained_model.", "_orig_mod.")


class _ExpertParallelModel:
    """The causal LM's methods that expert parallelism changes."""

    def __deepcopy__(self, memo):
        """copy.deepcopy (TRL's reference model): torch cannot copy a DTensor parameter, so each
        expert is copied as a DTensor over a copy of its local shard; the rest as usual. The copy
        runs on the same ranks and groups."""
        import copy

        from torch.distributed.tensor import DTensor

        for p in self.parameters():
            if isinstance(p, DTensor) and id(p) not in memo:
                local = torch.nn.Parameter(p._local_tensor.detach().clone(), requires_grad=p.requires_grad)
                memo[id(p)] = sharded_parameter(local, p.device_mesh)
        clone = copy._reconstruct(self, memo, *self.__reduce_ex__(4))
        if self._automoe_ep is not None:
            self._automoe_ep.service.add_model(clone)  # (every rank copies it, in the same order)
        return clone

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """DistributedDataParallel's ignore list: this rank's experts (its own, averaged by the
        experts' hook), named as they are now — also inside PEFT's wrappers (`experts.base_layer.`)
        and as seen from the wrappers DDP reads this attribute through: a PeftModel
        (`base_model.model.`), PEFT's LoraModel (`model.`), TRL's value head (`pretrained_model.`),
        torch.compile (`_orig_mod.`)."""
        names = list(self.__dict__.get("_automoe_ddp_ignore", ()))
        ep = self.__dict__.get("_automoe_ep")
        if ep is not None:
            for name, _ in self.named_parameters(remove_duplicate=False):
                if name.replace(".base_layer", "") in ep.routed:
                    names += [prefix + name for prefix in _WRAPPER_PREFIXES]
        return sorted(set(names))

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names) -> None:
        self.__dict__["_automoe_ddp_ignore"] = list(names)

    @property
    def automoe_parallel(self) -> dict | None:
        """Expert parallelism (from_pretrained(ep_size=N)): this rank, the mesh and the experts
        it holds; None when one process holds every expert."""
        return None if self._automoe_ep is None else dict(self._automoe_ep.info)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Module.load_state_dict, also from a one-process state dict (the Trainer's
        load_best_model_at_end, a checkpoint read back): under expert parallelism an expert tensor
        of the full [E, ...] shape is cut to this rank's experts."""
        if self._automoe_ep is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from torch.distributed.tensor import DTensor

        info, own = self._automoe_ep.info, self.state_dict(keep_vars=True)
        begin, count = info["expert_begin"], info["expert_count"]
        cut = {}
        for name, value in state_dict.items():
            param = own.get(name)
            full = (name in self._automoe_ep.routed and param is not None and not isinstance(value, DTensor)
                    and value.dim() > 0 and value.shape[0] == count * info["ep"])
            if full:
                value = value[begin:begin + count]
                if isinstance(param, DTensor):  # (Transformers' model: the experts are DTensors)
                    value = DTensor.from_local(value.to(param.dtype), param.device_mesh, param.placements,
                                               run_check=False, shape=param.shape, stride=param.stride())
            cut[name] = value
        return super().load_state_dict(cut, strict=strict, assign=assign)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this model's parameters; returns the total norm.
        Under expert parallelism it is the norm of the whole model's gradient — each rank's
        experts' part summed over its EP group, the dense part once — the same on every rank (as
        FSDP's clip_grad_norm_), so the ranks clip alike. torch.nn.utils.clip_grad_norm_ on the
        parameters would see only this rank's experts and clip each rank differently."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self._automoe_ep is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): under expert parallelism AutoMoE "
                             "computes the 2-norm")
        import torch.distributed as dist

        routed = self._automoe_ep.routed
        dense, experts = [], []
        for name, p in self.named_parameters():
            if p.grad is not None:
                (experts if name in routed else dense).append(p.grad)

        device = torch.device(self._automoe_ep.info["device"])

        def squares(grads):  # float64 sum of squares, on the collectives' device
            out = torch.zeros((), dtype=torch.float64, device=device)
            for g in grads:
                out += torch.linalg.vector_norm(_local(g.detach()), dtype=torch.float64).to(device) ** 2
            return out

        sq_experts = squares(experts)
        if self._automoe_ep.ep_group is not None:
            dist.all_reduce(sq_experts, group=self._automoe_ep.ep_group)
        total = (squares(dense) + sq_experts).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for p in params:
            _local(p.grad.detach()).mul_(coef.to(p.grad.device))
        return total

    def generate(self, *args, **kwargs):
        """Transformers' generate; under expert parallelism every rank runs a forward at every step
        until all ranks are done (synced_gpus, as under FSDP), since each forward exchanges
        tokens with the other ranks."""
        if self._automoe_ep is not None:
            if kwargs.get("synced_gpus") is False:
                raise ValueError("generate(synced_gpus=False): under expert parallelism every rank "
                                 "must run every step's forward")
            kwargs["synced_gpus"] = True
        return super().generate(*args, **kwargs)
