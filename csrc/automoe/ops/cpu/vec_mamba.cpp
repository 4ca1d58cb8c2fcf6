// Mamba-2's rows (vec.h mul_add_row, silu_store_row, silu_grad_row, gated_norm_group,
// gated_norm_group_bwd): the depthwise conv's taps and its SiLU, the gated grouped RMSNorm's
// groups. The SiLU rows have AVX2 and AVX-512 kernels (sigmoid by the shared exp polynomial) and
// the scalar body for the tail; the others are one body compiled per level (AUTOMOE_ROW_FN).
#include <cmath>
#include <cstdint>
#include <vector>

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

// The SSD scan's within-chunk row (see vec.h ssd_decay_row): every element vectorised, the tail
// with masked lanes on AVX-512; m stored in its dtype.
#if defined(AUTOMOE_VEC_X86)
template <typename T>
AUTOMOE_TARGET_AVX512 void ssd_decay_avx512(float al, const float* acum, const float* cb,
                                            const float* dt, float* ldec, T* m, int64_t n) {
  const __m512 a = _mm512_set1_ps(al);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(a, _mm512_maskz_loadu_ps(k, acum + i)));
    if (ldec) _mm512_mask_storeu_ps(ldec + i, k, e);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, cb + i), e),
                                   _mm512_maskz_loadu_ps(k, dt + i));
    if (k == 0xFFFF) {
      st16(m + i, v);
    } else {
      alignas(64) T tmp[16];
      st16(tmp, v);
      for (int64_t j = 0; j < n - i; ++j) m[i + j] = tmp[j];
    }
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t ssd_decay_avx2(float al, const float* acum,
                                                           const float* cb, const float* dt,
                                                           float* ldec, T* m, int64_t n) {
  const __m256 a = _mm256_set1_ps(al);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(a, _mm256_loadu_ps(acum + i)));
    if (ldec) _mm256_storeu_ps(ldec + i, e);
    st8(m + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(cb + i), e), _mm256_loadu_ps(dt + i)));
  }
  return i;
}
#endif

template <typename T>
void ssd_decay_typed(float al, const float* acum, const float* cb, const float* dt, float* ldec, T* m,
                     int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) return ssd_decay_avx512(al, acum, cb, dt, ldec, m, n);
  if (isa >= Isa::kAvx2) i = ssd_decay_avx2(al, acum, cb, dt, ldec, m, n);
#endif
  for (; i < n; ++i) {
    const float e = exp_approx(al - acum[i]);
    if (ldec) ldec[i] = e;
    st(m, i, cb[i] * e * dt[i]);
  }
}

// Its backward (see vec.h ssd_decay_row_bwd); returns the sum of r.
AUTOMOE_BODY float ssd_decay_row_bwd_rows_body(const float* dm, const float* ldec, const float* cb,
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


// The SSD scan's unit blocks (vec.h ssd_out_block ...): the per-(position, head) loops of p
// channels as one call per unit, each compiled per level.
template <typename T>
AUTOMOE_BODY float dot_typed(const float* a, const T* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * ld(b, i + j);
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * ld(b, i);
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

template <typename T>
AUTOMOE_BODY void ssd_out_typed(float* y, int64_t ldy, const float* z, int64_t ldz, const T* x,
                                int64_t ldx, const float* e, const float* d, int64_t q, int64_t hg,
                                int64_t p) {
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      float* yr = y + l * ldy + j * p;
      const float* zr = z + l * ldz + j * p;
      const T* xr = x + l * ldx + j * p;
      const float ev = e[j * q + l], dv = d[j];
      for (int64_t i = 0; i < p; ++i) yr[i] += ev * zr[i] + dv * ld(xr, i);
    }
  }
}

