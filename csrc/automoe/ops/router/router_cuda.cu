// Router kernels (CUDA): one warp per token. Lane l owns experts e = l + 32j (j < 32, so E is at
// most 1024), kept in shared memory; the top-k is K rounds of a warp argmax with ties to the
// lower expert index, as the CPU kernel's partial sort. Sums over the K slots run in slot order
// (as on the CPU), without FMA contraction.
#include <ATen/ops/empty.h>

#include <limits>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

constexpr int kWarps = 4;  // tokens per block
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxExperts = 32 * 32;
constexpr int64_t kMaxTopK = 32;
constexpr int kNone = std::numeric_limits<int>::max();

struct RouterArgs {
  int64_t T;
  int E;
  int K;
  bool sigmoid;
  int n_group;
  int topk_group;
  bool grouped;  // group-limited selection active (n_group > 1, topk_group < n_group)
  bool norm;
  float scaling;
};

// (v, e) ranks before (bv, be): higher score, then lower index.
__device__ __forceinline__ bool better(float v, int e, float bv, int be) {
  return v > bv || (v == bv && e < be);
}

// Warp-wide argmax of (v, e) in the `better` order; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(float& v, int& e) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, o);
    const int oe = __shfl_xor_sync(kFullMask, e, o);
    if (better(ov, oe, v, e)) {
      v = ov;
      e = oe;
    }
  }
}

// Writes the token's scores (softmax or sigmoid of its logits) to s[] and scores_row[].
__device__ void token_scores(const float* lrow, float* s, float* scores_row, const RouterArgs& a) {
  const int lane = threadIdx.x & 31;
  if (a.sigmoid) {
    for (int e = lane; e < a.E; e += 32) s[e] = 1.f / (1.f + expf(-lrow[e]));
  } else {
    float m = -std::numeric_limits<float>::infinity();
    for (int e = lane; e < a.E; e += 32) m = fmaxf(m, lrow[e]);
    m = warp_max(m);
    float sum = 0.f;
    for (int e = lane; e < a.E; e += 32) {
      s[e] = expf(lrow[e] - m);
      sum += s[e];
    }
    const float inv = 1.f / warp_sum(sum);
    for (int e = lane; e < a.E; e += 32) s[e] *= inv;
  }
  for (int e = lane; e < a.E; e += 32) scores_row[e] = s[e];
}

// Whether group g is among the topk_group best by rank (ties: lower group index).
__device__ bool group_kept(const float* grank, int g, const RouterArgs& a) {
  const float r = grank[g];
  int ahead = 0;
  for (int h = 0; h < a.n_group; ++h) ahead += grank[h] > r || (grank[h] == r && h < g);
  return ahead < a.topk_group;
}

// Ranks the groups by the sum of their two best selection scores and sets sel[] of the experts
// of all but the topk_group best groups to -inf (they stay candidates, ranked last, as on the
// CPU). Reads sel[] of all lanes: the caller syncs the warp after writing it.
__device__ void mask_dropped_groups(float* sel, float* grank, const RouterArgs& a) {
  const int lane = threadIdx.x & 31;
  const int gs = a.E / a.n_group;
  for (int g = lane; g < a.n_group; g += 32) {
    float b1 = -std::numeric_limits<float>::infinity();
    float b2 = b1;
    for (int e = g * gs; e < (g + 1) * gs; ++e) {
      const float v = sel[e];
      if (v > b1) {
        b2 = b1;
        b1 = v;
      } else if (v > b2) {
        b2 = v;
      }
    }
    grank[g] = gs >= 2 ? b1 + b2 : b1;
  }
  __syncwarp();  // all ranks written (and all sel[] reads done) before any lane masks
  int last = -1;
  bool keep = true;
  for (int e = lane; e < a.E; e += 32) {
    if (e / gs != last) {
      last = e / gs;
      keep = group_kept(grank, last, a);
    }
    if (!keep) sel[e] = -std::numeric_limits<float>::infinity();
  }
}

// Sum over k < K, in order, of lane k's v (every lane gets the same value).
__device__ __forceinline__ float slot_sum(float v, int K) {
  float total = 0.f;
  for (int k = 0; k < K; ++k) total = __fadd_rn(total, __shfl_sync(kFullMask, v, k));
  return total;
}

