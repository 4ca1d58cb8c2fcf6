// Row primitives of the CPU kernels: float32 math on contiguous rows. Each is compiled three times
// (x86-64 with AVX-512, with AVX2+FMA, and the baseline) and picked at each call from the active
// instruction-set level (ops/cpu/isa.h), so the loops use what the CPU has without requiring it.
// exp is a Cephes-style polynomial (relative error ~2e-7), which keeps the loops free of library
// calls. The kernels widen bf16 rows into float buffers with load(), compute here, and round back
// once with store() (round to nearest even, as c10::BFloat16).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace automoe::ops::cpu::vec {

// The copy the row primitives run at the active level: "avx512", "avx2" or "baseline".
const char* path_name();

void load(const void* src, c10::ScalarType dtype, float* dst, int64_t n);
void store(const float* src, void* dst, c10::ScalarType dtype, int64_t n);

// out = silu(g) * u
void silu_mul(const float* g, const float* u, float* out, int64_t n);
// dg = dy * u * s * (1 + g (1 - s)), du = dy * g * s, s = sigmoid(g)
void silu_mul_bwd(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n);

float sum_sq(const float* x, int64_t n);
// sum a * b * c
float dot3(const float* a, const float* b, const float* c, int64_t n);
// y = x * k * w
void scale_mul(const float* x, float k, const float* w, float* y, int64_t n);
// acc += a * b * k
void acc_mul(float* acc, const float* a, const float* b, float k, int64_t n);
// dx = k * (g * w - x * k * m)
void rms_dx(const float* g, const float* w, const float* x, float k, float m, float* dx, int64_t n);

// acc += a * x
void axpy(float* acc, float a, const float* x, int64_t n);
float dot(const float* a, const float* b, int64_t n);
// The same with x as raw bf16 (no widened copy of the row).
void axpy_bf16(float* acc, float a, const uint16_t* x, int64_t n);
float dot_bf16(const float* a, const uint16_t* b, int64_t n);
// y = a * x
void scale(const float* x, float a, float* y, int64_t n);

// Rotation of `heads` half-split rows (x and y [heads, 2h]): the pairs (x[i], x[i + h]) of each
// row by the angles (c[i], sign * s[i]).
void rotate_heads(const float* x, const float* c, const float* s, float sign, float* y,
                  int64_t heads, int64_t h);

// One AdamW step (decoupled weight decay; ATen's fused AdamW formula in float32 math) over
// elements [begin, begin + n) of one tensor. The weight is float32, or bf16 — with `rem` the lower
// 16 bits of its float32 master (split so that the bf16 part is the master rounded half away from
// zero: join(bf16, rem) is the master exactly), without it the master itself (rounded to nearest
// even after the update). Gradient and moments are float32 or bf16; the gradient is multiplied by
// g_scale (clipping) in float32 before use.
struct AdamwRow {
  void* p = nullptr;
  c10::ScalarType p_dtype = c10::ScalarType::Float;
  int16_t* rem = nullptr;
  const void* g = nullptr;
  c10::ScalarType g_dtype = c10::ScalarType::Float;
  void* m = nullptr;
  void* v = nullptr;
  c10::ScalarType s_dtype = c10::ScalarType::Float;
  float decay = 1.f;  // 1 - lr * weight_decay
  // (1 - beta1 and 1 - beta2 computed in double, then rounded, as ATen's fused AdamW does)
  float one_minus_beta1 = 0.1f, beta2 = 0.999f, one_minus_beta2 = 0.001f, eps = 1e-8f;
  float step_size = 0.f;  // lr / (1 - beta1^step)
  float bc2_sqrt = 1.f;   // sqrt(1 - beta2^step)
  float g_scale = 1.f;
};
void adamw(const AdamwRow& r, int64_t begin, int64_t n);

}  // namespace automoe::ops::cpu::vec
