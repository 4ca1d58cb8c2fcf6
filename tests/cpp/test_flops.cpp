// The analytic FLOPs formula against a count made by hand for a tiny config.
#include <gtest/gtest.h>

#include "automoe/train/flops.h"

namespace automoe {
namespace {

TEST(Flops, MatchesHandCountForTinyConfig) {
  ModelSpec s;
  s.vocab_size = 10;
  s.hidden_size = 4;
  s.attn.num_heads = 2;
  s.attn.num_kv_heads = 1;
  s.attn.head_dim = 3;
  s.intermediate_size = 5;
  s.num_layers = 2;
  s.set_moe_layers({true, false});
  s.moe.num_experts = 6;
  s.moe.top_k = 2;
  s.moe.intermediate_size = 7;
  const int64_t S = 9;
  // per layer, attention: q 2*4*6=48, k 2*4*3=24, v 24, o 2*6*4=48 -> 144;
  //   scores + values over (9+1)/2 = 5 keys: 2*2*2*3*5 = 120
  // MoE layer: router 2*4*6 = 48; experts 2 * (2*4*14 + 2*7*4) = 2 * (112 + 56) = 336
  // dense layer: 2*4*10 + 2*5*4 = 80 + 40 = 120
  // LM head: 2*4*10 = 80
  const double forward = (144 + 120 + 48 + 336) + (144 + 120 + 120) + 80;
  EXPECT_DOUBLE_EQ(forward_flops_per_token(s, S), forward);
  EXPECT_DOUBLE_EQ(training_flops_per_token(s, S), 3 * forward);
}

}  // namespace
}  // namespace automoe
