"""The Hugging Face drop-in: `from automoe import AutoModelForCausalLM`.

`from_pretrained` / `from_config` return Transformers' own model class for the checkpoint's
`model_type`:

- an architecture the engine implements (`automoe.native.NATIVE_CLASSES`) runs natively: the
  returned model is a subclass of Transformers' class whose forward, backward, generation and
  checkpoint I/O run in the C++ engine (loaded by `automoe.native_loading`);
- every other MoE type runs as Transformers' own model with AutoMoE's fused experts registered
  through Transformers' `ExpertsInterface` and its fused RMSNorm where the module matches
  (`automoe.fallback`); `force_transformers=True` picks this path for native types too.

Either way the model logs which path it took and what is accelerated (`model.automoe_path`,
`model.automoe_accelerated`). Transformers' keyword arguments are accepted; one that cannot apply
is refused or warned about by name, never silently dropped.
"""

from __future__ import annotations

import json
import os
from typing import Any

from automoe.arguments import AutoMoEError
from automoe.backend import BackendConfig
from automoe.native import NATIVE_CLASSES
from automoe.native_loading import _local_dir, load_native, native_from_config


def _read_model_type(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise OSError(f"{config_path}: cannot read the checkpoint's config ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise AutoMoEError(f"{config_path}: not valid JSON: {e}") from e
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise AutoMoEError(f"{config_path}: missing key \"model_type\"")
    return model_type


class AutoModelForCausalLM:
    """`from automoe import AutoModelForCausalLM` — the one changed import."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise OSError("AutoModelForCausalLM is a factory: use AutoModelForCausalLM.from_pretrained(path) "
                      "or AutoModelForCausalLM.from_config(config)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        backend: BackendConfig | dict | None = None,
                        force_transformers: bool = False, **kwargs: Any):
        """Loads a local Hugging Face checkpoint directory.

        Transformers' arguments apply as in `transformers.AutoModelForCausalLM.from_pretrained`
        (dtype / torch_dtype: None or "auto" is the config's dtype; attn_implementation "sdpa" or
        "eager"; keys of the config override it). backend: a BackendConfig or dict choosing each
        component's implementation. force_transformers: run Transformers' own model (with
        AutoMoE's kernels) even where the engine implements the architecture.
        ep_size: expert parallelism under torch.distributed (initialised by the caller, e.g. under
        torchrun): each rank holds 1/ep_size of the experts; see docs/parallelism.md.
        """
        subfolder = kwargs.get("subfolder", "")
        path = _local_dir(pretrained_model_name_or_path, subfolder)
        config = kwargs.get("config")
        model_type = config.model_type if config is not None else _read_model_type(path)
        if model_type in NATIVE_CLASSES and not force_transformers:
            return load_native(NATIVE_CLASSES[model_type], pretrained_model_name_or_path, *model_args,
                               backend=backend, **kwargs)
        from automoe import fallback

        try:
            return fallback.load(pretrained_model_name_or_path, *model_args, backend=backend, **kwargs)
        except ValueError as e:  # Transformers' loader does not implement the type either
            if "does not recognize this architecture" in str(e) or "Unrecognized configuration" in str(e):
                raise AutoMoEError(f"{pretrained_model_name_or_path}: neither AutoMoE's engine (native: "
                                   f"{sorted(NATIVE_CLASSES)}) nor Transformers implements this model: {e}") from e
            raise

    @classmethod
    def from_config(cls, config, *, backend: BackendConfig | dict | None = None,
                    force_transformers: bool = False, **kwargs: Any):
        """A model with fresh parameters for a Transformers config (no checkpoint)."""
        if config.model_type in NATIVE_CLASSES and not force_transformers:
            return native_from_config(NATIVE_CLASSES[config.model_type], config, backend=backend, **kwargs)
        from automoe import fallback

        return fallback.from_config(config, backend=backend, **kwargs)
