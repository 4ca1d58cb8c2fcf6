"""LoRA with PEFT itself driving the engine: `get_peft_model` on AutoMoE's model and on
Transformers' model must train the same (attention target_modules, expert target_parameters, both),
adapters move between the two, merge_and_unload and save_pretrained are PEFT's own, and what the
engine cannot run is refused by name. Checkpoints are tiny Qwen3-MoE models Transformers writes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import qwen3_moe_config, rel_err, write_checkpoint

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import automoe  # noqa: E402
from automoe import AutoModelForCausalLM  # noqa: E402

ATTN = dict(target_modules=["q_proj", "v_proj"])
EXPERTS = dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
BOTH = dict(target_modules=["q_proj", "o_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lora-base"), qwen3_moe_config(), "fused")


def batches(vocab: int, n: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        yield ids, ids.clone()


def load_pair(ckpt):
    import transformers

    ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return ours, theirs


def peft_pair(ckpt, targets: dict, **extra):
    ours, theirs = load_pair(ckpt)
    cfg = LoraConfig(r=4, lora_alpha=8, **targets, **extra)
    torch.manual_seed(0)
    p_ours = get_peft_model(ours, copy.deepcopy(cfg))
    torch.manual_seed(0)
    p_theirs = get_peft_model(theirs, copy.deepcopy(cfg))
    # B starts at zero (PEFT's init): give it values so that the first forward already differs from
    # the base model's and every factor gets a gradient.
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for (n1, a), (n2, b) in zip(p_ours.named_parameters(), p_theirs.named_parameters()):
            assert n1 == n2
            if "lora_B" in n1:
                v = torch.randn(a.shape, generator=g) * 0.05
                a.copy_(v)
                b.copy_(v)
    return p_ours, p_theirs


def assert_logits_and_adapter_grads_match(ours, theirs):
    """One batch through both PEFT models: logits to 1e-5, every adapter's gradient to 1e-4."""
    ids, labels = next(batches(theirs.config.vocab_size, 1))
    out = [m(input_ids=ids, labels=labels) for m in (ours, theirs)]
    assert rel_err(out[0].logits.detach(), out[1].logits.detach()) <= 1e-5
    for o in out:
        o.loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    for n, p in theirs.named_parameters():
        if p.requires_grad:
            assert rel_err(grads[n], p.grad) <= 1e-4, n


@pytest.mark.parametrize("targets", [ATTN, EXPERTS, BOTH], ids=["attention", "experts", "both"])
def test_peft_trains_automoe_as_it_trains_transformers(ckpt, targets):
    p_ours, p_theirs = peft_pair(ckpt, targets)
    trainable = [n for n, p in p_ours.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainable == [n for n, p in p_theirs.named_parameters() if p.requires_grad]
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (p_ours, p_theirs)]
    losses = ([], [])
    for ids, labels in batches(97, 10):
        for m, opt, out in zip((p_ours, p_theirs), opts, losses):
            m.train()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(b), (losses)
    assert losses[0][-1] < losses[0][0]
    # The base weights did not move; the adapters did, identically on both sides.
    ours = dict(p_ours.named_parameters())
    for n, p in p_theirs.named_parameters():
        assert rel_err(ours[n].detach(), p.detach()) <= 1e-4, n


