// CPU permute / unpermute. The plan is a histogram + exclusive prefix sum + one stable pass (no
// sort), the histogram and the pass over chunks of tokens in parallel; the gathers run parallel
// over rows; every reduction is per output row in slot order, so
// results are deterministic and need no atomics.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_plan(const at::Tensor& idx_TK,
                                                            int64_t num_experts) {
  const int64_t TK = idx_TK.numel();
  const auto opts = idx_TK.options().dtype(at::kLong);
  at::Tensor offsets = at::zeros({num_experts + 1}, opts);
  at::Tensor slot_pos = new_output(idx_TK.sizes(), opts);
  at::Tensor src_token = new_output({TK}, opts);
  const int64_t* idx = idx_TK.const_data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  int64_t* pos = slot_pos.data_ptr<int64_t>();
  int64_t* src = src_token.data_ptr<int64_t>();
  const int64_t K = idx_TK.dim() == 2 ? idx_TK.size(1) : 1;
  const int64_t E = num_experts;
  // Chunks of whole tokens, each with its own histogram; a chunk's cursor for expert e starts
  // after e's rows of all earlier chunks, so the result is the sequential one (slot order within
  // an expert) whatever the chunking and the thread count.
  const int64_t k_or_1 = std::max<int64_t>(K, 1);
  const int64_t chunk = std::max<int64_t>(1, K * std::max<int64_t>(1, 4096 / k_or_1));
  const int64_t chunks = std::max<int64_t>(1, (TK + chunk - 1) / chunk);
  std::vector<int64_t> cursor(chunks * E, 0);
  // The histogram pass also validates: each chunk notes its first index outside [-1, E) (a
  // separate at::aminmax cost as much as the whole plan at T = 4096, K = 8).
  std::vector<int64_t> first_bad(chunks, -1);
  // (Locals in the loops: captured references could alias the int64 outputs, forcing reloads.)
  at::parallel_for(0, chunks, 1, [&, idx](int64_t begin, int64_t end) {
    const int64_t n_exp = E, total = TK, step = chunk;
    for (int64_t c = begin; c < end; ++c) {
      int64_t* cnt = cursor.data() + c * n_exp;
      const int64_t last = std::min(total, (c + 1) * step);
      for (int64_t i = c * step; i < last; ++i) {
        const int64_t e = idx[i];
        if (static_cast<uint64_t>(e) < static_cast<uint64_t>(n_exp)) {
          ++cnt[e];
        } else if (e != -1 && first_bad[c] < 0) {
          first_bad[c] = i;
        }
      }
    }
  });
  for (const int64_t i : first_bad) {
    AUTOMOE_CHECK(i < 0, "automoe.moe_permute_plan: indices must be in [-1, ", E, "), got ", idx[i],
                  " at [", i / k_or_1, ", ", i % k_or_1, "]");
  }
  for (int64_t e = 0; e < E; ++e) {
    int64_t run = off[e];
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n = cursor[c * E + e];
      cursor[c * E + e] = run;
      run += n;
    }
    off[e + 1] = run;
  }
  at::parallel_for(0, chunks, 1, [&, idx, pos, src](int64_t begin, int64_t end) {
    const int64_t n_exp = E, total = TK, step = chunk, k_slots = K;
    for (int64_t c = begin; c < end; ++c) {
      int64_t* cur = cursor.data() + c * n_exp;
      const int64_t last = std::min(total, (c + 1) * step);
      for (int64_t i = c * step, t = i / k_or_1; i < last; ++t) {
        for (int64_t k = 0; k < k_slots; ++k, ++i) {  // (token, slot): no division per slot
          const int64_t e = idx[i];
          if (e < 0 || e >= n_exp) {
            pos[i] = -1;
            continue;
          }
          const int64_t r = cur[e]++;
          pos[i] = r;
          src[r] = t;
        }
      }
    }
  });
  std::fill(src + off[num_experts], src + TK, int64_t{-1});
  return {offsets, slot_pos, src_token};
}

at::Tensor permute_fwd(const at::Tensor& x_TH, const at::Tensor& src_token_N) {
  const int64_t N = src_token_N.size(0), H = x_TH.size(1), es = x_TH.element_size();
  at::Tensor out = new_output({N, H}, x_TH.options());
  const int64_t* src = src_token_N.const_data_ptr<int64_t>();
  const char* x = static_cast<const char*>(x_TH.const_data_ptr());
  char* y = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (src[n] < 0) {
        std::memset(y + n * H * es, 0, H * es);
      } else {
        std::memcpy(y + n * H * es, x + src[n] * H * es, H * es);
      }
    }
  });
  return out;
}

