"""`automoe train` with a `peft:` block: LoRA on attention and on the routed experts, frozen base,
checkpoints of adapters only, per-layer expert-adapter metrics, and exports checked by tools we did
not write: PEFT loads the adapter onto Transformers' model, Transformers loads the merged model —
both with the logits AutoMoE's engine computes with the same adapter."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import AUTOMOE_BIN, rel_err
from test_train import base_recipe, load_tensors, metrics, model_dir, run_train, tokenizer  # noqa: F401

peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_recipe(model_dir, tmp, run, **peft_section):
    section = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "target_parameters": EXPERTS, **peft_section}
    return base_recipe(model_dir, tmp, run, peft=section, optimizer={"lr": 1e-2})


def sample_ids(vocab: int = 400):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (2, 16), generator=g)


@pytest.mark.parametrize("moe_rank_scaling", [False, True], ids=["rank", "rank-over-topk"])
def test_lora_round_trip_through_peft_and_transformers(model_dir, tmp_path, moe_rank_scaling):
    import transformers
    from peft import PeftModel

    import automoe

    run = tmp_path / "run"
    run_train(lora_recipe(model_dir, tmp_path, "run", moe_rank_scaling=moe_rank_scaling,
                          export_merged=True), tmp_path)
    adapter, merged_dir = run / "export", run / "export-merged"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["target_parameters"] == EXPERTS
    top_k = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    if moe_rank_scaling:
        assert cfg["rank_pattern"] == {"experts.gate_up_proj": 4 // top_k, "experts.down_proj": 4 // top_k}
    else:
        assert cfg["rank_pattern"] == {}

    ids = sample_ids()
    theirs = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    ours = PeftModel.from_pretrained(
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        assert rel_err(theirs(input_ids=ids).logits, want) <= 1e-5
        assert rel_err(merged(input_ids=ids).logits, want) <= 1e-5
        with ours.disable_adapter():
            assert rel_err(ours(input_ids=ids).logits, want) > 1e-4  # the adapter changed something

    # merged = base + scaling·B·A exactly, per targeted expert; each expert that received tokens
    # during training has changed.
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    counts = torch.zeros(2, base.config.num_experts, dtype=torch.long)
    for rec in metrics(run).values():
        for layer in rec["expert_load"]:
            counts[layer["layer"]] += torch.tensor(layer["counts"])
    peft_base = theirs.base_model.model
    for layer in range(2):
        experts = peft_base.model.layers[layer].mlp.experts  # lora.ParamWrapper(down(gate_up))
        for wrapper in (experts, experts.base_layer):
            delta = wrapper.get_delta_weight("default")
            name = wrapper.parameter_name
            w0 = getattr(base.model.layers[layer].mlp.experts, name)
            w1 = getattr(merged.model.layers[layer].mlp.experts, name)
            assert rel_err(w1 - w0, delta) <= 1e-5, (layer, name)
            changed = (w1 - w0).flatten(1).abs().amax(1) > 0
            assert torch.equal(changed, counts[layer] > 0), (layer, name, changed, counts[layer])


def test_lora_checkpoints_hold_only_adapters_and_resume_with_the_same_losses(model_dir, tmp_path):
    recipe = lora_recipe(model_dir, tmp_path, "full")
    run_train(recipe, tmp_path)
    full = metrics(tmp_path / "full")
    # The same run stopped after 2 steps (a checkpoint every step), then resumed to 4.
    recipe = lora_recipe(model_dir, tmp_path, "split")
    recipe["checkpoint"]["every"] = 1
    run_train(recipe, tmp_path, "train.max_steps=2")
    saved = load_tensors(tmp_path / "split" / "step-2" / "model.safetensors")
    assert saved and all(".lora_A" in k or ".lora_B" in k for k in saved), sorted(saved)[:4]
    assert any(k.endswith("experts.gate_up_proj.lora_A") for k in saved)
    run_train(recipe, tmp_path)
    split = metrics(tmp_path / "split")
    for step in (1, 2, 3, 4):
        assert split[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-6), step
    # Resuming with another LoRA setting (or none) is refused by name.
    recipe["peft"]["r"] = 8
    proc = run_train(recipe, tmp_path, "train.max_steps=6", check=False)
    assert proc.returncode != 0 and "holds LoRA adapters" in proc.stderr


def test_expert_adapter_metrics_show_which_experts_trained(model_dir, tmp_path):
    run_train(lora_recipe(model_dir, tmp_path, "run"), tmp_path)
    recs = metrics(tmp_path / "run")
    for step, rec in recs.items():
        layers = rec["expert_lora"]
        assert [x["layer"] for x in layers] == [0, 1]
        for x, load in zip(layers, rec["expert_load"]):
            # B starts at zero, so only B trains at step 1; an expert with tokens always gets a
            # gradient.
            assert x["experts_with_grad"] == sum(c > 0 for c in load["counts"]), (step, x, load)
            assert x["update_norm"] > 0


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_lora_trains_with_activation_checkpointing_identically(model_dir, tmp_path, dropout):
    """With dropout on the adapters, the recomputed layer replays the forward's masks."""
    extra = dict(lora_dropout=dropout, target_parameters=[]) if dropout else {}
    plain = lora_recipe(model_dir, tmp_path, "plain", **extra)
    ckpt = lora_recipe(model_dir, tmp_path, "ckpt", **extra)
    ckpt["train"]["activation_checkpointing"] = True
    run_train(plain, tmp_path)
    run_train(ckpt, tmp_path)
    a, b = metrics(tmp_path / "plain"), metrics(tmp_path / "ckpt")
    for step in a:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)


