// The per-level machinery of the row primitives (vec.h), shared by ops/cpu/vec*.cpp: the macro that
// compiles a row body once per instruction-set level, and the lane helpers the families share.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _undefined_ placeholders.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/cpu/vec.h"

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
// 8-lane versions of exp_approx / sigmoid (same constants), for the AVX2 paths.
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

// The largest of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float hmax8(__m256 v) {
  v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0x4E));
  v = _mm256_max_ps(v, _mm256_permute_ps(v, 0xB1));
  return _mm256_cvtss_f32(v);
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
#endif

}  // namespace

// Reductions keep kLanes independent partial sums: vectorisable without reassociation flags, and
// 32 of them make four independent 8-wide (two 16-wide) FMA chains, so a row is not bound by the
// FMA latency (8 sums made one chain: 8 flops per 4 cycles, which bound unpermute's backward).
constexpr int kLanes = 32;

AUTOMOE_BODY float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

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

// One element of a row in its own dtype (float32, or bf16 bits rounded to nearest even), for the
// scalar loops of the one-pass rows.

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

}  // namespace
}  // namespace automoe::ops::cpu::vec