at::Tensor permute_bwd(const at::Tensor& grad_NH, const at::Tensor& slot_pos_TK) {
  const int64_t T = slot_pos_TK.size(0), K = slot_pos_TK.size(1), H = grad_NH.size(1);
  at::Tensor out = new_output({T, H}, grad_NH.options());
  const int64_t* pos = slot_pos_TK.const_data_ptr<int64_t>();
  const auto dtype = grad_NH.scalar_type();
  if (dtype != at::kDouble) {  // vectorised rows (float32 / bfloat16)
    const char* g = static_cast<const char*>(grad_NH.const_data_ptr());
    char* o = static_cast<char*>(out.data_ptr());
    const int64_t es = grad_NH.element_size();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = pos[t * K + k];
          if (r < 0) continue;
          if (dtype == at::kBFloat16) {  // acc += row, read straight from the bf16 row
            vec::axpy_bf16(acc.data(), 1.f, reinterpret_cast<const uint16_t*>(g + r * H * es), H);
          } else {
            vec::axpy(acc.data(), 1.f, reinterpret_cast<const float*>(g + r * H * es), H);
          }
        }
        vec::store(acc.data(), o + t * H * es, dtype, H);
      }
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, grad_NH.scalar_type(), "permute_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_NH.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(H);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = pos[t * K + k];
          if (r < 0) continue;
          const scalar_t* row = g + r * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += static_cast<acc_t>(row[h]);
        }
        for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

namespace {

template <typename scalar_t, typename weight_t>
void unpermute_rows(const at::Tensor& y_NH, const at::Tensor& slot_pos_TK,
                    const at::Tensor& weights_TK, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t T = slot_pos_TK.size(0), K = slot_pos_TK.size(1), H = y_NH.size(1);
  const scalar_t* y = y_NH.const_data_ptr<scalar_t>();
  const weight_t* w = weights_TK.const_data_ptr<weight_t>();
  const int64_t* pos = slot_pos_TK.const_data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        if (r < 0) continue;
        const acc_t wk = static_cast<acc_t>(w[t * K + k]);
        const scalar_t* row = y + r * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += wk * static_cast<acc_t>(row[h]);
      }
      for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<scalar_t>(acc[h]);
    }
  });
}

template <typename scalar_t, typename weight_t>
void unpermute_rows_bwd(const at::Tensor& grad_TH, const at::Tensor& y_NH,
                        const at::Tensor& slot_pos_TK, const at::Tensor& weights_TK,
                        at::Tensor& grad_y, at::Tensor& grad_w) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t T = slot_pos_TK.size(0), K = slot_pos_TK.size(1), H = y_NH.size(1);
  const int64_t N = y_NH.size(0);
  const scalar_t* g = grad_TH.const_data_ptr<scalar_t>();
  const scalar_t* y = y_NH.const_data_ptr<scalar_t>();
  const weight_t* w = weights_TK.const_data_ptr<weight_t>();
  const int64_t* pos = slot_pos_TK.const_data_ptr<int64_t>();
  scalar_t* gy = grad_y.data_ptr<scalar_t>();
  weight_t* gw = grad_w.data_ptr<weight_t>();
  // Rows that no slot points at (dropped capacity) get zeros: mark the referenced ones first.
  std::vector<uint8_t> used(N, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    if (pos[i] >= 0) used[pos[i]] = 1;
  }
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (!used[n]) std::fill_n(gy + n * H, H, scalar_t(0));
    }
  });
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gt = g + t * H;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        if (r < 0) {
          gw[t * K + k] = weight_t(0);
          continue;
        }
        const acc_t wk = static_cast<acc_t>(w[t * K + k]);
        const scalar_t* yr = y + r * H;
        scalar_t* gr = gy + r * H;
        acc_t dot = 0;
        for (int64_t h = 0; h < H; ++h) {
          const acc_t gh = static_cast<acc_t>(gt[h]);
          dot += gh * static_cast<acc_t>(yr[h]);
          gr[h] = static_cast<scalar_t>(wk * gh);
        }
        gw[t * K + k] = static_cast<weight_t>(dot);
      }
    }
  });
}

// float32 / bfloat16 rows, weights float32 or y's dtype.
float weight_at(const at::Tensor& w, int64_t i) {
  return w.scalar_type() == at::kFloat ? w.const_data_ptr<float>()[i]
                                       : static_cast<float>(w.const_data_ptr<c10::BFloat16>()[i]);
}

