"""DeepSeek-V3, GLM-4.5, Mixtral, Qwen2-MoE and OLMoE in AutoMoE match Transformers v5 on
checkpoints Transformers wrote.

float32, a batch with left and right padding, Transformers' default attention (sdpa) against ours and
eager against eager: logits at every position and the loss to 1e-5 relative, every parameter's
gradient to 1e-4, for configs of odd sizes that vary what changes the math (q LoRA or not, group
routing on and off with topk_group < n_group, 0/1/2 shared experts, 0/1/2 dense first layers, YaRN,
interleaved RoPE or not, partial rotary, q/k norms and attention biases, tied embeddings; for
Mixtral, Qwen2-MoE and OLMoE: sliding windows, the shared expert and its gate, full-width q/k norms,
clip_qkv, dense layers, top-1 to top-4), in both on-disk expert layouts. DeepSeek-V3 and GLM-4.5 have
no aux loss in Transformers, and none here; the others' aux loss and router logits match. The
routers' e_score_correction_bias (a float32 buffer) is randomised so that it steers the choice.
"""

from __future__ import annotations

import pytest
import torch
from conftest import autograd_node_names, padded_batch, rel_err, write_checkpoint

import automoe

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0}

DEEPSEEK_BASE = dict(vocab_size=89, hidden_size=20, intermediate_size=36, moe_intermediate_size=12,
                     num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                     q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                     v_head_dim=5, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     max_position_embeddings=64)
DEEPSEEK = {
    "qlora_groups2of1_shared1_dense1": {},
    "no_qlora_no_groups_shared0_dense0_tied": dict(q_lora_rank=None, n_group=1, topk_group=1,
                                                   n_shared_experts=0, first_k_dense_replace=0,
                                                   tie_word_embeddings=True, pad_token_id=0),
    "yarn_mscale_shared2_dense2_unnormed": dict(
        num_hidden_layers=4, n_shared_experts=2, first_k_dense_replace=2, norm_topk_prob=False,
        rope_parameters={**YARN, "mscale": 0.7, "mscale_all_dim": 1.0}),
    "groups4of2_top3_tied": dict(n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3,
                                 tie_word_embeddings=True),
    # a large eps: the latent norms keep Transformers' 1e-6, the others take the config's
    "half_split_rope_attention_bias_eps": dict(rope_interleave=False, attention_bias=True,
                                               rms_norm_eps=0.05),
    "yarn_no_qlora_groups3of2": dict(q_lora_rank=None, n_routed_experts=6, n_group=3, topk_group=2,
                                     routed_scaling_factor=1.0, qk_rope_head_dim=6,
                                     rope_parameters={**YARN, "beta_fast": 16, "beta_slow": 2}),
}

GLM_BASE = dict(vocab_size=91, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                partial_rotary_factor=0.5, max_position_embeddings=64)
GLM = {
    "half_rotary_groups2of1_shared1_dense1": {},
    "qk_norm_qkv_bias_eps": dict(use_qk_norm=True, attention_bias=True, rms_norm_eps=0.05),
    "full_rotary_no_groups_shared0_dense0_tied": dict(partial_rotary_factor=1.0, n_group=1,
                                                      topk_group=1, n_shared_experts=0,
                                                      first_k_dense_replace=0,
                                                      tie_word_embeddings=True, pad_token_id=0),
    "yarn_shared2_dense2": dict(num_hidden_layers=4, n_shared_experts=2, first_k_dense_replace=2,
                                rope_parameters={**YARN, "partial_rotary_factor": 0.5}),
    "groups4of3_top3_gqa4_unnormed": dict(n_routed_experts=12, n_group=4, topk_group=3,
                                          num_experts_per_tok=3, num_key_value_heads=1, head_dim=12,
                                          norm_topk_prob=False),
    "quarter_rotary_head16": dict(head_dim=16, partial_rotary_factor=0.25, num_attention_heads=2),
}

MIXTRAL_BASE = dict(vocab_size=83, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5,
                    num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.02)
