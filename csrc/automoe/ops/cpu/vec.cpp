#include "automoe/ops/cpu/vec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

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

// Where exp_approx is exact to its ~2e-7: above its lower clamp (exp(-87) is still a normal float).
constexpr float kExpExact = -87.f;

__attribute__((always_inline)) inline float exp_approx(float x) {
  x = !(x >= -87.3f) ? -87.3f : x;  // (NaN too: no undefined float -> int conversion below)
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

__attribute__((always_inline)) inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp_approx(-x));
}

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
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

#define AUTOMOE_TARGET_AVX2_FN __attribute__((target("avx2,fma"))) inline

// 8 floats from / to a float32 or bf16 row. bf16 rounds to nearest even, NaN -> 0x7FC0
// (c10::BFloat16's rule).
AUTOMOE_TARGET_AVX2_FN __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
AUTOMOE_TARGET_AVX2_FN __m256 ld8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AUTOMOE_TARGET_AVX2_FN void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// The bf16 bits of 8 floats in 32-bit lanes (each < 65536).
AUTOMOE_TARGET_AVX2_FN __m256i bf16_bits8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
}
AUTOMOE_TARGET_AVX2_FN void st8(uint16_t* p, __m256 f) {
  const __m256i r = bf16_bits8(f);
  // pack 8 x u32 (each < 65536) into 8 x u16
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}

// 16 floats to p[0, 16): float32 as two stores; bf16 rounded as st8 does (bf16_bits8), both
// halves packed into one 32-byte store (a 16-byte store per 8 lanes cost ~10 % of SwiGLU's bf16
// row on Zen 3).
AUTOMOE_TARGET_AVX2_FN void st16(float* p, __m256 a, __m256 b) {
  _mm256_storeu_ps(p, a);
  _mm256_storeu_ps(p + 8, b);
}
AUTOMOE_TARGET_AVX2_FN void st16(uint16_t* p, __m256 a, __m256 b) {
  // packus interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute restores the order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a), bf16_bits8(b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

// SwiGLU rows in one pass (T: float or uint16_t bf16 bits); return how many elements they did.
template <typename T>
__attribute__((target("avx2,fma"))) int64_t swiglu_avx2(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 g0 = ld8(g + i), g1 = ld8(g + i + 8);
    st16(y + i, _mm256_mul_ps(_mm256_mul_ps(g0, sigmoid8(g0)), ld8(u + i)),
         _mm256_mul_ps(_mm256_mul_ps(g1, sigmoid8(g1)), ld8(u + i + 8)));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = ld8(g + i);
    st8(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), ld8(u + i)));
  }
  return i;
}

template <typename T>
__attribute__((target("avx2,fma"))) int64_t swiglu_bwd_avx2(const T* g, const T* u, const T* dy,
                                                            T* dg, T* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 g0 = ld8(g + i), u0 = ld8(u + i), d0 = ld8(dy + i), s0 = sigmoid8(g0);
    const __m256 g1 = ld8(g + i + 8), u1 = ld8(u + i + 8), d1 = ld8(dy + i + 8),
                 s1 = sigmoid8(g1);
    st16(dg + i,
         _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d0, u0), s0),
                       _mm256_fmadd_ps(g0, _mm256_sub_ps(one, s0), one)),
         _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d1, u1), s1),
                       _mm256_fmadd_ps(g1, _mm256_sub_ps(one, s1), one)));
    st16(du + i, _mm256_mul_ps(_mm256_mul_ps(d0, g0), s0), _mm256_mul_ps(_mm256_mul_ps(d1, g1), s1));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = ld8(g + i), uv = ld8(u + i), dv = ld8(dy + i), s = sigmoid8(gv);
    const __m256 ds = _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one);  // 1 + g (1 - s)
    st8(dg + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, uv), s), ds));
    st8(du + i, _mm256_mul_ps(_mm256_mul_ps(dv, gv), s));
  }
  return i;
}

__attribute__((target("avx2,fma"))) int64_t load_bf16_avx2(const uint16_t* s, float* dst,
                                                           int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) st8(dst + i, ld8(s + i));
  return i;
}

__attribute__((target("avx2,fma"))) int64_t store_bf16_avx2(const float* src, uint16_t* d,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) st8(d + i, ld8(src + i));
  return i;
}

// The router's rows (float32, a multiple of 8 long): maximum, softmax, top-k.
// The largest of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0x4E));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// Maximum of x[0, n), n a multiple of 8, in four independent chains (max's latency would bound
// one chain).
__attribute__((target("avx2,fma"))) inline float max8(const float* x, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-INFINITY);
  __m256 m0 = lo, m1 = lo, m2 = lo, m3 = lo;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
    m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
  }
  for (; i < n; i += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
  return hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
}

// Whether x[0, n) (n a multiple of 8) holds a NaN; its minimum into *lo.
__attribute__((target("avx2,fma"))) inline bool has_nan8(const float* x, int64_t n, float* lo) {
  __m256 nan = _mm256_setzero_ps(), mn = _mm256_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mn = _mm256_min_ps(mn, v);
  }
  mn = _mm256_min_ps(mn, _mm256_permute2f128_ps(mn, mn, 1));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0x4E));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0xB1));
  *lo = _mm256_cvtss_f32(mn);
  return _mm256_movemask_ps(nan) != 0;
}

// Softmax of a row of a multiple of 8 (as softmax_rows_body); false, nothing written, when the row
// needs std::exp (see there).
__attribute__((target("avx2,fma"))) bool softmax_avx2(const float* x, float* y, int64_t n) {
  float lo;
  if (has_nan8(x, n, &lo)) return false;
  const float m = max8(x, n);
  if (!std::isfinite(m) || lo - m < kExpExact) return false;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv));
    _mm256_storeu_ps(y + i, e0);
    _mm256_storeu_ps(y + i + 8, e1);
    s0 = _mm256_add_ps(s0, e0);
    s1 = _mm256_add_ps(s1, e1);
  }
  for (; i < n; i += 8) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(y + i, e0);
    s0 = _mm256_add_ps(s0, e0);
  }
  __m256 sv = _mm256_add_ps(s0, s1);
  sv = _mm256_add_ps(sv, _mm256_permute2f128_ps(sv, sv, 1));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0x4E));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0xB1));
  const __m256 inv = _mm256_set1_ps(1.f / _mm256_cvtss_f32(sv));
  for (i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), inv));
  return true;
}

