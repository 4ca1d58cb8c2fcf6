// CPU router: one token per iteration of a parallel loop; E is small (<= a few hundred), so each
// token's scores, group ranking and top-k run in L1: vectorised scores (vec::softmax /
// sigmoid_row) and a vectorised selection (vec::topk: the few candidates above a bound, ranked by
// vector compares); a row with a NaN or a -inf among its top k is sorted instead.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {
namespace {

// Higher score first; on equal scores the lower index (deterministic, as the CUDA kernel).
inline bool better(float a, int64_t ia, float b, int64_t ib) {
  return a > b || (a == b && ia < ib);
}

// The gradient reaching the k chosen scores through the weights (scaling c, and the
// normalisation by their sum where norm_topk_prob).
void weights_grad(const float* s, const float* dw, const int64_t* id, int64_t K,
                  const RouterParams& p, float c, float* gk) {
  if (p.norm_topk_prob) {
    float S = 0.f, dot = 0.f;
    for (int64_t k = 0; k < K; ++k) S += s[id[k]];
    if (p.sigmoid) S += 1e-20f;
    for (int64_t k = 0; k < K; ++k) dot += dw[k] * s[id[k]];
    for (int64_t k = 0; k < K; ++k) gk[k] = c * (dw[k] / S - dot / (S * S));
  } else {
    for (int64_t k = 0; k < K; ++k) gk[k] = c * dw[k];
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_fwd(const at::Tensor& logits_TE,
                                                          const std::optional<at::Tensor>& bias_E,
                                                          const RouterParams& p) {
  const int64_t T = logits_TE.size(0), E = logits_TE.size(1), K = p.top_k;
  const int64_t group_size = E / p.n_group;
  at::Tensor scores = new_output({T, E}, logits_TE.options());
  at::Tensor weights = new_output({T, K}, logits_TE.options());
  at::Tensor idx = new_output({T, K}, logits_TE.options().dtype(at::kLong));
  const float* lg = logits_TE.const_data_ptr<float>();
  const float* bias = bias_E ? bias_E->const_data_ptr<float>() : nullptr;
  float* sc = scores.data_ptr<float>();
  float* wt = weights.data_ptr<float>();
  int64_t* ix = idx.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sel(E), scratch(E);
    std::vector<int64_t> order(E);
    std::vector<float> group_score(p.n_group);
    std::vector<int64_t> group_order(p.n_group);
    // The scores of a block of rows first, then their selection: each loop's rows are independent
    // and short enough for the core to overlap them (one loop of both left each row's long
    // dependency chain exposed: softmax + top-k 139 -> 87 ns a row of 128 at AVX-512, Zen 5).
    constexpr int64_t kBlock = 16;
    for (int64_t t = begin; t < end; ++t) {
      if ((t - begin) % kBlock == 0) {
        for (int64_t u = t; u < std::min(end, t + kBlock); ++u) {
          if (p.sigmoid) {
            vec::sigmoid_row(lg + u * E, sc + u * E, E);
          } else {
            vec::softmax(lg + u * E, sc + u * E, E);
          }
        }
      }
      float* s = sc + t * E;
      // The selection scores: the scores themselves unless a bias or the group limit changes them.
      const float* choose = s;
      if (bias) {
        for (int64_t e = 0; e < E; ++e) sel[e] = s[e] + bias[e];
        choose = sel.data();
      } else if (p.n_group > 1) {
        std::copy_n(s, E, sel.begin());
        choose = sel.data();
      }
      if (p.n_group > 1) {
        // Rank groups by the sum of their two best selection scores; drop all but topk_group.
        for (int64_t g = 0; g < p.n_group; ++g) {
          float a = -std::numeric_limits<float>::infinity(), b = a;
          for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
            if (sel[e] > a) {
              b = a;
              a = sel[e];
            } else if (sel[e] > b) {
              b = sel[e];
            }
          }
          group_score[g] = group_size > 1 ? a + b : a;
          group_order[g] = g;
        }
        std::partial_sort(group_order.begin(), group_order.begin() + p.topk_group,
                          group_order.end(), [&](int64_t a, int64_t b) {
                            return better(group_score[a], a, group_score[b], b);
                          });
        for (int64_t r = p.topk_group; r < p.n_group; ++r) {
          const int64_t g = group_order[r];
          std::fill_n(sel.begin() + g * group_size, group_size,
                      -std::numeric_limits<float>::infinity());
        }
      }
      if (!vec::topk(choose, E, K, scratch.data(), order.data())) {  // NaN or -inf: sort
        for (int64_t e = 0; e < E; ++e) order[e] = e;
        std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t a, int64_t b) {
          return better(choose[a], a, choose[b], b);
        });
      }
      float total = 0.f;
      for (int64_t k = 0; k < K; ++k) total += s[order[k]];
      const float denom = p.norm_topk_prob ? total + (p.sigmoid ? 1e-20f : 0.f) : 1.f;
      const float scale = static_cast<float>(p.scaling) / denom;
      for (int64_t k = 0; k < K; ++k) {
        ix[t * K + k] = order[k];
        wt[t * K + k] = s[order[k]] * scale;
      }
    }
  });
  return {weights, idx, scores};
}

