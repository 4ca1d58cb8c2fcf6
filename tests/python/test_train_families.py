"""`automoe train` fine-tunes a tiny DeepSeek-V3, GLM-4.5, Mixtral, Qwen2-MoE, OLMoE, GPT-OSS,
Nemotron-H and Qwen3-Next end to end:
the export loads in Transformers with AutoMoE's loss (in the original on-disk format: Mixtral's
block_sparse_moe names included), DeepSeek-V3's auxiliary-loss-free balancing moves the routers'
correction bias (and only it: the optimizer never touches that buffer), and the bias survives a
resume; a load-balancing coefficient these types do not have is refused by name."""

from __future__ import annotations

import pytest
import torch
from test_train import base_recipe, load_tensors, metrics, run_train, tokenizer  # noqa: F401

from conftest import padded_batch, rel_err

_DEEPSEEK_MOE = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                     topk_group=1, first_k_dense_replace=1, max_position_embeddings=256)
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256)
SIZES = {
    "deepseek_v3": dict(_DEEPSEEK_MOE, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    "glm4_moe": dict(_DEEPSEEK_MOE, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "mixtral": dict(_SMALL, intermediate_size=16, num_local_experts=4, head_dim=8),
    "qwen2_moe": dict(_SMALL, intermediate_size=48, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, num_experts=4, mlp_only_layers=[]),
    "olmoe": dict(_SMALL, intermediate_size=16, num_experts=4),
    "gpt_oss": dict(_SMALL, intermediate_size=16, num_local_experts=4, head_dim=8, sliding_window=8),
    "nemotron_h": dict(hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
                       mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=16,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, max_position_embeddings=256),
    "qwen3_next": dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, max_position_embeddings=256),
}
AUX_LOSS = {"mixtral", "qwen2_moe", "olmoe", "gpt_oss", "qwen3_next"}


_BUILT: dict = {}


def tiny_family_checkpoint(family: str, tmp_path_factory, tokenizer):
    from automoe.demo import build_checkpoint

    if family not in _BUILT:
        _BUILT[family] = build_checkpoint(tmp_path_factory.mktemp(family) / "tiny", tokenizer,
                                          family=family, **SIZES[family])
    return _BUILT[family]


@pytest.fixture(scope="module", params=sorted(SIZES))
def family_dir(request, tmp_path_factory, tokenizer):
    return request.param, tiny_family_checkpoint(request.param, tmp_path_factory, tokenizer)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tokenizer):
    return tiny_family_checkpoint("deepseek_v3", tmp_path_factory, tokenizer)


def test_fine_tune_exports_a_checkpoint_transformers_loads_with_the_same_loss(family_dir, tmp_path):
    from transformers import AutoModelForCausalLM as HFModel

    import automoe

    family, model_dir = family_dir
    rate = 0.01 if family == "deepseek_v3" else 0.0
    # An odd number of steps: the bias moves by an odd number of +-rate, so never back to 0.
    run_train(base_recipe(model_dir, tmp_path, "run", train={"max_steps": 3},
                          router={"bias_update_rate": rate}), tmp_path)
    export = tmp_path / "run" / "export"
    ids, mask, labels = padded_batch(300)
    with torch.no_grad():
        ref = HFModel.from_pretrained(export)(input_ids=ids, attention_mask=mask, labels=labels)
        out = automoe.AutoModelForCausalLM.from_pretrained(export)(input_ids=ids, attention_mask=mask,
                                                                   labels=labels)
        base = HFModel.from_pretrained(model_dir)(input_ids=ids, attention_mask=mask, labels=labels)
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert abs(base.loss.item() - ref.loss.item()) > 1e-4, "the export equals the untrained model"

    steps = metrics(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3]
    assert (steps[3]["aux_loss"] > 0) if family in AUX_LOSS else steps[3]["aux_loss"] is None
    before = load_tensors(next(model_dir.glob("*.safetensors")))
    after = load_tensors(next(export.glob("*.safetensors")))
    bias = [k for k in after if k.endswith("e_score_correction_bias")]
    assert bool(bias) == (family not in AUX_LOSS) and all(after[k].dtype == torch.float32 for k in bias)
    if rate:  # each step moves every expert's bias by exactly +-rate (or 0 at the mean load)
        assert set(steps[3]["router_bias"]) == {"1"}
        for k in bias:
            moved = (after[k] - before[k]).abs()
            assert moved.min() > 0 and moved.max() <= 3 * rate + 1e-6, k
            assert torch.allclose(moved / rate, (moved / rate).round(), atol=1e-4), k
    else:  # off: the buffer is never touched
        assert "router_bias" not in steps[3]
        for k in bias:
            assert torch.equal(after[k], before[k]), k


