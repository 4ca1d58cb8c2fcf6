// Mamba-2's rows (vec.h mul_add_row, silu_store_row, silu_grad_row, gated_norm_group,
// gated_norm_group_bwd): the depthwise conv's taps and its SiLU, the gated grouped RMSNorm's
// groups. The SiLU rows have AVX2 and AVX-512 kernels (sigmoid by the shared exp polynomial) and
// the scalar body for the tail; the others are one body compiled per level (AUTOMOE_ROW_FN).
#include <cmath>
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

template <typename T>
AUTOMOE_BODY void mul_add_typed(float* acc, const float* w, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w[i] * ld(x, i);
}

AUTOMOE_BODY void mul_add_row_body(float* acc, const float* w, const void* x, c10::ScalarType dtype,
                                   int64_t n) {
  AUTOMOE_TYPED(dtype, T, mul_add_typed(acc, w, static_cast<const T*>(x), n))
}

// Rounds v to T's precision (bf16: nearest even), as a float.
AUTOMOE_BODY float rounded(float v, const float*) { return v; }
AUTOMOE_BODY float rounded(float v, const uint16_t*) { return bf16_bits_to_float(to_bf16(v)); }

// One group of the gated norm: h = y * z * s (z and s = sigmoid(z) as float32 rows), returns
// k = 1 / sqrt(mean(h^2) + eps) and writes out = round(round(h * k) * w): the normalised value in
// the row's dtype before the weight multiplies it (the reference's order of rounding).
template <typename T>
AUTOMOE_BODY float gated_norm_typed(const T* y, const float* z, const float* s, const float* w,
                                    float eps, T* out, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float h = ld(y, i + j) * z[i + j] * s[i + j];
      acc[j] += h * h;
    }
  }
  float ss = 0.f;
  for (; i < n; ++i) {
    const float h = ld(y, i) * z[i] * s[i];
    ss += h * h;
  }
  for (int j = 0; j < kLanes; ++j) ss += acc[j];
  const float k = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) st(out, i, rounded(ld(y, i) * z[i] * s[i] * k, y) * w[i]);
  return k;
}

AUTOMOE_BODY float gated_norm_group_body(const void* y, const float* z, const float* s,
                                         const float* w, float eps, void* out,
                                         c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(dtype, T,
                return gated_norm_typed(static_cast<const T*>(y), z, s, w, eps, static_cast<T*>(out),
                                        n))
}

// One group's backward (see vec.h): two passes, the first for the mean of dn * nhat.
template <typename T>
AUTOMOE_BODY void gated_norm_bwd_typed(const T* g, const T* y, const float* z, const float* s,
                                       const float* w, float k, float* dw_acc, T* dy, float* dz,
                                       int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float gv = ld(g, i + j), nh = ld(y, i + j) * z[i + j] * s[i + j] * k;
      acc[j] += gv * w[i + j] * nh;
      dw_acc[i + j] += gv * rounded(nh, g);
    }
  }
  float dot = 0.f;
  for (; i < n; ++i) {
    const float gv = ld(g, i), nh = ld(y, i) * z[i] * s[i] * k;
    dot += gv * w[i] * nh;
    dw_acc[i] += gv * rounded(nh, g);
  }
  for (int j = 0; j < kLanes; ++j) dot += acc[j];
  const float m = dot / static_cast<float>(n);
  for (i = 0; i < n; ++i) {
    const float yv = ld(y, i), sv = s[i], zv = z[i];
    const float dh = k * (ld(g, i) * w[i] - yv * zv * sv * k * m);
    st(dy, i, dh * zv * sv);
    dz[i] = dh * yv * sv * (1.f + zv * (1.f - sv));
  }
}

AUTOMOE_BODY void gated_norm_group_bwd_body(const void* g, const void* y, const float* z,
                                            const float* s, const float* w, float k, float* dw_acc,
                                            void* dy, float* dz, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(dtype, T,
                gated_norm_bwd_typed(static_cast<const T*>(g), static_cast<const T*>(y), z, s, w, k,
                                     dw_acc, static_cast<T*>(dy), dz, n))
}

#if defined(AUTOMOE_VEC_X86)
template <typename T>
AUTOMOE_TARGET_AVX512 int64_t silu_store_avx512(const float* a, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(a + i);
    st16(y + i, _mm512_mul_ps(v, sigmoid16(v)));
  }
  return i;
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t silu_store_avx2(const float* a, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(a + i);
    st8(y + i, _mm256_mul_ps(v, sigmoid8(v)));
  }
  return i;
}

template <typename T>
AUTOMOE_TARGET_AVX512 int64_t silu_grad_avx512(const float* a, const T* dy, float* g, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(a + i), s = sigmoid16(v);
    const __m512 d = _mm512_fmadd_ps(v, _mm512_sub_ps(one, s), one);  // 1 + a (1 - s)
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_mul_ps(ld16(dy + i), s), d));
  }
  return i;
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t silu_grad_avx2(const float* a, const T* dy, float* g,
                                                           int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(a + i), s = sigmoid8(v);
    const __m256 d = _mm256_fmadd_ps(v, _mm256_sub_ps(one, s), one);
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(ld8(dy + i), s), d));
  }
  return i;
}
#endif

