// The gated delta rule: the recurrence of gated DeltaNet linear attention (Qwen3-Next, Qwen3.5),
// chunked over a sequence and as the one-token step of decoding. The references are ATen
// compositions that follow Transformers' torch path (modeling_qwen3_next.py:
// torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) operation by operation,
// differentiated by ATen's autograd; float32 compute (float64 kept, for the tests).
//
// Per value head, with q and k L2-normalised (eps 1e-6 inside the square root) and q scaled by
// head_k_dim^-1/2, the state S [Dk, Dv] evolves as
//   S ← exp(g_t) S;   S ← S + k_t (beta_t (v_t − Sᵀ k_t))ᵀ;   o_t = Sᵀ q_t.
// The chunked form solves each chunk's (I + strictly-lower(k_β kᵀ ∘ decay)) system (the UT
// transform) and carries S between chunks.
//
// Packed documents: `doc_BS` (integer document of each position, documents contiguous in a row)
// restarts the recurrence at each document boundary, as if each document ran alone (Transformers'
// torch path has no such input).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace automoe::ops {

struct DeltaRule {
  at::Tensor o_BSNV;      // in q's dtype
  at::Tensor final_BNKV;  // float32 state after the last position (when asked)
};

// q, k [B, S, N, Dk] (N value heads: shared key heads already repeated), v [B, S, N, Dv], g [B, S, N]
// (log decay, <= 0), beta [B, S, N]; `initial` [B, N, Dk, Dv] (zeros when absent; not with doc_BS).
DeltaRule chunk_gated_delta_rule_reference(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK,
                                           const at::Tensor& v_BSNV, const at::Tensor& g_BSN,
                                           const at::Tensor& beta_BSN, int64_t chunk,
                                           const std::optional<at::Tensor>& initial_BNKV,
                                           const std::optional<at::Tensor>& doc_BS, bool final_state);

// The same rule as a fused op: the chunked form in ATen ops with no autograd graph and a hand-
// derived backward that recomputes each chunk from the inputs (delta_rule.cpp; only the inputs
// are saved), float32 compute for float32 / bf16 inputs; float64 runs the reference. What the
// model runs (backend "mamba": "fused"); tested against the reference.
DeltaRule chunk_gated_delta_rule(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK,
                                 const at::Tensor& v_BSNV, const at::Tensor& g_BSN,
                                 const at::Tensor& beta_BSN, int64_t chunk,
                                 const std::optional<at::Tensor>& initial_BNKV,
                                 const std::optional<at::Tensor>& doc_BS, bool final_state);

namespace detail {
// The shapes both implementations take (an automoe::Error naming what differs).
void check_delta_rule_args(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK, const at::Tensor& v_BSNV,
                           const at::Tensor& g_BSN, const at::Tensor& beta_BSN, int64_t chunk,
                           const std::optional<at::Tensor>& initial_BNKV,
                           const std::optional<at::Tensor>& doc_BS);
// x · rsqrt(Σx² + kL2normEps) over the last dim (the FLA l2norm Transformers' rule applies to q
// and k; the CPU kernels normalise each row the same way).
constexpr double kL2normEps = 1e-6;
at::Tensor l2norm(const at::Tensor& x);
// Packed documents: `segment(b, s0, len)` (heads first, [1, N, len, Dv]) on each (row, document)
// run of doc_BS [B, S], concatenated to [B, N, S, Dv].
at::Tensor over_documents(const at::Tensor& doc_BS,
                          const std::function<at::Tensor(int64_t b, int64_t s0, int64_t len)>& segment);
}  // namespace detail

// One decoding step on `state` [B, N, Dk, Dv] float32 (replaced): q, k [B, N, Dk], v [B, N, Dv],
// g and beta [B, N]; o [B, N, Dv] in q's dtype.
at::Tensor gated_delta_rule_step_reference(at::Tensor& state_BNKV, const at::Tensor& q_BNK,
                                           const at::Tensor& k_BNK, const at::Tensor& v_BNV,
                                           const at::Tensor& g_BN, const at::Tensor& beta_BN);

}  // namespace automoe::ops