// Sigmoid of a row of a multiple of 8 (as sigmoid_row_body, NaN kept); false, nothing written,
// when the row reaches below exp's clamp (see there).
__attribute__((target("avx2,fma"))) bool sigmoid_avx2(const float* x, float* y, int64_t n) {
  __m256 mn = _mm256_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    mn = _mm256_min_ps(_mm256_loadu_ps(x + i), mn);  // a NaN is skipped (the second operand)
  }
  mn = _mm256_min_ps(mn, _mm256_permute2f128_ps(mn, mn, 1));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0x4E));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0xB1));
  if (_mm256_cvtss_f32(mn) < kExpExact) return false;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(y + i, _mm256_blendv_ps(sigmoid8(v), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  return true;
}

// The positions of the set bits of each 8-bit mask, in order (padded with 0): a compaction
// table for AVX2, which has no compress instruction.
struct CompressTable {
  uint8_t pos[256][8];
  constexpr CompressTable() : pos() {
    for (int m = 0; m < 256; ++m) {
      int c = 0;
      for (int b = 0; b < 8; ++b) {
        if (m & (1 << b)) pos[m][c++] = static_cast<uint8_t>(b);
      }
    }
  }
};
constexpr CompressTable kCompress;

// For k <= 8 and rows up to 512: the smallest of the 8 lane-wise maxima is a lower bound of the
// k-th largest (those maxima are 8 distinct elements), so only the elements at or above it can be
// among the k. They are few; they are compacted (in index order) without branches, and each
// one's rank — how many candidates are larger, or equal with a lower index — computed with
// vector compares: the candidate of rank r is the r-th of the top k. Otherwise (or when more than
// 64 candidates pass, with many equal values): k rounds of (maximum, its first index).
__attribute__((target("avx2,fma"))) bool topk_avx2(const float* x, int64_t n, int64_t k, float* w,
                                                   int64_t* idx) {
  float lowest;
  if (has_nan8(x, n, &lowest)) return false;
  if (k <= 8 && n <= 512) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    }
    if (i < n) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    __m256 lo = _mm256_max_ps(m0, m1);  // lane maxima; their minimum in every lane:
    lo = _mm256_min_ps(lo, _mm256_permute2f128_ps(lo, lo, 1));
    lo = _mm256_min_ps(lo, _mm256_permute_ps(lo, 0x4E));
    lo = _mm256_min_ps(lo, _mm256_permute_ps(lo, 0xB1));
    alignas(32) int32_t ci[512];
    float* cv = w;  // candidates' values (scratch: n floats)
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = 0;  // c <= i, so each 8-wide store stays inside the n entries
    for (i = 0; i < n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ));
      const __m256i perm = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kCompress.pos[mask])));
      _mm256_storeu_ps(cv + c, _mm256_permutevar8x32_ps(v, perm));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + c),
                          _mm256_add_epi32(_mm256_permutevar8x32_epi32(iota, perm),
                                           _mm256_set1_epi32(static_cast<int32_t>(i))));
      c += __builtin_popcount(static_cast<unsigned>(mask));
    }
    if (c <= 64) {
      const int64_t padded = (c + 7) / 8 * 8;  // <= n
      for (int64_t p = c; p < padded; ++p) {   // padding: never larger, never an earlier index
        cv[p] = -INFINITY;
        ci[p] = INT32_MAX;
      }
      float rv[64];
      int32_t ri[64];
      for (int64_t a = 0; a < c; ++a) {
        const __m256 va = _mm256_set1_ps(cv[a]);
        const __m256i ia = _mm256_set1_epi32(ci[a]);
        int rank = 0;
        for (int64_t b = 0; b < padded; b += 8) {
          const __m256 vb = _mm256_loadu_ps(cv + b);
          const __m256i ib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + b));
          const __m256 before =
              _mm256_or_ps(_mm256_cmp_ps(vb, va, _CMP_GT_OQ),
                           _mm256_and_ps(_mm256_cmp_ps(vb, va, _CMP_EQ_OQ),
                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(ia, ib))));
          rank += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(before)));
        }
        rv[rank] = cv[a];  // ranks are distinct: 0 .. c-1
        ri[rank] = ci[a];
      }
      for (int64_t r = 0; r < k; ++r) {
        if (rv[r] == -INFINITY) return false;
        idx[r] = ri[r];
      }
      return true;
    }
  }
  std::memcpy(w, x, n * sizeof(float));
  for (int64_t r = 0; r < k; ++r) {
    const float m = max8(w, n);
    if (m == -INFINITY) return false;
    const __m256 mv = _mm256_set1_ps(m);
    int64_t at = 0;
    for (;; at += 8) {  // the maximum is in w: the scan stops at its first occurrence
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + at), mv, _CMP_EQ_OQ));
      if (mask) {
        at += __builtin_ctz(static_cast<unsigned>(mask));
        break;
      }
    }
    idx[r] = at;
    w[at] = -INFINITY;
  }
  return true;
}

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

AUTOMOE_TARGET_AVX512 inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
AUTOMOE_TARGET_AVX512 inline __m512 ld16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AUTOMOE_TARGET_AVX512 inline void st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
AUTOMOE_TARGET_AVX512 inline void st16(uint16_t* p, __m512 f) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

template <typename T>
AUTOMOE_TARGET_AVX512 int64_t swiglu_avx512(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = ld16(g + i);
    st16(y + i, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid16(gv)), ld16(u + i)));
  }
  return i;
}

template <typename T>
AUTOMOE_TARGET_AVX512 int64_t swiglu_bwd_avx512(const T* g, const T* u, const T* dy, T* dg, T* du,
                                                int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = ld16(g + i), uv = ld16(u + i), dv = ld16(dy + i), s = sigmoid16(gv);
    const __m512 ds = _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one);  // 1 + g (1 - s)
    st16(dg + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dv, uv), s), ds));
    st16(du + i, _mm512_mul_ps(_mm512_mul_ps(dv, gv), s));
  }
  return i;
}

// The router's rows at AVX-512 (float32, a multiple of 16 long): 16 lanes halve the passes of the
// AVX2 versions, and the top-k's candidate bound is tighter (see topk_avx512).
AUTOMOE_TARGET_AVX512 bool softmax_avx512(const float* x, float* y, int64_t n) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 mx = _mm512_set1_ps(-INFINITY), mn = inf;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {  // NaN, minimum and maximum in one pass
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
    mn = _mm512_min_ps(mn, v);
  }
  if (nan) return false;
  const float m = _mm512_reduce_max_ps(mx), lo = _mm512_reduce_min_ps(mn);
  if (!std::isfinite(m) || lo - m < kExpExact) return false;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mv));
    _mm512_storeu_ps(y + i, e0);
    _mm512_storeu_ps(y + i + 16, e1);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
  }
  for (; i < n; i += 16) {
    const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(y + i, e0);
    s0 = _mm512_add_ps(s0, e0);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
  for (i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i), inv));
  return true;
}

AUTOMOE_TARGET_AVX512 bool sigmoid_avx512(const float* x, float* y, int64_t n) {
  __m512 mn = _mm512_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    mn = _mm512_min_ps(_mm512_loadu_ps(x + i), mn);  // a NaN is skipped (the second operand)
  }
  if (_mm512_reduce_min_ps(mn) < kExpExact) return false;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(y + i,
                     _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), sigmoid16(v), v));
  }
  return true;
}

