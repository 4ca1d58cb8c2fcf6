// The generic decoder on a Qwen3-MoE spec built in C++ (no checkpoint): the aux loss against a
// hand count, padding and packing invariances, and shape checks on construction.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "automoe/core/error.h"
#include "automoe/model/decoder.h"
#include "automoe/model/kv_cache.h"
#include "automoe/moe/aux_loss.h"
#include "tiny_spec.h"

namespace automoe {
namespace {

using automoe::testing::tiny_spec;

Decoder random_decoder(const ModelSpec& s, BackendConfig backend = {}) {
  at::manual_seed(0);
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::randn(d.shape) * 0.3);
  return Decoder(s, backend, std::move(params));
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}

TEST(AuxLoss, MatchesHandCountWithPaddingExcluded) {
  // 3 tokens, 3 experts, top-1; the last token is padding.
  const at::Tensor logits = at::log(at::tensor({0.7, 0.2, 0.1, 0.1, 0.6, 0.3, 0.1, 0.1, 0.8}))
                                .view({3, 3})
                                .to(at::kFloat);
  const at::Tensor mask = at::tensor({1, 1, 0}, at::kLong).view({1, 3});
  const double loss = moe::load_balancing_loss({logits}, 3, 1, mask).item<double>();
  // f = [1/2, 1/2, 0] (tokens 0 and 1 pick experts 0 and 1); P = [(0.7+0.1)/2, (0.2+0.6)/2,
  // (0.1+0.3)/2]
  const double expected = 3 * (0.5 * 0.4 + 0.5 * 0.4 + 0.0 * 0.2);
  EXPECT_NEAR(loss, expected, 1e-6);
  // without a mask the padding row counts: f = [1/3, 1/3, 1/3], P = [0.9, 0.9, 1.2] / 3
  const double unmasked = moe::load_balancing_loss({logits}, 3, 1, std::nullopt).item<double>();
  EXPECT_NEAR(unmasked, 3 * (1.0 / 3) * ((0.9 + 0.9 + 1.2) / 3), 1e-6);
}

TEST(Decoder, RightPaddingDoesNotChangeTheRealTokens) {
  const ModelSpec s = tiny_spec();
  const Decoder model = random_decoder(s);
  const at::Tensor ids = at::randint(0, s.vocab_size, {1, 7}, at::kLong);
  const at::Tensor padded = at::cat({ids, at::zeros({1, 3}, at::kLong)}, 1);
  const at::Tensor mask = at::cat({at::ones({1, 7}, at::kLong), at::zeros({1, 3}, at::kLong)}, 1);
  ForwardArgs a{ids};
  ForwardArgs b{padded, mask};
  const at::Tensor alone = model.forward(a).logits;
  const at::Tensor with_pad = model.forward(b).logits.narrow(1, 0, 7);
  EXPECT_LT(max_rel(with_pad, alone), 1e-5);
}

TEST(Decoder, LeftPaddingGivesFiniteOutputsAndTheSameRealTokens) {
  const ModelSpec s = tiny_spec();
  for (auto attn : {AttnBackend::kSdpa, AttnBackend::kEager}) {
    BackendConfig backend;
    backend.attn = attn;
    const Decoder model = random_decoder(s, backend);
    const at::Tensor ids = at::randint(0, s.vocab_size, {1, 6}, at::kLong);
    const at::Tensor padded = at::cat({at::zeros({1, 2}, at::kLong), ids}, 1);
    const at::Tensor mask = at::cat({at::zeros({1, 2}, at::kLong), at::ones({1, 6}, at::kLong)}, 1);
    // Real tokens keep their positions 0..5, as a tokenizer's left padding with position_ids does.
    const at::Tensor pos = at::clamp_min(at::arange(-2, 6, at::kLong), 0).view({1, 8});
    ForwardArgs a{ids};
    ForwardArgs b{padded, mask, pos};
    const at::Tensor out = model.forward(b).logits;
    EXPECT_TRUE(at::isfinite(out).all().item<bool>());
    EXPECT_LT(max_rel(out.narrow(1, 2, 6), model.forward(a).logits), 1e-5);
  }
}

TEST(Decoder, PackedDocumentsDoNotSeeEachOther) {
  const ModelSpec s = tiny_spec();
  const Decoder model = random_decoder(s);
  const at::Tensor doc1 = at::randint(0, s.vocab_size, {1, 4}, at::kLong);
  const at::Tensor doc2 = at::randint(0, s.vocab_size, {1, 5}, at::kLong);
  ForwardArgs packed{at::cat({doc1, doc2}, 1), std::nullopt,
                     at::cat({at::arange(4, at::kLong), at::arange(5, at::kLong)}).view({1, 9})};
  const at::Tensor out = model.forward(packed).logits;
  ForwardArgs one{doc1}, two{doc2};
  EXPECT_LT(max_rel(out.narrow(1, 0, 4), model.forward(one).logits), 1e-5);
  EXPECT_LT(max_rel(out.narrow(1, 4, 5), model.forward(two).logits), 1e-5);
}

TEST(Decoder, AuxLossAddedOnlyWhenRouterLogitsRequested) {
  const ModelSpec s = tiny_spec();
  const Decoder model = random_decoder(s);
  const at::Tensor ids = at::randint(0, s.vocab_size, {2, 5}, at::kLong);
  ForwardArgs off{ids, std::nullopt, std::nullopt, ids, false};
  ForwardArgs on{ids, std::nullopt, std::nullopt, ids, true};
  const ForwardResult r_off = model.forward(off);
  const ForwardResult r_on = model.forward(on);
  EXPECT_FALSE(r_off.aux_loss.has_value());
  ASSERT_TRUE(r_on.aux_loss.has_value());
  ASSERT_EQ(r_on.router_logits.size(), 1u);  // one MoE layer
  EXPECT_EQ(r_on.router_logits[0].sizes(), (std::vector<int64_t>{10, 5}));
  EXPECT_NEAR(r_on.loss->item<double>(),
              r_off.loss->item<double>() + 0.01 * r_on.aux_loss->item<double>(), 1e-6);
}

TEST(Decoder, RejectsParametersOfTheWrongShape) {
  const ModelSpec s = tiny_spec();
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::zeros(d.shape));
  params[3].second = at::zeros({3, 3});
  try {
    Decoder(s, {}, params);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(params[3].first), std::string::npos);
  }
}

}  // namespace
}  // namespace automoe

