// The chunked gated delta rule's CPU kernels (delta_rule_cpu.cpp): the UT-transform form of
// delta_rule.h's chunk_gated_delta_rule, one (batch row, value head) per parallel unit, its
// chunks in order inside the unit with every chunk's operands in cache. The products run on the
// CPU GEMM engine (gemm_cpu.h, float32, the path the instruction set gives), the row work on the
// vectorised row kernels (vec.h); the backward recomputes each chunk from the inputs and the
// saved chunk-entry states (Dk × Dv per chunk: small beside the inputs) and walks the state
// recurrence in reverse. float32 only; the autograd layer (delta_rule.cpp) converts.
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe::ops::cpu {

// q (L2-normalised and scaled), k (L2-normalised) [B, N, S, Dk], v [B, N, S, Dv], g (log-decay)
// and beta [B, N, S], initial state [B, N, Dk, Dv]; float32, any strides (made contiguous).
struct DeltaRuleFwd {
  at::Tensor out;     // [B, N, S, Dv]
  at::Tensor final;   // [B, N, Dk, Dv]: the state after the last position
  at::Tensor states;  // [B, N, nc, Dk, Dv]: the state entering each chunk (the backward's)
};
DeltaRuleFwd delta_rule_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial,
                            int64_t chunk);

struct DeltaRuleGrads {
  at::Tensor dq, dk, dv, dg, dbeta, dinitial;  // float32, the inputs' shapes
};
// From the output's and the final state's gradients (either undefined: zero).
DeltaRuleGrads delta_rule_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, const at::Tensor& states,
                              const at::Tensor& dout, const at::Tensor& dfinal, int64_t chunk);

}  // namespace automoe::ops::cpu