// For k <= 16 and rows up to 1024 (a multiple of 16): the 16 lane-wise maxima are 16 distinct
// elements, so the k-th largest of them bounds the k-th largest of the row from below; only the
// elements at or above it can be among the k (about 10 of 128 random scores for k = 8, against
// 20 with AVX2's bound, the least of 8 lane maxima). They are compacted in index order
// (vcompressps), and each one's rank — how many candidates are larger, or equal with a lower
// index — counted with mask compares: the candidate of rank r is the r-th of the top k. More
// than 64 candidates (many equal values): false with *handled = false, for the AVX2 version.
AUTOMOE_TARGET_AVX512 bool topk_avx512(const float* x, int64_t n, int64_t k, float* w, int64_t* idx,
                                       bool* handled) {
  *handled = true;
  __m512 lm = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lm = _mm512_max_ps(lm, v);
  }
  if (nan) return false;
  // Rank of each lane maximum among the 16 (how many are strictly larger); the k-th largest
  // value is the least of those ranked below k.
  __m512i rank = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < 16; ++j) {
    const __m512 bj = _mm512_permutexvar_ps(_mm512_set1_epi32(j), lm);
    rank = _mm512_mask_add_epi32(rank, _mm512_cmp_ps_mask(bj, lm, _CMP_GT_OQ), rank, one);
  }
  const __mmask16 top = _mm512_cmplt_epi32_mask(rank, _mm512_set1_epi32(static_cast<int>(k)));
  const __m512 lo = _mm512_set1_ps(_mm512_mask_reduce_min_ps(top, lm));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Up to 16 candidates (all but ~0.3 % of random rows of 128) stay in two registers: each chunk's
  // are compressed and moved to lanes [nc, nc + p); the ranks are then counted lane against lane,
  // so nothing goes through memory (stores read back at once stall the store-to-load forwarding).
  __m512 cand = _mm512_set1_ps(-INFINITY);
  __m512i cand_i = _mm512_set1_epi32(INT32_MAX);
  int nc = 0;
  bool fits = true;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 mask = _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ);
    const int p = __builtin_popcount(static_cast<unsigned>(mask));
    if (p == 0) continue;
    if (nc + p > 16) {
      fits = false;
      break;
    }
    const __m512i to = _mm512_sub_epi32(iota, _mm512_set1_epi32(nc));  // lane nc + j <- j
    const __mmask16 dst = static_cast<__mmask16>(((1u << p) - 1u) << nc);
    cand = _mm512_mask_permutexvar_ps(cand, dst, to, _mm512_maskz_compress_ps(mask, v));
    cand_i = _mm512_mask_permutexvar_epi32(
        cand_i, dst, to,
        _mm512_maskz_compress_epi32(
            mask, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    nc += p;
  }
  if (fits) {
    __m512i pos = _mm512_setzero_si512();
    for (int j = 0; j < nc; ++j) {
      const __m512i at = _mm512_set1_epi32(j);
      const __m512 vj = _mm512_permutexvar_ps(at, cand);
      const __m512i ij = _mm512_permutexvar_epi32(at, cand_i);
      const __mmask16 before =
          _mm512_cmp_ps_mask(vj, cand, _CMP_GT_OQ) |
          (_mm512_cmp_ps_mask(vj, cand, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(ij, cand_i));
      pos = _mm512_mask_add_epi32(pos, before, pos, one);
    }
    // The padding lanes rank after every candidate (nc >= k of them are at or above the bound).
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, cand);
    _mm512_store_si512(ids, cand_i);
    for (int64_t r = 0; r < k; ++r) {
      const unsigned m = _mm512_cmpeq_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(r)));
      const int lane = __builtin_ctz(m);  // ranks are distinct: 0 .. nc-1
      if (vals[lane] == -INFINITY) return false;
      idx[r] = ids[lane];
    }
    return true;
  }
  alignas(64) int32_t ci[1024];
  float* cv = w;  // candidates' values (scratch: n floats)
  int64_t c = 0;  // c <= i, so each 16-wide store stays inside the n entries
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 mask = _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ);
    _mm512_storeu_ps(cv + c, _mm512_maskz_compress_ps(mask, v));
    _mm512_storeu_si512(
        ci + c, _mm512_maskz_compress_epi32(
                    mask, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    c += __builtin_popcount(static_cast<unsigned>(mask));
  }
  if (c > 64) {
    *handled = false;
    return false;
  }
  const int64_t padded = (c + 15) / 16 * 16;  // <= n
  for (int64_t p = c; p < padded; ++p) {      // padding: never larger, never an earlier index
    cv[p] = -INFINITY;
    ci[p] = INT32_MAX;
  }
  float rv[64];
  int32_t ri[64];
  for (int64_t a = 0; a < c; ++a) {
    const __m512 va = _mm512_set1_ps(cv[a]);
    const __m512i ia = _mm512_set1_epi32(ci[a]);
    int r = 0;
    for (int64_t b = 0; b < padded; b += 16) {
      const __m512 vb = _mm512_loadu_ps(cv + b);
      const __m512i ib = _mm512_loadu_si512(ci + b);
      const __mmask16 before =
          _mm512_cmp_ps_mask(vb, va, _CMP_GT_OQ) |
          (_mm512_cmp_ps_mask(vb, va, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(ia, ib));
      r += __builtin_popcount(static_cast<unsigned>(before));
    }
    rv[r] = cv[a];  // ranks are distinct: 0 .. c-1
    ri[r] = ci[a];
  }
  for (int64_t r = 0; r < k; ++r) {
    if (rv[r] == -INFINITY) return false;
    idx[r] = ri[r];
  }
  return true;
}

AUTOMOE_TARGET_AVX512 int64_t load_bf16_avx512(const uint16_t* s, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) st16(dst + i, ld16(s + i));
  return i;
}

AUTOMOE_TARGET_AVX512 int64_t store_bf16_avx512(const float* src, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) st16(d + i, ld16(src + i));
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

// One element's AdamW update in float32, in place (ATen's fused AdamW formula).
AUTOMOE_BODY void adamw_math(const AdamwRow& r, float g, float& p, float& m, float& v) {
  p *= r.decay;
  m += r.one_minus_beta1 * (g - m);
  v = v * r.beta2 + r.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v) / r.bc2_sqrt + r.eps;
  p -= r.step_size * m / denom;
}

// P: 0 float32 weight, 1 bf16 weight (the master), 2 bf16 weight + remainder.
template <int P>
AUTOMOE_BODY float load_weight(const void* p, const int16_t* rem, int64_t i) {
  if (P == 0) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return P == 1 ? bf16_bits_to_float(h) : join_bits(h, rem[i]);
}
template <int P>
AUTOMOE_BODY void store_weight(void* p, int16_t* rem, int64_t i, float w) {
  if (P == 0) static_cast<float*>(p)[i] = w;
  if (P == 1) static_cast<uint16_t*>(p)[i] = to_bf16(w);
  if (P == 2) split_bits(w, static_cast<uint16_t*>(p) + i, rem + i);
}