MIXTRAL = {
    "e5_top2_gqa2": {},
    "e3_top1_mha_tied": dict(num_local_experts=3, num_experts_per_tok=1, num_key_value_heads=4,
                             tie_word_embeddings=True, pad_token_id=0),
    "sliding4_e7_top3": dict(sliding_window=4, num_local_experts=7, num_experts_per_tok=3,
                             num_hidden_layers=3),
    "e4_top4_head12": dict(num_local_experts=4, num_experts_per_tok=4, hidden_size=32, head_dim=12),
    "linear_rope_gqa4": dict(num_key_value_heads=1,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    "yarn_rope_e6": dict(num_local_experts=6, rope_parameters=YARN),
}

QWEN2_BASE = dict(vocab_size=79, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                  shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=5, num_experts_per_tok=2,
                  max_position_embeddings=64, router_aux_loss_coef=0.02)
QWEN2 = {
    "e5_top2_shared20": {},
    "norm_top3_e6_mlp_only": dict(norm_topk_prob=True, num_experts=6, num_experts_per_tok=3,
                                  num_hidden_layers=3, mlp_only_layers=[1]),
    "sparse_step2_tied": dict(decoder_sparse_step=2, num_hidden_layers=4, tie_word_embeddings=True,
                              pad_token_id=0),
    "sliding4_layers": dict(use_sliding_window=True, sliding_window=4, max_window_layers=2,
                            num_hidden_layers=3),
    "no_qkv_bias_e9_shared8": dict(qkv_bias=False, num_experts=9, shared_expert_intermediate_size=8),
    "gqa1_linear_rope": dict(num_key_value_heads=1,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}

OLMOE_BASE = dict(vocab_size=73, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=5, num_experts_per_tok=2,
                  max_position_embeddings=64, router_aux_loss_coef=0.02, pad_token_id=0,
                  eos_token_id=2)
OLMOE = {
    "e5_top2_gqa2": {},
    "clip_qkv_bias": dict(clip_qkv=0.5, attention_bias=True),
    "norm_top3_e6_tied": dict(norm_topk_prob=True, num_experts=6, num_experts_per_tok=3,
                              tie_word_embeddings=True),
    "mha_e7_top1": dict(num_key_value_heads=4, num_experts=7, num_experts_per_tok=1,
                        num_hidden_layers=3),
    "gqa1_clip2": dict(num_key_value_heads=1, clip_qkv=2.0),
    "linear_rope_e4_top4": dict(num_experts=4, num_experts_per_tok=4, hidden_size=32,
                                rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 500.0}),
}

GPT_OSS_BASE = dict(vocab_size=71, hidden_size=24, intermediate_size=12, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=5,
                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
                    router_aux_loss_coef=0.02)
GPT_OSS = {
    "e5_top2_alternating_sliding4_default_yarn": {},
    "all_full_attention_default_rope": dict(layer_types=["full_attention"] * 2,
                                            rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0}),
    "e7_top3_three_layers_window3": dict(num_local_experts=7, num_experts_per_tok=3,
                                         num_hidden_layers=3, sliding_window=3),
    "no_attention_bias_mha_tied": dict(attention_bias=False, num_key_value_heads=4,
                                       tie_word_embeddings=True, pad_token_id=0),
    "e4_top4_head12_gqa4": dict(num_local_experts=4, num_experts_per_tok=4, hidden_size=32,
                                head_dim=12, num_key_value_heads=1),
    "yarn_truncated_e6_top1": dict(num_local_experts=6, num_experts_per_tok=1,
                                   rope_parameters={**YARN, "truncate": True}),
}

FAMILIES = {"deepseek_v3": (DEEPSEEK_BASE, DEEPSEEK), "glm4_moe": (GLM_BASE, GLM),
            "mixtral": (MIXTRAL_BASE, MIXTRAL), "qwen2_moe": (QWEN2_BASE, QWEN2),
            "olmoe": (OLMOE_BASE, OLMOE), "gpt_oss": (GPT_OSS_BASE, GPT_OSS)}
