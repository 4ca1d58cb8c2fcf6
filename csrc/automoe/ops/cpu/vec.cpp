#include "automoe/ops/cpu/vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _undefined_ placeholders.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "automoe/ops/cpu/isa.h"

// Each simple row loop is written once (an always-inline body) and compiled three times: for
// AVX-512, for AVX2+FMA and for the baseline; the copy that runs is chosen at each call from the
// active instruction-set level (ops/cpu/isa.h), so tests can force a lower one.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AUTOMOE_VEC_X86 1
#define AUTOMOE_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define AUTOMOE_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define AUTOMOE_ROW_FN(ret, name, params, args)                               \
  AUTOMOE_TARGET_AVX512 ret name##_avx512 params { return name##_body args; } \
  AUTOMOE_TARGET_AVX2 ret name##_avx2 params { return name##_body args; }     \
  ret name##_base params { return name##_body args; }                         \
  ret name params {                                                           \
    const Isa isa = active_isa();                                             \
    if (isa >= Isa::kAvx512) return name##_avx512 args;                       \
    if (isa >= Isa::kAvx2) return name##_avx2 args;                           \
    return name##_base args;                                                  \
  }
#else
#define AUTOMOE_ROW_FN(ret, name, params, args) \
  ret name params { return name##_body args; }
#endif
#define AUTOMOE_BODY __attribute__((always_inline)) static inline

namespace automoe::ops::cpu::vec {
namespace {

using cpu::active_isa;
using cpu::Isa;

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

#if defined(AUTOMOE_VEC_X86)
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

// 16-lane AVX-512 versions of the above (same constants and rounding rules).
AUTOMOE_TARGET_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

AUTOMOE_TARGET_AVX512 inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

AUTOMOE_TARGET_AVX512 int64_t silu_mul_avx512(const float* g, const float* u, float* out,
                                              int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(out + i,
                     _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid16(gv)), _mm512_loadu_ps(u + i)));
  }
  return i;
}

AUTOMOE_TARGET_AVX512 int64_t silu_mul_bwd_avx512(const float* g, const float* u, const float* dy,
                                                  float* dg, float* du, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i), uv = _mm512_loadu_ps(u + i);
    const __m512 dv = _mm512_loadu_ps(dy + i), s = sigmoid16(gv);
    const __m512 ds = _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one);  // 1 + g (1 - s)
    _mm512_storeu_ps(dg + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dv, uv), s), ds));
    _mm512_storeu_ps(du + i, _mm512_mul_ps(_mm512_mul_ps(dv, gv), s));
  }
  return i;
}

AUTOMOE_TARGET_AVX512 int64_t load_bf16_avx512(const uint16_t* s, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  return i;
}

AUTOMOE_TARGET_AVX512 int64_t store_bf16_avx512(const float* src, uint16_t* d, int64_t n) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i qnan = _mm512_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 f = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
  }
  return i;
}
#endif

}  // namespace

const char* path_name() {
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) return "avx512";
  if (isa >= Isa::kAvx2) return "avx2";
#endif
  return "baseline";
}

void load(const void* src, c10::ScalarType dtype, float* dst, int64_t n) {
  if (dtype == c10::ScalarType::Float) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = load_bf16_avx512(s, dst, n);
  } else if (isa >= Isa::kAvx2) {
    i = load_bf16_avx2(s, dst, n);
  }
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
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = store_bf16_avx512(src, d, n);
  } else if (isa >= Isa::kAvx2) {
    i = store_bf16_avx2(src, d, n);
  }
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
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = silu_mul_avx512(g, u, out, n);
  } else if (isa >= Isa::kAvx2) {
    i = silu_mul_avx2(g, u, out, n);
  }
#endif
  for (; i < n; ++i) out[i] = g[i] * sigmoid(g[i]) * u[i];
}

void silu_mul_bwd(const float* g, const float* u, const float* dy, float* dg, float* du,
                  int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = silu_mul_bwd_avx512(g, u, dy, dg, du, n);
  } else if (isa >= Isa::kAvx2) {
    i = silu_mul_bwd_avx2(g, u, dy, dg, du, n);
  }
