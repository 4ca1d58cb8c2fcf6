// AdamW's rows (vec.h adamw): one step over float32 or bf16 weights, gradients and moments,
// compiled once per instruction-set level.
#include <cstdint>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_adamw_step.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

// P as load_weight's (vec_adamw_step.h); G, S: 0 float32, 1 bf16 (gradient, moments).
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

}  // namespace

AUTOMOE_ROW_FN(void, adamw, (const AdamwRow& r, int64_t begin, int64_t n), (r, begin, n))

}  // namespace automoe::ops::cpu::vec