void unpermute_rows_vec(const at::Tensor& y_NH, const at::Tensor& slot_pos_TK,
                        const at::Tensor& weights_TK, at::Tensor& out) {
  const int64_t T = slot_pos_TK.size(0), K = slot_pos_TK.size(1), H = y_NH.size(1);
  const auto dtype = y_NH.scalar_type();
  const int64_t es = y_NH.element_size();
  const char* y = static_cast<const char*>(y_NH.const_data_ptr());
  const int64_t* pos = slot_pos_TK.const_data_ptr<int64_t>();
  char* o = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        if (r < 0) continue;
        const float wk = weight_at(weights_TK, t * K + k);
        if (dtype == at::kBFloat16) {
          vec::axpy_bf16(acc.data(), wk, reinterpret_cast<const uint16_t*>(y + r * H * es), H);
        } else {
          vec::axpy(acc.data(), wk, reinterpret_cast<const float*>(y + r * H * es), H);
        }
      }
      vec::store(acc.data(), o + t * H * es, dtype, H);
    }
  });
}

void unpermute_rows_bwd_vec(const at::Tensor& grad_TH, const at::Tensor& y_NH,
                            const at::Tensor& slot_pos_TK, const at::Tensor& weights_TK,
                            at::Tensor& grad_y, at::Tensor& grad_w) {
  const int64_t T = slot_pos_TK.size(0), K = slot_pos_TK.size(1), H = y_NH.size(1);
  const int64_t N = y_NH.size(0);
  const auto dtype = y_NH.scalar_type(), wdtype = weights_TK.scalar_type();
  const int64_t es = y_NH.element_size();
  const char* g = static_cast<const char*>(grad_TH.const_data_ptr());
  const char* y = static_cast<const char*>(y_NH.const_data_ptr());
  const int64_t* pos = slot_pos_TK.const_data_ptr<int64_t>();
  char* gy = static_cast<char*>(grad_y.data_ptr());
  char* gw = static_cast<char*>(grad_w.data_ptr());
  const int64_t wes = grad_w.element_size();
  std::vector<uint8_t> used(N, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    if (pos[i] >= 0) used[pos[i]] = 1;
  }
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (!used[n]) std::memset(gy + n * H * es, 0, H * es);
    }
  });
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gt(H), out(H);
    for (int64_t t = begin; t < end; ++t) {
      vec::load(g + t * H * es, dtype, gt.data(), H);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[t * K + k];
        float dw = 0.f;
        if (r >= 0) {
          dw = dtype == at::kBFloat16
                   ? vec::dot_bf16(gt.data(), reinterpret_cast<const uint16_t*>(y + r * H * es), H)
                   : vec::dot(gt.data(), reinterpret_cast<const float*>(y + r * H * es), H);
          vec::scale(gt.data(), weight_at(weights_TK, t * K + k), out.data(), H);
          vec::store(out.data(), gy + r * H * es, dtype, H);
        }
        vec::store(&dw, gw + (t * K + k) * wes, wdtype, 1);
      }
    }
  });
}

}  // namespace

at::Tensor unpermute_fwd(const at::Tensor& y_NH, const at::Tensor& slot_pos_TK,
                         const at::Tensor& weights_TK) {
  at::Tensor out = new_output({slot_pos_TK.size(0), y_NH.size(1)}, y_NH.options());
  if (y_NH.scalar_type() != at::kDouble) {
    unpermute_rows_vec(y_NH, slot_pos_TK, weights_TK, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y_NH.scalar_type(), "unpermute_fwd", [&] {
    if (weights_TK.scalar_type() == at::kFloat) {
      unpermute_rows<scalar_t, float>(y_NH, slot_pos_TK, weights_TK, out);
    } else {
      unpermute_rows<scalar_t, scalar_t>(y_NH, slot_pos_TK, weights_TK, out);
    }
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor& grad_TH, const at::Tensor& y_NH,
                                                const at::Tensor& slot_pos_TK,
                                                const at::Tensor& weights_TK) {
  at::Tensor grad_y = new_output(y_NH.sizes(), y_NH.options());
  at::Tensor grad_w = new_output(weights_TK.sizes(), weights_TK.options());
  if (y_NH.scalar_type() != at::kDouble) {
    unpermute_rows_bwd_vec(grad_TH, y_NH, slot_pos_TK, weights_TK, grad_y, grad_w);
    return {grad_y, grad_w};
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y_NH.scalar_type(), "unpermute_bwd", [&] {
    if (weights_TK.scalar_type() == at::kFloat) {
      unpermute_rows_bwd<scalar_t, float>(grad_TH, y_NH, slot_pos_TK, weights_TK, grad_y, grad_w);
    } else {
      unpermute_rows_bwd<scalar_t, scalar_t>(grad_TH, y_NH, slot_pos_TK, weights_TK, grad_y,
                                             grad_w);
    }
  });
  return {grad_y, grad_w};
}

}  // namespace automoe::ops::cpu