// Grid: ceil(T / kWarps) blocks of kWarps warps; warp w of block b routes token b*kWarps + w.
// Dynamic smem per warp: s[E], sel[E], grank[n_group] floats. Lane k < K ends up holding the
// k-th choice and writes weights[t, k], idx[t, k]; the winner's owner lane marks it taken.
__global__ void router_fwd_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                  float* __restrict__ weights, int64_t* __restrict__ idx,
                                  float* __restrict__ scores, RouterArgs a) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= a.T) return;  // whole warps only; the kernel has no block barrier
  float* s = smem + warp * (2 * a.E + a.n_group);
  float* sel = s + a.E;
  float* grank = sel + a.E;
  token_scores(logits + t * a.E, s, scores + t * a.E, a);
  for (int e = lane; e < a.E; e += 32) sel[e] = s[e] + (bias != nullptr ? bias[e] : 0.f);
  __syncwarp();
  if (a.grouped) mask_dropped_groups(sel, grank, a);  // each lane then reads only its own sel[]

  uint32_t taken = 0;
  float my_w = 0.f;
  int my_idx = -1;
  for (int k = 0; k < a.K; ++k) {
    float bv = -std::numeric_limits<float>::infinity();
    int be = kNone;
    for (int j = 0; lane + 32 * j < a.E; ++j) {
      const int e = lane + 32 * j;
      if (!(taken >> j & 1u) && better(sel[e], e, bv, be)) {
        bv = sel[e];
        be = e;
      }
    }
    warp_argmax(bv, be);
    if (be == kNone) break;  // K > E (uniform over the warp)
    if ((be & 31) == lane) taken |= 1u << (be >> 5);
    if (lane == k) {
      my_idx = be;
      my_w = s[be];
    }
  }
  const float denom = a.norm ? slot_sum(my_w, a.K) + (a.sigmoid ? 1e-20f : 0.f) : 1.f;
  const float scale = a.scaling / denom;
  if (lane < a.K) {
    weights[t * a.K + lane] = my_w * scale;
    idx[t * a.K + lane] = my_idx;
  }
}

// Grid: ceil(T / kWarps) blocks of kWarps warps; warp w of block b handles token b*kWarps + w.
// Lane k < K holds slot k; d(score) accumulates in shared g[E] per warp, each entry touched
// only by its owning lane (e % 32), so the slots add in order k = 0..K-1 without races.
__global__ void router_bwd_kernel(const float* __restrict__ dweights,
                                  const float* __restrict__ dscores,
                                  const float* __restrict__ scores,
                                  const int64_t* __restrict__ idx, float* __restrict__ dlogits,
                                  RouterArgs a) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= a.T) return;
  float* g = smem + warp * a.E;
  const float* srow = scores + t * a.E;
  for (int e = lane; e < a.E; e += 32) g[e] = dscores != nullptr ? dscores[t * a.E + e] : 0.f;

  int e_k = -1;
  float s_k = 0.f;
  float dw_k = 0.f;
  if (lane < a.K) {
    const int64_t e = idx[t * a.K + lane];
    if (e >= 0 && e < a.E) {
      e_k = static_cast<int>(e);
      s_k = srow[e];
      dw_k = dweights[t * a.K + lane];
    }
  }
  // w_k = c * s_k / D with D = sum of selected s (+1e-20 for sigmoid), as in the forward.
  const float d = slot_sum(s_k, a.K) + (a.sigmoid ? 1e-20f : 0.f);
  const float dot = slot_sum(__fmul_rn(dw_k, s_k), a.K);
  const float ds_k = a.norm ? a.scaling * (dw_k / d - dot / (d * d)) : a.scaling * dw_k;
  for (int k = 0; k < a.K; ++k) {
    const int e = __shfl_sync(kFullMask, e_k, k);
    const float v = __shfl_sync(kFullMask, ds_k, k);
    if (e >= 0 && (e & 31) == lane) g[e] += v;
  }

  float* drow = dlogits + t * a.E;
  if (a.sigmoid) {
    for (int e = lane; e < a.E; e += 32) drow[e] = g[e] * srow[e] * (1.f - srow[e]);
  } else {
    float p = 0.f;
    for (int e = lane; e < a.E; e += 32) p = fmaf(g[e], srow[e], p);
    p = warp_sum(p);
    for (int e = lane; e < a.E; e += 32) drow[e] = srow[e] * (g[e] - p);
  }
}

