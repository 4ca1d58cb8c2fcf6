"""Every Mixture-of-Experts causal-LM type of the installed Transformers, at a tiny size.

`moe_causal_lm_types()` reads Transformers' own registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`)
and keeps the types whose causal-LM modeling module defines an experts class decorated with
`transformers.integrations.moe.use_experts_implementation`, so a type that a Transformers upgrade
adds shows up here with no edit. `moe_types_without_experts_interface()` names the causal-LM types
that are MoE by their config but whose experts do not use that interface.

`tiny_config(t)` shrinks `AutoConfig.for_model(t)` with generic rules keyed on attribute names
(per-type overrides only where a rule cannot work), so that tests can build and run every type on
a CPU in a fraction of a second. `run_tiny(t)` is the check: build, a padded train-mode forward
with labels, a finite loss, backward, and experts modules whose weights get a gradient.
`TRANSFORMERS_CANNOT_RUN` names the types that Transformers itself cannot run so, and why.
Run as a script, it prints each type's experts class and layout:

    PYTHONPATH=python:tests/python .venv/bin/python tests/python/moe_types.py
"""

from __future__ import annotations

import functools
import inspect
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import moe as hf_moe
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Config attributes that hold the number of routed experts / experts per token.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts")
# Config attributes that split experts into groups for routing (the expert count must divide).
GROUP_KEYS = ("n_group", "num_expert_group")
# Values of per-layer lists (mlp_layer_types, layers_block_type) that mark an MoE layer.
MOE_LAYER_VALUES = ("sparse", "moe", "hash_moe")

NUM_LAYERS = 2
NUM_EXPERTS = 5
NUM_GROUPED_EXPERTS = 8  # with n_group 2
VOCAB = 61
BATCH, SEQ, LEFT_PAD = 2, 9, 3

# Tiny sizes by attribute name, applied to every (sub-)config that has the attribute and a value
# that is not None there.
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "model_max_length": 64,
    "intermediate_size": 40, "dense_intermediate_size": 40,
    "expert_ffn_hidden_size": 12, "shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
    "topk_group": 1,
    # multi-head latent attention, DeepSeek-V4's grouped output LoRA
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "o_lora_rank": 16, "o_groups": 2,
    # sparse-attention indexers
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "index_block_size": 4,
    "index_topk_blocks": 2,
    # sliding windows, extra attention kinds
    "sliding_window": 4, "sliding_window_size": 4, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "swa_head_dim": 8, "rotary_dim": 4, "rel_extent": 16,
    "d_rel": 4,
    # Mamba: heads * head_dim = expand (2) * hidden_size
    "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_d_state": 8, "ssm_state_size": 8, "mamba_dt_rank": 4, "mamba_chunk_size": 8,
    "chunk_size": 8, "n_groups": 2,
    # linear attention (gated delta net, KDA, lightning)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_heads": 4, "linear_head_dim": 8, "block_size": 4,
    # per-layer input embeddings, hyper-connections, n-gram embeddings, router widths
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "hc_lowrank": 8,
    "ple_embed_dim": 16, "router_hidden_size": 16,
}
# Set whatever the default, often None where a config is MoE or dense by a setting (Gemma 4) or
# where the default config cannot build a model (head_dim, shared experts, QSA indexer: None).
REQUIRED = {
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    "enable_moe_block": True, "moe_intermediate_size": 12, "head_dim": 8,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
    "indexer_compress_ratio": 2,
    **{key: 2 for key in TOP_K_KEYS},
}
# Layer-count knobs: layer 0 dense (where the config can say so), layer 1 MoE; Jamba-style
# periods: layer 0 attention, layer 1 Mamba + MoE.
LAYER_KNOBS = {
    "num_hidden_layers": NUM_LAYERS, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "moe_layer_start_index": 1, "moe_layer_end_index": NUM_LAYERS - 1, "moe_layer_interval": 1,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "moe_layer_freq": 1,
    "global_attn_every_n_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 0,
    "expert_layer_period": 2, "expert_layer_offset": 1,
}

