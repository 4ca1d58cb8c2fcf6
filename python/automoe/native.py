"""Native models: Transformers' own model classes whose compute runs in the AutoMoE engine.

`Qwen3MoeForCausalLM` here *is* a `transformers.Qwen3MoeForCausalLM` (a subclass with the same name,
module tree, config, generation config and methods), so Trainer, TRL, accelerate, `generate` and
pipelines drive it unchanged. Its parameters are the engine's tensors: each `nn.Parameter` in the
tree aliases an engine tensor and is handed back to the engine, so an optimizer step changes what
the next forward uses. `forward` (and the backbone's) hands the whole computation to the engine;
no submodule's forward ever runs. Before each forward the engine re-binds parameters that were
replaced on the module tree (`load_state_dict(assign=True)`, `resize_token_embeddings`, a deep
copy), and anything the engine cannot honour (a module swapped for an adapter, a hook on a
submodule, an unsupported argument) is refused by name rather than silently skipped.

The causal LM is put together from the parts' modules: `native_binding` (the module tree bound to
the engine's tensors, PEFT's adapters, the sync before each forward), `native_forward` (the
forward, the cache hand-over, the backbone), `native_checkpoint` (save_pretrained,
load_state_dict), `native_parallel` (expert parallelism) and `native_loading` (from_pretrained,
from_config).
"""

from __future__ import annotations

import copy

import transformers
from transformers.cache_utils import DynamicCache

from automoe.arguments import ENGINE_EXPERTS, AutoMoEError
from automoe.backend import BackendConfig
from automoe.cache import EngineCache
from automoe.native_binding import _EngineBuild
from automoe.native_checkpoint import _EngineCheckpoint
from automoe.native_forward import EngineBackbone, _EngineModule
from automoe.native_loading import load_native, native_from_config
from automoe.native_parallel import _ExpertParallelModel


class EngineCausalLM(_EngineBuild, _EngineCheckpoint, _ExpertParallelModel, _EngineModule):
    """The causal LM: forward, loss, generation, checkpoints, all through the engine."""

    _automoe_backbone_class: type

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True  # set_experts_implementation() switches the engine's experts backend

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        return load_native(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return native_from_config(cls, config, **kwargs)

    # -- what the engine exposes ----------------------------------------------------------------
    @property
    def spec(self) -> dict:
        return self._automoe_engine.spec

    @property
    def layout(self) -> str:
        """The experts layout of the checkpoint this model was loaded from (what a save writes)."""
        return self._automoe_engine.layout

    @property
    def backend(self) -> BackendConfig:
        return BackendConfig.from_engine(self._automoe_engine.backend())

    def set_backend(self, backend: BackendConfig | dict) -> None:
        cfg = copy.copy(BackendConfig.coerce(backend))
        if cfg.attn is None:  # not chosen: the attention stays what it is
            cfg.attn = self.config._attn_implementation or self._automoe_engine.backend()["attn"]
        if cfg.attn == "sdpa" and not type(self)._supports_sdpa:
            raise AutoMoEError(f"backend attn='sdpa': {type(self).__name__} has no sdpa attention "
                               "(its attention sinks need 'eager')")
        current = self._automoe_engine.backend()["dispatcher"]
        in_process = cfg.dispatcher == "local" and self._automoe_ep is None  # (what "auto" is then)
        if cfg.dispatcher not in ("auto", current) and not in_process:
            raise AutoMoEError(f"backend dispatcher={cfg.dispatcher!r}: the dispatcher is chosen when the "
                               "model is loaded (from_pretrained(..., ep_size=N, backend={'dispatcher': ...})); "
                               f"this model runs {current!r}")
        cfg.dispatcher = current
        self._automoe_engine.set_backend(cfg.to_dict())
        self.config._attn_implementation = cfg.attn
        self.config._experts_implementation_internal = ENGINE_EXPERTS[cfg.experts]

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                logits_to_keep=0, **kwargs):
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        return self._automoe_forward(
            lm_head=True, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            labels=labels, use_cache=use_cache, output_router_logits=output_router_logits,
            logits_to_keep=logits_to_keep, num_items_in_batch=num_items_in_batch, kwargs=kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() keeps the engine's cache between steps rather than a DynamicCache (what
        Transformers would create; a cache the user passed is used as given)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        if (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False)
                and not getattr(cache, "offloading", False) and cache.get_seq_length() == 0):
            model_kwargs["past_key_values"] = EngineCache(self.config.num_hidden_layers)


class Qwen3MoeModel(EngineBackbone, transformers.Qwen3MoeModel):
    pass


class Qwen3MoeForCausalLM(EngineCausalLM, transformers.Qwen3MoeForCausalLM):
    _automoe_backbone_class = Qwen3MoeModel


class DeepseekV3Model(EngineBackbone, transformers.DeepseekV3Model):
    pass


class DeepseekV3ForCausalLM(EngineCausalLM, transformers.DeepseekV3ForCausalLM):
    _automoe_backbone_class = DeepseekV3Model


class Glm4MoeModel(EngineBackbone, transformers.Glm4MoeModel):
    pass


class Glm4MoeForCausalLM(EngineCausalLM, transformers.Glm4MoeForCausalLM):
    _automoe_backbone_class = Glm4MoeModel


class MixtralModel(EngineBackbone, transformers.MixtralModel):
    pass


class MixtralForCausalLM(EngineCausalLM, transformers.MixtralForCausalLM):
    _automoe_backbone_class = MixtralModel


class Qwen2MoeModel(EngineBackbone, transformers.Qwen2MoeModel):
    pass


class Qwen2MoeForCausalLM(EngineCausalLM, transformers.Qwen2MoeForCausalLM):
    _automoe_backbone_class = Qwen2MoeModel


class OlmoeModel(EngineBackbone, transformers.OlmoeModel):
    pass


class OlmoeForCausalLM(EngineCausalLM, transformers.OlmoeForCausalLM):
    _automoe_backbone_class = OlmoeModel


class GptOssModel(EngineBackbone, transformers.GptOssModel):
    pass


class GptOssForCausalLM(EngineCausalLM, transformers.GptOssForCausalLM):
    _automoe_backbone_class = GptOssModel


class NemotronHModel(EngineBackbone, transformers.NemotronHModel):
    pass


class NemotronHForCausalLM(EngineCausalLM, transformers.NemotronHForCausalLM):
    _automoe_backbone_class = NemotronHModel


class Qwen3NextModel(EngineBackbone, transformers.Qwen3NextModel):
    pass


class Qwen3NextForCausalLM(EngineCausalLM, transformers.Qwen3NextForCausalLM):
    _automoe_backbone_class = Qwen3NextModel


class Qwen3_5MoeTextModel(EngineBackbone, transformers.Qwen3_5MoeTextModel):
    pass


class Qwen3_5MoeForCausalLM(EngineCausalLM, transformers.Qwen3_5MoeForCausalLM):
    _automoe_backbone_class = Qwen3_5MoeTextModel


# model_type -> the engine-backed causal-LM class
NATIVE_CLASSES: dict[str, type] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,  # Kimi-K2's config.json names its remote code; it is DeepSeek-V3
    "glm4_moe": Glm4MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    # Qwen3.5's released vision-language checkpoints: their language model, as Transformers'
    # AutoModelForCausalLM loads it (text_config; the vision tower skipped)
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
}
