"""Loading automoe._C, the C++ engine, after checking it matches the installed torch."""

from __future__ import annotations

import functools


@functools.cache
def load():
    """Imports automoe._C after checking it was compiled against the torch that is installed
    (LibTorch's C++ ABI changes between releases: a mismatch would fail with undefined symbols)."""
    import torch

    try:
        from automoe._build_info import TORCH_VERSION as built_with
    except ImportError as e:
        raise ImportError("automoe: the engine is not built; run `make` (or `pip install .`)") from e
    if built_with != torch.__version__:
        raise ImportError(
            f"automoe was compiled against torch {built_with} but torch {torch.__version__} is "
            "installed; rebuild it against this torch: `make` in the repository, or "
            "`pip install --no-build-isolation .`"
        )
    from automoe import _C

    return _C