#endif
  for (; i < n; ++i) {
    const float s = sigmoid(g[i]);
    dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = dy[i] * g[i] * s;
  }
}

// Reductions keep kLanes independent partial sums: vectorisable without reassociation flags, and
// 32 of them make four independent 8-wide (two 16-wide) FMA chains, so a row is not bound by the
// FMA latency (8 sums made one chain: 8 flops per 4 cycles, which bound unpermute's backward).
constexpr int kLanes = 32;
AUTOMOE_BODY float sum_sq_body(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += x[i] * x[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}
AUTOMOE_ROW_FN(float, sum_sq, (const float* x, int64_t n), (x, n))

AUTOMOE_BODY float dot3_body(const float* a, const float* b, const float* c, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}
AUTOMOE_ROW_FN(float, dot3, (const float* a, const float* b, const float* c, int64_t n),
               (a, b, c, n))

AUTOMOE_BODY float dot_body(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}
AUTOMOE_ROW_FN(float, dot, (const float* a, const float* b, int64_t n), (a, b, n))

AUTOMOE_BODY void scale_mul_body(const float* x, float k, const float* w, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * k * w[i];
}
AUTOMOE_ROW_FN(void, scale_mul, (const float* x, float k, const float* w, float* y, int64_t n),
               (x, k, w, y, n))

AUTOMOE_BODY void acc_mul_body(float* acc, const float* a, const float* b, float k, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a[i] * b[i] * k;
}
AUTOMOE_ROW_FN(void, acc_mul, (float* acc, const float* a, const float* b, float k, int64_t n),
               (acc, a, b, k, n))

AUTOMOE_BODY void rms_dx_body(const float* g, const float* w, const float* x, float k, float m,
                              float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] = k * (g[i] * w[i] - x[i] * k * m);
}
AUTOMOE_ROW_FN(void, rms_dx,
               (const float* g, const float* w, const float* x, float k, float m, float* dx,
                int64_t n),
               (g, w, x, k, m, dx, n))

AUTOMOE_BODY void axpy_body(float* acc, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * x[i];
}
AUTOMOE_ROW_FN(void, axpy, (float* acc, float a, const float* x, int64_t n), (acc, a, x, n))

AUTOMOE_BODY float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

AUTOMOE_BODY void axpy_bf16_body(float* acc, float a, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * bf16_bits_to_float(x[i]);
}
AUTOMOE_ROW_FN(void, axpy_bf16, (float* acc, float a, const uint16_t* x, int64_t n), (acc, a, x, n))

AUTOMOE_BODY float dot_bf16_body(const float* a, const uint16_t* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * bf16_bits_to_float(b[i + j]);
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * bf16_bits_to_float(b[i]);
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}
AUTOMOE_ROW_FN(float, dot_bf16, (const float* a, const uint16_t* b, int64_t n), (a, b, n))

AUTOMOE_BODY void scale_body(const float* x, float a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a * x[i];
}
AUTOMOE_ROW_FN(void, scale, (const float* x, float a, float* y, int64_t n), (x, a, y, n))

AUTOMOE_BODY void rotate_heads_body(const float* x, const float* c, const float* s, float sign,
                                    float* y, int64_t heads, int64_t h) {
  for (int64_t n = 0; n < heads; ++n) {
    const float* xa = x + n * 2 * h;
    float* ya = y + n * 2 * h;
    for (int64_t i = 0; i < h; ++i) {
      const float sv = sign * s[i];
      ya[i] = xa[i] * c[i] - xa[i + h] * sv;
      ya[i + h] = xa[i + h] * c[i] + xa[i] * sv;
    }
  }
}
AUTOMOE_ROW_FN(void, rotate_heads,
               (const float* x, const float* c, const float* s, float sign, float* y, int64_t heads,
                int64_t h),
               (x, c, s, sign, y, heads, h))