// P as above; G, S: 0 float32, 1 bf16 (gradient, moments).
template <int P, int G, int S>
AUTOMOE_BODY void adamw_typed(const AdamwRow& r, int64_t b, int64_t n) {
  int16_t* rem = P == 2 ? r.rem + b : nullptr;
  void* pw = static_cast<char*>(r.p) + b * (P == 0 ? 4 : 2);
  const auto* gf = static_cast<const float*>(r.g) + b;
  const auto* gh = static_cast<const uint16_t*>(r.g) + b;
  auto* mf = static_cast<float*>(r.m) + b;
  auto* mh = static_cast<uint16_t*>(r.m) + b;
  auto* vf = static_cast<float*>(r.v) + b;
  auto* vh = static_cast<uint16_t*>(r.v) + b;
  for (int64_t i = 0; i < n; ++i) {
    float p = load_weight<P>(pw, rem, i);
    const float g = (G == 0 ? gf[i] : bf16_bits_to_float(gh[i])) * r.g_scale;
    float m = S == 0 ? mf[i] : bf16_bits_to_float(mh[i]);
    float v = S == 0 ? vf[i] : bf16_bits_to_float(vh[i]);
    adamw_math(r, g, p, m, v);
    store_weight<P>(pw, rem, i, p);
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

// ---- 8-bit moments ----

struct QMap8 {
  float value[256];
  float mid[256];  // between value[j] and value[j + 1]; mid[255] = +inf
  // By a float's sign, exponent (clamped to [2^-24, 2^0]: every smaller magnitude has the code of
  // 0, every larger one that of 2^0's slot) and 7 upper mantissa bits, a slot of floats: the code
  // of its lowest float, and where the slot holds a midpoint (never more than one: checked when
  // the table is built, and against a search of the midpoints by a test), that midpoint's key.
  // A float's key, its lower 16 bits (inverted for negatives), grows with it inside its slot, so
  // its code is code[slot] plus one where its key is above the slot's threshold (0xFFFF: none) —
  // one table load per value and no dependent second one. 19 KB.
  static constexpr uint32_t kExpLo = 127 - 24, kExps = 25, kSlots = 2 * kExps * 128;
  uint8_t code[kSlots];
  uint16_t threshold[kSlots];
  // (branch-free: the exponent clamped by min / max; a clamped tiny value keeps its mantissa
  // bits, and every slot of the lowest exponent has the code of 0 and no threshold)
  static uint32_t slot(uint32_t bits) {
    const uint32_t e = std::min(std::max((bits >> 23) & 0xFFu, kExpLo), 127u) - kExpLo;
    return ((bits >> 31) * kExps + e) * 128 + ((bits >> 16) & 0x7Fu);
  }
  static uint32_t key(uint32_t bits) { return (bits & 0xFFFFu) ^ (0u - (bits >> 31) & 0xFFFFu); }
  // The map's structure, for the vector path: |x| lies in decade i = the number of bound[1..6]
  // below it (bound[i]: the midpoint below the decade's first value; bound[0], below the first
  // nonzero value: at or under it, the zero code); inside it the nearest value is bin
  // k = floor(|x| F[i] - G[i]) clamped to [0, kmax[i]] (the midpoints between neighbours of a
  // decade are its bins' edges), code zero_code +- (base[i] + k); above `top`, 255.
  float bound[8] = {}, F[8] = {}, G[8] = {}, kmax[8] = {};
  int32_t base[8] = {};
  float top = 0.f;
  int32_t zero_code = 0;
};

// How many midpoints lie below x: the nearest value's index (ties to the lower; NaN: 0).
AUTOMOE_BODY uint8_t nearest8(const float* mid, float x) {
  int lo = 0;
  for (int step = 128; step > 0; step >>= 1) {
    if (lo + step <= 255 && mid[lo + step - 1] < x) lo += step;
  }
  return static_cast<uint8_t>(lo);
}

const QMap8* make_qmap8(bool is_signed) {
  // Decade i (1e-6 .. 1) holds 2^i values (signed: and their negatives) or 2^(i+1) (unsigned): the
  // middles of [0.1, 1] cut into that many equal bins, times the decade; then 0 and 1. 127 * 2 + 2
  // or 254 + 2 = 256 values.
  std::vector<double> v{0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int bins = is_signed ? 1 << i : 1 << (i + 1);
    const double decade = std::pow(10.0, i - 6);
    for (int k = 0; k < bins; ++k) {
      const double middle = 0.1 + 0.9 * (k + 0.5) / bins;
      v.push_back(decade * middle);
      if (is_signed) v.push_back(-decade * middle);
    }
  }
  std::sort(v.begin(), v.end());
  auto* qp = new QMap8();
  QMap8& q = *qp;
  for (int j = 0; j < 256; ++j) q.value[j] = static_cast<float>(v[j]);
  for (int j = 0; j < 255; ++j) {
    q.mid[j] = static_cast<float>((static_cast<double>(q.value[j]) + q.value[j + 1]) / 2);
  }
  q.mid[255] = std::numeric_limits<float>::infinity();
  q.zero_code = is_signed ? 127 : 0;
  for (int i = 0; i < 7; ++i) {
    const int bins = is_signed ? 1 << i : 1 << (i + 1);
    q.base[i] = is_signed ? bins : bins - 1;
    q.bound[i] = q.mid[q.zero_code + q.base[i] - 1];
    q.F[i] = static_cast<float>(bins / (0.9 * std::pow(10.0, i - 6)));
    q.G[i] = static_cast<float>(0.1 * bins / 0.9);
    q.kmax[i] = static_cast<float>(bins - 1);
  }
  q.top = q.mid[254];
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = QMap8::kExpLo; e < QMap8::kExpLo + QMap8::kExps; ++e) {
      for (uint32_t m = 0; m < 128; ++m) {
        const uint32_t bits = (sign << 31) | (e << 23) | (m << 16);
        const float first = bits_to_float(bits), last = bits_to_float(bits | 0xFFFFu);
        const float lowest = sign ? last : first, highest = sign ? first : last;
        const uint8_t c = nearest8(q.mid, lowest), h = nearest8(q.mid, highest);
        const bool edge = e == QMap8::kExpLo || e == QMap8::kExpLo + QMap8::kExps - 1;
        if (h > c + 1 || (edge && h != c)) {  // (the map is fixed: this cannot happen)
          std::fprintf(stderr, "automoe: the 8-bit map does not fit its code table\n");
          std::abort();
        }
        q.code[QMap8::slot(bits)] = c;
        q.threshold[QMap8::slot(bits)] =
            h == c ? 0xFFFFu : static_cast<uint16_t>(QMap8::key(float_to_bits(q.mid[c])));
      }
    }
  }
  return qp;
}

const QMap8& qmap8_table(bool is_signed) {
  static const QMap8* const s = make_qmap8(true);
  static const QMap8* const u = make_qmap8(false);
  return is_signed ? *s : *u;
}

// nearest8 through the table: one slot's code and threshold.
AUTOMOE_BODY uint8_t code8(const QMap8& q, float x) {
  if (x != x) return static_cast<uint8_t>(q.zero_code);  // NaN: the code of 0
  const uint32_t bits = float_to_bits(x), s = QMap8::slot(bits);
  return static_cast<uint8_t>(q.code[s] + (QMap8::key(bits) > q.threshold[s] ? 1 : 0));
}

