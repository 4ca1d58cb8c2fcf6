// Expert computation: out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
// e = idx[t, k], with experts held fused: w_gate_up [E, 2I, H] (gate rows first, then up rows),
// w_down [E, H, I].
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe::moe {

// The `eager` backend: a loop over the experts that received tokens, Transformers' semantics and
// order of accumulation (experts in ascending order, index_add into a zeroed output).
at::Tensor experts_eager(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                         const at::Tensor& w_down_EHI);

// The `grouped` backend, as the ATen composition of routing -> permute -> grouped GEMM -> SwiGLU
// -> grouped GEMM -> weighted unpermute:
//   permute:   (token, slot) pairs sorted by expert (stable), rows gathered once: x_perm [T*K, H],
//              layout [E][tokens of e][H], tokens ascending within an expert
//   GEMMs:     per expert on its contiguous rows (experts with no tokens skipped)
//   unpermute: one index_add of the weighted rows back to [T, H]
// Same math and summation order as `eager`, without eager's per-expert full-size gradient
// buffers (its backward gathers/scatters once, and weights are unbound once).
at::Tensor experts_grouped(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                           const at::Tensor& w_down_EHI);

}  // namespace automoe::moe