AUTOMOE_BODY void ssd_out_block_body(float* y, int64_t ldy, const float* z, int64_t ldz,
                                     const void* x, int64_t ldx, c10::ScalarType dtype,
                                     const float* e, const float* d, int64_t q, int64_t hg,
                                     int64_t p) {
  AUTOMOE_TYPED(dtype, T, ssd_out_typed(y, ldy, z, ldz, static_cast<const T*>(x), ldx, e, d, q, hg, p))
}

template <typename T>
AUTOMOE_BODY void ssd_scale_typed(const T* x, int64_t ldx, const float* w, T* out, int64_t q,
                                  int64_t hg, int64_t p) {
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      const T* xr = x + l * ldx + j * p;
      T* o = out + (l * hg + j) * p;
      const float wv = w[j * q + l];
      for (int64_t i = 0; i < p; ++i) st(o, i, ld(xr, i) * wv);
    }
  }
}

AUTOMOE_BODY void ssd_scale_block_body(const void* x, int64_t ldx, c10::ScalarType dtype,
                                       const float* w, void* out, int64_t q, int64_t hg, int64_t p) {
  AUTOMOE_TYPED(dtype, T,
                ssd_scale_typed(static_cast<const T*>(x), ldx, w, static_cast<T*>(out), q, hg, p))
}

template <typename T>
AUTOMOE_BODY void ssd_out_bwd_typed(const float* g, int64_t ldg, const float* z, int64_t ldz,
                                    const T* x, int64_t ldx, const float* e, const float* d,
                                    float* dx, int64_t lddx, T* dz, T* gh, float* re, float* dd,
                                    int64_t q, int64_t hg, int64_t p) {
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      const float* gr = g + l * ldg + j * p;
      const float ev = e[j * q + l], dv = d[j];
      T* dzr = dz + (l * hg + j) * p;
      T* ghr = gh + (j * q + l) * p;
      float* dxr = dx + l * lddx + j * p;
      for (int64_t i = 0; i < p; ++i) {
        st(dzr, i, ev * gr[i]);
        st(ghr, i, gr[i]);
        dxr[i] = dv * gr[i];
      }
      re[j * q + l] = ev * dot_typed(gr, z + l * ldz + j * p, p);
      dd[j] += dot_typed(gr, x + l * ldx + j * p, p);
    }
  }
}

AUTOMOE_BODY void ssd_out_block_bwd_rows_body(const float* g, int64_t ldg, const float* z, int64_t ldz,
                                         const void* x, int64_t ldx, c10::ScalarType dtype,
                                         const float* e, const float* d, float* dx, int64_t lddx,
                                         void* dz, void* gh, float* re, float* dd, int64_t q,
                                         int64_t hg, int64_t p) {
  AUTOMOE_TYPED(dtype, T,
                ssd_out_bwd_typed(g, ldg, z, ldz, static_cast<const T*>(x), ldx, e, d, dx, lddx,
                                  static_cast<T*>(dz), static_cast<T*>(gh), re, dd, q, hg, p))
}

template <typename T>
AUTOMOE_BODY void ssd_scale_bwd_typed(const float* g, const T* x, int64_t ldx, const float* w,
                                      float* dx, int64_t lddx, float* u, int64_t q, int64_t hg,
                                      int64_t p) {
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      const float* gr = g + (l * hg + j) * p;
      float* dxr = dx + l * lddx + j * p;
      const float wv = w[j * q + l];
      for (int64_t i = 0; i < p; ++i) dxr[i] += wv * gr[i];
      u[j * q + l] = dot_typed(gr, x + l * ldx + j * p, p);
    }
  }
}

AUTOMOE_BODY void ssd_scale_block_bwd_rows_body(const float* g, const void* x, int64_t ldx,
                                           c10::ScalarType dtype, const float* w, float* dx,
                                           int64_t lddx, float* u, int64_t q, int64_t hg,
                                           int64_t p) {
  AUTOMOE_TYPED(dtype, T,
                ssd_scale_bwd_typed(g, static_cast<const T*>(x), ldx, w, dx, lddx, u, q, hg, p))
}

