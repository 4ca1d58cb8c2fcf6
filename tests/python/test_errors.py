"""Bad input gets a clear error naming the file, key or tensor — never a crash."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import padded_batch
from safetensors.torch import load_file, save_file

import automoe
from automoe import AutoModelForCausalLM
from automoe import AutoMoEError


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture_names_the_native_ones(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    edit_config(path, model_type="no_such_moe")
    with pytest.raises(AutoMoEError, match=r"neither AutoMoE's engine \(native: \['deepseek_v3', 'glm4_moe', 'gpt_oss', 'kimi_k2', 'mixtral', 'nemotron_h', 'olmoe', 'qwen2_moe', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_moe', 'qwen3_next'\]\) nor Transformers"):
        AutoModelForCausalLM.from_pretrained(path)


def test_checkpoint_that_does_not_match_its_fallback_model_is_refused(checkpoint_factory, tmp_path):
    """Qwen3-MoE weights under a GraniteMoE config: Transformers would initialise the missing
    weights at random and warn; AutoMoE refuses and names them."""
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    edit_config(path, model_type="granitemoe", num_local_experts=5)
    with pytest.raises(AutoMoEError, match=r"does not match Transformers' GraniteMoeForCausalLM.*missing keys"):
        AutoModelForCausalLM.from_pretrained(path)


def test_checkpoint_that_does_not_match_its_native_model_is_refused(checkpoint_factory, tmp_path):
    """Qwen3-MoE weights under a Mixtral config: the engine names the tensors Mixtral lacks."""
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied", "fused"), tmp_path / "m")
    edit_config(path, model_type="mixtral", num_local_experts=5, intermediate_size=12)
    with pytest.raises(AutoMoEError, match=r"tensor\(s\) that a mixtral model .* does not have: .*q_norm"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(hidden_act="gelu"), r"hidden_act.*silu.*gelu"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}), r"rope_type.*dynamic"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok"),
        (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config"),
        (dict(dtype="int4"), r"dtype.*int4"),
    ],
)
def test_unsupported_config_values_are_refused_at_load(checkpoint_factory, tmp_path, changes, pattern):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    edit_config(path, **changes)
    with pytest.raises(AutoMoEError, match=pattern) as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "config.json" in str(err.value)


def test_missing_tensor_is_named(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AutoMoEError, match=r"missing tensor model\.layers\.1\.self_attn\.k_norm\.weight"):
        AutoModelForCausalLM.from_pretrained(path)


def test_missing_expert_is_named(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.4.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AutoMoEError, match=r"missing tensor model\.layers\.0\.mlp\.experts\.4\.up_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(path)


def test_shape_mismatch_between_config_and_weights_is_named(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    edit_config(path, intermediate_size=41)  # no dense layer here: change the vocab instead
    edit_config(path, vocab_size=98)
    with pytest.raises(AutoMoEError, match=r"model\.embed_tokens\.weight: expected shape \[98, 24\].*found \[97, 24\]"):
        AutoModelForCausalLM.from_pretrained(path)


def test_unexpected_tensors_are_reported(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AutoMoEError, match=r"shared_expert"):
        AutoModelForCausalLM.from_pretrained(path)


def test_corrupt_safetensors_file_is_reported_not_crashed(checkpoint_factory, tmp_path):
    path = copy_ckpt(checkpoint_factory("e5_top2_gqa2_untied"), tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AutoMoEError, match=r"model\.safetensors"):
        AutoModelForCausalLM.from_pretrained(path)


def test_not_a_directory_and_unknown_arguments(checkpoint_factory, tmp_path):
    with pytest.raises(OSError, match="not a local checkpoint directory"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "missing")
    with pytest.raises(OSError, match="config.json: cannot read the checkpoint's config"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    path = checkpoint_factory("e5_top2_gqa2_untied")
    with pytest.raises(TypeError, match=r"neither from_pretrained's nor keys of the qwen3_moe config: \['not_an_argument'\]"):
        AutoModelForCausalLM.from_pretrained(path, not_an_argument=1)
    with pytest.raises(ValueError, match="device_map=.*one device"):
        AutoModelForCausalLM.from_pretrained(path, device_map={"model": "cpu", "lm_head": "meta"})
    with pytest.raises(ValueError, match="quantization_config"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config={"load_in_8bit": True})
    with pytest.warns(UserWarning, match=r"revision \(only used to download.*low_cpu_mem_usage \(AutoMoE always loads with low memory"):
        AutoModelForCausalLM.from_pretrained(path, low_cpu_mem_usage=True, revision="main")


def test_unimplemented_backend_value_names_the_available_ones(checkpoint_factory):
    path = checkpoint_factory("e5_top2_gqa2_untied")
    with pytest.raises(AutoMoEError, match=r"experts=\"deepep\" is not implemented.*available: grouped, torch_mm, eager"):
        AutoModelForCausalLM.from_pretrained(path, backend={"experts": "deepep"})
    with pytest.raises(AutoMoEError, match=r"loss=\"liger\" is not implemented.*available: torch, fused_linear_ce"):
        AutoModelForCausalLM.from_pretrained(path, backend={"loss": "liger"})
    with pytest.raises(ValueError, match="unknown field"):
        AutoModelForCausalLM.from_pretrained(path, backend={"expert": "eager"})


def test_bad_forward_inputs_are_named(checkpoint_factory):
    model = AutoModelForCausalLM.from_pretrained(checkpoint_factory("e5_top2_gqa2_untied"))
    ids, mask, labels = padded_batch(model.spec["vocab_size"])
    with pytest.raises(AutoMoEError, match=r"input_ids: token ids must be in \[0, 97\)"):
        model(ids + 1000)
    with pytest.raises(AutoMoEError, match=r"attention_mask: expected shape \[3, 9\]"):
        model(ids, attention_mask=mask[:, :5])
    with pytest.raises(AutoMoEError, match=r"labels: expected token ids in \[0, 97\) or -100"):
        model(ids, labels=labels - 200)
    with pytest.raises(AutoMoEError, match=r"input_ids: expected integer token ids"):
        model(ids.float())
    with pytest.raises(AutoMoEError, match=r"input_ids: expected a \[batch, seq\] tensor"):
        model(ids[0])
