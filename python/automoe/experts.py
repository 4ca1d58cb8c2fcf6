"""Transformers' experts interface on AutoMoE's kernels.

Every MoE type in Transformers v5 holds its routed experts in one module registered through
`transformers.integrations.moe.use_experts_implementation`: 3-D weights (`gate_up_proj` [E, 2I, H]
or, without a gate, `up_proj` [E, I, H]; `down_proj` [E, H, I]; both transposed when the class
says `is_transposed`), optional per-expert biases, and what runs between the two projections
(`_apply_gate` on the gate/up output, or `act_fn` without a gate). Its forward takes
hidden_states [T, H], top_k_index [T, K] and top_k_weights [T, K].

`forward` runs any such module on AutoMoE's kernels: the permute plan, the permute, our grouped
GEMM for both projections (a transposed weight is read in place through its transposed view),
the biases added per row's expert, the weighted unpermute. Between the projections runs AutoMoE's
fused SwiGLU where the module's gate is exactly one it implements (Transformers' default gate with
SiLU; GPT-OSS's clamped, interleaved gate), and the module's own `_apply_gate` / `act_fn` (ATen)
otherwise — so the result is the module's, whatever its layout or activation. `layout_of` says
which, for `model.automoe_accelerated`.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automoe import _engine
from automoe.arguments import AutoMoEError

_engine.load()  # registers torch.ops.automoe
OPS = torch.ops.automoe


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` is registered through Transformers' experts interface."""
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate")


def source_body(fn: Any) -> str | None:
    """A function's source without its signature, comments and blank lines (None: no source)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    lines = src.strip().splitlines()
    return "\n".join(s for line in lines[1:] if (s := line.strip()) and not s.startswith("#"))


@functools.cache
def _gpt_oss_gate_body() -> str | None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return source_body(GptOssExperts._apply_gate)


def _is_silu(act: Any) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (SiLUActivation, nn.SiLU)) or act is torch.nn.functional.silu


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module's weights are stored and what runs between its projections."""

    gated: bool        # gate_up_proj (then _apply_gate), else up_proj (then act_fn)
    transposed: bool   # [E, in, out] instead of [E, out, in]
    biased: bool       # per-expert biases on both projections
    activation: str    # "swiglu" / "gpt_oss": AutoMoE's fused op; "module": the module's own

    def describe(self) -> str:
        parts = ["gated" if self.gated else "no gate"]
        if self.transposed:
            parts.append("transposed")
        if self.biased:
            parts.append("biases")
        parts.append({"swiglu": "fused SwiGLU", "gpt_oss": "fused clamped SwiGLU (GPT-OSS)",
                      "module": "the module's own activation in ATen"}[self.activation])
        return ", ".join(parts)


def _activation_of(module: nn.Module) -> str:
    from transformers.integrations.moe import _default_apply_gate

    if not module.has_gate:
        return "module"
    gate = type(module)._apply_gate
    if gate is _default_apply_gate and _is_silu(getattr(module, "act_fn", None)):
        return "swiglu"
    if (_is_gpt_oss_gate(gate) and isinstance(getattr(module, "alpha", None), float)
            and isinstance(getattr(module, "limit", None), float)):
        return "gpt_oss"
    return "module"


@functools.cache
def _is_gpt_oss_gate(gate: Any) -> bool:
    """Whether an `_apply_gate` is GPT-OSS's (its source read once per function)."""
    return source_body(gate) == _gpt_oss_gate_body()


class ExpertParallelRuntime:
    """What an experts module under expert parallelism (automoe.fallback_parallel) runs with: the
    engine's dispatcher over its EP group, the world size and the data-parallel group of the
    gradient rule. A copy of the model (copy.deepcopy: TRL's reference model) shares it."""

    def __init__(self, dispatcher, world: int, dp_group):
        self.dispatcher, self.world, self.dp_group = dispatcher, world, dp_group

    def __deepcopy__(self, memo):
        return self


