// The small Qwen3-MoE spec the C++ tests build models from (no checkpoint): 2 layers, the first
// MoE (5 experts, top-2, renormalised), the second dense.
#pragma once

#include "automoe/model/spec.h"

namespace automoe::testing {

inline ModelSpec tiny_spec() {
  ModelSpec s;
  s.model_type = "qwen3_moe";
  s.vocab_size = 31;
  s.hidden_size = 16;
  s.num_layers = 2;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 6;
  s.intermediate_size = 20;
  s.moe = MoESpec{5, 2, 8, RouterScore::kSoftmax, true, 0.01, true};
  s.layer_is_moe = {true, false};
  return s;
}

}  // namespace automoe::testing
