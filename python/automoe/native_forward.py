"""The native model's forward: Transformers' forward arguments checked and handed to the engine in
one call, its results returned as Transformers' outputs, and the KV cache handed over (the engine's
`EngineCache`, or a Transformers `Cache` read and updated in place). `EngineBackbone` is the
decoder without its LM head (`model.model`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from automoe.cache import EngineCache, export_new_positions, import_cache
from automoe.native_binding import _EngineBinding

# Keyword arguments of Transformers' forward that carry nothing for the engine: the varlen
# boundaries that TRL's padding-free collator adds for flash-attention kernels (Transformers' own
# sdpa and eager paths ignore them too and split packed documents by position_ids, as the engine
# does), and cache_position, which Transformers 5 no longer reads.
_IGNORED_FORWARD_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                           "cache_position")


class _EngineModule(_EngineBinding):
    """What the causal LM and its backbone share: the engine, parameter binding and the forward."""

    def _automoe_forward(self, *, lm_head: bool, input_ids=None, attention_mask=None,
                         position_ids=None, past_key_values=None, inputs_embeds=None, labels=None,
                         use_cache=None, output_router_logits=None, logits_to_keep=0,
                         num_items_in_batch=None, kwargs: dict):
        config = self.config
        return_dict = kwargs.pop("return_dict", None)
        return_dict = config.return_dict if return_dict is None else return_dict
        output_hidden_states = kwargs.pop("output_hidden_states", None)
        output_hidden_states = bool(config.output_hidden_states if output_hidden_states is None
                                    else output_hidden_states)
        output_attentions = kwargs.pop("output_attentions", None)
        if config.output_attentions if output_attentions is None else output_attentions:
            raise TypeError("forward(): output_attentions=True is not supported by the AutoMoE engine "
                            "(its attention kernels do not form the attention weights)")
        if kwargs.pop("shift_labels", None) is not None:
            raise TypeError("forward(): shift_labels is not supported by the AutoMoE engine; pass labels")
        for key in _IGNORED_FORWARD_KWARGS:
            kwargs.pop(key, None)
        if kwargs:
            raise TypeError(f"forward(): arguments not supported by AutoMoE: {sorted(kwargs)}")
        cache = foreign = None
        if past_key_values is not None:
            if isinstance(past_key_values, EngineCache):
                cache = past_key_values
            elif isinstance(past_key_values, Cache):
                if getattr(past_key_values, "offloading", False):
                    raise TypeError("past_key_values: an offloaded cache is not supported by the AutoMoE engine")
                foreign, cache = past_key_values, import_cache(past_key_values, config.num_hidden_layers)
            else:
                raise TypeError(f"past_key_values: expected a transformers Cache, got "
                                f"{type(past_key_values).__name__} (tuples of tensors are not supported, "
                                "as in Transformers 5)")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise TypeError(f"forward(): attention_mask must be 2-D [batch, seq] (1 = token, 0 = padding); "
                            f"got {attention_mask.dim()}-D (custom 4-D masks are not supported)")
        if output_router_logits is None:
            output_router_logits = bool(getattr(config, "output_router_logits", False))

        engine = self._automoe_sync()
        if self._automoe_check_hooks() and inputs_embeds is None and input_ids is not None:
            inputs_embeds, input_ids = self.get_input_embeddings()(input_ids), None

        # Transformers' rule (merge_with_config_defaults): no cache under gradient checkpointing.
        checkpointing = self.training and self.is_gradient_checkpointing
        use_cache = config.use_cache if use_cache is None else use_cache
        if checkpointing:
            use_cache = False
        if cache is None and use_cache:
            cache = EngineCache(config.num_hidden_layers)
        past_length = cache.get_seq_length() if cache is not None else 0

        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = float(num_items_in_batch.item())
        logits_indices = None
        if isinstance(logits_to_keep, torch.Tensor):
            logits_indices, logits_to_keep = logits_to_keep, 0
        out = engine.forward(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            output_router_logits=output_router_logits,
            num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch),
            # Transformers splits packed documents (position_ids restarting, no attention_mask)
            # only when it runs without a KV cache.
            split_packed_documents=cache is None,
            activation_checkpointing=checkpointing,
            training=self.training,
            inputs_embeds=inputs_embeds,
            cache=None if cache is None else cache.storage,
            lm_head=lm_head,
            logits_to_keep=int(logits_to_keep),
            logits_indices=logits_indices,
            output_hidden_states=output_hidden_states,
            router_aux_loss_coef=getattr(self, "router_aux_loss_coef", None),
        )
        if foreign is not None:
            export_new_positions(cache, foreign, past_length)
            cache = foreign
        if lm_head:
            result = MoeCausalLMOutputWithPast(
                loss=out["loss"], aux_loss=out["aux_loss"], logits=out["logits"],
                past_key_values=cache, hidden_states=out["hidden_states"],
                router_logits=out["router_logits"],
            )
        else:
            result = MoeModelOutputWithPast(
                last_hidden_state=out["last_hidden_state"], past_key_values=cache,
                hidden_states=out["hidden_states"], router_logits=out["router_logits"],
            )
        return result if return_dict else result.to_tuple()


class EngineBackbone(_EngineModule):
    """The decoder without its LM head (`model.model`, `model.base_model`): hidden states."""

    _automoe_prefix = "model."

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_router_logits=None, **kwargs):
        return self._automoe_forward(
            lm_head=False, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, output_router_logits=output_router_logits, kwargs=kwargs)