#if defined(AUTOMOE_VEC_X86)
// 8 values at a time: the code of x * inv from the map's structure (QMap8::bound ..), no table
// loads; the nearest value as code8 finds it but where x lies within float rounding of a
// midpoint (there one code either side). How many were done.
__attribute__((target("avx2,fma"))) int64_t quant8_avx2(const float* x, float inv,
                                                        const QMap8& q, uint8_t* c, int64_t n) {
  const __m256 iv = _mm256_set1_ps(inv), zero = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 F = _mm256_loadu_ps(q.F), G = _mm256_loadu_ps(q.G), kmax = _mm256_loadu_ps(q.kmax);
  const __m256i base = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base));
  __m256 bound[7];
  for (int j = 0; j < 7; ++j) bound[j] = _mm256_set1_ps(q.bound[j]);
  const __m256 top = _mm256_set1_ps(q.top);
  const __m256i zero_code = _mm256_set1_epi32(q.zero_code), top_code = _mm256_set1_epi32(255);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
    const __m256 a = _mm256_and_ps(v, abs_mask);
    __m256i decade = _mm256_setzero_si256();
    for (int j = 1; j < 7; ++j) {  // (a true compare is -1)
      decade = _mm256_sub_epi32(decade,
                                _mm256_castps_si256(_mm256_cmp_ps(bound[j], a, _CMP_LT_OQ)));
    }
    __m256 t = _mm256_fmsub_ps(a, _mm256_permutevar8x32_ps(F, decade),
                               _mm256_permutevar8x32_ps(G, decade));
    // (max first: a NaN becomes 0)
    t = _mm256_min_ps(_mm256_max_ps(t, zero), _mm256_permutevar8x32_ps(kmax, decade));
    const __m256i off =
        _mm256_add_epi32(_mm256_permutevar8x32_epi32(base, decade), _mm256_cvttps_epi32(t));
    const __m256i neg = _mm256_srai_epi32(_mm256_castps_si256(v), 31);  // -1 where negative
    __m256i code = _mm256_add_epi32(zero_code, _mm256_sub_epi32(_mm256_xor_si256(off, neg), neg));
    code = _mm256_blendv_epi8(code, zero_code,  // (not above the first bound, or NaN)
                              _mm256_castps_si256(_mm256_cmp_ps(a, bound[0], _CMP_NGT_UQ)));
    code = _mm256_blendv_epi8(code, top_code,
                              _mm256_castps_si256(_mm256_cmp_ps(v, top, _CMP_GT_OQ)));
    const __m128i w =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i), _mm_packus_epi16(w, w));
  }
  return i;
}

// quant8_avx2 with 16 lanes (the same operations lane for lane: the same codes).
AUTOMOE_TARGET_AVX512 int64_t quant8_avx512(const float* x, float inv, const QMap8& q, uint8_t* c,
                                            int64_t n) {
  const __m512 iv = _mm512_set1_ps(inv), zero = _mm512_setzero_ps();
  const __m512 F = _mm512_castps256_ps512(_mm256_loadu_ps(q.F));  // decades index lanes 0..6
  const __m512 G = _mm512_castps256_ps512(_mm256_loadu_ps(q.G));
  const __m512 kmax = _mm512_castps256_ps512(_mm256_loadu_ps(q.kmax));
  const __m512i base =
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base)));
  __m512 bound[7];
  for (int j = 0; j < 7; ++j) bound[j] = _mm512_set1_ps(q.bound[j]);
  const __m512 top = _mm512_set1_ps(q.top);
  const __m512i zero_code = _mm512_set1_epi32(q.zero_code), top_code = _mm512_set1_epi32(255);
  const __m512i one = _mm512_set1_epi32(1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), iv);
    const __m512 a = _mm512_abs_ps(v);
    __m512i decade = _mm512_setzero_si512();
    for (int j = 1; j < 7; ++j) {
      decade = _mm512_mask_add_epi32(decade, _mm512_cmp_ps_mask(bound[j], a, _CMP_LT_OQ), decade,
                                     one);
    }
    __m512 t = _mm512_fmsub_ps(a, _mm512_permutexvar_ps(decade, F),
                               _mm512_permutexvar_ps(decade, G));
    // (max first: a NaN becomes 0)
    t = _mm512_min_ps(_mm512_max_ps(t, zero), _mm512_permutexvar_ps(decade, kmax));
    const __m512i off =
        _mm512_add_epi32(_mm512_permutexvar_epi32(decade, base), _mm512_cvttps_epi32(t));
    const __m512i neg = _mm512_srai_epi32(_mm512_castps_si512(v), 31);  // -1 where negative
    __m512i code = _mm512_add_epi32(zero_code, _mm512_sub_epi32(_mm512_xor_si512(off, neg), neg));
    code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, bound[0], _CMP_NGT_UQ), code, zero_code);
    code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, top, _CMP_GT_OQ), code, top_code);
    // (clamped to [0, 255] as AVX2's signed-to-unsigned saturating packs do: a negative value
    // in the unsigned map gives code 0)
    code = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_setzero_si512()), top_code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(code));
  }
  return i;
}

// out[e] = table[c[e]] * s (one rounding, as the scalar loop), how many were done. AVX-512: the
// 256-entry table in 16 registers, 16 codes at a time by 8 two-register permutes (the codes'
// low 5 bits) and a 3-level blend on their upper bits. The compiler's own vectorisation of the
// table loads extracts every index to a scalar load; on a Zen 5 the permutes take ~20 % fewer
// cycles of the whole 8-bit update than that, a 16-lane gather about half as many fewer, and at
// AVX2 an 8-lane gather was no faster than the scalar loads (so AVX2 keeps them).
AUTOMOE_TARGET_AVX512 int64_t dequant8_avx512(const float* table, const uint8_t* c, float s,
                                              float* out, int64_t n) {
  __m512 t[16];
  for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(table + 16 * j);
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64), b7 = _mm512_set1_epi32(128);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
    __m512 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(t[2 * j], idx, t[2 * j + 1]);
    const __mmask16 k5 = _mm512_test_epi32_mask(idx, b5), k6 = _mm512_test_epi32_mask(idx, b6),
                    k7 = _mm512_test_epi32_mask(idx, b7);
    for (int j = 0; j < 4; ++j) r[j] = _mm512_mask_blend_ps(k5, r[2 * j], r[2 * j + 1]);
    for (int j = 0; j < 2; ++j) r[j] = _mm512_mask_blend_ps(k6, r[2 * j], r[2 * j + 1]);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mask_blend_ps(k7, r[0], r[1]), sv));
  }
  return i;
}
int64_t dequant8_vec(const float* table, const uint8_t* c, float s, float* out, int64_t n) {
  return active_isa() >= Isa::kAvx512 ? dequant8_avx512(table, c, s, out, n) : 0;
}

// The widest vector quantizer the CPU has; how many of the n it did.
int64_t quant8_vec(const float* x, float inv, const QMap8& q, uint8_t* c, int64_t n) {
  if (active_isa() >= Isa::kAvx512) return quant8_avx512(x, inv, q, c, n);
  if (active_isa() >= Isa::kAvx2) return quant8_avx2(x, inv, q, c, n);
  return 0;
}
#endif

