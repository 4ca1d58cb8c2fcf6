"""Checkpoints AutoMoE writes: Transformers loads them with identical logits, the safetensors
package reads them, and load -> save -> load is bit-exact in both experts layouts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import padded_batch, run_cli
from safetensors import safe_open
from safetensors.torch import load_file

import automoe


def all_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("save_layout", [None, "per-expert", "fused"])
@pytest.mark.parametrize("src_layout", ["per-expert", "fused"])
def test_saved_checkpoint_loads_in_transformers_with_identical_logits(
    checkpoint_factory, tmp_path, src_layout, save_layout
):
    from transformers import AutoModelForCausalLM as HFModel

    src = checkpoint_factory("e6_top3_norm_mlp_only", src_layout)
    ours = automoe.AutoModelForCausalLM.from_pretrained(src)
    ours.save_pretrained(tmp_path, layout=save_layout)

    names = set(all_tensors(tmp_path))
    expect_fused = (save_layout or src_layout) == "fused"
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == expect_fused
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names) != expect_fused

    hf_ours = HFModel.from_pretrained(tmp_path, attn_implementation="eager")
    hf_orig = HFModel.from_pretrained(src, attn_implementation="eager")
    ids, mask, _ = padded_batch(hf_orig.config.vocab_size)
    with torch.no_grad():
        from_ours = hf_ours(input_ids=ids, attention_mask=mask).logits
        from_orig = hf_orig(input_ids=ids, attention_mask=mask).logits
        engine = ours(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(from_ours, from_orig)  # identical: the weights went through unchanged
    keep = mask.bool()
    assert (engine[keep] - from_orig[keep]).abs().max() <= 1e-5 * from_orig.abs().max()


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_load_save_load_is_bit_exact(checkpoint_factory, tmp_path, layout):
    src = checkpoint_factory("e5_top2_gqa2_untied", layout)
    first = automoe.AutoModelForCausalLM.from_pretrained(src)
    first.save_pretrained(tmp_path / "a")
    second = automoe.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert second.layout == layout
    p1, p2 = dict(first.named_parameters()), dict(second.named_parameters())
    assert p1.keys() == p2.keys()
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name
    # and the files themselves hold exactly what Transformers wrote
    original, ours = all_tensors(src), all_tensors(tmp_path / "a")
    assert original.keys() == ours.keys()
    for name in original:
        assert original[name].dtype == ours[name].dtype and torch.equal(original[name], ours[name]), name


def test_saved_files_have_pt_metadata_config_and_tokenizer_files(checkpoint_factory, tmp_path):
    src = checkpoint_factory("e5_top2_gqa2_untied")
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    model = automoe.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "float32"
    assert (tmp_path / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert (tmp_path / "generation_config.json").exists()


def test_sharded_save_writes_index_that_transformers_loads(checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM as HFModel

    src = checkpoint_factory("e7_top4_sparse_step2_gqa4")
    model = automoe.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / s).exists() for s in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in all_tensors(tmp_path).values())
    hf = HFModel.from_pretrained(tmp_path)
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        assert torch.equal(p, ours[name]), name
    # and our own reader takes the sharded directory back
    again = automoe.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(p, ours[n]) for n, p in again.named_parameters())


def test_bfloat16_load_casts_and_saves_bfloat16(checkpoint_factory, tmp_path):
    src = checkpoint_factory("e5_top2_gqa2_untied")
    model = automoe.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids, mask, labels = padded_batch(model.spec["vocab_size"])
    loss = model(ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(loss)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in all_tensors(tmp_path).values())


def test_optimizer_step_changes_the_engine_parameters(checkpoint_factory):
    """Parameters live in the engine; torch.optim updates exactly what the forward uses."""
    src = checkpoint_factory("e5_top2_gqa2_untied")
    model = automoe.AutoModelForCausalLM.from_pretrained(src)
    ids, mask, labels = padded_batch(model.spec["vocab_size"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model(ids, attention_mask=mask, labels=labels).loss
    before.backward()
    opt.step()
    after = model(ids, attention_mask=mask, labels=labels).loss
    assert after.item() < before.item()
    # the parameters own their memory: the checkpoint file still holds the original weights
    reloaded = automoe.AutoModelForCausalLM.from_pretrained(src)
    assert torch.allclose(reloaded(ids, attention_mask=mask, labels=labels).loss, before)


def test_convert_cli_round_trips_both_layouts_bit_exact(checkpoint_factory, tmp_path):
    src = checkpoint_factory("e4_top4_bias_tied_linear_rope", "per-expert")
    run_cli("convert", src, tmp_path / "fused", "--layout", "fused")
    run_cli("convert", tmp_path / "fused", tmp_path / "back", "--layout", "per-expert")
    fused = all_tensors(tmp_path / "fused")
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 24, 32)
    original, back = all_tensors(src), all_tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_inspect_cli_reports_architecture_counts_layout_and_dtype(checkpoint_factory):
    src = checkpoint_factory("e6_top3_norm_mlp_only", "fused")
    out = run_cli("inspect", src).stdout
    model = automoe.AutoModelForCausalLM.from_pretrained(src)
    total = model.num_parameters()
    assert "qwen3_moe (Qwen3MoeForCausalLM)" in out
    assert "3 (2 MoE, 1 dense)" in out
    assert f"({total})" in out
    assert "layout         fused" in out
    assert "F32 x" in out


def test_cli_reports_errors_with_exit_code_and_message(tmp_path):
    proc = run_cli("inspect", tmp_path / "nope", check=False)
    assert proc.returncode == 1 and "nope" in proc.stderr and "config" in proc.stderr
    proc = run_cli("convert", tmp_path, tmp_path / "out", "--layout", "stacked", check=False)
    assert proc.returncode == 1 and "stacked" in proc.stderr
    assert run_cli("frobnicate", check=False).returncode == 2


def test_parameters_replaced_on_the_module_are_what_the_engine_uses(checkpoint_factory):
    """load_state_dict(assign=True) (as PEFT/accelerate do) swaps Parameter objects: the engine
    must compute with, and put gradients on, the new ones."""
    src = checkpoint_factory("e5_top2_gqa2_untied")
    model = automoe.AutoModelForCausalLM.from_pretrained(src)
    ids, mask, labels = padded_batch(model.spec["vocab_size"])
    before = model(ids, attention_mask=mask, labels=labels).loss.item()
    state = {k: v.detach().clone() * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.loss.item() != before
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tied_lm_head_is_in_state_dict_like_transformers(checkpoint_factory):
    from transformers import AutoModelForCausalLM as HFModel

    src = checkpoint_factory("e3_top1_norm_tied")
    ours = automoe.AutoModelForCausalLM.from_pretrained(src)
    hf = HFModel.from_pretrained(src)
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert ours.state_dict()["lm_head.weight"].data_ptr() == ours.state_dict()["model.embed_tokens.weight"].data_ptr()
    hf.load_state_dict(ours.state_dict(), strict=True)
    assert len(list(ours.parameters())) == len(list(hf.parameters()))


def test_backend_round_trips_through_the_engine(checkpoint_factory):
    model = automoe.AutoModelForCausalLM.from_pretrained(checkpoint_factory("e5_top2_gqa2_untied"))
    backend = model.backend
    assert backend.attn == "sdpa" and backend.fake_balanced_gate is False
    backend.fake_balanced_gate = True
    model.set_backend(backend)
    assert model.backend.fake_balanced_gate is True
