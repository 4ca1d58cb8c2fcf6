// RoPE's rows (vec.h rotate_heads): the rotation of half-split heads in their own dtype, compiled
// once per instruction-set level.
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

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

AUTOMOE_BODY void rotate_heads_body(const void* x, const float* c, const float* s, float sign,
                                    void* y, c10::ScalarType dtype, int64_t heads, int64_t h) {
  AUTOMOE_TYPED(dtype, T,
                rotate_typed(static_cast<const T*>(x), c, s, sign, static_cast<T*>(y), heads, h))
}

}  // namespace

AUTOMOE_ROW_FN(void, rotate_heads,
               (const void* x, const float* c, const float* s, float sign, void* y,
                c10::ScalarType dtype, int64_t heads, int64_t h),
               (x, c, s, sign, y, dtype, heads, h))

}  // namespace automoe::ops::cpu::vec
