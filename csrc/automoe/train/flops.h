// Analytic FLOPs of a decoder step, the one formula both benchmark sides and the trainer's MFU use.
//
// Matmul FLOPs only (2 per multiply-add); norms, RoPE, softmax and elementwise ops are not
// counted. Per token, forward:
//   attention  2*H*(N*D) + 2*2*H*(KV*D) + 2*(N*D)*H        q, k, v, o projections
//            + 2*2*N*D*(S+1)/2                             scores and weighted values, over the
//                                                          (S+1)/2 keys a causal query sees
//   MoE layer  2*H*E + K * (2*H*2I + 2*I*H)                router + the top-k routed experts only
//   dense MLP  2*H*2I_dense + 2*I_dense*H
//   LM head    2*H*V
// Training = 3 x forward (the backward computes two products per forward product).
#pragma once

#include <cstdint>

#include "automoe/model/spec.h"

namespace automoe {

double forward_flops_per_token(const ModelSpec& spec, int64_t seq_len);
inline double training_flops_per_token(const ModelSpec& spec, int64_t seq_len) {
  return 3.0 * forward_flops_per_token(spec, seq_len);
}

}  // namespace automoe
