// The chunked gated delta rule's CPU kernels (delta_rule_cpu.cpp): the UT-transform form of
// delta_rule.h's chunk_gated_delta_rule, one (batch row, value head) per parallel unit, its
// chunks in order inside the unit with every chunk's operands in cache. The products run on the
// CPU GEMM engine (gemm_cpu.h, float32, the path the instruction set gives), the row work on the
// vectorised row kernels (vec.h); the backward recomputes each chunk from the inputs and the
// saved chunk-entry states (Dk × Dv per chunk: small beside the inputs) and walks the state
// recurrence in reverse. Each unit gathers its rows from the model's layout into float32 (q and k
// L2-normalised on the way) and writes its outputs and gradients back there: no heads-first
// copies, no separate normalisation pass.
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe::ops::cpu {

// In the model's layout: q and k [B, S, N, Dk] as projected (the kernel L2-normalises each row,
// x·rsqrt(|x|² + 1e-6), and scales q by `scale`), v [B, S, N, Dv], g (log-decay) and beta
// [B, S, N]; each float32 or bf16 (its own), contiguous; initial state [B, N, Dk, Dv] float32.
struct DeltaRuleFwd {
  at::Tensor out;     // [B, S, N, Dv] float32
  at::Tensor final;   // [B, N, Dk, Dv]: the state after the last position
  at::Tensor states;  // [B, N, nc, Dk, Dv]: the state entering each chunk (the backward's)
};
DeltaRuleFwd delta_rule_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& initial,
                            int64_t chunk, double scale);

struct DeltaRuleGrads {
  at::Tensor dq, dk, dv, dg, dbeta;  // each its input's shape and dtype (through the normalisation)
  at::Tensor dinitial;               // float32
};
// From the output's gradient [B, S, N, Dv] and the final state's (either undefined: zero).
DeltaRuleGrads delta_rule_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, const at::Tensor& states,
                              const at::Tensor& dout, const at::Tensor& dfinal, int64_t chunk, double scale);

}  // namespace automoe::ops::cpu