namespace {

AUTOMOE_BODY float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
AUTOMOE_BODY uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
// Round to nearest even (c10::BFloat16's rounding; NaN stays a quiet NaN).
AUTOMOE_BODY uint16_t to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}
// The master's upper half rounded half away from zero, and its lower half: rounding went up
// exactly when the lower half, read as int16, is negative — which join() undoes.
AUTOMOE_BODY void split_bits(float f, uint16_t* hi, int16_t* lo) {
  const uint32_t u = float_to_bits(f);
  *hi = static_cast<uint16_t>((u + 0x8000u) >> 16);
  *lo = static_cast<int16_t>(static_cast<uint16_t>(u & 0xFFFFu));
}
AUTOMOE_BODY float join_bits(uint16_t hi, int16_t lo) {
  const uint32_t low = static_cast<uint16_t>(lo);
  return bits_to_float((static_cast<uint32_t>(hi) << 16) + low - (lo < 0 ? 0x10000u : 0u));
}

// P: 0 float32 weight, 1 bf16 weight (the master), 2 bf16 weight + remainder; G, S: 0 float32,
// 1 bf16 (gradient, moments).
template <int P, int G, int S>
AUTOMOE_BODY void adamw_typed(const AdamwRow& r, int64_t b, int64_t n) {
  auto* pf = static_cast<float*>(r.p) + b;
  auto* ph = static_cast<uint16_t*>(r.p) + b;
  int16_t* rem = r.rem + (P == 2 ? b : 0);
  const auto* gf = static_cast<const float*>(r.g) + b;
  const auto* gh = static_cast<const uint16_t*>(r.g) + b;
  auto* mf = static_cast<float*>(r.m) + b;
  auto* mh = static_cast<uint16_t*>(r.m) + b;
  auto* vf = static_cast<float*>(r.v) + b;
  auto* vh = static_cast<uint16_t*>(r.v) + b;
  const float one_minus_b1 = r.one_minus_beta1, one_minus_b2 = r.one_minus_beta2;
  for (int64_t i = 0; i < n; ++i) {
    float p = P == 0 ? pf[i] : P == 1 ? bf16_bits_to_float(ph[i]) : join_bits(ph[i], rem[i]);
    const float g = (G == 0 ? gf[i] : bf16_bits_to_float(gh[i])) * r.g_scale;
    float m = S == 0 ? mf[i] : bf16_bits_to_float(mh[i]);
    float v = S == 0 ? vf[i] : bf16_bits_to_float(vh[i]);
    p *= r.decay;
    m += one_minus_b1 * (g - m);
    v = v * r.beta2 + one_minus_b2 * g * g;
    const float denom = std::sqrt(v) / r.bc2_sqrt + r.eps;
    p -= r.step_size * m / denom;
    if (P == 0) pf[i] = p;
    if (P == 1) ph[i] = to_bf16(p);
    if (P == 2) split_bits(p, ph + i, rem + i);
    if (S == 0) {
      mf[i] = m;
      vf[i] = v;
    } else {
      mh[i] = to_bf16(m);
      vh[i] = to_bf16(v);
    }
  }
}

template <int P>
AUTOMOE_BODY void adamw_by_state(const AdamwRow& r, int64_t b, int64_t n) {
  const bool gb = r.g_dtype != c10::ScalarType::Float, sb = r.s_dtype != c10::ScalarType::Float;
  if (!gb && !sb) adamw_typed<P, 0, 0>(r, b, n);
  if (!gb && sb) adamw_typed<P, 0, 1>(r, b, n);
  if (gb && !sb) adamw_typed<P, 1, 0>(r, b, n);
  if (gb && sb) adamw_typed<P, 1, 1>(r, b, n);
}

AUTOMOE_BODY void adamw_body(const AdamwRow& r, int64_t b, int64_t n) {
  if (r.p_dtype == c10::ScalarType::Float) {
    adamw_by_state<0>(r, b, n);
  } else if (r.rem == nullptr) {
    adamw_by_state<1>(r, b, n);
  } else {
    adamw_by_state<2>(r, b, n);
  }
}

}  // namespace

AUTOMOE_ROW_FN(void, adamw, (const AdamwRow& r, int64_t begin, int64_t n), (r, begin, n))

}  // namespace automoe::ops::cpu::vec
