// Mamba-2's ops (the selective state-space mixer of Nemotron-H): the depthwise causal conv1d, the
// chunked SSD scan, its one-token recurrent step and the gated grouped RMSNorm. The conv and the
// norm are fused ops (kernels in ops/kernels.h) with plain-ATen `_reference` twins; the scan and
// the step are ATen compositions. The references, differentiated by ATen's autograd, follow
// Transformers' torch path
// (modeling_nemotron_h.py: causal_conv1d_fn / _update, mamba2_chunk_scan,
// mamba2_selective_state_update, Zamba2RMSNormGated) operation by operation.
//
// Packed documents: `doc_BS` (integer document of each position, documents contiguous in a row)
// makes the conv and the scan restart at each document boundary, as if each document ran alone —
// what the attention mask does for attention (Transformers' torch path has no such input).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace automoe::ops {

// The depthwise causal conv over channels-last x [B, S, C] with w [C, K] (tap K - 1 at the current
// position): out[b, t, c] = bias[c] + sum_k w[c, k] * x[b, t - K + 1 + k, c] (zeros before the start,
// and with doc_BS, taps of another document), then SiLU when `silu` (Transformers' conv1d + act);
// the result in x's dtype. The fused op runs ops/kernels.h's causal_conv1d kernels (custom
// autograd, the SiLU's input recomputed in the backward; float64 runs the reference); the
// reference is F.conv1d as Transformers calls it (or, with documents, the masked taps), in x's
// dtype.
at::Tensor causal_conv1d(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                         const std::optional<at::Tensor>& bias_C,
                         const std::optional<at::Tensor>& doc_BS, bool silu);
at::Tensor causal_conv1d_reference(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                                   const std::optional<at::Tensor>& bias_C,
                                   const std::optional<at::Tensor>& doc_BS, bool silu);

struct SsdScan {
  at::Tensor y_BSHP;         // float32
  at::Tensor final_BHPN;     // float32 state after the last position (when asked)
};
// The SSD scan, chunked by `chunk`: with dt [B, S, H] (already softplus'd and clamped), A [H],
// x [B, S, H, P], B and C [B, S, G, N] (G groups, each read by H / G heads), D [H]:
//   h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_tᵀ,   y_t = C_t h_t + D x_t,
// from `initial` [B, H, P, N] (zeros when absent). Computed in float32.
SsdScan ssd_scan_reference(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH,
                           const at::Tensor& A_H, const at::Tensor& B_BSGN,
                           const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                           const std::optional<at::Tensor>& initial_BHPN,
                           const std::optional<at::Tensor>& doc_BS, bool final_state);

// The same scan with the products a group's heads share done once per group (C·Bᵀ is the same for
// the H / G heads that read one B/C group) and the others as wide matrix products over the group's
// heads ([Q, N] · [N, (H/G)·P] instead of H/G products of width P), as ATen operations: what CUDA
// tensors and float64 run. Equal to the reference up to float32 summation order.
SsdScan ssd_scan_aten(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                      const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                      const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                      bool final_state);
// ssd_scan_aten's hand-derived backward: the grouped form recomputed (nothing of it saved between
// the passes) and differentiated in closed form, in its compute dtype (float32, float64 kept). With
// an autograd function saving only the inputs it is what CUDA tensors run when "ssd_scan" is
// enabled (cuda_status.h): ATen's autograd through ssd_scan_aten keeps every [B, H, c, Q, Q] decay
// and product of the forward for the backward. dy or dfinal may be undefined (zero).
struct SsdGroupedGrads {
  at::Tensor dx, ddt, dA, dB, dC, dD, dinitial;  // dinitial defined when initial was given
};
SsdGroupedGrads ssd_scan_aten_backward(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                                       const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H,
                                       int64_t chunk, const std::optional<at::Tensor>& initial_BHPN,
                                       const std::optional<at::Tensor>& doc_BS, const at::Tensor& dy_BSHP,
                                       const at::Tensor& dfinal_BHPN);
// ssd_scan_aten's forward (no autograd graph) with that backward, on any device: what CUDA tensors
// run when "ssd_scan" is enabled (cuda_status.h); the CPU runs it in the tests.
SsdScan ssd_scan_grouped(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                         const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                         const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                         bool final_state);
// What the model runs: on the CPU, for float32 or bf16 x with B and C in x's dtype, the fused
// kernels of ops/mamba/ssd_cpu.h (the grouped form on the CPU GEMM engine, operands in x's dtype,
// float32 accumulation; a hand-derived backward that recomputes the chunk states); CUDA tensors
// with "ssd_scan" enabled, ssd_scan_grouped; otherwise ssd_scan_aten. Tested against the reference in the op harness (tests/python/test_ops.py).
SsdScan ssd_scan(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                 const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                 const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                 bool final_state);

// One decoding step of the same recurrence on `state` [B, H, P, N] (updated in place): x [B, H, P],
// dt [B, H] raw (dt_bias added and softplus applied here, not clamped: Transformers'
// selective_state_update), B and C [B, G, N]; y [B, H, P] in x's dtype.
at::Tensor ssd_step_reference(at::Tensor& state_BHPN, const at::Tensor& x_BHP, const at::Tensor& dt_BH,
                              const at::Tensor& dt_bias_H, const at::Tensor& A_H,
                              const at::Tensor& B_BGN, const at::Tensor& C_BGN, const at::Tensor& D_H);

// weight * rmsnorm_per_group(y * silu(z)) over groups of `group_size` of the last dim, statistics
// in float32, the normalised value cast to y's dtype before the weight multiplies it (Transformers'
// Zamba2RMSNormGated: with the scan's float32 y, a bf16 gate and weight give a float32 result).
// The fused op runs the gated_rmsnorm kernels whenever the result has y's dtype (a weight no wider
// than y); otherwise, and for float64, the reference, which promotes as Transformers does.
at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight,
                          int64_t group_size, double eps);
at::Tensor gated_rms_norm_reference(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight,
                                    int64_t group_size, double eps);

}  // namespace automoe::ops