template <typename T>
void silu_store_dispatch(const float* a, T* y, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = silu_store_avx512(a, y, n);
  } else if (isa >= Isa::kAvx2) {
    i = silu_store_avx2(a, y, n);
  }
#endif
  for (; i < n; ++i) st(y, i, a[i] * sigmoid(a[i]));
}

template <typename T>
void silu_grad_dispatch(const float* a, const T* dy, float* g, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = silu_grad_avx512(a, dy, g, n);
  } else if (isa >= Isa::kAvx2) {
    i = silu_grad_avx2(a, dy, g, n);
  }
#endif
  for (; i < n; ++i) {
    const float s = sigmoid(a[i]);
    g[i] = ld(dy, i) * s * (1.f + a[i] * (1.f - s));
  }
}

// The SSD scan's within-chunk row (see vec.h ssd_decay_row).
#if defined(AUTOMOE_VEC_X86)
AUTOMOE_TARGET_AVX512 int64_t ssd_decay_avx512(float al, const float* acum, const float* cb,
                                               const float* dt, float* ldec, float* m, int64_t n) {
  const __m512 a = _mm512_set1_ps(al);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(a, _mm512_loadu_ps(acum + i)));
    _mm512_storeu_ps(ldec + i, e);
    _mm512_storeu_ps(m + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(cb + i), e), _mm512_loadu_ps(dt + i)));
  }
  return i;
}

__attribute__((target("avx2,fma"))) int64_t ssd_decay_avx2(float al, const float* acum, const float* cb,
                                                          const float* dt, float* ldec, float* m,
                                                          int64_t n) {
  const __m256 a = _mm256_set1_ps(al);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(a, _mm256_loadu_ps(acum + i)));
    _mm256_storeu_ps(ldec + i, e);
    _mm256_storeu_ps(m + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(cb + i), e), _mm256_loadu_ps(dt + i)));
  }
  return i;
}
#endif

// Its backward (see vec.h ssd_decay_row_bwd); returns the sum of r.
AUTOMOE_BODY float ssd_decay_row_bwd_body(const float* dm, const float* ldec, const float* cb,
                                          const float* dt, float* dcb, float* ddt, float* dacum,
                                          int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float t = dm[i + j] * ldec[i + j], r = t * cb[i + j] * dt[i + j];
      dcb[i + j] += t * dt[i + j];
      ddt[i + j] += t * cb[i + j];
      dacum[i + j] -= r;
      acc[j] += r;
    }
  }
  float sum = 0.f;
  for (; i < n; ++i) {
    const float t = dm[i] * ldec[i], r = t * cb[i] * dt[i];
    dcb[i] += t * dt[i];
    ddt[i] += t * cb[i];
    dacum[i] -= r;
    sum += r;
  }
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

}  // namespace

AUTOMOE_ROW_FN(void, mul_add_row,
               (float* acc, const float* w, const void* x, c10::ScalarType dtype, int64_t n),
               (acc, w, x, dtype, n))
AUTOMOE_ROW_FN(float, gated_norm_group,
               (const void* y, const float* z, const float* s, const float* w, float eps, void* out,
                c10::ScalarType dtype, int64_t n),
               (y, z, s, w, eps, out, dtype, n))
AUTOMOE_ROW_FN(void, gated_norm_group_bwd,
               (const void* g, const void* y, const float* z, const float* s, const float* w,
                float k, float* dw_acc, void* dy, float* dz, c10::ScalarType dtype, int64_t n),
               (g, y, z, s, w, k, dw_acc, dy, dz, dtype, n))

AUTOMOE_ROW_FN(float, ssd_decay_row_bwd,
               (const float* dm, const float* ldec, const float* cb, const float* dt, float* dcb,
                float* ddt, float* dacum, int64_t n),
               (dm, ldec, cb, dt, dcb, ddt, dacum, n))

void ssd_decay_row(float al, const float* acum, const float* cb, const float* dt, float* ldec,
                   float* m, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = ssd_decay_avx512(al, acum, cb, dt, ldec, m, n);
  } else if (isa >= Isa::kAvx2) {
    i = ssd_decay_avx2(al, acum, cb, dt, ldec, m, n);
  }
#endif
  for (; i < n; ++i) {
    ldec[i] = exp_approx(al - acum[i]);
    m[i] = cb[i] * ldec[i] * dt[i];
  }
}

void silu_store_row(const float* a, bool silu, void* y, c10::ScalarType dtype, int64_t n) {
  if (!silu) return store(a, y, dtype, n);
  AUTOMOE_TYPED(dtype, T, silu_store_dispatch(a, static_cast<T*>(y), n))
}

void silu_grad_row(const float* a, bool silu, const void* dy, c10::ScalarType dtype, float* g,
                   int64_t n) {
  if (!silu) return load(dy, dtype, g, n);
  AUTOMOE_TYPED(dtype, T, silu_grad_dispatch(a, static_cast<const T*>(dy), g, n))
}

}  // namespace automoe::ops::cpu::vec