# Where a generic rule cannot work, by the (sub-)config's model type; each says why.
OVERRIDES: dict[str, dict] = {
    # DeepSeek-V4's rope width is head_dim * partial_rotary_factor (1/8 unless the legacy
    # qk_rope_head_dim argument sets it): 1 at head_dim 8. Its compressed attentions fold every 4
    # and 128 tokens: a 9-token batch would give the heavily compressed one no block.
    "deepseek_v4": {"qk_rope_head_dim": 4,
                    "compress_rates": {"compressed_sparse_attention": 2,
                                       "heavily_compressed_attention": 4}},
    # Gemma 4's full-attention layers take their head_dim from `global_head_dim`, a constructor
    # argument that is no attribute (defaults to 512).
    "gemma4_text": {"global_head_dim": 16},
    # GraniteMoeHybrid defaults to Mamba layers only, where Transformers' cache cannot tell a
    # sequence length (the forward raises); real checkpoints have attention layers.
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # Lfm2MoeConfig leaves layer_types None (Lfm2Config derives it), and the model indexes it.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # ZAYA validates num_experts_per_tok == 1.
    "zaya": {"num_experts_per_tok": 1},
}

# Transformers itself cannot build or run these at a tiny size on CPU in float32.
TRANSFORMERS_CANNOT_RUN: dict[str, str] = {}

# Why a causal-LM type that is MoE by its config has no `use_experts_implementation` experts.
_NO_INTERFACE_REASONS = {
    "aria_text": "AriaExperts: fc1/fc2 AriaGroupedExpertsGemm modules (weights [E, in, out]) with "
                 "their own routing and sequential GEMM, not decorated",
    "dbrx": "DbrxExperts: w1/v1/w2 flattened to [E * ffn, hidden] in a DbrxExpertGLU, an "
            "own per-expert loop, not decorated",
    "doge": "DogeCDMoE: product-key retrieval experts stored as embeddings (down_embed/up_embed), "
            "no expert MLPs (and is_moe defaults to False)",
    "jetmoe": "JetMoeParallelExperts: one [E, out, in] weight per projection, used by JetMoeMoE "
              "and the mixture-of-attention JetMoeMoA; not decorated",
    "llama4": "Llama4TextExperts: [E, hidden, 2 * I] weights applied to every expert on a "
              "pre-scattered batch (bmm), routed in Llama4TextMoe; not decorated",
    "llama4_text": "Llama4TextExperts: [E, hidden, 2 * I] weights applied to every expert on a "
                   "pre-scattered batch (bmm), routed in Llama4TextMoe; not decorated",
    "longcat_flash": "LongcatFlashExperts: routed experts plus identity 'zero experts' in one "
                     "index space, an own per-expert loop; not decorated",
}


def _causal_lm_class(model_type: str) -> type:
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _is_experts_class(obj: object, module_name: str) -> bool:
    """A class of `module_name` whose __init__ is `use_experts_implementation`'s wrapper."""
    if not inspect.isclass(obj) or obj.__module__ != module_name:
        return False
    init = obj.__init__
    return hasattr(init, "__wrapped__") and {"has_gate", "is_concatenated"} <= set(
        getattr(getattr(init, "__code__", None), "co_names", ()))


def experts_classes(model_type: str) -> list[str]:
    """The experts classes that the causal-LM class's modeling module defines."""
    module = sys.modules[_causal_lm_class(model_type).__module__]
    return [name for name, obj in vars(module).items() if _is_experts_class(obj, module.__name__)]


@functools.cache
def _moe_causal_lm_types() -> tuple[str, ...]:
    return tuple(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if experts_classes(t))


def moe_causal_lm_types() -> list[str]:
    """Every causal-LM model type whose modeling module has `use_experts_implementation` experts."""
    return list(_moe_causal_lm_types())


