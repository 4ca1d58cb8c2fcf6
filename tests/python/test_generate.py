"""Generation with the drop-in: Transformers' generate() and pipelines over the engine's KV cache
give Transformers' own tokens (float32, same checkpoint, same seeds)."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, rel_err

import automoe
from automoe import EngineCache


def prompts(vocab: int):
    return left_padded_prompts(vocab, seed=7)


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e6_top3_norm_mlp_only")
    return automoe.AutoModelForCausalLM.from_pretrained(path), HFModel.from_pretrained(path)


@pytest.mark.parametrize("mode", [
    dict(do_sample=False),
    dict(do_sample=True, top_k=8, temperature=0.8),
    dict(num_beams=3, do_sample=False),
    dict(do_sample=False, num_return_sequences=2, num_beams=2),
])
def test_generate_gives_transformers_tokens(models, mode):
    ours, ref = models
    ids, mask = prompts(ours.config.vocab_size)
    for rows in (slice(0, 1), slice(0, 3)):  # one prompt, and a left-padded batch
        torch.manual_seed(11)
        got = ours.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=10, pad_token_id=0, **mode)
        torch.manual_seed(11)
        want = ref.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=10, pad_token_id=0, **mode)
        assert torch.equal(got, want), (mode, got, want)


def test_generate_keeps_the_engine_cache_and_stops_at_eos(models):
    ours, ref = models
    ids, mask = prompts(ours.config.vocab_size)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                        return_dict_in_generate=True)
    assert isinstance(out.past_key_values, EngineCache)
    assert out.past_key_values.get_seq_length() == ids.shape[1] + 6 - 1
    # eos: the first greedy token of row 0 as eos ends that row there, padded after
    eos = int(out.sequences[0, ids.shape[1]])
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=eos)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 1:] == 0).all()


def test_manual_decoding_with_past_key_values_matches_the_full_forward(models):
    """Prefill, then one token at a time through out.past_key_values, as users write it by hand;
    a DynamicCache passed in is updated in place as Transformers updates it."""
    from transformers import DynamicCache

    ours, ref = models
    ids, mask = prompts(ours.config.vocab_size)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask, use_cache=False).logits
        out = ours(ids[:, :4], attention_mask=mask[:, :4])
        steps = [out.logits]
        for t in range(4, 7):
            out = ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
        real = mask.bool()
        assert rel_err(torch.cat(steps, 1)[real], full[real]) <= 1e-5

        cache = DynamicCache(config=ours.config)
        first = ours(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache)
        assert first.past_key_values is cache and cache.get_seq_length() == 5
        second = ours(ids[:, 5:], attention_mask=mask, past_key_values=cache)
        assert cache.get_seq_length() == 7
        ref_cache = DynamicCache(config=ref.config)
        ref(ids[:, :5], attention_mask=mask[:, :5], past_key_values=ref_cache)
        assert rel_err(cache.layers[1].keys[:, :, :5], ref_cache.layers[1].keys) <= 1e-5
        assert rel_err(second.logits[real[:, 5:]], full[:, 5:][real[:, 5:]]) <= 1e-5


def test_deep_copied_prompt_cache_is_reused_for_two_continuations(models):
    """Transformers' prefix-reuse pattern: a prompt's cache is computed once and deep-copied for
    each continuation; the copies are independent and give what a fresh generate gives."""
    import copy

    ours, _ = models
    ids, mask = prompts(ours.config.vocab_size)
    prompt, prompt_mask = ids[:1, :5], mask[:1, :5]
    with torch.no_grad():
        cache = ours(prompt, attention_mask=prompt_mask).past_key_values
    for tail in (ids[:1, 5:6], ids[:1, 5:7]):
        full = torch.cat([prompt, tail], 1)
        fresh = ours.generate(full, max_new_tokens=4, do_sample=False, pad_token_id=0)
        reused = ours.generate(full, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               past_key_values=copy.deepcopy(cache))
        assert torch.equal(reused, fresh)
    assert cache.get_seq_length() == 5  # the original was never extended


def test_caches_the_engine_cannot_read_are_refused_by_name(models):
    ours, _ = models
    ids, mask = prompts(ours.config.vocab_size)
    with pytest.raises(TypeError, match=r"past_key_values: AutoMoE's engine reads its own EngineCache.*StaticCache"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, cache_implementation="static")


def test_text_generation_pipeline_gives_transformers_text(chat_checkpoint):
    from transformers import AutoModelForCausalLM as HFModel
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    messages = [{"role": "user", "content": "What colour is a banana?"}]
    texts = []
    for model in (automoe.AutoModelForCausalLM.from_pretrained(chat_checkpoint),
                  HFModel.from_pretrained(chat_checkpoint)):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        texts.append(generator(messages, max_new_tokens=12, do_sample=False)[0]["generated_text"])
        texts.append(generator("The cat", max_new_tokens=8, do_sample=False)[0]["generated_text"])
    assert texts[:2] == texts[2:]
