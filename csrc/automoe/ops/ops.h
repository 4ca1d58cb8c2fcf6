// The fused ops: what the model and Python callers use (the latter as torch.ops.automoe.*, see
// ops/registry.cpp). Each op is differentiable (a custom autograd Function around the kernels of
// ops/kernels.h, picked by the inputs' device) and has a plain-ATen `_reference` twin with the
// same signature, differentiated by ATen's autograd: the ground truth of the op tests and the
// `torch` backend of BackendConfig. Inputs may be non-contiguous; errors name the op and tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "automoe/ops/kernels.h"

namespace automoe::ops {

// ---- router -------------------------------------------------------------------------------
struct RouterResult {
  at::Tensor weights_TK;  // float32 combine weights
  at::Tensor idx_TK;      // int64 experts, per token in descending selection score
  at::Tensor scores_TE;   // float32 softmax / sigmoid scores (the aux loss's probabilities)
};
// logits_TE: router logits (upcast to float32); bias_E: DeepSeek-V3's e_score_correction_bias.
RouterResult router(const at::Tensor& logits_TE, const std::optional<at::Tensor>& bias_E,
                    const RouterParams& p);
RouterResult router_reference(const at::Tensor& logits_TE, const std::optional<at::Tensor>& bias_E,
                              const RouterParams& p);
// The same scores and weights for experts already chosen (a checkpointed layer's recompute).
RouterResult router_given(const at::Tensor& logits_TE, const at::Tensor& idx_TK,
                          const RouterParams& p);

// ---- permute / unpermute ------------------------------------------------------------------
struct PermutePlan {
  at::Tensor offsets;    // [E+1] int64 row ranges per expert
  at::Tensor slot_pos;   // [T, K] int64 permuted row of each slot, -1 if dropped
  at::Tensor src_token;  // [T*K] int64 token of each permuted row, -1 past offsets[E]
};
PermutePlan permute_plan(const at::Tensor& idx_TK, int64_t num_experts);
// The same plan from ATen ops (a stable sort by expert): what CUDA runs until our kernel has run.
PermutePlan permute_plan_reference(const at::Tensor& idx_TK, int64_t num_experts);
at::Tensor permute(const at::Tensor& x_TH, const PermutePlan& plan);
at::Tensor permute_reference(const at::Tensor& x_TH, const PermutePlan& plan);
// out[t] = sum_k weights[t, k] * y[slot_pos[t, k]], float32 accumulation, in y's dtype.
at::Tensor unpermute(const at::Tensor& y_NH, const PermutePlan& plan, const at::Tensor& weights_TK);
at::Tensor unpermute_reference(const at::Tensor& y_NH, const PermutePlan& plan,
                               const at::Tensor& weights_TK);

// ---- grouped GEMM -------------------------------------------------------------------------
// y[rows of g] = x[rows of g] · w[g]ᵀ, rows of g = [offsets[g], offsets[g+1]); w [G, O, K].
at::Tensor grouped_gemm(const at::Tensor& x_NK, const at::Tensor& w_GOK, const at::Tensor& offsets);
at::Tensor grouped_gemm_reference(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                                  const at::Tensor& offsets);
// A dense linear layer, y = x·wᵀ (+ bias) for x [..., K], w [O, K]: at::linear, except where
// ATen's GEMM is the slower engine for bf16 on this CPU (cpu::engine_preferred: no AVX512_BF16
// or AMX) — there the forward, dX and dW run on the CPU GEMM engine as a one-group grouped_gemm
// (float32 accumulation, the bias added to it, each result rounded once to bf16, as ATen's bf16
// GEMM and addmm round).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// Attention (SDPA) for bf16 CPU tensors with gradients where ATen's bf16 GEMM is not native
// (cpu::engine_preferred): ATen's bf16 flash-attention forward — the kernel
// at::scaled_dot_product_attention runs there, a bool mask converted as it converts it — and its
// float32 backward on the saved tensors widened, the gradients rounded once. q, k, v
// [B, N, S, D] with as many key/value heads as query heads; mask bool or q's dtype. _applies
// says whether it is the path for these inputs (else at::scaled_dot_product_attention).
bool sdpa_bf16_float_backward_applies(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const std::optional<at::Tensor>& mask);
at::Tensor sdpa_bf16_float_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, bool is_causal,
                                    double scale);
// at::matmul(a, b), except for bf16 CPU tensors [..., M, K] x [..., K, N] (equal batch sizes)
// where ATen's bf16 GEMM is not native (cpu::engine_preferred): there the forward and both
// gradients run as float32 GEMMs on the tensors widened, each result rounded once to bf16 — how
// ATen's bf16 GEMM computes, at float32 GEMM speed. Eager attention's two products use it.
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b);
// LoRA on the grouped GEMM: y[rows of g] = x·w[g]ᵀ + scaling·(x·a[g]ᵀ)·b[g]ᵀ with a [G, r, K],
// b [G, O, r] (per-group low-rank factors, x's dtype), without forming w + scaling·b·a. w gets a
// gradient only when it requires one.
at::Tensor grouped_gemm_lora(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                             const at::Tensor& a_GRK, const at::Tensor& b_GOR,
                             const at::Tensor& offsets, double scaling);
at::Tensor grouped_gemm_lora_reference(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                                       const at::Tensor& a_GRK, const at::Tensor& b_GOR,
                                       const at::Tensor& offsets, double scaling);

// ---- SwiGLU -------------------------------------------------------------------------------
struct SwigluParams {
  bool gpt_oss = false;  // interleaved gate/up, clamped, (up + 1) * gate * sigmoid(alpha * gate)
  double alpha = 1.702;
  double limit = 7.0;
};
at::Tensor swiglu(const at::Tensor& gate_up, const SwigluParams& p = {});
at::Tensor swiglu_reference(const at::Tensor& gate_up, const SwigluParams& p = {});

// ---- RMSNorm ------------------------------------------------------------------------------
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (The reference is rms_norm_reference in ops/rmsnorm/rmsnorm.h: Transformers' exact rounding.)

// ---- RoPE ---------------------------------------------------------------------------------
// x [B, S, N, D] rotated by angle tables cos/sin [B, S, D/2].
at::Tensor rope(const at::Tensor& x_BSND, const at::Tensor& cos_BSh, const at::Tensor& sin_BSh,
                bool interleaved);
at::Tensor rope_reference(const at::Tensor& x_BSND, const at::Tensor& cos_BSh,
                          const at::Tensor& sin_BSh, bool interleaved);

// ---- fused linear cross-entropy -----------------------------------------------------------
struct LinearCrossEntropy {
  at::Tensor sum;    // float32 scalar (float64 for float64 x), differentiable in x and weight
  at::Tensor count;  // int64 scalar: labels != ignore_index
};
// sum over rows of CE(x · weightᵀ, labels) without holding [N, V] logits beyond a budget: the
// forward walks token chunks, the backward vocabulary chunks, each chunk's logits at most
// `chunk_bytes` of float32 (0 = 64 MiB); logits of at most 8 chunks (512 MiB) are kept from the
// forward for the backward instead of recomputed.
LinearCrossEntropy linear_cross_entropy(const at::Tensor& x_NH, const at::Tensor& weight_VH,
                                        const at::Tensor& labels_N, int64_t ignore_index = -100,
                                        int64_t chunk_bytes = 0);
LinearCrossEntropy linear_cross_entropy_reference(const at::Tensor& x_NH,
                                                  const at::Tensor& weight_VH,
                                                  const at::Tensor& labels_N,
                                                  int64_t ignore_index = -100);

}  // namespace automoe::ops