def _experts_count_key(config_class: type) -> str | None:
    """The experts-count attribute of a config class or of one of its sub-configs."""
    names = set(getattr(config_class, "__dataclass_fields__", ())) | set(
        getattr(config_class, "attribute_map", {}))
    for key in EXPERT_COUNT_KEYS:
        if key in names:
            return key
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if (sub_key := _experts_count_key(sub_class)) is not None:
            return f"{name}.{sub_key}"
    return None


def moe_types_without_experts_interface() -> dict[str, str]:
    """Causal-LM types with an experts count in their config but no decorated experts class:
    type -> why."""
    moe = set(_moe_causal_lm_types())
    found = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        key = None if model_type in moe else _experts_count_key(CONFIG_MAPPING[model_type])
        if key is not None:
            found[model_type] = _NO_INTERFACE_REASONS.get(
                model_type, f"config has `{key}`, but {_causal_lm_class(model_type).__module__} "
                            "has no class decorated with use_experts_implementation")
    return found


def _pick_layers(per_layer: dict[str, list], num_layers: int) -> tuple[int, int]:
    """Two of the default layers that between them cover the most per-layer values: an MoE layer
    among them where the lists mark MoE layers, a full-attention layer where one can be."""
    def covered(*layers):
        return {(name, values[i]) for name, values in per_layer.items() for i in layers}

    def is_moe(i):
        return any(values[i] in MOE_LAYER_VALUES for values in per_layer.values())

    marks_moe = any(is_moe(i) for i in range(num_layers))
    pairs = [(i, j) for i in range(num_layers) for j in range(i + 1, num_layers)
             if not marks_moe or is_moe(i) or is_moe(j)]
    return max(pairs, key=lambda p: (len(covered(*p)),
                                     any(v == "full_attention" for _, v in covered(*p)),
                                     -p[0], -p[1]))


def _value(config, name: str):
    """The attribute as stored: no properties, no per-layer access checks."""
    return vars(config).get(config.attribute_map.get(name, name))


def _shrink(config, experts: int | None = None) -> dict:
    """Keyword arguments that make `config` (its class's defaults) tiny."""
    fields = list(getattr(type(config), "__dataclass_fields__", ()))
    grouped = any(_value(config, k) is not None for k in GROUP_KEYS)
    kwargs = {}
    for name in fields:
        value = _value(config, name)
        if name in REQUIRED:
            kwargs[name] = REQUIRED[name]
        elif name in EXPERT_COUNT_KEYS:
            kwargs[name] = experts or (NUM_GROUPED_EXPERTS if grouped else NUM_EXPERTS)
        elif name in GROUP_KEYS and value is not None:
            kwargs[name] = 2
        elif name in SIZES and value is not None:
            kwargs[name] = SIZES[name]
        elif name in LAYER_KNOBS and value is not None:
            kwargs[name] = LAYER_KNOBS[name]
    if "kv_lora_rank" in fields:  # multi-head latent attention has no grouped keys / values
        kwargs["num_key_value_heads"] = SIZES["num_attention_heads"]

    num_layers = getattr(config, "num_hidden_layers", None)
    per_layer = {name: _value(config, name) for name in fields
                 if isinstance(_value(config, name), list)
                 and len(_value(config, name)) == num_layers}
    if isinstance(num_layers, int) and num_layers > NUM_LAYERS and per_layer:
        named = {k: v for k, v in per_layer.items() if all(isinstance(x, str) for x in v)}
        picked = _pick_layers(named or per_layer, num_layers)
        for name, values in per_layer.items():
            # a per-layer size (num_attention_heads_per_layer) takes the tiny size
            size = next((SIZES[k] for k in SIZES if name.startswith(k)), None)
            kwargs[name] = [values[i] if size is None else size for i in picked]

    for name in getattr(config, "sub_configs", {}):
        sub = _value(config, name)
        if sub is not None:
            kwargs[name] = _shrink(sub, experts)
    kwargs.update(OVERRIDES.get(config.model_type, {}))
    return kwargs