def test_adapter_trained_on_transformers_loads_into_automoe(ckpt, tmp_path):
    _, p_theirs = peft_pair(ckpt, BOTH)
    p_theirs.save_pretrained(tmp_path / "adapter")
    ours, theirs = load_pair(ckpt)
    lo = PeftModel.from_pretrained(ours, tmp_path / "adapter").eval()
    lt = PeftModel.from_pretrained(theirs, tmp_path / "adapter").eval()
    ids = next(batches(97, 1))[0]
    with torch.no_grad():
        got, want = lo(input_ids=ids).logits, lt(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5
    # ... and the adapter is not a no-op: without it the logits differ.
    with torch.no_grad(), lo.disable_adapter():
        plain = lo(input_ids=ids).logits
    assert rel_err(plain, want) > 1e-3


def test_merge_and_unload_and_save_pretrained_are_peft_s_own(ckpt, tmp_path):
    p_ours, p_theirs = peft_pair(ckpt, BOTH)
    ids = next(batches(97, 1))[0]
    with torch.no_grad():
        want = p_theirs(input_ids=ids).logits
        got = p_ours(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5
    p_ours.save_pretrained(tmp_path / "ours")
    p_theirs.save_pretrained(tmp_path / "theirs")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(
        tmp_path / "theirs" / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    merged = p_ours.merge_and_unload()
    assert isinstance(merged, automoe.native.Qwen3MoeForCausalLM)
    with torch.no_grad():
        assert rel_err(merged(input_ids=ids).logits, want) <= 1e-5
    merged.save_pretrained(tmp_path / "merged")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(back(input_ids=ids).logits, want) <= 1e-5


def test_gradient_checkpointing_and_bf16_model_with_float32_adapters(ckpt):
    ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    model = get_peft_model(ours, LoraConfig(r=4, lora_alpha=8, **BOTH))
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    model.gradient_checkpointing_enable()
    model.train()
    ids, labels = next(batches(97, 1))
    model(input_ids=ids, labels=labels).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "experts" in n and "lora_B" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_what_the_engine_cannot_run_is_refused_by_name(ckpt):
    ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = get_peft_model(ours, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    ids = next(batches(97, 1))[0]
    with pytest.raises(automoe.AutoMoEError, match=r"self_attn.q_proj: DoRA \(use_dora\)"):
        model(input_ids=ids)
    ours = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = get_peft_model(ours, peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                feedforward_modules=["down_proj"]))
    with pytest.raises(automoe.AutoMoEError, match=r"self_attn.k_proj is a PEFT peft.tuners.ia3"):
        model(input_ids=ids)


def test_transformers_trainer_with_peft_matches_transformers(ckpt, tmp_path):
    """Trainer on get_peft_model(AutoMoE's model) against the same on Transformers' model: padded
    batches, gradient checkpointing on, only the adapters train; then the Trainer saves the PEFT
    adapter."""
    from test_clients import assert_same_curve, losses, pad_collator, token_dataset, trainer_for

    train = token_dataset(16, 97, seed=0)
    runs = []
    for model in load_pair(ckpt):
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **BOTH))
        trainer = trainer_for(model, tmp_path / str(len(runs)), train, None, pad_collator(0),
                              max_steps=4, gradient_checkpointing=True, learning_rate=1e-2)
        trainer.train()
        runs.append(losses(trainer))
        trainer.save_model(tmp_path / f"adapter{len(runs)}")
        assert (tmp_path / f"adapter{len(runs)}" / "adapter_model.safetensors").exists()
    assert_same_curve(*runs)


@pytest.mark.parametrize("family, name", [("deepseek_v3", "qlora_groups2of1_shared1_dense1"),
                                          ("qwen2_moe", "norm_top3_e6_mlp_only"),
                                          ("mixtral", "sliding4_e7_top3")])
def test_all_linear_and_experts_on_other_families_match_peft_on_transformers(family, name, tmp_path):
    """MLA's low-rank projections, shared experts, Qwen2-MoE's shared_expert_gate [1, H] (PEFT's
    all-linear includes it, whatever the rank), dense MLP layers and Mixtral's experts: the logits
    and every adapter's gradient equal PEFT's on Transformers' model."""
    from test_parity_families import make_config

    path = write_checkpoint(tmp_path / "ckpt", make_config(family, name), "fused", seed=7)
    targets = dict(target_modules="all-linear",
                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ours, theirs = peft_pair(path, targets)
    names = {n.split(".lora_")[0] for n, p in ours.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in names) and any("proj" in n for n in names)
    assert_logits_and_adapter_grads_match(ours, theirs)


def test_nemotron_h_mamba_latent_and_relu2_experts_match_peft_on_transformers(tmp_path):
    """Nemotron-H under PEFT: the Mamba-2 in_proj (PEFT refuses out_proj and conv1d on Mamba
    models), attention, the shared expert, the dense MLP and the latent projections;
    target_parameters the routed experts without a gate (up_proj / down_proj). Logits and every
    adapter's gradient equal PEFT's on Transformers' model."""
    from test_parity_nemotron import make_config

    path = write_checkpoint(tmp_path / "ckpt", make_config("latent_moe_biases"), "fused", seed=7)
    targets = dict(target_modules=["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj", "fc1_latent_proj", "fc2_latent_proj"],
                   target_parameters=["mixer.experts.up_proj", "mixer.experts.down_proj"])
    ours, theirs = peft_pair(path, targets)
    names = {n.split(".lora_")[0] for n, p in ours.named_parameters() if p.requires_grad}
    for part in ("in_proj", "q_proj", "fc1_latent_proj", "shared_experts.up_proj", "3.mixer.up_proj",
                 "experts.up_proj", "experts.down_proj"):
        assert any(part in n for n in names), part
    assert_logits_and_adapter_grads_match(ours, theirs)


def test_disable_adapter_after_merge_gives_the_base_model(ckpt):
    """PEFT unmerges a merged adapter when it is disabled; the engine must see the base weights."""
    p_ours, p_theirs = peft_pair(ckpt, BOTH)
    ids = next(batches(97, 1))[0]
    with torch.no_grad():
        for m in (p_ours, p_theirs):
            m.merge_adapter()
        with p_ours.disable_adapter(), p_theirs.disable_adapter():
            assert rel_err(p_ours(input_ids=ids).logits, p_theirs(input_ids=ids).logits) <= 1e-5
        base = load_pair(ckpt)[1](input_ids=ids).logits
        with p_ours.disable_adapter():
            assert rel_err(p_ours(input_ids=ids).logits, base) <= 1e-5


@pytest.mark.parametrize("name", ["linear_full_linear_linear_r2_kernel3", "qwen3_5_linear_full_r2"])
def test_qwen3_next_deltanet_gated_attention_and_experts_match_peft_on_transformers(tmp_path, name):
    """Qwen3-Next / Qwen3.5 under PEFT: the gated DeltaNet's in-projections (fused per key head, or
    split) and out_proj, the gated attention's doubled q_proj, the shared expert and its gate;
    target_parameters the routed experts. Logits and every adapter's gradient equal PEFT's on
    Transformers' model."""
    import transformers
    from test_parity_qwen3_next import make_config, realistic_decays

    # Transformers' own initialisation (std 0.02): the adapters' effect is what the test measures;
    # with the parity tests' decays: its A_log draw reaches -20 per position, where the float32
    # decay gradient moves ~3e-5 between implementations (measured against float64 on identical
    # inputs: the ATen form 3.0e-5, the CPU kernel 2.4e-6; Transformers' own float32 adapter
    # gradient 1.9e-5 from its float64 one), so the 1e-4 check compared rounding, not the model.
    torch.manual_seed(7)
    path = tmp_path / "ckpt"
    model = transformers.AutoModelForCausalLM.from_config(make_config(name))
    with torch.no_grad():
        for n, p in model.named_parameters():
            realistic_decays(n, p)
    model.save_pretrained(path)
    targets = dict(target_modules=["in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                   "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj", "shared_expert_gate"],
                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ours, theirs = peft_pair(path, targets)
    names = {n.split(".lora_")[0] for n, p in ours.named_parameters() if p.requires_grad}
    # (PEFT itself picks which modules get adapters — on Qwen3-Next it leaves the shared expert's
    # MLP out; peft_pair holds the engine to the same names.)
    for part in ("linear_attn.out_proj", "self_attn.q_proj", "shared_expert_gate", "mlp.experts",
                 "linear_attn.in_proj_qkv" if "qwen3_5" in name else "linear_attn.in_proj_qkvz"):
        assert any(part in n for n in names), part
    assert_logits_and_adapter_grads_match(ours, theirs)