RouterArgs router_args(int64_t T, int64_t E, const RouterParams& p, const char* kernel) {
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, "automoe::ops::cuda::", kernel, ": ", E,
              " experts (the CUDA router takes 1..", kMaxExperts, ")");
  TORCH_CHECK(p.top_k >= 0 && p.top_k <= kMaxTopK, "automoe::ops::cuda::", kernel,
              ": top_k ", p.top_k, " (the CUDA router takes at most ", kMaxTopK, ")");
  TORCH_CHECK(p.n_group >= 1 && E % p.n_group == 0 && p.topk_group >= 1 &&
                  p.topk_group <= p.n_group,
              "automoe::ops::cuda::", kernel, ": bad grouping n_group=", p.n_group,
              " topk_group=", p.topk_group, " for ", E, " experts");
  const int n_group = static_cast<int>(p.n_group);
  const int topk_group = static_cast<int>(p.topk_group);
  return {T,
          static_cast<int>(E),
          static_cast<int>(p.top_k),
          p.sigmoid,
          n_group,
          topk_group,
          n_group > 1 && topk_group < n_group,
          p.norm_topk_prob,
          static_cast<float>(p.scaling)};
}

void check_fp32(const at::Tensor& t, const char* what, const char* kernel) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "automoe::ops::cuda::", kernel, ": ", what,
              " must be float32, got ", t.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_fwd(const at::Tensor& logits_TE,
                                                          const std::optional<at::Tensor>& bias_E,
                                                          const RouterParams& p) {
  const c10::cuda::CUDAGuard guard(logits_TE.device());
  check_fp32(logits_TE, "logits", "router_fwd");
  const bool has_bias = bias_E.has_value() && bias_E->defined();
  if (has_bias) check_fp32(*bias_E, "bias", "router_fwd");
  const int64_t T = logits_TE.size(0);
  const RouterArgs a = router_args(T, logits_TE.size(1), p, "router_fwd");
  at::Tensor weights = new_output({T, a.K}, logits_TE.options());
  at::Tensor idx = new_output({T, a.K}, logits_TE.options().dtype(at::kLong));
  at::Tensor scores = new_output({T, a.E}, logits_TE.options());
  if (T == 0) return {weights, idx, scores};
  const size_t smem = sizeof(float) * kWarps * (2 * a.E + a.n_group);
  router_fwd_kernel<<<grid_dim(ceil_div(T, kWarps)), kThreads, smem, stream()>>>(
      ptr<float>(logits_TE), has_bias ? ptr<float>(*bias_E) : nullptr, ptr<float>(weights),
      ptr<int64_t>(idx), ptr<float>(scores), a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {weights, idx, scores};
}

at::Tensor router_bwd(const at::Tensor& grad_weights_TK,
                      const std::optional<at::Tensor>& grad_scores_TE, const at::Tensor& scores_TE,
                      const at::Tensor& idx_TK, const RouterParams& p, at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(scores_TE.device());
  check_fp32(grad_weights_TK, "grad_weights", "router_bwd");
  check_fp32(scores_TE, "scores", "router_bwd");
  const bool has_dscores = grad_scores_TE.has_value() && grad_scores_TE->defined();
  if (has_dscores) check_fp32(*grad_scores_TE, "grad_scores", "router_bwd");
  const int64_t T = scores_TE.size(0);
  const RouterArgs a = router_args(T, scores_TE.size(1), p, "router_bwd");
  TORCH_CHECK(idx_TK.size(1) == a.K && grad_weights_TK.size(1) == a.K,
              "automoe::ops::cuda::router_bwd: idx/grad_weights have ", idx_TK.size(1),
              " slots per token, top_k is ", a.K);
  at::Tensor dlogits = new_output({T, a.E}, scores_TE.options());
  if (T == 0) return dlogits.to(out_dtype);
  const size_t smem = sizeof(float) * kWarps * a.E;
  router_bwd_kernel<<<grid_dim(ceil_div(T, kWarps)), kThreads, smem, stream()>>>(
      ptr<float>(grad_weights_TK), has_dscores ? ptr<float>(*grad_scores_TE) : nullptr,
      ptr<float>(scores_TE), ptr<int64_t>(idx_TK), ptr<float>(dlogits), a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dlogits.to(out_dtype);
}

}  // namespace automoe::ops::cuda
