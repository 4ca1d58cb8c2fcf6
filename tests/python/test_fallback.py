"""MoE types without a native engine model load through the same import as Transformers' own model
with AutoMoE's fused experts (ExpertsInterface) and RMSNorm: logits to 1e-5 and every gradient to
1e-4 of Transformers' own (float32), on tiny checkpoints Transformers itself wrote, with a
left-padded row in the batch."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_close, autograd_node_names, rel_err

import automoe

COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Each small, odd where it can be, and covering the family's own MoE options (shared experts, dense
# first layers, group-limited routing, sigmoid scoring, q/k norms, MLA attention).
FAMILIES = {
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2, head_dim=8),
    "olmoe": dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                      shared_expert_intermediate_size=16),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=8),
    "granitemoe": dict(num_local_experts=5, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5_moe": dict(moe_num_experts=5, moe_k=2, moe_intermediate_size=12, moe_layer_start_index=0,
                         head_dim=8),
    "hunyuan_v1_moe": dict(num_experts=5, moe_topk=2, head_dim=8),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=8),
    "minimax_m2": dict(num_local_experts=5, num_experts_per_tok=2, head_dim=8),
    "flex_olmo": dict(num_experts=5, num_experts_per_tok=2),
    # experts without a gate projection (relu2 between up_proj and down_proj), Mamba-2 blocks
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], head_dim=8,
                       mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=4,
                       n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                       moe_shared_expert_intermediate_size=16),
    # biased, transposed, interleaved experts with a clamped gate (AutoMoE's fused GPT-OSS SwiGLU)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]),
}
# Families the engine runs natively take the fallback path when asked (force_transformers=True).
NATIVE = {"deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "nemotron_h", "olmoe", "qwen2_moe"}


def write_family_checkpoint(path, model_type: str, **overrides):
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM as HFModel

    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})
    torch.manual_seed(0)
    model = HFModel.from_config(config)
    with torch.no_grad():  # spread wider than Transformers' init: decisive routing, signal everywhere
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if "bias" in name else 0.2)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fallback_matches_transformers_logits_and_gradients(tmp_path, model_type):
    from transformers import AutoModelForCausalLM as HFModel

    path = write_family_checkpoint(tmp_path / model_type, model_type)
    ref = HFModel.from_pretrained(path)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, force_transformers=model_type in NATIVE)
    assert type(ours) is type(ref) and ours.automoe_path == "transformers"
    report = ours.automoe_accelerated
    assert report["experts"].startswith("AutoMoE grouped GEMMs"), report["experts"]
    assert ours.config._experts_implementation == "automoe"

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 61, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    ours.train()
    ref.train()
    got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert rel_err(got.logits, want.logits) <= 1e-5
    assert rel_err(got.loss, want.loss) <= 1e-5
    # AutoMoE's kernels really ran: their backward nodes are in the graph
    ran = {n.split("::")[-1].rstrip(">") for n in autograd_node_names(got.loss) if "automoe::ops" in n}
    expected = {"RmsNormFn"} if "AutoMoE fused (" in report["rms_norm"] else set()
    expected |= {"PermuteFn", "GroupedGemmFn", "UnpermuteFn"}
    expected |= set() if model_type == "nemotron_h" else {"SwigluFn"}  # relu2 runs in ATen
    assert ran == expected
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(ours, ref)


def test_fallback_rmsnorm_is_fused_only_where_the_module_is_standard(tmp_path):
    path = write_family_checkpoint(tmp_path / "flex", "flex_olmo")  # (weight * x).to(dtype): not standard
    model = automoe.AutoModelForCausalLM.from_pretrained(path)
    assert model.automoe_accelerated["rms_norm"] == "Transformers'"
    path = write_family_checkpoint(tmp_path / "mixtral", "mixtral")
    model = automoe.AutoModelForCausalLM.from_pretrained(path, force_transformers=True)
    assert model.automoe_accelerated["rms_norm"] == "AutoMoE fused (5 modules)"
    assert type(model.model.norm).__name__ == "MixtralRMSNorm"


def test_fallback_backend_choices_and_refusals(tmp_path):
    path = write_family_checkpoint(tmp_path / "olmoe", "olmoe")
    eager = automoe.AutoModelForCausalLM.from_pretrained(path, backend={"experts": "eager", "rms_norm": "torch"},
                                                         force_transformers=True)
    assert eager.config._experts_implementation == "eager"
    assert eager.automoe_accelerated == {"experts": "Transformers' eager", "rms_norm": "Transformers'",
                                         "attention": "Transformers' sdpa", "loss": "Transformers'"}
    with pytest.raises(ValueError, match="loss='fused_linear_ce'.*Transformers' own"):
        automoe.AutoModelForCausalLM.from_pretrained(path, backend={"loss": "fused_linear_ce"},
                                                     force_transformers=True)


def test_fallback_under_bf16_autocast_follows_transformers(tmp_path):
    """OLMoE's q/k norms see bf16 projections under autocast while their weights are float32: the
    fused RMSNorm hands such calls to Transformers' own promotion rules."""
    from transformers import AutoModelForCausalLM as HFModel

    path = write_family_checkpoint(tmp_path / "olmoe", "olmoe")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, force_transformers=True)
    ref = HFModel.from_pretrained(path)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert got.logits.dtype == want.logits.dtype == torch.bfloat16
    assert rel_err(got.loss, want.loss) <= 1e-3
    got.loss.backward()