template <int P, int G>
AUTOMOE_BODY void adamw8_typed(const AdamwRow& r, int64_t row0, int64_t rows) {
  const QMap8& qm = qmap8_table(true);
  const QMap8& qv = qmap8_table(false);
  const int64_t cols = r.cols, nb = (cols + kQuantBlock - 1) / kQuantBlock;
  float mb[kQuantBlock], vb[kQuantBlock];
  for (int64_t row = row0; row < row0 + rows; ++row) {
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t c0 = k * kQuantBlock, n = std::min(kQuantBlock, cols - c0);
      const int64_t b = row * cols + c0;
      int16_t* rem = P == 2 ? r.rem + b : nullptr;
      void* pw = static_cast<char*>(r.p) + b * (P == 0 ? 4 : 2);
      const auto* gf = static_cast<const float*>(r.g) + b;
      const auto* gh = static_cast<const uint16_t*>(r.g) + b;
      uint8_t* mc = static_cast<uint8_t*>(r.m) + b;
      uint8_t* vc = static_cast<uint8_t*>(r.v) + b;
      float& sm = r.m_scale[row * nb + k];
      float& sv = r.v_scale[row * nb + k];
      // Dequantize (AVX-512: permutes; else table loads), update (vectorisable: kLanes running
      // maxima, no reassociation), then quantize with the new absmax.
      int64_t d = 0;
#if defined(AUTOMOE_VEC_X86)
      d = dequant8_vec(qm.value, mc, sm, mb, n);
      dequant8_vec(qv.value, vc, sv, vb, n);
#endif
      for (int64_t e = d; e < n; ++e) {
        mb[e] = qm.value[mc[e]] * sm;
        vb[e] = qv.value[vc[e]] * sv;
      }
      float aml[kLanes] = {}, avl[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          float p = load_weight<P>(pw, rem, i + j);
          const float g = (G == 0 ? gf[i + j] : bf16_bits_to_float(gh[i + j])) * r.g_scale;
          adamw_math(r, g, p, mb[i + j], vb[i + j]);
          store_weight<P>(pw, rem, i + j, p);
          const float a = std::fabs(mb[i + j]);
          aml[j] = aml[j] < a ? a : aml[j];
          avl[j] = avl[j] < vb[i + j] ? vb[i + j] : avl[j];
        }
      }
      float am = 0.f, av = 0.f;
      for (; i < n; ++i) {
        float p = load_weight<P>(pw, rem, i);
        const float g = (G == 0 ? gf[i] : bf16_bits_to_float(gh[i])) * r.g_scale;
        adamw_math(r, g, p, mb[i], vb[i]);
        store_weight<P>(pw, rem, i, p);
        am = std::max(am, std::fabs(mb[i]));
        av = std::max(av, vb[i]);
      }
      for (int j = 0; j < kLanes; ++j) {
        am = std::max(am, aml[j]);
        av = std::max(av, avl[j]);
      }
      // A block whose largest magnitude is below the smallest normal float is flushed to zero
      // (its reciprocal would overflow: 0 * inf); NaN never reaches the maxima.
      if (!(am >= std::numeric_limits<float>::min())) am = 0.f;
      if (!(av >= std::numeric_limits<float>::min())) av = 0.f;
      const float im = am > 0.f ? 1.f / am : 0.f, iv = av > 0.f ? 1.f / av : 0.f;
      int64_t e = 0;
#if defined(AUTOMOE_VEC_X86)
      e = quant8_vec(mb, im, qm, mc, n);
      quant8_vec(vb, iv, qv, vc, n);
#endif
      for (; e < n; ++e) {
        mc[e] = code8(qm, mb[e] * im);
        vc[e] = code8(qv, vb[e] * iv);
      }
      sm = am;
      sv = av;
    }
  }
}

template <int P>
AUTOMOE_BODY void adamw8_by_grad(const AdamwRow& r, int64_t row0, int64_t rows) {
  if (r.g_dtype == c10::ScalarType::Float) {
    adamw8_typed<P, 0>(r, row0, rows);
  } else {
    adamw8_typed<P, 1>(r, row0, rows);
  }
}

AUTOMOE_BODY void adamw8_body(const AdamwRow& r, int64_t row0, int64_t rows) {
  if (r.p_dtype == c10::ScalarType::Float) {
    adamw8_by_grad<0>(r, row0, rows);
  } else if (r.rem == nullptr) {
    adamw8_by_grad<1>(r, row0, rows);
  } else {
    adamw8_by_grad<2>(r, row0, rows);
  }
}

}  // namespace

const float* qmap8(bool is_signed) { return qmap8_table(is_signed).value; }
const float* qmid8(bool is_signed) { return qmap8_table(is_signed).mid; }
uint8_t quantize8(float x, bool is_signed) { return code8(qmap8_table(is_signed), x); }

void quantize8_row(const float* x, float inv, bool is_signed, uint8_t* codes, int64_t n) {
  const QMap8& q = qmap8_table(is_signed);
  int64_t e = 0;
#if defined(AUTOMOE_VEC_X86)
  e = quant8_vec(x, inv, q, codes, n);
#endif
  for (; e < n; ++e) codes[e] = code8(q, x[e] * inv);
}

AUTOMOE_ROW_FN(void, adamw8, (const AdamwRow& r, int64_t row_begin, int64_t rows),
               (r, row_begin, rows))
AUTOMOE_ROW_FN(void, adamw, (const AdamwRow& r, int64_t begin, int64_t n), (r, begin, n))

// ---- one-pass rows in their own dtype -------------------------------------------------------

namespace {

AUTOMOE_BODY float ld(const float* p, int64_t i) { return p[i]; }
AUTOMOE_BODY float ld(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }
AUTOMOE_BODY void st(float* p, int64_t i, float v) { p[i] = v; }
AUTOMOE_BODY void st(uint16_t* p, int64_t i, float v) { p[i] = to_bf16(v); }

// Calls f with the row pointers cast to float (float32) or uint16_t (bf16 bits).
#define AUTOMOE_TYPED(dtype, T, ...)       \
  if ((dtype) == c10::ScalarType::Float) { \
    using T = float;                       \
    __VA_ARGS__;                           \
  } else {                                 \
    using T = uint16_t;                    \
    __VA_ARGS__;                           \
  }

template <typename T>
AUTOMOE_BODY void swiglu_typed(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = ld(g, i);
    st(y, i, gv * sigmoid(gv) * ld(u, i));
  }
}

template <typename T>
AUTOMOE_BODY void swiglu_bwd_typed(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = ld(g, i), uv = ld(u, i), dv = ld(dy, i);
    const float s = sigmoid(gv);
    st(dg, i, dv * uv * s * (1.0f + gv * (1.0f - s)));
    st(du, i, dv * gv * s);
  }
}

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

