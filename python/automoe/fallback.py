"""Transformers' own model, with AutoMoE's kernels: the path for MoE types the engine does not
implement natively (Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5, GraniteMoE, ...).

- Experts: AutoMoE's fused experts (router output -> permute -> grouped GEMM -> SwiGLU, or relu2
  for experts without a gate projection such as Nemotron-H's -> grouped GEMM -> weighted
  unpermute, `torch.ops.automoe.moe_experts`) registered in Transformers' `ExpertsInterface` as
  "automoe" and selected through `experts_implementation`, so every v5 MoE model whose experts use
  that interface runs them without any change to its modeling file. Experts modules our kernel
  does not cover (biases, transposed or interleaved weights, a custom gate such as GPT-OSS's
  clamped SwiGLU, another activation) run Transformers' own `grouped_mm` path; the load report
  says which.
- RMSNorm: modules whose forward is exactly Transformers' standard RMSNorm (float32 statistics,
  `weight * normed.to(input dtype)`) run AutoMoE's fused kernel (`torch.ops.automoe.rmsnorm`).
- Everything else (attention, router, dense MLPs, loss) is Transformers' code.
"""

from __future__ import annotations

import functools
import inspect
import logging
import textwrap
from typing import Any

import torch
from torch import nn

from automoe import _engine
from automoe.arguments import AutoMoEError
from automoe.backend import BackendConfig

_engine.load()  # registers torch.ops.automoe
logger = logging.getLogger("automoe")

EXPERTS_IMPLEMENTATION = "automoe"


def _is_silu(act: Any) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (SiLUActivation, nn.SiLU)) or act is torch.nn.functional.silu


def _is_relu2(act: Any) -> bool:
    from transformers.activations import ReLUSquaredActivation

    return isinstance(act, ReLUSquaredActivation)


def experts_supported(experts: nn.Module) -> str | None:
    """None when AutoMoE's fused experts compute exactly what `experts` computes; else why not."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(experts, "has_gate", False):  # up_proj [E, I, H] then act then down_proj
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
            return "experts without a gate projection, with biases or transposed weights"
        if not _is_relu2(getattr(experts, "act_fn", None)):
            return (f"experts without a gate projection and activation "
                    f"{type(getattr(experts, 'act_fn', None)).__name__} (the fused one is relu2)")
        return None
    if getattr(experts, "has_bias", False):
        return "experts with biases"
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return "transposed or interleaved expert weights"
    if type(experts)._apply_gate is not _default_apply_gate:
        return f"a custom gate ({type(experts).__name__}._apply_gate)"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} (the fused SwiGLU is SiLU)"
    return None


def automoe_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Transformers' experts interface: hidden_states [T, H], top_k_index / top_k_weights [T, K]."""
    if experts_supported(self) is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    gated = self.has_gate
    x, w_gate_up, w_down = hidden_states, self.gate_up_proj if gated else self.up_proj, self.down_proj
    device = x.device.type
    if torch.is_autocast_enabled(device):  # the GEMMs in autocast's dtype, as F.linear would run
        dtype = torch.get_autocast_dtype(device)
        x, w_gate_up, w_down = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    weights = top_k_weights if top_k_weights.dtype == x.dtype else top_k_weights.float()
    out = torch.ops.automoe.moe_experts(x, top_k_index, weights, w_gate_up, w_down, "grouped",
                                        activation="swiglu" if gated else "relu2")
    return out.to(hidden_states.dtype)


@functools.cache
def register() -> None:
    """Makes experts_implementation="automoe" available to every Transformers model."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, automoe_experts_forward)


def _forward_body(cls: type) -> str | None:
    try:
        src = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    lines = src.strip().splitlines()
    body = [line.strip() for line in lines[1:] if line.strip() and not line.strip().startswith("#")]
    return "\n".join(body)


@functools.cache
def _standard_rmsnorm_body() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _forward_body(LlamaRMSNorm)


@functools.cache
def _fused_rmsnorm_class(cls: type) -> type | None:
    """A subclass of `cls` (same name) whose forward is AutoMoE's fused RMSNorm, when `cls.forward`
    is Transformers' standard RMSNorm; None otherwise."""
    if _forward_body(cls) != _standard_rmsnorm_body():
        return None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # autocast: Transformers' promotion rules
            return cls.forward(self, hidden_states)
        return torch.ops.automoe.rmsnorm(hidden_states, self.weight, float(self.variance_epsilon))

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_automoe_fused": True})


