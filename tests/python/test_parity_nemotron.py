"""Nemotron-H (Nemotron 3's hybrid Mamba-2 + attention + MoE stack) in AutoMoE's engine matches
Transformers v5 on checkpoints Transformers wrote.

float32, a batch with left and right padding: logits at every position and the loss to 1e-5
relative, every parameter's gradient to 1e-4, with Transformers' default attention (sdpa) against
ours and eager against eager, both on-disk layouts (`backbone.` per-expert tensors as the released
checkpoints, and the fused in-memory names), for configs of odd sizes that vary what changes the
math: the block pattern and its order (list and legacy `hybrid_override_pattern`), n_groups 1 / 2 /
3, chunk sizes that do and do not divide the sequence, conv kernels 2-4 with and without bias,
projection and MLP biases, latent MoE on and off, group-limited routing, unnormalised top-k.
`generate` (greedy, sampled, a left-padded batch) gives Transformers' tokens, and decoding runs
the recurrent step: one token at a time on the cache reproduces the full forward's logits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, padded_batch, rel_err, write_checkpoint

import automoe

BASE = dict(vocab_size=67, hidden_size=24,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=20,
            mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=5, n_groups=2, conv_kernel=3,
            chunk_size=4, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
            moe_shared_expert_intermediate_size=14, n_group=2, topk_group=1, routed_scaling_factor=1.5,
            pad_token_id=0)
CONFIGS = {
    "mamba_moe_attn_mlp_groups2_chunk4": {},
    "latent_moe_biases": dict(moe_latent_size=8, mlp_bias=True, use_bias=True),
    "legacy_pattern_groups1_chunk3_kernel4_no_conv_bias": dict(
        layers_block_type=None, hybrid_override_pattern="M*E-ME", n_groups=1, chunk_size=3,
        conv_kernel=4, use_conv_bias=False),
    "chunk_longer_than_the_batch_unnormed_no_groups": dict(chunk_size=16, n_group=1, topk_group=1,
                                                           norm_topk_prob=False),
    "attention_first_groups3_heads6": dict(
        layers_block_type=["full_attention", "linear_attention", "linear_attention", "moe"],
        mamba_num_heads=6, mamba_head_dim=4, n_groups=3, chunk_size=5, ssm_state_size=7),
    "chunk_divides_mha_kernel2": dict(chunk_size=3, num_key_value_heads=4, conv_kernel=2,
                                      num_experts_per_tok=3),
    # top-1 unnormalised: a normalised top-1 weight is exactly 1, its router gradient exactly 0
    "moe_first_top1_latent": dict(layers_block_type=["moe", "linear_attention", "full_attention", "moe"],
                                  moe_latent_size=12, num_experts_per_tok=1, n_group=1, topk_group=1,
                                  norm_topk_prob=False),
    "two_attention_blocks_gqa1_chunk2": dict(
        layers_block_type=["linear_attention", "full_attention", "moe", "full_attention", "linear_attention"],
        num_key_value_heads=1, chunk_size=2, time_step_min=0.05),
}
TORCH = dict(experts="eager", rms_norm="torch", rope="torch", swiglu="torch", loss="torch")
FUSED = dict(experts="grouped", rms_norm="fused", rope="fused", swiglu="fused", loss="fused_linear_ce")
# (layout, our backend, attention): sdpa against Transformers' default, eager against eager.
COMBOS = [("per-expert", TORCH, "eager"), ("fused", FUSED, "sdpa")]


def make_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("nemotron_h", **{**BASE, **CONFIGS[name]})


@pytest.fixture(scope="module")
def nemotron_checkpoint(tmp_path_factory):
    cache: dict = {}

    def make(name: str, layout: str = "per-expert"):
        if (name, layout) not in cache:
            path = tmp_path_factory.mktemp(f"nemotron-{name}-{layout}")
            cache[name, layout] = write_checkpoint(path, make_config(name), layout, seed=7)
        return cache[name, layout]

    return make


@pytest.mark.parametrize("combo", range(len(COMBOS)))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers_logits_loss_and_grads(nemotron_checkpoint, name, combo):
    from transformers import AutoModelForCausalLM as HFModel

    layout, backend, attn = COMBOS[combo]
    path = nemotron_checkpoint(name, layout)
    hf = HFModel.from_pretrained(path, attn_implementation=attn)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, backend=backend)
    assert isinstance(ours, type(hf)) and ours.automoe_path == "native" and ours.layout == layout
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    out.loss.backward()
    if out.logits is None:  # the fused loss forms no logits: read them from a label-free pass
        with torch.no_grad():
            out.logits = ours(input_ids=ids, attention_mask=mask).logits
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.loss, ref.loss) <= 1e-5
    ref_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert list(our_params) == list(ref_params)  # names and Transformers' order
    for pname, p in our_params.items():
        assert p.grad is not None, f"{pname} got no gradient"
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname


def test_saved_checkpoint_loads_back_into_transformers_bit_identically(nemotron_checkpoint, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM as HFModel

    for layout in ("per-expert", "fused"):
        path = nemotron_checkpoint("latent_moe_biases", layout)
        automoe.AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / layout)
        original = HFModel.from_pretrained(path).state_dict()
        reloaded = HFModel.from_pretrained(tmp_path / layout).state_dict()
        assert reloaded.keys() == original.keys()
        for key, t in original.items():
            assert reloaded[key].dtype == t.dtype and torch.equal(reloaded[key], t), key

        def names(directory):
            with safe_open(str(next(directory.glob("*.safetensors"))), "pt") as f:
                return set(f.keys())

        assert names(tmp_path / layout) == names(path)  # `backbone.` and per-expert names as written
        if layout == "per-expert":
            assert any(n.startswith("backbone.layers.1.mixer.experts.0.") for n in names(path))


@pytest.mark.parametrize("name", ["mamba_moe_attn_mlp_groups2_chunk4", "attention_first_groups3_heads6"])
def test_generate_gives_transformers_tokens(nemotron_checkpoint, name):
    from transformers import AutoModelForCausalLM as HFModel

    path = nemotron_checkpoint(name)
    hf, ours = HFModel.from_pretrained(path), automoe.AutoModelForCausalLM.from_pretrained(path)
    ids, mask = left_padded_prompts(hf.config.vocab_size)
    for kwargs in (dict(do_sample=False), dict(do_sample=True, top_k=5)):
        runs = []
        for model in (hf, ours):
            torch.manual_seed(0)
            runs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                       pad_token_id=0, **kwargs))
        assert torch.equal(runs[1], runs[0]), kwargs


def test_decoding_runs_the_recurrent_step_on_the_cached_state(nemotron_checkpoint):
    """Each decoding call gets one token and the cache: the Mamba-2 layers can only have its
    predecessors from their carried conv and SSM state (there is nothing to re-scan), and the
    logits equal the full sequence's. A cache cannot be cropped (a recurrence has no rollback)."""
    path = nemotron_checkpoint("mamba_moe_attn_mlp_groups2_chunk4")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(1, 60, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = ours(input_ids=ids).logits
        out = ours(input_ids=ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(6, 11):
            out = ours(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            assert out.logits.shape[1] == 1 and cache.get_seq_length() == t + 1
            steps.append(out.logits)
    assert rel_err(torch.cat(steps, 1), full) <= 1e-5
    with pytest.raises(automoe.AutoMoEError, match="cannot remove positions from a recurrent layer"):
        cache.crop(-1)


def test_the_multi_token_prediction_module_is_skipped_as_transformers_skips_it(nemotron_checkpoint, tmp_path):
    """Nemotron 3 Super / Ultra ship `mtp.*` tensors (num_nextn_predict_layers): Transformers ignores
    them on load; the engine skips them with one message and runs the model Transformers runs."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM as HFModel

    path = tmp_path / "mtp"
    shutil.copytree(nemotron_checkpoint("mamba_moe_attn_mlp_groups2_chunk4"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["mtp.layers.0.norm.weight"] = torch.ones(cfg["hidden_size"])
    tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(32, cfg["hidden_size"])
    save_file(tensors, str(file), metadata={"format": "pt"})
    ids, mask, _ = padded_batch(cfg["vocab_size"])
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        want = HFModel.from_pretrained(path)(input_ids=ids, attention_mask=mask).logits
        assert rel_err(ours(input_ids=ids, attention_mask=mask).logits, want) <= 1e-5
    ours.save_pretrained(tmp_path / "out")
    with __import__("safetensors").safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as f:
        assert not any(k.startswith("mtp.") for k in f.keys())


def test_bf16_training_follows_transformers_losses_for_20_steps(tmp_path):
    """bfloat16 weights, AdamW, 20 steps on one batch: every loss within 1 % of Transformers' (the
    Mamba-2 scan runs in float32 on both sides; roundings of the bf16 GEMMs differ). Sizes in
    multiples of 8: Transformers' grouped_mm experts need 16-byte strides in bf16."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM as HFModel

    config = AutoConfig.for_model("nemotron_h", **{**BASE, **CONFIGS["latent_moe_biases"], "hidden_size": 32,
                                                   "moe_intermediate_size": 16, "moe_latent_size": 16,
                                                   "moe_shared_expert_intermediate_size": 16})
    path = write_checkpoint(tmp_path / "ckpt", config, "fused", seed=7)
    ids, mask, labels = padded_batch(BASE["vocab_size"])
    curves = []
    for load in (HFModel.from_pretrained, automoe.AutoModelForCausalLM.from_pretrained):
        model = load(path, dtype=torch.bfloat16)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves.append(losses)
    theirs, ours = curves
    assert theirs[-1] < 0.8 * theirs[0]  # it learns
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 0.01 * abs(b), (step, a, b)


def test_gradient_checkpointing_recomputes_the_hybrid_layers_exactly(nemotron_checkpoint):
    """Checkpointed Mamba-2, attention and MoE blocks (recomputed in the backward with the forward's
    padding mask and routing) give the gradients of the plain backward, bit for bit."""
    path = nemotron_checkpoint("latent_moe_biases")
    ids, mask, labels = padded_batch(BASE["vocab_size"])
    grads = []
    for checkpointing in (False, True):
        model = automoe.AutoModelForCausalLM.from_pretrained(path)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name
