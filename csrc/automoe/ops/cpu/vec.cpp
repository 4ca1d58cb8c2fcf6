#include "automoe/ops/cpu/vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AUTOMOE_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define AUTOMOE_CLONES
#endif

namespace automoe::ops::cpu::vec {
namespace {

__attribute__((always_inline)) inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  // floor(x log2(e) + 1/2) without a library call: truncate, then step down for negatives.
  const float t = x * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(t);
  n -= static_cast<float>(n) > t ? 1 : 0;
  const float fx = static_cast<float>(n);
  const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return y * pow2;
}

__attribute__((always_inline)) inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AUTOMOE_HAVE_AVX2_PATH 1
// 8-lane versions of exp_approx / sigmoid (same constants), for the AVX2 paths below.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

__attribute__((target("avx2,fma"))) int64_t silu_mul_avx2(const float* g, const float* u,
                                                           float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), _mm256_loadu_ps(u + i)));
  }
  return i;
}

__attribute__((target("avx2,fma"))) int64_t silu_mul_bwd_avx2(const float* g, const float* u,
                                                               const float* dy, float* dg,
                                                               float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
    const __m256 dv = _mm256_loadu_ps(dy + i), s = sigmoid8(gv);
    const __m256 ds = _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one);  // 1 + g (1 - s)
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, uv), s), ds));
    _mm256_storeu_ps(du + i, _mm256_mul_ps(_mm256_mul_ps(dv, gv), s));
  }
  return i;
}

__attribute__((target("avx2,fma"))) int64_t load_bf16_avx2(const uint16_t* s, float* dst,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
  }
  return i;
}

// Round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's rule), 8 floats at a time.
__attribute__((target("avx2,fma"))) int64_t store_bf16_avx2(const float* src, uint16_t* d,
                                                             int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i qnan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(src + i);
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, is_nan);
    // pack 8 x u32 (each < 65536) into 8 x u16
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm_packus_epi32(lo, hi));
  }
  return i;
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

}  // namespace

void load(const void* src, c10::ScalarType dtype, float* dst, int64_t n) {
  if (dtype == c10::ScalarType::Float) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(AUTOMOE_HAVE_AVX2_PATH)
  if (has_avx2()) i = load_bf16_avx2(s, dst, n);
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

void store(const float* src, void* dst, c10::ScalarType dtype, int64_t n) {
  if (dtype == c10::ScalarType::Float) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(AUTOMOE_HAVE_AVX2_PATH)
  if (has_avx2()) i = store_bf16_avx2(src, d, n);
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7FC0u : rounded);
  }
}

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_HAVE_AVX2_PATH)
  if (has_avx2()) i = silu_mul_avx2(g, u, out, n);
#endif
  for (; i < n; ++i) out[i] = g[i] * sigmoid(g[i]) * u[i];
}

void silu_mul_bwd(const float* g, const float* u, const float* dy, float* dg, float* du,
                  int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_HAVE_AVX2_PATH)
  if (has_avx2()) i = silu_mul_bwd_avx2(g, u, dy, dg, du, n);
#endif
  for (; i < n; ++i) {
    const float s = sigmoid(g[i]);
    dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = dy[i] * g[i] * s;
  }
}

// Reductions keep 8 independent partial sums (vectorisable without reassociation flags).
AUTOMOE_CLONES float sum_sq(const float* x, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * x[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += x[i] * x[i];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

AUTOMOE_CLONES float dot3(const float* a, const float* b, const float* c, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

AUTOMOE_CLONES float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

AUTOMOE_CLONES void scale_mul(const float* x, float k, const float* w, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * k * w[i];
}

AUTOMOE_CLONES void acc_mul(float* acc, const float* a, const float* b, float k, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a[i] * b[i] * k;
}

AUTOMOE_CLONES void rms_dx(const float* g, const float* w, const float* x, float k, float m,
                           float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = k * (g[i] * w[i] - x[i] * k * m);
}

AUTOMOE_CLONES void axpy(float* acc, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * x[i];
}

AUTOMOE_CLONES void scale(const float* x, float a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a * x[i];
}

AUTOMOE_CLONES void rotate(const float* xa, const float* xb, const float* c, const float* s,
                           float sign, float* ya, float* yb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sv = sign * s[i];
    ya[i] = xa[i] * c[i] - xb[i] * sv;
    yb[i] = xb[i] * c[i] + xa[i] * sv;
  }
}

}  // namespace automoe::ops::cpu::vec