def fuse_rmsnorms(model: nn.Module) -> int:
    """Switches every standard RMSNorm module to the fused kernel; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(type(module), "_automoe_fused", False):
            count += 1
            continue
        fused = _fused_rmsnorm_class(type(module)) if "RMSNorm" in type(module).__name__ else None
        if fused is not None and getattr(module, "weight", None) is not None and hasattr(module, "variance_epsilon"):
            module.__class__ = fused
            count += 1
    return count


def _experts_kwargs(cfg: BackendConfig, kwargs: dict, explicit_backend: bool) -> None:
    """Transformers' loader arguments for what `cfg` chooses; refuses choices it cannot honour."""
    if cfg.loss != "torch":
        raise ValueError(f"backend loss={cfg.loss!r}: on Transformers' model (no native AutoMoE model for "
                         "this type) the loss is Transformers' own; use loss='torch'")
    if cfg.dispatcher not in ("auto", "local"):
        raise ValueError(f"backend dispatcher={cfg.dispatcher!r}: expert parallelism is not available")
    if cfg.fake_balanced_gate:
        raise ValueError("backend fake_balanced_gate=True needs AutoMoE's native engine")
    if "experts_implementation" not in kwargs:
        kwargs["experts_implementation"] = {"grouped": EXPERTS_IMPLEMENTATION, "torch_mm": "grouped_mm",
                                            "eager": "eager"}[cfg.experts]
    if explicit_backend and "attn_implementation" not in kwargs:
        kwargs["attn_implementation"] = cfg.attn


def _finish(model, cfg: BackendConfig, source: str):
    rmsnorms = fuse_rmsnorms(model) if cfg.rms_norm == "fused" else 0
    experts = [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]
    impl = getattr(model.config, "_experts_implementation", None)
    reasons = sorted({r for m in experts if (r := experts_supported(m)) is not None})
    if not experts:
        experts_note = "Transformers' (no experts module uses the ExpertsInterface)"
    elif impl != EXPERTS_IMPLEMENTATION:
        experts_note = f"Transformers' {impl}"
    elif reasons:
        experts_note = f"Transformers' grouped_mm ({'; '.join(reasons)})"
    else:
        experts_note = f"AutoMoE fused experts ({len(experts)} modules)"
    model.automoe_path = "transformers"
    model.automoe_accelerated = {
        "experts": experts_note,
        "rms_norm": f"AutoMoE fused ({rmsnorms} modules)" if rmsnorms else "Transformers'",
        "attention": f"Transformers' {model.config._attn_implementation}",
        "loss": "Transformers'",
    }
    logger.info("automoe: %s (%s) runs as Transformers' %s with AutoMoE kernels: %s", source,
                model.config.model_type, type(model).__name__,
                "; ".join(f"{k}: {v}" for k, v in model.automoe_accelerated.items()))
    return model


def load(pretrained_model_name_or_path, *model_args, backend: BackendConfig | dict | None = None,
         force_transformers: bool = False, **kwargs):
    """Transformers' from_pretrained with AutoMoE's experts and RMSNorm."""
    import transformers

    register()
    cfg = BackendConfig.coerce(backend)
    _experts_kwargs(cfg, kwargs, explicit_backend=backend is not None)
    want_info = kwargs.pop("output_loading_info", False)
    # (A type Transformers does not implement either fails here with Transformers' ValueError;
    # automoe.modeling, which chose this path, says so naming both.)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
    # Transformers initialises missing weights at random and only warns; AutoMoE refuses instead.
    problems = {k: v for k in ("missing_keys", "mismatched_keys", "unexpected_keys") if (v := info.get(k))}
    if problems:
        detail = "; ".join(f"{k.replace('_', ' ')}: {sorted(map(str, v))[:5]}{' ...' if len(v) > 5 else ''}"
                           for k, v in problems.items())
        raise AutoMoEError(f"{pretrained_model_name_or_path}: the checkpoint does not match Transformers' "
                           f"{type(model).__name__} for its config ({detail})")
    model = _finish(model, cfg, str(pretrained_model_name_or_path))
    return (model, info) if want_info else model


def from_config(config, *, backend: BackendConfig | dict | None = None, **kwargs):
    import transformers

    register()
    cfg = BackendConfig.coerce(backend)
    _experts_kwargs(cfg, kwargs, explicit_backend=backend is not None)
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return _finish(model, cfg, f"a {config.model_type} config")