def test_correction_bias_resumes_with_the_run(deepseek_dir, tmp_path, monkeypatch):
    # The two runs start in separate processes, and each measures its own CPU GEMM path (a resume
    # adopts the recorded one; a fresh start cannot): near the margin they pick different paths
    # and round differently. The generic kernels involve no such choice, so equality is exact.
    monkeypatch.setenv("AUTOMOE_CPU_ISA", "baseline")
    model_dir = deepseek_dir
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 4},
                         checkpoint={"every": 2}, router={"bias_update_rate": 0.01})
    run_train(recipe, tmp_path)
    straight = load_tensors(tmp_path / "run" / "step-4" / "model.safetensors")
    recipe["checkpoint"]["dir"] = str(tmp_path / "again")
    run_train(recipe, tmp_path, "train.max_steps=2")
    run_train(recipe, tmp_path)  # resumes at step 2
    resumed = load_tensors(tmp_path / "again" / "step-4" / "model.safetensors")
    for k, t in straight.items():
        assert torch.equal(resumed[k], t), k


@pytest.mark.parametrize("family", sorted(set(SIZES) - AUX_LOSS))
def test_aux_loss_coefficient_is_refused_for_types_without_one(family, tmp_path, tmp_path_factory,
                                                               tokenizer):
    model_dir = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    proc = run_train(base_recipe(model_dir, tmp_path, "run", model={"router_aux_loss_coef": 0.01}),
                     tmp_path, check=False)
    assert proc.returncode == 1 and "model.router_aux_loss_coef" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_router_jitter_draws_from_the_seed_the_same_in_every_run_and_across_a_resume(
        tmp_path, tmp_path_factory, tokenizer, monkeypatch):
    """Mixtral's router_jitter_noise draws in `automoe train` come from train.seed (with the rank
    and the step): two runs of one recipe train bit for bit alike, a run stopped at step 2 and
    resumed draws what the uninterrupted run drew, and another seed draws other noise. (They
    were drawn from an unseeded generator, different in every process.)"""
    from automoe.demo import build_checkpoint

    monkeypatch.setenv("AUTOMOE_CPU_ISA", "baseline")  # no per-process GEMM choice (see above)
    model_dir = build_checkpoint(tmp_path_factory.mktemp("jitter") / "tiny", tokenizer,
                                 family="mixtral", router_jitter_noise=0.5, **SIZES["mixtral"])

    def run(name, seed=0, *overrides):
        r = base_recipe(model_dir, tmp_path, name, data={"shuffle": False},  # seed: noise only
                        train={"seed": seed}, checkpoint={"every": 2})
        run_train(r, tmp_path, *overrides)
        last = tmp_path / name / "step-4" / "model.safetensors"
        return metrics(tmp_path / name), load_tensors(last) if last.exists() else None

    (a, wa), (b, wb) = run("a"), run("b")
    run("split", 0, "train.max_steps=2")
    split, ws = run("split")  # resumes at step 2
    other, _ = run("other", 1)
    for step in (1, 2, 3, 4):
        assert b[step]["loss"] == a[step]["loss"] and split[step]["loss"] == a[step]["loss"], step
        assert other[step]["loss"] != a[step]["loss"], step
    for k, t in wa.items():
        assert torch.equal(wb[k], t) and torch.equal(ws[k], t), k


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_hybrid_packed_documents_train_like_unpacked_ones(family, tmp_path, tmp_path_factory, tokenizer):
    """Six chats packed into one row of 512 tokens (Nemotron-H's Mamba-2 chunks of 16 and
    Qwen3-Next's delta-rule chunks of 64 straddle the document boundaries) or one per padded row:
    with the conv and the recurrence restarting at each boundary (and attention split by document)
    the first step's loss and gradient norm agree. Without the restart the state of one chat would
    leak into the next and they would not."""
    from test_train import EXAMPLES

    model_dir = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    f = tmp_path / "six.jsonl"
    f.write_text("".join(open(EXAMPLES / "chat_valid.jsonl").readlines()[:6]))
    out = {}
    for packing, micro in [(True, 1), (False, 6)]:
        name = f"packing-{packing}"
        recipe = base_recipe(model_dir, tmp_path, name, f, train={"micro_batch_size": micro, "max_steps": 1})
        recipe["data"].update(packing=packing, seq_len=512, shuffle=False)
        run_train(recipe, tmp_path)
        out[packing] = metrics(tmp_path / name)[1]
    assert out[True]["tokens"] == out[False]["tokens"]
    for key in ("loss", "grad_norm"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-5), key
