// RMSNorm's rows (vec.h rmsnorm_row, rmsnorm_row_bwd): one body per row in its own dtype, compiled
// once per instruction-set level.
#include <cmath>
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

// The sums keep kLanes partial sums (vectorisable without reassociation), as sum_sq does.
template <typename T>
AUTOMOE_BODY float rmsnorm_typed(const T* x, const float* w, float eps, T* y, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = ld(x, i + j);
      acc[j] += v * v;
    }
  }
  float ss = 0.f;
  for (; i < n; ++i) {
    const float v = ld(x, i);
    ss += v * v;
  }
  for (int j = 0; j < kLanes; ++j) ss += acc[j];
  const float k = 1.f / std::sqrt(ss / n + eps);
  for (i = 0; i < n; ++i) st(y, i, ld(x, i) * k * w[i]);
  return k;
}

template <typename T>
AUTOMOE_BODY void rmsnorm_bwd_typed(const T* g, const T* x, const float* w, float k, float* pw,
                                    T* dx, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float gv = ld(g, i + j), xv = ld(x, i + j);
      acc[j] += gv * w[i + j] * xv;
      pw[i + j] += gv * xv * k;
    }
  }
  float dot = 0.f;
  for (; i < n; ++i) {
    const float gv = ld(g, i), xv = ld(x, i);
    dot += gv * w[i] * xv;
    pw[i] += gv * xv * k;
  }
  for (int j = 0; j < kLanes; ++j) dot += acc[j];
  const float m = k * dot / n;
  for (i = 0; i < n; ++i) st(dx, i, k * (ld(g, i) * w[i] - ld(x, i) * k * m));
}

AUTOMOE_BODY float rmsnorm_row_body(const void* x, const float* w, float eps, void* y,
                                    c10::ScalarType dtype, int64_t n){
    AUTOMOE_TYPED(dtype, T,
                  return rmsnorm_typed(static_cast<const T*>(x), w, eps, static_cast<T*>(y), n))}

AUTOMOE_BODY void rmsnorm_row_bwd_body(const void* g, const void* x, const float* w, float k,
                                       float* dw_acc, void* dx, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(dtype, T,
                rmsnorm_bwd_typed(static_cast<const T*>(g), static_cast<const T*>(x), w, k, dw_acc,
                                  static_cast<T*>(dx), n))
}

}  // namespace

AUTOMOE_ROW_FN(float, rmsnorm_row,
               (const void* x, const float* w, float eps, void* y, c10::ScalarType dtype,
                int64_t n),
               (x, w, eps, y, dtype, n))
AUTOMOE_ROW_FN(void, rmsnorm_row_bwd,
               (const void* g, const void* x, const float* w, float k, float* dw_acc, void* dx,
                c10::ScalarType dtype, int64_t n),
               (g, x, w, k, dw_acc, dx, dtype, n))

}  // namespace automoe::ops::cpu::vec
