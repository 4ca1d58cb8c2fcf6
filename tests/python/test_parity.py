"""Qwen3-MoE in AutoMoE matches Transformers v5 on checkpoints Transformers wrote.

float32, a batch with left and right padding: logits (at every position, padding included), loss
and aux loss to 1e-5 relative, every parameter's gradient after loss.backward() to 1e-4 relative;
for every backend combination below, with Transformers' default attention (sdpa) against AutoMoE's
sdpa and Transformers' eager against AutoMoE's eager. The left-padded row's first real token is
predicted from a query that sees no key, where sdpa and eager differ: each side must follow its own.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, padded_batch

import automoe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


TORCH = dict(experts="eager", rms_norm="torch", rope="torch", swiglu="torch", loss="torch")
FUSED = dict(experts="grouped", rms_norm="fused", rope="fused", swiglu="fused",
             loss="fused_linear_ce")
BACKENDS = {
    "all_torch": TORCH,
    "all_fused": FUSED,
    "torch_mm": dict(FUSED, experts="torch_mm", loss="torch"),
    "grouped_torch_swiglu": dict(TORCH, experts="grouped"),
}


def run_both(path, attn="sdpa", backend=None, **forward_kwargs):
    from transformers import AutoModelForCausalLM as HFModel

    hf = HFModel.from_pretrained(path, attn_implementation=attn)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                        backend=backend or FUSED)
    ids, mask, labels = padded_batch(hf.config.vocab_size)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, **forward_kwargs)
    ref = hf(**kwargs)
    out = ours(**kwargs)
    ref.loss.backward()
    out.loss.backward()
    if out.logits is None:  # the fused loss returns no logits: read them from a label-free pass
        with torch.no_grad():
            out.logits = ours(input_ids=ids, attention_mask=mask).logits
    return hf, ours, ref, out, mask


@pytest.mark.parametrize("layout, backend, attn", [
    ("per-expert", "all_torch", "sdpa"), ("fused", "all_torch", "eager"),
    ("per-expert", "all_fused", "eager"), ("fused", "all_fused", "sdpa"),
    ("fused", "torch_mm", "sdpa"), ("fused", "grouped_torch_swiglu", "eager")])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers_logits_loss_aux_and_grads(checkpoint_factory, name, layout, backend, attn):
    path = checkpoint_factory(name, layout)
    hf, ours, ref, out, mask = run_both(path, attn=attn, backend=BACKENDS[backend],
                                        output_router_logits=True)
    assert ours.layout == layout
    if backend == "all_fused":
        assert ours(input_ids=torch.ones(1, 3, dtype=torch.long),
                    labels=torch.ones(1, 3, dtype=torch.long)).logits is None

    keep = mask.bool()
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.loss, ref.loss) <= 1e-5
    assert rel_err(out.aux_loss, ref.aux_loss) <= 1e-5
    assert len(out.router_logits) == len(ref.router_logits) == sum(ours.spec["layer_is_moe"])
    for ours_rl, ref_rl in zip(out.router_logits, ref.router_logits):
        assert rel_err(ours_rl.view(3, 9, -1)[keep], ref_rl.view(3, 9, -1)[keep]) <= 1e-5

    ref_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == ref_params.keys()
    for pname, p in our_params.items():
        assert p.shape == ref_params[pname].shape, pname
        assert p.grad is not None, f"{pname} got no gradient"
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_query_that_sees_no_key_follows_each_attention(checkpoint_factory, attn):
    """Labels on the left-padded row's first real token: its prediction comes from a padding query
    with no key to attend to. Transformers' sdpa (bool mask) and eager (finite mask) treat that row
    differently; loss and every gradient must match the attention Transformers uses."""
    path = checkpoint_factory("e7_top4_sparse_step2_gqa4")
    from transformers import AutoModelForCausalLM as HFModel

    hf = HFModel.from_pretrained(path, attn_implementation=attn)
    ours = automoe.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    ids, mask, _ = padded_batch(hf.config.vocab_size)
    labels = ids.clone()  # every position carries a label, padding included
    ref, out = hf(input_ids=ids, attention_mask=mask, labels=labels), ours(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    out.loss.backward()
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.loss, ref.loss) <= 1e-5
    ref_params = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        assert rel_err(p.grad, ref_params[pname].grad) <= 1e-4, pname
    # and the two attentions really differ there (so the test can tell them apart)
    other = HFModel.from_pretrained(path, attn_implementation="eager" if attn == "sdpa" else "sdpa")
    assert rel_err(other(input_ids=ids, attention_mask=mask, labels=labels).loss, ref.loss) > 1e-4


def test_aux_loss_is_off_unless_router_logits_requested(checkpoint_factory):
    path = checkpoint_factory("e5_top2_gqa2_untied")
    _, _, ref, out, _ = run_both(path)
    assert ref.aux_loss is None and out.aux_loss is None and out.router_logits is None
    assert rel_err(out.loss, ref.loss) <= 1e-5


def test_packed_position_ids_without_mask_match_transformers(checkpoint_factory):
    """position_ids restarting inside a row mean separate documents, as Transformers reads them
    when it runs without a KV cache (use_cache=False, the training setting)."""
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e6_top3_norm_mlp_only")
    hf = HFModel.from_pretrained(path, attn_implementation="eager")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    ref = hf(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    out = ours(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.loss, ref.loss) <= 1e-5
    # with Transformers' default (use_cache=True) neither side splits the documents
    ref_cached = hf(input_ids=ids, position_ids=pos, labels=ids)
    out_cached = ours(input_ids=ids, position_ids=pos, labels=ids)
    assert rel_err(out_cached.loss, ref_cached.loss) <= 1e-5
    assert rel_err(out_cached.loss, out.loss) > 1e-3
    # and the first document's logits do not depend on what follows it
    alone = ours(input_ids=ids[:1, :4]).logits
    assert rel_err(out.logits[0, :4], alone[0]) <= 1e-5


def test_num_items_in_batch_normalises_the_summed_loss(checkpoint_factory):
    path = checkpoint_factory("e5_top2_gqa2_untied")
    ours = automoe.AutoModelForCausalLM.from_pretrained(path)
    ids, mask, labels = padded_batch(ours.spec["vocab_size"])
    mean = ours(ids, attention_mask=mask, labels=labels).loss
    n = int((labels[:, 1:] != -100).sum())
    summed = ours(ids, attention_mask=mask, labels=labels, num_items_in_batch=2 * n).loss
    assert rel_err(summed * 2, mean) <= 1e-6
