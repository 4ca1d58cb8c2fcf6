"""AutoMoE: fast Mixture-of-Experts fine-tuning on a C++ engine, behind the Transformers API.

    from automoe import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("path/to/qwen3-moe")
"""

import importlib as _importlib
import logging as _logging
import os as _os

from automoe import _engine
from automoe.backend import BackendConfig

# `import automoe` loads the engine, which registers the fused ops as torch.ops.automoe.*
# (docs/ops.md). Transformers (1.5-2 s to import) is imported with the first name that needs it,
# so that the `automoe` command (automoe/cli.py, imported through this package) starts quickly.
AutoMoEError = _engine.load().AutoMoEError
# Under torchrun, torch.distributed's env:// rendezvous (init_process_group, accelerate, the
# Trainer) gets a namespace of its own per restart attempt (automoe/elastic.py).
_importlib.import_module("automoe.elastic").install()
# ... and the Trainer's resume on several CPU processes can read its optimizer.pt (elastic.py).
_importlib.import_module("automoe.elastic").accept_indexed_cpu_locations()
_LAZY = {"AutoModelForCausalLM": "automoe.modeling", "EngineCache": "automoe.cache", "plan": "automoe.planning"}

__all__ = ["AutoModelForCausalLM", "AutoMoEError", "BackendConfig", "EngineCache", "plan"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'automoe' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

# Which path a model takes (native engine / Transformers + AutoMoE kernels) is logged at INFO on the
# "automoe" logger; like Transformers' own logger it prints to stderr unless the application
# configured logging. AUTOMOE_VERBOSITY=warning (or error) quiets it.
class _StderrHandler(_logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (not when the handler was made)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


_logger = _logging.getLogger("automoe")
if not _logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(_logging.Formatter("%(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_os.environ.get("AUTOMOE_VERBOSITY", "info").upper())
    _logger.propagate = False
