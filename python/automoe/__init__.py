"""AutoMoE: fast Mixture-of-Experts fine-tuning on a C++ engine, behind the Transformers API.

    from automoe import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("path/to/qwen3-moe")
"""

from automoe.backend import BackendConfig
from automoe.modeling import AutoModelForCausalLM, MoEForCausalLM

__all__ = ["AutoModelForCausalLM", "BackendConfig", "MoEForCausalLM"]
__version__ = "0.1.0"