AUTOMOE_BODY void ssd_state_step_body(float* next, const float* prev, const float* f, int64_t rows,
                                      int64_t hg, int64_t p) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hg; ++j) {
      float* nr = next + (r * hg + j) * p;
      const float* pr = prev + (r * hg + j) * p;
      const float fv = f[j];
      for (int64_t i = 0; i < p; ++i) nr[i] += fv * pr[i];
    }
  }
}

AUTOMOE_BODY void ssd_state_step_bwd_rows_body(float* cur, const float* next, const float* h,
                                          const float* f, float* fd, int64_t rows, int64_t hg,
                                          int64_t p) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < hg; ++j) {
      const int64_t o = (r * hg + j) * p;
      const float fv = f[j];
      for (int64_t i = 0; i < p; ++i) cur[o + i] += fv * next[o + i];
      fd[j] += dot_typed(next + o, h + o, p);
    }
  }
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

AUTOMOE_ROW_FN(float, ssd_decay_row_bwd_rows,
               (const float* dm, const float* ldec, const float* cb, const float* dt, float* dcb,
                float* ddt, float* dacum, int64_t n),
               (dm, ldec, cb, dt, dcb, ddt, dacum, n))
AUTOMOE_ROW_FN(void, ssd_out_block,
               (float* y, int64_t ldy, const float* z, int64_t ldz, const void* x, int64_t ldx,
                c10::ScalarType dtype, const float* e, const float* d, int64_t q, int64_t hg,
                int64_t p),
               (y, ldy, z, ldz, x, ldx, dtype, e, d, q, hg, p))
AUTOMOE_ROW_FN(void, ssd_scale_block,
               (const void* x, int64_t ldx, c10::ScalarType dtype, const float* w, void* out,
                int64_t q, int64_t hg, int64_t p),
               (x, ldx, dtype, w, out, q, hg, p))
AUTOMOE_ROW_FN(void, ssd_out_block_bwd_rows,
               (const float* g, int64_t ldg, const float* z, int64_t ldz, const void* x,
                int64_t ldx, c10::ScalarType dtype, const float* e, const float* d, float* dx,
                int64_t lddx, void* dz, void* gh, float* re, float* dd, int64_t q, int64_t hg,
                int64_t p),
               (g, ldg, z, ldz, x, ldx, dtype, e, d, dx, lddx, dz, gh, re, dd, q, hg, p))
AUTOMOE_ROW_FN(void, ssd_scale_block_bwd_rows,
               (const float* g, const void* x, int64_t ldx, c10::ScalarType dtype, const float* w,
                float* dx, int64_t lddx, float* u, int64_t q, int64_t hg, int64_t p),
               (g, x, ldx, dtype, w, dx, lddx, u, q, hg, p))
AUTOMOE_ROW_FN(void, ssd_state_step,
               (float* next, const float* prev, const float* f, int64_t rows, int64_t hg,
                int64_t p),
               (next, prev, f, rows, hg, p))
AUTOMOE_ROW_FN(void, ssd_state_step_bwd_rows,
               (float* cur, const float* next, const float* h, const float* f, float* fd,
                int64_t rows, int64_t hg, int64_t p),
               (cur, next, h, f, fd, rows, hg, p))

void ssd_decay_row(float al, const float* acum, const float* cb, const float* dt, float* ldec,
                   void* m, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(dtype, T, ssd_decay_typed(al, acum, cb, dt, ldec, static_cast<T*>(m), n))
}