template <typename T>
AUTOMOE_BODY void rotate_typed(const T* x, const float* c, const float* s, float sign, T* y,
                               int64_t heads, int64_t h) {
  for (int64_t n = 0; n < heads; ++n) {
    const T* xa = x + n * 2 * h;
    T* ya = y + n * 2 * h;
    for (int64_t i = 0; i < h; ++i) {
      const float sv = sign * s[i], a = ld(xa, i), b = ld(xa, i + h);
      st(ya, i, a * c[i] - b * sv);
      st(ya, i + h, b * c[i] + a * sv);
    }
  }
}

// The vector kernels of the active level, then the scalar body for the tail.
template <typename T>
void swiglu_dispatch(const T* g, const T* u, T* y, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = swiglu_avx512(g, u, y, n);
  } else if (isa >= Isa::kAvx2) {
    i = swiglu_avx2(g, u, y, n);
  }
#endif
  swiglu_typed(g + i, u + i, y + i, n - i);
}

template <typename T>
void swiglu_bwd_dispatch(const T* g, const T* u, const T* dy, T* dg, T* du, int64_t n) {
  int64_t i = 0;
#if defined(AUTOMOE_VEC_X86)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    i = swiglu_bwd_avx512(g, u, dy, dg, du, n);
  } else if (isa >= Isa::kAvx2) {
    i = swiglu_bwd_avx2(g, u, dy, dg, du, n);
  }
#endif
  swiglu_bwd_typed(g + i, u + i, dy + i, dg + i, du + i, n - i);
}

AUTOMOE_BODY float rmsnorm_row_body(const void* x, const float* w, float eps, void* y,
                                    c10::ScalarType dtype, int64_t n){
    AUTOMOE_TYPED(dtype, T,
                  return rmsnorm_typed(static_cast<const T*>(x), w, eps, static_cast<T*>(y), n))}

AUTOMOE_BODY void rmsnorm_row_bwd_body(const void* g, const void* x, const float* w, float k,
                                       float* dw_acc, void* dx, c10::ScalarType dtype, int64_t n){
    AUTOMOE_TYPED(dtype, T,
                  rmsnorm_bwd_typed(static_cast<const T*>(g), static_cast<const T*>(x), w, k,
                                    dw_acc, static_cast<T*>(dx), n))}

AUTOMOE_BODY void rotate_heads_body(const void* x, const float* c, const float* s, float sign,
                                    void* y, c10::ScalarType dtype, int64_t heads, int64_t h){
    AUTOMOE_TYPED(dtype, T,
                  rotate_typed(static_cast<const T*>(x), c, s, sign, static_cast<T*>(y), heads, h))}

// Largest of the lanes-wise maxima; `bad` collects NaNs.
AUTOMOE_BODY float max_of(const float* x, int64_t n, bool* bad) {
  float mx[kLanes];
  int nan[kLanes] = {};
  for (int j = 0; j < kLanes; ++j) mx[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      mx[j] = v > mx[j] ? v : mx[j];
      nan[j] |= v != v;
    }
  }
  float m = -INFINITY;
  int any = 0;
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  for (int j = 0; j < kLanes; ++j) {
    m = mx[j] > m ? mx[j] : m;
    any |= nan[j];
  }
  *bad = any != 0;
  return m;
}

AUTOMOE_BODY float min_of(const float* x, int64_t n) {
  float mn[kLanes];
  for (int j = 0; j < kLanes; ++j) mn[j] = INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) mn[j] = x[i + j] < mn[j] ? x[i + j] : mn[j];
  }
  float m = INFINITY;
  for (; i < n; ++i) m = x[i] < m ? x[i] : m;
  for (int j = 0; j < kLanes; ++j) m = mn[j] < m ? mn[j] : m;
  return m;
}

// exp_approx clamps below -87.3 (exp(-inf) would come out ~1e-38, not 0, and every score further
// down would tie), so a row reaching below kExpExact is computed with std::exp: NaN, infinities
// and masked (-inf) experts come out as ATen's softmax / sigmoid give them.
AUTOMOE_BODY void softmax_rows_body(const float* x, float* y, int64_t n) {
  bool bad = false;
  const float m = max_of(x, n, &bad);
  if (bad || !std::isfinite(m) || min_of(x, n) - m < kExpExact) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (y[i] = std::exp(x[i] - m));
    for (int64_t i = 0; i < n; ++i) y[i] *= 1.f / sum;
    return;
  }
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += (y[i + j] = exp_approx(x[i + j] - m));
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += (y[i] = exp_approx(x[i] - m));
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) y[i] *= inv;
}

AUTOMOE_BODY void sigmoid_rows_body(const float* x, float* y, int64_t n) {
  if (min_of(x, n) < kExpExact) {  // (a NaN alone does not need this: it stays NaN below)
    for (int64_t i = 0; i < n; ++i) {  // exp(x) / (1 + exp(x)) keeps x far below 0 apart
      const float e = std::exp(x[i] < 0.f ? x[i] : -x[i]);
      y[i] = x[i] < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] != x[i] ? x[i] : sigmoid(x[i]);
}

// k rounds of (maximum, its first index, taken out): for the small k and n of routers this beats
// a sort, and the maximum is a vector reduction.
AUTOMOE_BODY bool topk_body(const float* x, int64_t n, int64_t k, float* w, int64_t* idx) {
  std::memcpy(w, x, n * sizeof(float));
  for (int64_t r = 0; r < k; ++r) {
    bool bad = false;
    const float m = max_of(w, n, &bad);
    if (bad || m == -INFINITY) return false;
    int64_t at = 0;
    while (w[at] != m) ++at;
    idx[r] = at;
    w[at] = -INFINITY;
  }
  return true;
}

}  // namespace

void swiglu_row(const void* g, const void* u, void* y, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(
      dtype, T,
      swiglu_dispatch(static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(y), n))
}
void swiglu_row_bwd(const void* g, const void* u, const void* dy, void* dg, void* du,
                    c10::ScalarType dtype, int64_t n){AUTOMOE_TYPED(
    dtype, T,
    swiglu_bwd_dispatch(static_cast<const T*>(g), static_cast<const T*>(u),
                        static_cast<const T*>(dy), static_cast<T*>(dg), static_cast<T*>(du),
                        n))} AUTOMOE_ROW_FN(float, rmsnorm_row,
                                            (const void* x, const float* w, float eps, void* y,
                                             c10::ScalarType dtype, int64_t n),
                                            (x, w, eps, y, dtype, n))
    AUTOMOE_ROW_FN(void, rmsnorm_row_bwd,
                   (const void* g, const void* x, const float* w, float k, float* dw_acc, void* dx,
                    c10::ScalarType dtype, int64_t n),
                   (g, x, w, k, dw_acc, dx, dtype, n))
        AUTOMOE_ROW_FN(void, rotate_heads,
                       (const void* x, const float* c, const float* s, float sign, void* y,
                        c10::ScalarType dtype, int64_t heads, int64_t h),
                       (x, c, s, sign, y, dtype, heads, h))


namespace {
AUTOMOE_ROW_FN(void, softmax_rows, (const float* x, float* y, int64_t n), (x, y, n))
AUTOMOE_ROW_FN(void, sigmoid_rows, (const float* x, float* y, int64_t n), (x, y, n))
}  // namespace