def tiny_config(model_type: str, experts: int | None = None):
    """`AutoConfig.for_model(model_type)`, shrunk to a size that runs in well under a second;
    `experts`: the number of routed experts (default 5, or 8 where routing groups them)."""
    return AutoConfig.for_model(model_type, **_shrink(AutoConfig.for_model(model_type), experts))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [2, 9] in 3..60, the second row left-padded by 3, labels -100 at the padding."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :LEFT_PAD] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that `use_experts_implementation` made."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated")]


def runnable_moe_types() -> list[str]:
    """`moe_causal_lm_types()` less `TRANSFORMERS_CANNOT_RUN`."""
    return [t for t in moe_causal_lm_types() if t not in TRANSFORMERS_CANNOT_RUN]


def _act_name(act_fn) -> str:
    if act_fn is None:
        return "-"
    return type(act_fn).__name__ if isinstance(act_fn, torch.nn.Module) else act_fn.__name__


def run_tiny(model_type: str) -> dict:
    """Build the tiny model (seed 0), run a padded train-mode forward with labels and a backward.

    Raises unless the loss is finite and the model has experts modules whose weights all get a
    gradient. Returns what the experts look like: their class, layout flags, whether the class
    overrides `_apply_gate`, the name of `act_fn`'s class (of the function where it is a plain
    function; "-" where there is none), the loss and the seconds it all took.
    """
    start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    model.train()
    ids, mask, labels = padded_batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    if not torch.isfinite(loss):
        raise AssertionError(f"{model_type}: loss {loss.item()}")
    loss.backward()
    experts = experts_modules(model)
    if not experts:
        raise AssertionError(f"{model_type}: no experts module in {type(model).__name__}")
    no_grad = [name for m in experts for name, p in m.named_parameters()
               if p.grad is None or not p.grad.any()]
    if no_grad:
        raise AssertionError(f"{model_type}: experts weights without a gradient: {no_grad}")
    first = experts[0]
    return {
        "experts": "/".join(sorted({type(m).__name__ for m in experts})),
        "has_gate": first.has_gate,
        "has_bias": first.has_bias,
        "is_transposed": first.is_transposed,
        "is_concatenated": first.is_concatenated,
        "gate_override": type(first)._apply_gate is not hf_moe._default_apply_gate,
        "act": _act_name(getattr(first, "act_fn", None)),
        "loss": loss.item(),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    start, passed = time.perf_counter(), 0
    print(f"{'type':20} {'experts':24} {'has_gate':8} {'has_bias':8} {'transposed':10} "
          f"{'concatenated':12} {'gate_override':13} {'act':21} {'loss':>6} {'s':>5}")
    for model_type in runnable_moe_types():
        try:
            r = run_tiny(model_type)
        except Exception as error:  # noqa: BLE001 - the table reports every type
            print(f"{model_type:20} FAILED {type(error).__name__}: {str(error)[:300]}")
            continue
        passed += 1
        print(f"{model_type:20} {r['experts']:24} {r['has_gate']!s:8} {r['has_bias']!s:8} "
              f"{r['is_transposed']!s:10} {r['is_concatenated']!s:12} {r['gate_override']!s:13} "
              f"{r['act']:21} {r['loss']:6.3f} {r['seconds']:5.2f}")
    print(f"{passed} of {len(runnable_moe_types())} types built and run in "
          f"{time.perf_counter() - start:.1f} s")
    for model_type, reason in TRANSFORMERS_CANNOT_RUN.items():
        print(f"cannot run: {model_type}: {reason}")
    for model_type, reason in moe_types_without_experts_interface().items():
        print(f"no experts interface: {model_type}: {reason}")


if __name__ == "__main__":
    main()