at::Tensor router_bwd(const at::Tensor& grad_weights_TK,
                      const std::optional<at::Tensor>& grad_scores_TE, const at::Tensor& scores_TE,
                      const at::Tensor& idx_TK, const RouterParams& p, at::ScalarType out_dtype) {
  const int64_t T = scores_TE.size(0), E = scores_TE.size(1), K = idx_TK.size(1);
  // float32 and bf16 rows are written straight in the logits' dtype (no [T, E] float32 gradient
  // converted afterwards); others (float64: the op tests' ground truth) as float32, then cast.
  const bool direct = out_dtype == at::kFloat || out_dtype == at::kBFloat16;
  at::Tensor grad = new_output({T, E}, scores_TE.options().dtype(direct ? out_dtype : at::kFloat));
  const float* gw = grad_weights_TK.const_data_ptr<float>();
  const float* gs = grad_scores_TE ? grad_scores_TE->const_data_ptr<float>() : nullptr;
  const float* sc = scores_TE.const_data_ptr<float>();
  const int64_t* ix = idx_TK.const_data_ptr<int64_t>();
  const auto dt = grad.scalar_type();
  char* out = static_cast<char*>(grad.data_ptr());
  const int64_t row_bytes = E * grad.element_size();
  const float c = static_cast<float>(p.scaling);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> g(E), gk(K);
    for (int64_t t = begin; t < end; ++t) {
      const float* s = sc + t * E;
      const float* dw = gw + t * K;
      const int64_t* id = ix + t * K;
      weights_grad(s, dw, id, K, p, c, gk.data());
      if (!gs) {
        // Only the weights carry a gradient (no aux loss): it is nonzero at the k chosen experts
        // alone, so the softmax's dot product runs over those k, not over E.
        if (p.sigmoid) {
          std::fill(g.begin(), g.end(), 0.f);
          for (int64_t k = 0; k < K; ++k) g[id[k]] = gk[k] * s[id[k]] * (1.f - s[id[k]]);
        } else {
          float dot = 0.f;
          for (int64_t k = 0; k < K; ++k) dot += gk[k] * s[id[k]];
          vec::scale(s, -dot, g.data(), E);
          for (int64_t k = 0; k < K; ++k) g[id[k]] = s[id[k]] * (gk[k] - dot);
        }
      } else {
        std::copy_n(gs + t * E, E, g.begin());  // the scores' gradient (an aux loss), plus:
        for (int64_t k = 0; k < K; ++k) g[id[k]] += gk[k];
        if (p.sigmoid) {
          for (int64_t e = 0; e < E; ++e) g[e] = g[e] * s[e] * (1.f - s[e]);
        } else {
          const float dot = vec::dot(g.data(), s, E);
          for (int64_t e = 0; e < E; ++e) g[e] = s[e] * (g[e] - dot);
        }
      }
      vec::store(g.data(), out + t * row_bytes, dt, E);
    }
  });
  return grad;
}

}  // namespace automoe::ops::cpu