// Router rows of a multiple of 16 take the AVX-512 kernels at AVX-512, of a multiple of 8 the AVX2
// ones at AVX2; others (and rows the fast exp cannot take) the bodies.
void softmax(const float* x, float* y, int64_t n) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && active_isa() >= Isa::kAvx512) {
    if (softmax_avx512(x, y, n)) return;
  } else if (n % 8 == 0 && active_isa() >= Isa::kAvx2 && softmax_avx2(x, y, n)) {
    return;
  }
#endif
  softmax_rows(x, y, n);
}

void sigmoid_row(const float* x, float* y, int64_t n) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && active_isa() >= Isa::kAvx512) {
    if (sigmoid_avx512(x, y, n)) return;
  } else if (n % 8 == 0 && active_isa() >= Isa::kAvx2 && sigmoid_avx2(x, y, n)) {
    return;
  }
#endif
  sigmoid_rows(x, y, n);
}

bool topk(const float* x, int64_t n, int64_t k, float* scratch, int64_t* idx) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && k <= 16 && n <= 1024 && active_isa() >= Isa::kAvx512) {
    bool handled;
    const bool ok = topk_avx512(x, n, k, scratch, idx, &handled);
    if (handled) return ok;
  }
  if (n % 8 == 0 && active_isa() >= Isa::kAvx2) return topk_avx2(x, n, k, scratch, idx);
#endif
  return topk_body(x, n, k, scratch, idx);
}

// ---- cross-entropy rows (the fused linear cross-entropy's softmax over a vocabulary row) --------

namespace {

// Exact (std::exp) versions: the baseline path, and rows whose maximum or lse is not finite
// (NaN and infinities come out as ATen's logsumexp / exp give them).
template <typename T>
AUTOMOE_BODY float logsumexp_exact(const T* x, int64_t n) {
  float m = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = ld(x, i);
    nan |= v != v;
    m = v > m ? v : m;
  }
  if (nan) return NAN;
  if (!std::isfinite(m)) return m;  // +inf, or every logit -inf
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(ld(x, i) - m);
  return m + static_cast<float>(std::log(s));
}

template <typename T>
AUTOMOE_BODY void ce_grad_exact(T* x, float lse, int64_t label, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    st(x, i, (std::exp(ld(x, i) - lse) - (i == label ? 1.f : 0.f)) * scale);
  }
}

#if defined(AUTOMOE_VEC_X86)
template <typename T>
AUTOMOE_TARGET_AVX512 float logsumexp_avx512(const T* x, int64_t n) {
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // NaN ignored by max (the accumulator is its second operand)
    const __m512 a = ld16(x + i), b = ld16(x + i + 16);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(a, m0);
    m1 = _mm512_max_ps(b, m1);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 a = ld16(x + i);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(a, m0);
  }
  float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  bool nan_tail = false;
  for (int64_t j = i; j < n; ++j) {
    const float v = ld(x, j);
    nan_tail |= v != v;
    m = v > m ? v : m;
  }
  if (nan || nan_tail || !std::isfinite(m)) return logsumexp_exact(x, n);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  for (i = 0; i + 32 <= n; i += 32) {
    s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(ld16(x + i), mv)));
    s1 = _mm512_add_ps(s1, exp16(_mm512_sub_ps(ld16(x + i + 16), mv)));
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_add_ps(s0, exp16(_mm512_sub_ps(ld16(x + i), mv)));
  float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < n; ++i) s += exp_approx(ld(x, i) - m);
  return m + std::log(s);
}

template <typename T>
AUTOMOE_TARGET_AVX512 void ce_grad_avx512(T* x, float lse, int64_t label, float scale, int64_t n) {
  const bool has_label = label >= 0 && label < n;
  const float at_label = has_label ? ld(x, label) : 0.f;
  const __m512 lv = _mm512_set1_ps(lse), sv = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    st16(x + i, _mm512_mul_ps(exp16(_mm512_sub_ps(ld16(x + i), lv)), sv));
  }
  for (; i < n; ++i) st(x, i, exp_approx(ld(x, i) - lse) * scale);
  if (has_label) st(x, label, (exp_approx(at_label - lse) - 1.f) * scale);
}

template <typename T>
AUTOMOE_TARGET_AVX2 float logsumexp_avx2(const T* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = ld8(x + i), b = ld8(x + i + 8);
    nan = _mm256_or_ps(
        nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(a, m0);
    m1 = _mm256_max_ps(b, m1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = ld8(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(a, m0);
  }
  float m = hmax8(_mm256_max_ps(m0, m1));
  bool nan_tail = false;
  for (int64_t j = i; j < n; ++j) {
    const float v = ld(x, j);
    nan_tail |= v != v;
    m = v > m ? v : m;
  }
  if (_mm256_movemask_ps(nan) || nan_tail || !std::isfinite(m)) return logsumexp_exact(x, n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (i = 0; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(ld8(x + i), mv)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(ld8(x + i + 8), mv)));
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(ld8(x + i), mv)));
  __m256 sv = _mm256_add_ps(s0, s1);
  sv = _mm256_add_ps(sv, _mm256_permute2f128_ps(sv, sv, 1));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0x4E));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0xB1));
  float s = _mm256_cvtss_f32(sv);
  for (; i < n; ++i) s += exp_approx(ld(x, i) - m);
  return m + std::log(s);
}

template <typename T>
AUTOMOE_TARGET_AVX2 void ce_grad_avx2(T* x, float lse, int64_t label, float scale, int64_t n) {
  const bool has_label = label >= 0 && label < n;
  const float at_label = has_label ? ld(x, label) : 0.f;
  const __m256 lv = _mm256_set1_ps(lse), sv = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) st8(x + i, _mm256_mul_ps(exp8(_mm256_sub_ps(ld8(x + i), lv)), sv));
  for (; i < n; ++i) st(x, i, exp_approx(ld(x, i) - lse) * scale);
  if (has_label) st(x, label, (exp_approx(at_label - lse) - 1.f) * scale);
}
#endif

}  // namespace

float logsumexp_row(const void* x, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(dtype, T, {
    const T* p = static_cast<const T*>(x);
#if defined(AUTOMOE_VEC_X86)
    if (active_isa() >= Isa::kAvx512) return logsumexp_avx512(p, n);
    if (active_isa() >= Isa::kAvx2) return logsumexp_avx2(p, n);
#endif
    return logsumexp_exact(p, n);
  })
}

void ce_grad_row(void* x, c10::ScalarType dtype, float lse, int64_t label, float scale, int64_t n) {
  AUTOMOE_TYPED(dtype, T, {
    T* p = static_cast<T*>(x);
#if defined(AUTOMOE_VEC_X86)
    if (std::isfinite(lse)) {
      if (active_isa() >= Isa::kAvx512) return ce_grad_avx512(p, lse, label, scale, n);
      if (active_isa() >= Isa::kAvx2) return ce_grad_avx2(p, lse, label, scale, n);
    }
#endif
    return ce_grad_exact(p, lse, label, scale, n);
  })
}

#undef AUTOMOE_TYPED

}  // namespace automoe::ops::cpu::vec
