// One element of the AdamW step and the weight's three storage forms, shared by adamw
// (vec_adamw.cpp) and adamw8 (vec_adamw8.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

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

}  // namespace
}  // namespace automoe::ops::cpu::vec
