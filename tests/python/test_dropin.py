"""The drop-in is Transformers' own model class: its module tree, methods and arguments behave as
Transformers' do, its compute runs in the engine, and what the engine cannot honour is refused by
name. (Trainer, TRL, accelerate: test_clients.py; generation: test_generate.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import autograd_node_names, padded_batch, rel_err
from torch import nn

import automoe
from automoe import AutoMoEError


@pytest.fixture
def pair(checkpoint_factory):
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e5_top2_gqa2_untied")
    return automoe.AutoModelForCausalLM.from_pretrained(path), HFModel.from_pretrained(path), path


def test_is_transformers_class_with_its_module_tree_and_methods(pair):
    import transformers

    ours, ref, path = pair
    assert isinstance(ours, transformers.Qwen3MoeForCausalLM)
    assert isinstance(ours, transformers.PreTrainedModel) and isinstance(ours, transformers.GenerationMixin)
    assert type(ours).__name__ == "Qwen3MoeForCausalLM" and ours.automoe_path == "native"
    assert [(n, type(m).__name__) for n, m in ours.named_modules()] == \
        [(n, type(m).__name__) for n, m in ref.named_modules()]
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert not ours.training  # from_pretrained returns an eval-mode model, as Transformers'
    assert ours.loss_type == ref.loss_type == "ForCausalLM"
    assert ours.can_generate() and ours.generation_config.to_dict() == ref.generation_config.to_dict()
    assert ours.num_parameters() == ref.num_parameters()
    assert ours.num_parameters(exclude_embeddings=True) == ref.num_parameters(exclude_embeddings=True)
    assert ours.get_input_embeddings().weight is ours.model.embed_tokens.weight
    assert isinstance(ours.get_output_embeddings(), nn.Linear)
    assert ours.base_model is ours.model and ours.dtype == torch.float32 and ours.device.type == "cpu"
    ours.add_model_tags(["automoe-test"])
    assert "automoe-test" in ours.model_tags
    assert ours.config._name_or_path == str(path)


def test_backbone_hidden_states_and_return_dict_like_transformers(pair):
    ours, ref, _ = pair
    ids, mask, labels = padded_batch(97)
    with torch.no_grad():
        got = ours.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_router_logits=True)
        want = ref.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_router_logits=True)
        assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-5
        assert len(got.hidden_states) == len(want.hidden_states) == 3
        for a, b in zip(got.hidden_states, want.hidden_states):
            assert rel_err(a, b) <= 1e-5
        assert len(got.router_logits) == len(want.router_logits) == 2
        as_tuple = ours(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
        ref_tuple = ref(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
        assert isinstance(as_tuple, tuple) and len(as_tuple) == len(ref_tuple)
        assert rel_err(as_tuple[0], ref_tuple[0]) <= 1e-5
        kept = ours(input_ids=ids, logits_to_keep=1).logits
        assert kept.shape == (3, 1, 97) and rel_err(kept, ref(input_ids=ids, logits_to_keep=1).logits) <= 1e-5
        embeds = ref.get_input_embeddings()(ids)
        assert rel_err(ours(inputs_embeds=embeds, attention_mask=mask).logits,
                       ref(inputs_embeds=embeds, attention_mask=mask).logits) <= 1e-5


def test_config_overrides_reach_the_engine(checkpoint_factory):
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e5_top2_gqa2_untied")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, output_router_logits=True, num_experts_per_tok=3)
    ref = HFModel.from_pretrained(path, output_router_logits=True, num_experts_per_tok=3)
    ids, mask, labels = padded_batch(97)
    got, want = ours(ids, attention_mask=mask, labels=labels), ref(ids, attention_mask=mask, labels=labels)
    assert got.aux_loss is not None and rel_err(got.aux_loss, want.aux_loss) <= 1e-5
    assert rel_err(got.loss, want.loss) <= 1e-5


def test_deepcopy_is_an_independent_model(pair):
    ours, _, _ = pair
    ids, mask, labels = padded_batch(97)
    twin = copy.deepcopy(ours)
    with torch.no_grad():
        before = ours(ids, attention_mask=mask).logits
        assert torch.equal(twin(ids, attention_mask=mask).logits, before)
    twin.train()
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.5)
    twin(ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()
    with torch.no_grad():
        assert torch.equal(ours(ids, attention_mask=mask).logits, before)  # the original is untouched
        assert not torch.equal(twin(ids, attention_mask=mask).logits, before)
    assert all(p.grad is None for p in ours.parameters())


def test_resize_token_embeddings_then_train_and_save(pair, tmp_path):
    from transformers import AutoModelForCausalLM as HFModel

    ours, ref, _ = pair
    for model in (ours, ref):
        torch.manual_seed(0)
        model.resize_token_embeddings(105)
    assert ours.config.vocab_size == 105 and ours.spec["vocab_size"] == 97  # re-bound at the next forward
    ids = torch.randint(0, 105, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (ours, ref):
        model.train()
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    got, want = ours(ids, labels=ids), ref(ids, labels=ids)
    assert ours.spec["vocab_size"] == 105 and got.logits.shape[-1] == 105
    assert rel_err(got.loss, want.loss) <= 1e-5
    got.loss.backward()
    want.loss.backward()
    assert rel_err(ours.lm_head.weight.grad, ref.lm_head.weight.grad) <= 1e-4
    with torch.no_grad():
        for p in ours.parameters():
            p -= 0.1 * p.grad
    ours.save_pretrained(tmp_path / "resized")
    ours.eval()
    with torch.no_grad():
        assert rel_err(HFModel.from_pretrained(tmp_path / "resized")(ids).logits, ours(ids).logits) <= 1e-5


def test_from_config_builds_a_model_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM as HFModel
    from conftest import qwen3_moe_config

    torch.manual_seed(0)
    model = automoe.AutoModelForCausalLM.from_config(qwen3_moe_config(pad_token_id=0))
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.automoe_path == "native"
    emb = model.get_input_embeddings().weight
    assert emb[0].abs().sum() == 0 and 0.15 < emb[1:].std() / 0.02 < 10  # pad row zero, N(0, 0.02)
    ids = torch.randint(1, 97, (2, 6))
    model.save_pretrained(tmp_path / "fresh")
    with torch.no_grad():
        assert rel_err(HFModel.from_pretrained(tmp_path / "fresh")(ids).logits, model(ids).logits) <= 1e-5


def test_save_pretrained_takes_transformers_arguments(pair, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM as HFModel

    ours, _, _ = pair
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    state["model.norm.weight"].fill_(2.0)
    ours.save_pretrained(tmp_path / "sd", state_dict=state, save_original_format=False)
    assert torch.all(HFModel.from_pretrained(tmp_path / "sd").model.norm.weight == 2.0)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "sd" / "model.safetensors")
    assert torch.all(ours.model.norm.weight != 2.0)  # the model itself is unchanged
    with pytest.raises(ValueError, match="push_to_hub"):
        ours.save_pretrained(tmp_path / "hub", push_to_hub=True)
    with pytest.raises(AutoMoEError, match=r"state_dict: missing model\.embed_tokens\.weight"):
        ours.save_pretrained(tmp_path / "partial", state_dict={"lm_head.weight": state["lm_head.weight"]})
    with pytest.warns(UserWarning, match=r"safe_serialization \(weights are always written as safetensors"):
        ours.save_pretrained(tmp_path / "unsafe", safe_serialization=False)


def test_load_state_dict_reads_either_experts_layout(pair, tmp_path):
    """What Trainer's resume_from_checkpoint does: load_state_dict of a saved model.safetensors,
    here in the per-expert layout Transformers writes by default."""
    from safetensors.torch import load_file

    ours, _, path = pair
    on_disk = load_file(path / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    result = ours.load_state_dict(on_disk)
    assert not result.missing_keys and not result.unexpected_keys
    gate_up = ours.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(gate_up[3, 12:], on_disk["model.layers.0.mlp.experts.3.up_proj.weight"])


def test_peft_adapters_and_submodule_hooks_are_refused_by_name(pair):
    """A hook on a submodule would be silently skipped by the engine, and so would a PEFT feature it
    does not run (DoRA here; plain LoRA runs: test_lora.py): both are refused by name."""
    from peft import LoraConfig, get_peft_model

    ours, _, path = pair
    ids = torch.randint(0, 97, (1, 5))
    handle = ours.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    with pytest.raises(AutoMoEError, match=r"model\.layers\.0\.mlp .*has a hook registered"):
        ours(ids)
    handle.remove()
    fresh = automoe.AutoModelForCausalLM.from_pretrained(path)
    peft_model = get_peft_model(fresh, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(AutoMoEError, match=r"q_proj: DoRA \(use_dora\).*force_transformers=True"):
        peft_model(input_ids=ids)
    # The fallback path is Transformers' own model: PEFT works there.
    fallback = automoe.AutoModelForCausalLM.from_pretrained(path, force_transformers=True)
    assert fallback.automoe_path == "transformers"
    adapted = get_peft_model(fallback, LoraConfig(r=4, target_modules=["q_proj"]))
    adapted(input_ids=ids, labels=ids).loss.backward()
    assert adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.grad is not None


def test_unsupported_forward_arguments_are_refused(pair):
    ours, _, _ = pair
    ids = torch.randint(0, 97, (1, 5))
    with pytest.raises(TypeError, match="output_attentions"):
        ours(ids, output_attentions=True)
    with pytest.raises(TypeError, match=r"arguments not supported by AutoMoE: \['token_type_ids'\]"):
        ours(ids, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(AutoMoEError, match="attn_implementation='flex_attention'"):
        ours.config._attn_implementation = "flex_attention"
        ours(ids)


def test_load_logs_the_path_taken(checkpoint_factory, capfd):
    import logging

    logger = logging.getLogger("automoe")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        path = checkpoint_factory("e5_top2_gqa2_untied")
        automoe.AutoModelForCausalLM.from_pretrained(path)
        assert "runs natively in the AutoMoE engine" in capfd.readouterr().err
        automoe.AutoModelForCausalLM.from_pretrained(path, force_transformers=True)
        assert ("runs as Transformers' Qwen3MoeForCausalLM with AutoMoE kernels: experts: AutoMoE grouped "
                "GEMMs (2 modules: gated, fused SwiGLU)") in capfd.readouterr().err
    finally:
        logger.setLevel(level)


def test_gradient_checkpointing_enable_reaches_the_engine(pair):
    """Trainer's gradient_checkpointing_enable(gradient_checkpointing_kwargs=...): in training mode
    each layer runs checkpointed in the engine (and the cache is off, as in Transformers)."""
    ours, _, _ = pair
    ids = torch.randint(0, 97, (2, 7))
    ours.train()
    plain = ours(ids, labels=ids)
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ours.is_gradient_checkpointing
    checkpointed = ours(ids, labels=ids)
    assert checkpointed.past_key_values is None and plain.past_key_values is not None
    layer_fn = "CheckpointedLayerFn"
    assert not any(layer_fn in n for n in autograd_node_names(plain.loss))
    assert any(layer_fn in n for n in autograd_node_names(checkpointed.loss))
    assert torch.equal(checkpointed.loss, plain.loss)
    ours.eval()  # not in eval mode
    assert not any(layer_fn in n for n in autograd_node_names(ours(ids, labels=ids).loss))


def test_transformers_implementation_switches_reach_the_engine(pair):
    """set_experts_implementation / set_attn_implementation (Transformers' API) choose the engine's
    backends; a value the engine does not implement is refused at the next forward."""
    ours, _, _ = pair
    ids = torch.randint(0, 97, (1, 6))
    assert ours.config._experts_implementation == "automoe" and ours.backend.experts == "grouped"
    ours.set_experts_implementation("eager")
    ours.set_attn_implementation("eager")
    ours(ids)
    assert ours.backend.experts == "eager" and ours.backend.attn == "eager"
    ours.config._experts_implementation_internal = "batched_mm"
    with pytest.raises(AutoMoEError, match=r"experts_implementation='batched_mm'"):
        ours(ids)


def test_data_parallel_replicas_are_refused(pair):
    ours, _, _ = pair
    ours._is_replica = True  # what nn.DataParallel's replicate() marks its copies with
    with pytest.raises(AutoMoEError, match="DataParallel"):
        ours(torch.randint(0, 97, (1, 4)))


def test_dtype_auto_without_a_config_dtype_keeps_the_stored_dtype(checkpoint_factory, tmp_path):
    """A config.json without "dtype": weights load in the dtype they are stored in (Transformers'
    rule for dtype="auto"), not float32."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "bf16"
    shutil.copytree(checkpoint_factory("e5_top2_gqa2_untied"), path)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(cfg))
    assert automoe.AutoModelForCausalLM.from_pretrained(path, dtype="auto").dtype == torch.bfloat16


