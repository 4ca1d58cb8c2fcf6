"""Transformers' own model, with AutoMoE's kernels: the path for MoE types the engine does not
implement natively (Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5, GraniteMoE, ...).

- Experts: `automoe.experts.forward` (permute -> grouped GEMM -> the gate or activation ->
  grouped GEMM -> weighted unpermute, on AutoMoE's kernels, whatever the experts' layout: gated or
  not, transposed, biased, any activation) registered in Transformers' `ExpertsInterface` as
  "automoe" and selected through `experts_implementation`, so every v5 MoE model whose experts use
  that interface runs them without any change to its modeling file; the load report says which
  layouts and activations ran.
- RMSNorm: modules whose forward is exactly Transformers' standard RMSNorm (float32 statistics,
  `weight * normed.to(input dtype)`) run AutoMoE's fused kernel (`torch.ops.automoe.rmsnorm`).
- Everything else (attention, router, dense MLPs, loss) is Transformers' code.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from automoe import _engine, experts
from automoe.arguments import AutoMoEError
from automoe.backend import BackendConfig

_engine.load()  # registers torch.ops.automoe
logger = logging.getLogger("automoe")

EXPERTS_IMPLEMENTATION = "automoe"


@functools.cache
def register() -> None:
    """Makes experts_implementation="automoe" available to every Transformers model."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts.forward)


@functools.cache
def _standard_rmsnorm_body() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return experts.source_body(LlamaRMSNorm.forward)


@functools.cache
def _fused_rmsnorm_class(cls: type) -> type | None:
    """A subclass of `cls` (same name) whose forward is AutoMoE's fused RMSNorm, when `cls.forward`
    is Transformers' standard RMSNorm; None otherwise."""
    if experts.source_body(cls.forward) != _standard_rmsnorm_body():
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


def _experts_kwargs(cfg: BackendConfig, kwargs: dict, explicit_backend: bool, ep_size: int = 1) -> None:
    """Transformers' loader arguments for what `cfg` chooses; refuses choices it cannot honour."""
    if cfg.loss != "torch":
        raise ValueError(f"backend loss={cfg.loss!r}: on Transformers' model (no native AutoMoE model for "
                         "this type) the loss is Transformers' own; use loss='torch'")
    if cfg.dispatcher not in ("auto", "local") and ep_size == 1:
        raise ValueError(f"backend dispatcher={cfg.dispatcher!r}: this model runs every expert in this process; "
                         "the dispatchers that exchange tokens between ranks need from_pretrained(..., ep_size=N) "
                         "under torch.distributed (docs/parallelism.md)")
    if ep_size > 1 and (cfg.experts != "grouped" or kwargs.get("experts_implementation") not in
                        (None, EXPERTS_IMPLEMENTATION)):
        raise ValueError(f"from_pretrained(ep_size={ep_size}): expert parallelism runs the experts on AutoMoE's "
                         f"kernels (experts_implementation={EXPERTS_IMPLEMENTATION!r}, backend experts='grouped'), "
                         f"not {kwargs.get('experts_implementation') or cfg.experts!r}")
    if cfg.fake_balanced_gate:
        raise ValueError("backend fake_balanced_gate=True needs AutoMoE's native engine")
    if "experts_implementation" not in kwargs:
        kwargs["experts_implementation"] = {"grouped": EXPERTS_IMPLEMENTATION, "torch_mm": "grouped_mm",
                                            "eager": "eager"}[cfg.experts]
    if explicit_backend and "attn_implementation" not in kwargs:
        kwargs["attn_implementation"] = cfg.attn


def _finish(model, cfg: BackendConfig, source: str):
    rmsnorms = fuse_rmsnorms(model) if cfg.rms_norm == "fused" else 0
    modules = [m for m in model.modules() if experts.is_experts_module(m)]
    impl = getattr(model.config, "_experts_implementation", None)
    if not modules:
        experts_note = "Transformers' (no experts module uses the ExpertsInterface)"
    elif impl != EXPERTS_IMPLEMENTATION:
        experts_note = f"Transformers' {impl}"
    else:
        layouts = sorted({experts.layout_of(m).describe() for m in modules})
        count = f"{len(modules)} module{'s' if len(modules) > 1 else ''}"
        experts_note = f"AutoMoE grouped GEMMs ({count}: {'; '.join(layouts)})"
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
         force_transformers: bool = False, ep_size: int | None = None, **kwargs):
    """Transformers' from_pretrained with AutoMoE's experts and RMSNorm; with ep_size, this rank's
    share of the experts (automoe.fallback_parallel)."""
    import transformers

    register()
    cfg = BackendConfig.coerce(backend)
    if ep_size is not None and (isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1):
        raise ValueError(f"from_pretrained(ep_size={ep_size!r}): expected a positive integer")
    ep = ep_size or 1
    _experts_kwargs(cfg, kwargs, explicit_backend=backend is not None, ep_size=ep)
    want_info = kwargs.pop("output_loading_info", False)
    # (A type Transformers does not implement either fails here with Transformers' ValueError;
    # automoe.modeling, which chose this path, says so naming both.)
    if ep > 1:
        from automoe import fallback_parallel

        config = kwargs.get("config") or transformers.AutoConfig.from_pretrained(
            pretrained_model_name_or_path, **{k: kwargs[k] for k in ("subfolder", "trust_remote_code", "revision")
                                              if k in kwargs})
        mapping = transformers.AutoModelForCausalLM._model_mapping
        if type(config) not in mapping:
            raise AutoMoEError(f"from_pretrained(ep_size={ep}): {config.model_type!r} has no causal-LM class in "
                               "Transformers (remote code is not sharded by AutoMoE's expert parallelism)")
        model_cls = mapping[type(config)]
        model, info = fallback_parallel.load(model_cls, pretrained_model_name_or_path, *model_args,
                                             ep_size=ep, dispatcher=cfg.dispatcher, **kwargs)
    else:
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
    if kwargs.pop("ep_size", None) not in (None, 1):
        raise ValueError("from_config(ep_size=...): expert parallelism loads a checkpoint; save the fresh model "
                         "and load it with from_pretrained(path, ep_size=...)")
    cfg = BackendConfig.coerce(backend)
    _experts_kwargs(cfg, kwargs, explicit_backend=backend is not None)
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return _finish(model, cfg, f"a {config.model_type} config")
