// SwiGLU's rows (vec.h swiglu_row, swiglu_row_bwd): the AVX2 and AVX-512 kernels, one pass over
// rows in their own dtype, then the scalar body for the tail.
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

#if defined(AUTOMOE_VEC_X86)
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
    const __m256 g1 = ld8(g + i + 8), u1 = ld8(u + i + 8), d1 = ld8(dy + i + 8), s1 = sigmoid8(g1);
    st16(dg + i,
         _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d0, u0), s0),
                       _mm256_fmadd_ps(g0, _mm256_sub_ps(one, s0), one)),
         _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d1, u1), s1),
                       _mm256_fmadd_ps(g1, _mm256_sub_ps(one, s1), one)));
    st16(du + i, _mm256_mul_ps(_mm256_mul_ps(d0, g0), s0),
         _mm256_mul_ps(_mm256_mul_ps(d1, g1), s1));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = ld8(g + i), uv = ld8(u + i), dv = ld8(dy + i), s = sigmoid8(gv);
    const __m256 ds = _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one);  // 1 + g (1 - s)
    st8(dg + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, uv), s), ds));
    st8(du + i, _mm256_mul_ps(_mm256_mul_ps(dv, gv), s));
  }
  return i;
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
#endif

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

}  // namespace

void swiglu_row(const void* g, const void* u, void* y, c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(
      dtype, T,
      swiglu_dispatch(static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(y), n))
}
void swiglu_row_bwd(const void* g, const void* u, const void* dy, void* dg, void* du,
                    c10::ScalarType dtype, int64_t n) {
  AUTOMOE_TYPED(
      dtype, T,
      swiglu_bwd_dispatch(static_cast<const T*>(g), static_cast<const T*>(u),
                          static_cast<const T*>(dy), static_cast<T*>(dg), static_cast<T*>(du), n))
}

}  // namespace automoe::ops::cpu::vec
