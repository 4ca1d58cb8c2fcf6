// The row primitives of no one op family (vec.h): the active level's name, bf16 rows widened and
// rounded back (load, store), and the float32 reductions and updates (sum_sq, dot, axpy, scale).
#include "automoe/ops/cpu/vec.h"

#include <cstdint>
#include <cstring>

#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

#if defined(AUTOMOE_VEC_X86)
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

AUTOMOE_BODY void exp_from_body(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(a - x[i]);
}
AUTOMOE_ROW_FN(void, exp_from, (float a, const float* x, float* y, int64_t n), (a, x, y, n))

}  // namespace automoe::ops::cpu::vec