// The reducing SSD blocks on AVX-512: 16-lane sums reduced once per dot (the bodies' 32 scalar
// partial sums cost as much as the dot at p = 64), the decay row's tail in masked lanes.
#if defined(AUTOMOE_VEC_X86)
namespace {

AUTOMOE_TARGET_AVX512 float decay_row_bwd_avx512(const float* dm, const float* ldec, const float* cb,
                                                 const float* dt, float* dcb, float* ddt, float* dacum,
                                                 int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 c = _mm512_maskz_loadu_ps(k, cb + i), d = _mm512_maskz_loadu_ps(k, dt + i);
    const __m512 t = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, dm + i), _mm512_maskz_loadu_ps(k, ldec + i));
    const __m512 r = _mm512_mul_ps(_mm512_mul_ps(t, c), d);
    _mm512_mask_storeu_ps(dcb + i, k, _mm512_fmadd_ps(t, d, _mm512_maskz_loadu_ps(k, dcb + i)));
    _mm512_mask_storeu_ps(ddt + i, k, _mm512_fmadd_ps(t, c, _mm512_maskz_loadu_ps(k, ddt + i)));
    _mm512_mask_storeu_ps(dacum + i, k, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dacum + i), r));
    acc = _mm512_add_ps(acc, r);
  }
  return _mm512_reduce_add_ps(acc);
}

// (positions outer, heads inner: the rows are read in memory order; dd's per-head 16-lane sums in
// `lanes`, hg x 16 floats of the caller's)
template <typename T>
AUTOMOE_TARGET_AVX512 void out_block_bwd_avx512(const float* g, int64_t ldg, const float* z, int64_t ldz,
                                                const T* x, int64_t ldx, const float* e, const float* d,
                                                float* dx, int64_t lddx, T* dz, T* gh, float* re, float* dd,
                                                int64_t q, int64_t hg, int64_t p, float* lanes) {
  for (int64_t j = 0; j < hg; ++j) _mm512_storeu_ps(lanes + 16 * j, _mm512_setzero_ps());
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      const float* gr = g + l * ldg + j * p;
      const float* zr = z + l * ldz + j * p;
      const T* xr = x + l * ldx + j * p;
      float* dxr = dx + l * lddx + j * p;
      T* dzr = dz + (l * hg + j) * p;
      T* ghr = gh + (j * q + l) * p;
      const __m512 ev = _mm512_set1_ps(e[j * q + l]), dv = _mm512_set1_ps(d[j]);
      __m512 zacc = _mm512_setzero_ps(), dacc = _mm512_loadu_ps(lanes + 16 * j);
      for (int64_t i = 0; i < p; i += 16) {
        const __m512 gv = _mm512_loadu_ps(gr + i);
        st16(dzr + i, _mm512_mul_ps(ev, gv));
        st16(ghr + i, gv);
        _mm512_storeu_ps(dxr + i, _mm512_mul_ps(dv, gv));
        zacc = _mm512_fmadd_ps(gv, _mm512_loadu_ps(zr + i), zacc);
        dacc = _mm512_fmadd_ps(gv, ld16(xr + i), dacc);
      }
      _mm512_storeu_ps(lanes + 16 * j, dacc);
      re[j * q + l] = e[j * q + l] * _mm512_reduce_add_ps(zacc);
    }
  }
  for (int64_t j = 0; j < hg; ++j) dd[j] += _mm512_reduce_add_ps(_mm512_loadu_ps(lanes + 16 * j));
}

template <typename T>
AUTOMOE_TARGET_AVX512 void scale_block_bwd_avx512(const float* g, const T* x, int64_t ldx, const float* w,
                                                  float* dx, int64_t lddx, float* u, int64_t q, int64_t hg,
                                                  int64_t p) {
  for (int64_t l = 0; l < q; ++l) {
    for (int64_t j = 0; j < hg; ++j) {
      const float* gr = g + (l * hg + j) * p;
      const T* xr = x + l * ldx + j * p;
      float* dxr = dx + l * lddx + j * p;
      const __m512 wv = _mm512_set1_ps(w[j * q + l]);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < p; i += 16) {
        const __m512 gv = _mm512_loadu_ps(gr + i);
        _mm512_storeu_ps(dxr + i, _mm512_fmadd_ps(wv, gv, _mm512_loadu_ps(dxr + i)));
        acc = _mm512_fmadd_ps(gv, ld16(xr + i), acc);
      }
      u[j * q + l] = _mm512_reduce_add_ps(acc);
    }
  }
}

