// The fused linear cross-entropy's rows (vec.h logsumexp_row, ce_grad_row): float32 or bf16 logits,
// AVX2 and AVX-512 kernels, the exact std::exp versions for the baseline and non-finite rows.
#include <cmath>
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
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

}  // namespace automoe::ops::cpu::vec
