"""What the native and the Transformers paths share about Transformers' arguments: the error they
raise (`AutoMoEError`), dtype names, the experts_implementation names and the engine's experts
backends they stand for, the one warning that names arguments with no effect, and the device a
`device_map` names."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from automoe import _engine

AutoMoEError = _engine.load().AutoMoEError

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
           torch.float64: "float64"}

# Transformers' experts_implementation -> the engine's experts backend ("automoe" is AutoMoE's
# fused experts, what the engine runs by default; see fallback.py for the same name there).
EXPERTS_IMPLEMENTATIONS = {"automoe": "grouped", "grouped_mm": "torch_mm", "eager": "eager"}
ENGINE_EXPERTS = {v: k for k, v in EXPERTS_IMPLEMENTATIONS.items()}


def dtype_name(dtype: Any) -> str | None:
    """None/"auto" -> None (the checkpoint's config dtype); torch.dtype or name -> engine name."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: unsupported {dtype}; expected one of {list(_DTYPES)}")
        return _DTYPES[dtype]
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    raise TypeError(f"dtype: expected a torch.dtype or a string, got {type(dtype).__name__}")


def warn_ignored(where: str, ignored: dict[str, str]) -> None:
    """One warning naming every argument that has no effect, and why."""
    if ignored:
        warnings.warn(f"{where}: arguments with no effect: "
                      + "; ".join(f"{k} ({why})" for k, why in ignored.items()), stacklevel=3)


def device_of(device_map: Any, ep_size: int | None = None) -> torch.device | None:
    """The one device a `device_map` names (under expert parallelism "auto" is each rank's current
    GPU); splitting the model across devices is refused."""
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(
                f"device_map={device_map!r}: AutoMoE keeps a model on one device (splitting it across "
                "devices is expert parallelism's job, not device_map's)"
            )
        device_map = devices.pop()
    if device_map == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device() if ep_size not in (None, 1) else 0)
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    if device_map in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(f"device_map={device_map!r}: AutoMoE keeps a model on one device")
    return torch.device(device_map)