AUX_LOSS = {"mixtral", "qwen2_moe", "olmoe", "gpt_oss"}  # the types whose Transformers model has one
# GPT-OSS: one on-disk layout (Transformers keeps its in-memory names) and no sdpa (its sinks).
SINGLE_LAYOUT_EAGER_ONLY = {"gpt_oss"}
CASES = [(family, name) for family, (_, configs) in FAMILIES.items() for name in sorted(configs)]

TORCH = dict(experts="eager", rms_norm="torch", rope="torch", swiglu="torch", loss="torch")
FUSED = dict(experts="grouped", rms_norm="fused", rope="fused", swiglu="fused",
             loss="fused_linear_ce")


def make_config(family: str, name: str):
    from transformers import AutoConfig

    base, configs = FAMILIES[family]
    return AutoConfig.for_model(family, **{**base, **configs[name]})


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    cache: dict = {}

    def make(family: str, name: str, layout: str = "per-expert"):
        key = (family, name, layout)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{name}-{layout}")
            cache[key] = write_checkpoint(path, make_config(family, name), layout, seed=7)
        return cache[key]

    return make


def run_both(path, attn, backend, **kwargs):
    from transformers import AutoModelForCausalLM as HFModel

    hf = HFModel.from_pretrained(path, attn_implementation=attn)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, backend=backend)
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    ref.loss.backward()
    out.loss.backward()
    if out.logits is None:  # the fused loss returns no logits: read them from a label-free pass
        with torch.no_grad():
            out.logits = ours(input_ids=ids, attention_mask=mask).logits
    return hf, ours, ref, out


COMBOS = [("per-expert", "torch", "sdpa"), ("fused", "torch", "eager"),
          ("per-expert", "fused", "eager"), ("fused", "fused", "sdpa")]
PARITY_CASES = [(family, name, *combo) for family, name in CASES for combo in COMBOS
                if family not in SINGLE_LAYOUT_EAGER_ONLY] + \
               [(family, name, "fused", backend, "eager") for family, name in CASES
                for backend in ("torch", "fused", "torch_mm") if family in SINGLE_LAYOUT_EAGER_ONLY]