namespace automoe {
namespace {

using automoe::testing::tiny_spec;

TEST(KVCache, AppendGrowsAndKeepsEveryPositionInOrder) {
  KVCache cache(2);
  EXPECT_EQ(cache.length(), 0);
  EXPECT_FALSE(cache.keys(0).defined());
  at::manual_seed(1);
  std::vector<at::Tensor> parts;
  for (int64_t s : {5, 1, 1, 200, 3}) {  // a prefill, decode steps, then a long chunk (regrowth)
    const at::Tensor k = at::randn({2, 3, s, 4}), v = at::randn({2, 3, s, 4});
    const auto [all_k, all_v] = cache.append(0, k, v);
    parts.push_back(k);
    EXPECT_TRUE(all_k.equal(at::cat(parts, 2)));
    EXPECT_EQ(all_v.size(2), cache.length(0));
  }
  EXPECT_EQ(cache.length(0), 210);
  EXPECT_EQ(cache.length(1), 0);
  EXPECT_EQ(cache.batch_size(), 2);
}

TEST(KVCache, BatchReorderRepeatAndRemoveLast) {
  KVCache cache(1);
  const at::Tensor k = at::arange(2 * 6, at::kFloat).view({2, 1, 6, 1});
  cache.append(0, k, k + 100);
  cache.index_batch(at::tensor({1, 1, 0}, at::kLong));
  EXPECT_TRUE(cache.keys(0).equal(k.index_select(0, at::tensor({1, 1, 0}, at::kLong))));
  cache.repeat_interleave_batch(2);
  EXPECT_EQ(cache.batch_size(), 6);
  cache.remove_last(2);
  EXPECT_EQ(cache.length(0), 4);
  EXPECT_TRUE(cache.values(0).narrow(0, 0, 1).equal(k.narrow(0, 1, 1).narrow(2, 0, 4) + 100));
  EXPECT_THROW(cache.index_batch(at::tensor({6}, at::kLong)), Error);
  EXPECT_THROW(cache.append(0, at::zeros({6, 2, 1, 1}), at::zeros({6, 2, 1, 1})), Error);
}

TEST(Decoder, IncrementalDecodingWithTheCacheMatchesTheFullForward) {
  const ModelSpec s = tiny_spec();
  for (auto attn : {AttnBackend::kSdpa, AttnBackend::kEager}) {
    BackendConfig backend;
    backend.attn = attn;
    const Decoder model = random_decoder(s, backend);
    const at::Tensor ids = at::randint(0, s.vocab_size, {2, 9}, at::kLong);
    at::Tensor mask = at::ones({2, 9}, at::kLong);
    mask.narrow(1, 0, 3)[1].zero_();  // row 1 is left-padded
    ForwardArgs full{ids, mask};
    const at::Tensor expected = model.forward(full).logits;
    KVCache cache(s.num_layers);
    std::vector<at::Tensor> steps;
    for (int64_t start : {0, 5, 6, 7, 8}) {  // prefill 5, then one token at a time
      const int64_t len = start == 0 ? 5 : 1;
      ForwardArgs a{ids.narrow(1, start, len), mask.narrow(1, 0, start + len)};
      a.cache = &cache;
      steps.push_back(model.forward(a).logits);
    }
    EXPECT_EQ(cache.length(), 9);
    const at::Tensor real = mask.unsqueeze(-1).to(at::kBool).expand_as(expected);
    EXPECT_LT(max_rel(at::cat(steps, 1).masked_select(real), expected.masked_select(real)), 1e-5);
  }
}

TEST(Decoder, BackboneOnlyAndLogitsToKeep) {
  const ModelSpec s = tiny_spec();
  const Decoder model = random_decoder(s);
  const at::Tensor ids = at::randint(0, s.vocab_size, {2, 6}, at::kLong);
  ForwardArgs a{ids};
  const ForwardResult full = model.forward(a);
  a.lm_head = false;
  a.output_hidden_states = true;
  const ForwardResult hidden = model.forward(a);
  EXPECT_FALSE(hidden.logits.defined());
  EXPECT_TRUE(hidden.last_hidden_state.equal(full.last_hidden_state));
  ASSERT_EQ(hidden.hidden_states.size(), static_cast<size_t>(s.num_layers + 1));
  EXPECT_TRUE(hidden.hidden_states.back().equal(full.last_hidden_state));
  ForwardArgs last{ids};
  last.logits_to_keep = 1;
  EXPECT_LT(max_rel(model.forward(last).logits, full.logits.narrow(1, 5, 1)), 1e-6);
  last.labels = ids;
  EXPECT_THROW(model.forward(last), Error);
}

}  // namespace
}  // namespace automoe

namespace automoe {
namespace {

TEST(KVCache, FirstFillBorrowsAndLaterWritesNeverTouchTheCallersTensors) {
  KVCache cache(1);
  const at::Tensor k = at::randn({1, 2, 4, 3}), v = at::randn({1, 2, 4, 3});
  const at::Tensor k_before = k.clone();
  cache.append(0, k, v);
  EXPECT_EQ(cache.keys(0).data_ptr(), k.data_ptr());  // no copy for the first fill
  cache.remove_last(2);
  cache.append(0, at::zeros({1, 2, 3, 3}), at::zeros({1, 2, 3, 3}));  // would overwrite k in place
  EXPECT_TRUE(k.equal(k_before));
  EXPECT_EQ(cache.length(0), 5);
  KVCache copy = cache.clone();
  cache.append(0, at::ones({1, 2, 1, 3}), at::ones({1, 2, 1, 3}));
  EXPECT_EQ(copy.length(0), 5);
  EXPECT_TRUE(copy.keys(0).equal(cache.keys(0).narrow(2, 0, 5)));
}

}  // namespace
}  // namespace automoe