AUTOMOE_TARGET_AVX512 void state_step_bwd_avx512(float* cur, const float* next, const float* h,
                                                 const float* f, float* fd, int64_t rows, int64_t hg,
                                                 int64_t p) {
  for (int64_t j = 0; j < hg; ++j) {
    const __m512 fv = _mm512_set1_ps(f[j]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t o = (r * hg + j) * p;
      for (int64_t i = 0; i < p; i += 16) {
        const __m512 nv = _mm512_loadu_ps(next + o + i);
        _mm512_storeu_ps(cur + o + i, _mm512_fmadd_ps(fv, nv, _mm512_loadu_ps(cur + o + i)));
        acc = _mm512_fmadd_ps(nv, _mm512_loadu_ps(h + o + i), acc);
      }
    }
    fd[j] += _mm512_reduce_add_ps(acc);
  }
}

}  // namespace
#endif

namespace {
// A thread's scratch of hg x 16 floats (per-head vector sums).
float* lanes(int64_t hg) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 16 * hg) buf.resize(16 * hg);
  return buf.data();
}
}  // namespace

float ssd_decay_row_bwd(const float* dm, const float* ldec, const float* cb, const float* dt,
                        float* dcb, float* ddt, float* dacum, int64_t n) {
#if defined(AUTOMOE_VEC_X86)
  if (active_isa() >= Isa::kAvx512) return decay_row_bwd_avx512(dm, ldec, cb, dt, dcb, ddt, dacum, n);
#endif
  return ssd_decay_row_bwd_rows(dm, ldec, cb, dt, dcb, ddt, dacum, n);
}

void ssd_out_block_bwd(const float* g, int64_t ldg, const float* z, int64_t ldz, const void* x,
                       int64_t ldx, c10::ScalarType dtype, const float* e, const float* d, float* dx,
                       int64_t lddx, void* dz, void* gh, float* re, float* dd, int64_t q, int64_t hg,
                       int64_t p) {
#if defined(AUTOMOE_VEC_X86)
  if (active_isa() >= Isa::kAvx512 && p % 16 == 0) {
    AUTOMOE_TYPED(dtype, T,
                  return out_block_bwd_avx512(g, ldg, z, ldz, static_cast<const T*>(x), ldx, e, d, dx, lddx,
                                              static_cast<T*>(dz), static_cast<T*>(gh), re, dd, q, hg, p,
                                              lanes(hg)))
  }
#endif
  ssd_out_block_bwd_rows(g, ldg, z, ldz, x, ldx, dtype, e, d, dx, lddx, dz, gh, re, dd, q, hg, p);
}

void ssd_scale_block_bwd(const float* g, const void* x, int64_t ldx, c10::ScalarType dtype,
                         const float* w, float* dx, int64_t lddx, float* u, int64_t q, int64_t hg,
                         int64_t p) {
#if defined(AUTOMOE_VEC_X86)
  if (active_isa() >= Isa::kAvx512 && p % 16 == 0) {
    AUTOMOE_TYPED(dtype, T,
                  return scale_block_bwd_avx512(g, static_cast<const T*>(x), ldx, w, dx, lddx, u, q, hg, p))
  }
#endif
  ssd_scale_block_bwd_rows(g, x, ldx, dtype, w, dx, lddx, u, q, hg, p);
}

void ssd_state_step_bwd(float* cur, const float* next, const float* h, const float* f, float* fd,
                        int64_t rows, int64_t hg, int64_t p) {
#if defined(AUTOMOE_VEC_X86)
  if (active_isa() >= Isa::kAvx512 && p % 16 == 0) return state_step_bwd_avx512(cur, next, h, f, fd, rows, hg, p);
#endif
  ssd_state_step_bwd_rows(cur, next, h, f, fd, rows, hg, p);
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