@pytest.mark.parametrize("family, name, layout, backend, attn", PARITY_CASES)
def test_matches_transformers_logits_loss_and_grads(family_checkpoint, family, name, layout, backend,
                                                    attn):
    path = family_checkpoint(family, name, layout)
    aux = family in AUX_LOSS
    backends = {"torch": TORCH, "fused": FUSED, "torch_mm": dict(FUSED, experts="torch_mm", loss="torch")}
    hf, ours, ref, out = run_both(path, attn, backends[backend],
                                  **(dict(output_router_logits=True) if aux else {}))
    assert type(ours).__name__ == type(hf).__name__ and isinstance(ours, type(hf))
    assert ours.layout == layout
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.loss, ref.loss) <= 1e-5
    if aux:  # the loss above includes coef * aux
        assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-5
        keep = padded_batch(hf.config.vocab_size)[1].bool()
        assert len(out.router_logits) == len(ref.router_logits) == sum(ours.spec["layer_is_moe"])
        for ours_rl, ref_rl in zip(out.router_logits, ref.router_logits):
            assert rel_err(ours_rl.view(3, 9, -1)[keep], ref_rl.view(3, 9, -1)[keep]) <= 1e-5
    else:
        assert out.aux_loss is None and out.router_logits is None  # none in Transformers either

    ref_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == ref_params.keys()
    for pname, p in our_params.items():
        assert p.shape == ref_params[pname].shape, pname
        if p.numel() == 0:  # the shared experts' MLP of n_shared_experts=0
            continue
        assert p.grad is not None, f"{pname} got no gradient"
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname
    ref_bufs = {n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    our_bufs = {n: b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")}
    assert our_bufs.keys() == ref_bufs.keys() and (bool(ref_bufs) == (family not in AUX_LOSS))
    for bname, b in our_bufs.items():
        assert b.dtype == torch.float32 and torch.equal(b, ref_bufs[bname]), bname


@pytest.mark.parametrize("family, name", [("deepseek_v3", "yarn_mscale_shared2_dense2_unnormed"),
                                          ("glm4_moe", "qk_norm_qkv_bias_eps")])
def test_correction_bias_steers_the_choice_of_experts(family_checkpoint, family, name):
    """Zeroing the correction bias changes which experts run (so the bias is really read), and
    Transformers agrees on the result either way."""
    from transformers import AutoModelForCausalLM as HFModel

    path = family_checkpoint(family, name)
    hf = HFModel.from_pretrained(path)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ids, mask, _ = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        before = ours(input_ids=ids, attention_mask=mask).logits
        for model in (hf, ours):
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.zero_()
        after, ref = ours(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert rel_err(after, ref) <= 1e-5
    assert rel_err(after, before) > 1e-3


SAVE_CASES = [(family, name, layout) for family, name in [
    ("deepseek_v3", "qlora_groups2of1_shared1_dense1"), ("glm4_moe", "yarn_shared2_dense2"),
    ("mixtral", "sliding4_e7_top3"), ("qwen2_moe", "norm_top3_e6_mlp_only"),
    ("olmoe", "clip_qkv_bias")] for layout in ("per-expert", "fused")] + \
    [("gpt_oss", "e7_top3_three_layers_window3", "fused")]


@pytest.mark.parametrize("family, name, layout", SAVE_CASES)
def test_saved_checkpoint_loads_back_into_transformers_bit_identically(family_checkpoint, tmp_path,
                                                                       family, name, layout):
    from transformers import AutoModelForCausalLM as HFModel

    path = family_checkpoint(family, name, layout)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ours.save_pretrained(tmp_path / "out")
    original = HFModel.from_pretrained(path).state_dict()
    reloaded = HFModel.from_pretrained(tmp_path / "out").state_dict()
    assert reloaded.keys() == original.keys()
    for key, t in original.items():
        assert reloaded[key].dtype == t.dtype and torch.equal(reloaded[key], t), key
    assert automoe.AutoModelForCausalLM.from_pretrained(tmp_path / "out").layout == layout
    # the same tensor names on disk as Transformers writes for that layout (Mixtral's originals too)
    from safetensors import safe_open

    def names(directory):
        with safe_open(str(next(directory.glob("*.safetensors"))), "pt") as f:
            return set(f.keys())

    assert names(tmp_path / "out") == names(path)


def test_bfloat16_load_keeps_the_correction_bias_float32(family_checkpoint):
    path = family_checkpoint("deepseek_v3", "groups4of2_top3_tied")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    biases = [b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.dtype == torch.float32 for b in biases)
    ids, mask, labels = padded_batch(ours.config.vocab_size)
    assert torch.isfinite(ours(input_ids=ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("family, name", [("deepseek_v3", "yarn_mscale_shared2_dense2_unnormed"),
                                          ("glm4_moe", "half_rotary_groups2of1_shared1_dense1")])
def test_generate_and_a_transformers_cache_continue_as_in_transformers(family_checkpoint, family, name):
    """Greedy generation from a left-padded batch gives Transformers' tokens; a DynamicCache that
    Transformers filled (DeepSeek's holds the compressed latents) continues in the engine with
    Transformers' logits."""
    import copy

    from transformers import AutoModelForCausalLM as HFModel

    path = family_checkpoint(family, name)
    hf = HFModel.from_pretrained(path)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ids, mask, _ = padded_batch(hf.config.vocab_size)
    ids, mask = ids[[0, 2]], mask[[0, 2]]  # a full and a left-padded row
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))

    with torch.no_grad():
        past = hf(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        nxt = torch.tensor([[5], [7]])
        full = torch.cat([mask, torch.ones_like(nxt)], 1)
        ref = hf(input_ids=nxt, attention_mask=full, past_key_values=copy.deepcopy(past)).logits
        out = ours(input_ids=nxt, attention_mask=full, past_key_values=past).logits
    assert rel_err(out, ref) <= 1e-5


def test_multi_token_prediction_layers_are_skipped_with_a_message_and_others_refused(
        family_checkpoint, tmp_path, capfd):
    """DeepSeek-V3's released checkpoints carry num_nextn_predict_layers extra layers after the
    last one: skipped on load (one message), as Transformers ignores them. A tensor of any other
    layer past the end is an error naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = family_checkpoint("deepseek_v3", "qlora_groups2of1_shared1_dense1", "fused")
    path = shutil.copytree(src, tmp_path / "mtp")
    weights = load_file(path / "model.safetensors")
    n = 3  # num_hidden_layers: the MTP layer is model.layers.3
    for name in [k for k in weights if k.startswith("model.layers.2.")]:
        weights[name.replace("model.layers.2.", f"model.layers.{n}.")] = weights[name].clone()
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(20, 40)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model = automoe.AutoModelForCausalLM.from_pretrained(path)
    assert "multi-token-prediction layer(s) 3" in capfd.readouterr().err
    ids, mask, labels = padded_batch(model.config.vocab_size)
    from transformers import AutoModelForCausalLM as HFModel

    ref = HFModel.from_pretrained(src)(input_ids=ids, attention_mask=mask, labels=labels)
    assert rel_err(model(input_ids=ids, attention_mask=mask, labels=labels).loss, ref.loss) <= 1e-5

    weights["model.layers.4.input_layernorm.weight"] = torch.ones(20)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(automoe.AutoMoEError, match=r"model\.layers\.4\.input_layernorm\.weight"):
        automoe.AutoModelForCausalLM.from_pretrained(path)


def test_a_kimi_k2_config_loads_as_deepseek_v3(family_checkpoint, tmp_path):
    """Kimi-K2's config.json names model_type "kimi_k2" (its remote code); the model is
    DeepSeek-V3's, and AutoMoE loads it as that without trust_remote_code."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM as HFModel

    src = family_checkpoint("deepseek_v3", "groups4of2_top3_tied")
    path = shutil.copytree(src, tmp_path / "kimi")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(cfg))
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    assert type(ours).__name__ == "DeepseekV3ForCausalLM" and ours.automoe_path == "native"
    ids, mask, labels = padded_batch(ours.config.vocab_size)
    ref = HFModel.from_pretrained(src)(input_ids=ids, attention_mask=mask, labels=labels)
    assert rel_err(ours(input_ids=ids, attention_mask=mask, labels=labels).loss, ref.loss) <= 1e-5


@pytest.mark.parametrize("family, name", [("deepseek_v3", "yarn_mscale_shared2_dense2_unnormed"),
                                          ("glm4_moe", "groups4of3_top3_gqa4_unnormed")])
def test_activation_checkpointing_gives_transformers_gradients(family_checkpoint, family, name):
    """Checkpointed layers (recomputed in the backward with the forward's routing) give
    Transformers' gradients, latent attention and the correction bias included."""
    from transformers import AutoModelForCausalLM as HFModel

    path = family_checkpoint(family, name)
    hf = HFModel.from_pretrained(path)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, backend=FUSED)
    for model in (hf, ours):
        model.gradient_checkpointing_enable()
        model.train()
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref.loss.backward()
    out.loss.backward()
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert any("CheckpointedLayerFn" in n for n in autograd_node_names(out.loss))
    ref_params = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_training_tracks_transformers_for_twenty_steps(tmp_path, family):
    """The same tiny model (Transformers' own initialisation) in bfloat16, trained 20 steps with
    torch.optim.AdamW on the same batches in AutoMoE (the drop-in) and in Transformers: the losses
    stay within 1 % at every step. (The two sides round differently — AutoMoE's router runs in
    float32 — so bf16 is compared to a tolerance, float32 exactly above.)"""
    from transformers import AutoModelForCausalLM as HFModel

    torch.manual_seed(5)
    path = tmp_path / family
    HFModel.from_config(make_config(family, sorted(FAMILIES[family][1])[0])).save_pretrained(path)
    # (Transformers' grouped_mm needs 16-byte strides, which these odd bf16 widths lack.)
    hf = HFModel.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for model in (hf, ours):
        model.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (hf, ours)]
    g = torch.Generator().manual_seed(11)
    vocab = hf.config.vocab_size
    for step in range(20):
        ids = torch.randint(1, vocab, (4, 16), generator=g)
        losses = []
        for model, opt in zip((hf, ours), opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= 0.01 * abs(losses[0]), (step, losses)


def test_gpt_oss_runs_eager_by_default_and_refuses_sdpa(family_checkpoint):
    """GPT-OSS's attention sinks have no SDPA kernel: like Transformers, the drop-in defaults to
    eager and refuses sdpa by name."""
    path = family_checkpoint("gpt_oss", "e5_top2_alternating_sliding4_default_yarn", "fused")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    assert ours.config._attn_implementation == "eager" and ours.automoe_accelerated["attn"] == "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'.*sinks"):
        automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")


def test_mixtral_router_jitter_noise_draws_as_transformers_in_training(family_checkpoint, tmp_path):
    """router_jitter_noise multiplies the MoE input by uniform(1 - j, 1 + j) in training only,
    drawn from torch's default generator as Transformers draws it: with the same seed both sides
    draw the same noise (loss and gradients match); in eval mode there is none; a checkpointed
    layer's recompute replays the forward's draws (its gradients equal the plain backward's)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM as HFModel

    path = shutil.copytree(family_checkpoint("mixtral", "e5_top2_gqa2"), tmp_path / "jitter")
    cfg = json.loads((path / "config.json").read_text())
    cfg["router_jitter_noise"] = 0.2
    (path / "config.json").write_text(json.dumps(cfg))
    hf = HFModel.from_pretrained(path, attn_implementation="eager")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", backend=FUSED)
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    with torch.no_grad():  # eval: no noise, so the seed does not matter
        assert rel_err(ours(input_ids=ids, labels=labels).loss, hf(input_ids=ids, labels=labels).loss) <= 1e-5
    losses = {}
    for model in (hf, ours):
        model.train()
        torch.manual_seed(123)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses[model is ours] = out.loss
    assert rel_err(losses[True], losses[False]) <= 1e-5
    with torch.no_grad():  # and the noise really changed the result
        plain = ours.eval()(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert rel_err(losses[True], plain) > 1e-4
    ref_params = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname
    grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ours.train()
    ours.gradient_checkpointing_enable()
    torch.manual_seed(123)
    ours(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    for pname, p in ours.named_parameters():
        assert rel_err(p.grad, grads[pname]) <= 1e-6, pname


def test_gpt_oss_mxfp4_experts_are_dequantised_on_load_as_transformers_does(tmp_path, capfd):
    """GPT-OSS's released checkpoints store the experts as MXFP4 (`*_blocks` + `*_scales`). They
    load dequantised exactly as Transformers' convert_moe_packed_tensors does (the oracle), with
    one message, and save dequantised without the quantization_config: what we save loads in
    Transformers with the same logits."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM as HFModel
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = make_config("gpt_oss", "e5_top2_alternating_sliding4_default_yarn")
    config.hidden_size, config.intermediate_size = 32, 32  # MXFP4 blocks are 32 wide
    torch.manual_seed(0)
    HFModel.from_config(config).save_pretrained(tmp_path / "plain")
    weights = load_file(tmp_path / "plain" / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, O = weights[name].shape  # in memory [E, K, O]; stored as [E, O, K/32, 16] + scales
        blocks = torch.randint(0, 256, (E, O, K // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 126, (E, O, K // 32), generator=g, dtype=torch.uint8)
        del weights[name]
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dense.shape == (E, K, O)
        weights.setdefault("_dequantised", {})[name] = dense
    dequantised = weights.pop("_dequantised")
    (tmp_path / "mxfp4").mkdir()
    save_file(weights, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    oracle = {k: v for k, v in weights.items() if not k.endswith(("_blocks", "_scales"))}
    oracle.update(dequantised)
    (tmp_path / "oracle").mkdir()
    save_file(oracle, tmp_path / "oracle" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "oracle" / "config.json").write_text(json.dumps(cfg))

    ours = automoe.AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32)
    assert "dequantised 4 MXFP4 expert tensors to float32" in capfd.readouterr().err
    for name, dense in dequantised.items():
        assert torch.equal(ours.state_dict()[name], dense), name
    hf = HFModel.from_pretrained(tmp_path / "oracle")
    ids, mask, _ = padded_batch(config.vocab_size)
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids, attention_mask=mask).logits,
                       hf(input_ids=ids, attention_mask=mask).logits) <= 1e-5
    ours.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    # As released: bf16 tensors and no dtype key in config.json. The experts dequantise to the
    # checkpoint's dtype (their biases'), so the model stays in one dtype and runs.
    bf16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights.items()}
    (tmp_path / "released").mkdir()
    save_file(bf16, tmp_path / "released" / "model.safetensors", metadata={"format": "pt"})
    released_cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
    (tmp_path / "released" / "config.json").write_text(
        json.dumps({**released_cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    released = automoe.AutoModelForCausalLM.from_pretrained(tmp_path / "released")
    assert {p.dtype for p in released.parameters()} == {torch.bfloat16}
    assert torch.isfinite(released(input_ids=ids, attention_mask=mask, labels=ids).loss)
    with torch.no_grad():
        again = HFModel.from_pretrained(tmp_path / "saved")(input_ids=ids, attention_mask=mask).logits
    assert rel_err(again, hf(input_ids=ids, attention_mask=mask).logits) <= 1e-6


def test_gpt_oss_under_bf16_autocast_follows_transformers(family_checkpoint):
    """Under torch.autocast (float32 parameters, bf16 matmuls) GPT-OSS runs on the eager and the
    grouped experts, its logits come out bf16 and agree with Transformers' under autocast to bf16
    noise. (This guards agreement; bf16 rounding elsewhere in the model is as large as the
    difference fp32 experts would make, so it does not prove the experts' precision.
    torch_mm: ATen's _grouped_mm needs 16-byte row strides, which this bf16 width of 12 lacks.)"""
    from transformers import AutoModelForCausalLM as HFModel

    path = family_checkpoint("gpt_oss", "e7_top3_three_layers_window3", "fused")
    hf = HFModel.from_pretrained(path, experts_implementation="eager")
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    for experts in ("eager", "grouped"):
        ours = automoe.AutoModelForCausalLM.from_pretrained(path, backend={"experts": experts})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ours(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits.dtype == ref.logits.dtype == torch.bfloat16
        assert rel_err(out.logits, ref.logits) <= 2e-2, experts
        assert rel_err(out.loss, ref.loss) <= 1e-2, experts


def test_a_backend_config_object_keeps_gpt_oss_on_eager(family_checkpoint):
    """A BackendConfig that does not choose the attention leaves the model's default (eager for
    GPT-OSS); set_backend without an attention keeps the current one; sdpa is refused by name."""
    path = family_checkpoint("gpt_oss", "e5_top2_alternating_sliding4_default_yarn", "fused")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, backend=automoe.BackendConfig(experts="eager"))
    assert ours.backend.attn == "eager" and ours.backend.experts == "eager"
    ours.set_backend({"experts": "grouped"})
    assert ours.backend.attn == "eager" and ours.backend.experts == "grouped"
    ids, mask, labels = padded_batch(ours.config.vocab_size)
    assert torch.isfinite(ours(input_ids=ids, attention_mask=mask, labels=labels).loss)
    with pytest.raises(automoe.AutoMoEError, match="attn='sdpa'.*sinks"):
        ours.set_backend({"attn": "sdpa"})