def test_from_pretrained_does_not_modify_the_config_passed_in(checkpoint_factory):
    from transformers import AutoConfig

    path = checkpoint_factory("e5_top2_gqa2_untied")
    config = AutoConfig.from_pretrained(path)
    model = automoe.AutoModelForCausalLM.from_pretrained(path, config=config, output_router_logits=True)
    assert model.config.output_router_logits and not config.output_router_logits


def test_double_backward_is_refused_on_fused_ops_and_matches_transformers_on_the_reference_ones(checkpoint_factory):
    """A gradient penalty (create_graph=True): the fused backends refuse it by name; with every
    component on its reference backend the second-order gradient is Transformers'."""
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e5_top2_gqa2_untied")
    ids = torch.randint(0, 90, (2, 7), generator=torch.Generator().manual_seed(0))

    def penalty(model):
        loss = model(ids, labels=ids).loss
        emb = model.get_input_embeddings().weight
        (g,) = torch.autograd.grad(loss, emb, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), emb)
        return gg

    fused = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with pytest.raises(Exception, match="no double backward"):
        penalty(fused)
    reference = automoe.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager",
        backend={"experts": "eager", "rms_norm": "torch", "rope": "torch", "swiglu": "torch",
                 "linear": "torch", "loss": "torch"})
    hf = HFModel.from_pretrained(path, attn_implementation="eager", experts_implementation="eager")
    assert rel_err(penalty(reference), penalty(hf)) <= 1e-4
