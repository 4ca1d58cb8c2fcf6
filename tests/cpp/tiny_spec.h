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
  s.attn.num_heads = 4;
  s.attn.num_kv_heads = 2;
  s.attn.head_dim = 6;
  s.attn.qk_norm = true;
  s.rope.dim = 6;
  s.intermediate_size = 20;
  s.moe.num_experts = 5;
  s.moe.top_k = 2;
  s.moe.intermediate_size = 8;
  s.moe.norm_topk_prob = true;
  s.moe.router_aux_loss_coef = 0.01;
  s.moe.output_router_logits = true;
  s.set_moe_layers({true, false});
  return s;
}

}  // namespace automoe::testing