class _AverageOverReplicas(torch.autograd.Function):
    """Identity forward; the backward divides the gradient by the world size and sums it over the
    data-parallel replicas holding the same experts — the expert-parallel gradient rule
    (automoe.native_parallel._ExpertParallel), inside the graph, so that it survives what replaces
    a parameter's tensor (Module.to / accelerate swap DTensor parameters, dropping their hooks)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, world: int, dp_group) -> torch.Tensor:
        ctx.world, ctx.dp_group = world, dp_group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad / ctx.world
        if ctx.dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(grad, group=ctx.dp_group)
        return grad, None, None


def _stored(module: nn.Module) -> list:
    """[first projection, down projection, their biases (None without)] as the module stores them."""
    first = "gate_up_proj" if module.has_gate else "up_proj"
    names = [first, "down_proj"] + ([f"{first}_bias", "down_proj_bias"] if module.has_bias else [])
    missing = [n for n in names if not isinstance(getattr(module, n, None), torch.Tensor)]
    if missing:
        raise AutoMoEError(f"{type(module).__name__}: an experts module (Transformers' experts interface, "
                           f"has_gate={module.has_gate}, has_bias={module.has_bias}) without {missing}")
    got = [getattr(module, n) for n in names]
    return got + [None] * (4 - len(got))


def _weights(module: nn.Module, layout: ExpertsLayout, dtype: torch.dtype) -> tuple:
    """The weights as the GEMMs take them: this rank's experts (a DTensor's local shard, with the
    expert-parallel gradient rule attached), [E, out, in] (a transposed store through its view),
    in the GEMMs' dtype; the biases as stored."""
    runtime = getattr(module, "_automoe_ep_runtime", None)
    got = []
    for t in _stored(module):
        if isinstance(t, DTensor):
            if runtime is None:
                raise AutoMoEError(f"{type(module).__name__}: experts sharded by Transformers' own tensor / expert "
                                   "parallelism (tp_plan, distributed_config) do not run on AutoMoE's experts; "
                                   "load with from_pretrained(..., ep_size=N) instead")
            t = t.to_local()
            if t.requires_grad and torch.is_grad_enabled():
                t = _AverageOverReplicas.apply(t, runtime.world, runtime.dp_group)
        got.append(t)
    w_first, w_down, b_first, b_down = got
    if layout.transposed:  # our grouped GEMM takes [E, out, in]: the transposed view, read in place
        w_first, w_down = w_first.transpose(1, 2), w_down.transpose(1, 2)
    return w_first.to(dtype), w_down.to(dtype), b_first, b_down


def layout_of(module: nn.Module) -> ExpertsLayout:
    """The layout of an experts module; AutoMoEError when its weights are not the interface's."""
    w_first, w_down = _stored(module)[:2]
    if w_first.dim() != 3 or w_down.dim() != 3 or w_first.shape[0] != w_down.shape[0]:
        raise AutoMoEError(f"{type(module).__name__}: expert weights of shapes {tuple(w_first.shape)} and "
                           f"{tuple(w_down.shape)}, not [E, out, in] / [E, in, out]")
    return ExpertsLayout(gated=bool(module.has_gate), transposed=bool(module.is_transposed),
                         biased=bool(module.has_bias), activation=_activation_of(module))


def _activate(module: nn.Module, layout: ExpertsLayout, h: torch.Tensor) -> torch.Tensor:
    if layout.activation == "swiglu":
        return OPS.swiglu(h)
    if layout.activation == "gpt_oss":
        return OPS.swiglu(h, "gpt_oss", float(module.alpha), float(module.limit))
    return module._apply_gate(h) if layout.gated else module.act_fn(h)


def experts_on_rows(module: nn.Module, layout: ExpertsLayout, weights: tuple, x_NH: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    """The experts of `module` on rows grouped by expert: rows [offsets[e], offsets[e+1]) run
    expert e, with `weights` from `_weights` (the GEMMs in their dtype). Unweighted outputs [N, H]."""
    w_first, w_down, b_first, b_down = weights
    if b_first is not None:  # the expert of each row
        counts = offsets[1:] - offsets[:-1]
        expert_N = torch.repeat_interleave(torch.arange(w_first.shape[0], device=offsets.device), counts,
                                           output_size=x_NH.shape[0])
    h = OPS.grouped_gemm(x_NH.to(w_first.dtype), w_first, offsets)
    if b_first is not None:
        h = h + b_first.index_select(0, expert_N)
    h = _activate(module, layout, h)
    y = OPS.grouped_gemm(h.to(w_down.dtype), w_down, offsets)
    if b_down is not None:
        y = y + b_down.index_select(0, expert_N)
    return y


def forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Transformers' experts interface on AutoMoE's kernels: hidden_states [T, H], top_k_index /
    top_k_weights [T, K] -> [T, H] in hidden_states' dtype. Under expert parallelism
    (`automoe.fallback_parallel`) the module's dispatcher takes the rows to the ranks holding their
    experts, which run them here, and brings the results back."""
    layout = layout_of(module)
    x = hidden_states
    device = x.device.type
    mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x = x.to(mm)  # under autocast the GEMMs run in its dtype, as F.linear would run them
    weights = _weights(module, layout, mm)  # (once, however many pieces the dispatcher runs)
    runtime = getattr(module, "_automoe_ep_runtime", None)
    if runtime is not None:
        routing = top_k_weights if top_k_weights.dtype == mm else top_k_weights.float()
        out = runtime.dispatcher.run(x, top_k_index, routing, lambda x_NH, offsets: experts_on_rows(
            module, layout, weights, x_NH, offsets).to(mm))
        return out.to(hidden_states.dtype)
    offsets, slot_pos, src_token = OPS.moe_permute_plan(top_k_index, weights[0].shape[0])
    y = experts_on_rows(module, layout, weights, OPS.permute(x, offsets, slot_pos, src_token), offsets)
    routing = top_k_weights if top_k_weights.dtype == y.dtype else top_k_weights.float()
    out = OPS.unpermute(y, offsets, slot_pos, src_token, routing)
    return out.to(hidden_states.dtype)