def test_bfloat16_lora_keeps_the_base_in_bf16_and_the_loss_falls(model_dir, tmp_path):
    recipe = lora_recipe(model_dir, tmp_path, "run", target_modules="all-linear")
    recipe["model"]["dtype"] = "bfloat16"
    recipe["train"]["max_steps"] = 8
    recipe["checkpoint"]["every"] = 4
    run_train(recipe, tmp_path)
    # The checkpoint holds float32 adapters and no base weight (those stay bf16, frozen, unsaved).
    saved = load_tensors(tmp_path / "run" / "step-4" / "model.safetensors")
    assert all(".lora_" in k and t.dtype == torch.float32 for k, t in saved.items())
    recs = metrics(tmp_path / "run")
    assert recs[8]["loss"] < recs[1]["loss"]
    cfg = json.loads((tmp_path / "run" / "export" / "adapter_config.json").read_text())
    # all-linear on a model whose every layer is MoE: the attention projections (routers are not
    # linear layers; the experts are target_parameters)
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    adapter = load_tensors(tmp_path / "run" / "export" / "adapter_model.safetensors")
    assert all(t.dtype == torch.float32 for t in adapter.values())


def test_export_merge_command_merges_a_peft_adapter(model_dir, tmp_path):
    """`automoe export --merge` on an adapter PEFT itself trained on Transformers' model."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "o_proj"],
                                          target_parameters=["mlp.experts.down_proj"],
                                          rank_pattern={"experts.down_proj": 2}))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(tmp_path / "adapter")
    ids = sample_ids()
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    proc = subprocess.run([str(AUTOMOE_BIN), "export", str(tmp_path / "adapter"), str(tmp_path / "out"),
                           "--merge", "--base", str(model_dir)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "6 LoRA adapters merged (2 on routed experts)" in proc.stdout  # 2 layers x k, o, experts
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(merged(input_ids=ids).logits, want) <= 1e-5
    assert (tmp_path / "out" / "tokenizer.json").exists()


@pytest.mark.parametrize("section,message", [
    ({"target_modules": ["q_projection"]}, r"target_modules: \"q_projection\" matches no linear layer"),
    ({"target_modules": ["gate"]}, r"selects model.layers.0.mlp.gate \(a router\)"),
    ({"target_parameters": ["mlp.experts.up_proj"]}, r"\"mlp.experts.up_proj\" matches no routed-experts tensor"),
    ({"r": 64, "target_modules": ["k_proj"]}, r"rank 64 on model.layers.0.self_attn.k_proj \(16 x 32\) must be between 1"),
    ({"lora_dropout": 0.1}, r"peft.lora_dropout: 0.1 with routed experts targeted"),
    ({"target_modules": None, "target_parameters": None}, r"say which weights get adapters"),
])
def test_lora_recipe_errors_name_the_target(model_dir, tmp_path, section, message):
    recipe = lora_recipe(model_dir, tmp_path, "run")
    for k, v in section.items():
        if v is None:
            recipe["peft"].pop(k)
        else:
            recipe["peft"][k] = v
    if "target_modules" in section and "target_parameters" not in section and section["target_modules"]:
        recipe["peft"].pop("target_parameters")
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode != 0
    import re

    assert re.search(message, proc.stderr), proc.stderr


def test_an_adapter_for_another_model_is_refused_with_its_shapes(model_dir, tmp_path):
    run_train(lora_recipe(model_dir, tmp_path, "run"), tmp_path)
    other = tmp_path / "other"
    from automoe.demo import build_checkpoint
    from test_train import EXAMPLES  # noqa: F401

    import automoe.demo

    tok = automoe.demo.build_tokenizer(EXAMPLES / "corpus.txt", vocab_size=400)
    build_checkpoint(other, tok, seed=1, hidden_size=48, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, mlp_only_layers=[], num_experts=4, head_dim=8,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    proc = subprocess.run([str(AUTOMOE_BIN), "export", str(tmp_path / "run" / "export"),
                           str(tmp_path / "out"), "--merge", "--base", str(other)],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "was it trained on another base model?" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


HYBRID_LORA = {
    "nemotron_h": (["in_proj", "q_proj", "o_proj"], ["mixer.experts.up_proj", "mixer.experts.down_proj"]),
    "qwen3_next": (["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "o_proj"],
                   ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


@pytest.mark.parametrize("family", sorted(HYBRID_LORA))
def test_hybrid_lora_recipe_round_trips_through_peft_and_transformers(tmp_path, tmp_path_factory, tokenizer,
                                                                      family):
    """LoRA through the recipe on Nemotron-H (Mamba-2 in_proj, attention, the relu2 experts without
    a gate) and Qwen3-Next (gated DeltaNet's projections, the gated attention, the routed experts):
    PEFT loads the exported adapter onto Transformers' model and Transformers the merged model,
    both with the engine's logits."""
    import transformers
    from peft import PeftModel
    from test_train_families import tiny_family_checkpoint

    import automoe

    model_dir = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    modules, experts = HYBRID_LORA[family]
    run_train(lora_recipe(model_dir, tmp_path, "run", target_modules=modules,
                          target_parameters=experts, export_merged=True), tmp_path)
    adapter, merged_dir = tmp_path / "run" / "export", tmp_path / "run" / "export-merged"
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"] == experts
    ids = sample_ids(300)
    theirs = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    ours = PeftModel.from_pretrained(
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        assert rel_err(theirs(input_ids=ids).logits, want) <= 1e-5
        assert rel_err(merged(input_ids=ids).logits, want) <= 1e-5
        with ours.disable_adapter():
            assert rel_err(ours(input_ids=ids).logits, want) > 1e-4
