// Analytic FLOPs of a training step, the one formula both benchmark sides and the trainer's MFU
// use: matmul FLOPs only, derived from the model's components (model/components.h,
// forward_flops_per_token). Training = 3 x forward (the backward computes two products per forward
// product).
#pragma once

#include <cstdint>

#include "automoe/model/components.h"

namespace automoe {

inline double training_flops_per_token(const ModelSpec& spec, int64_t seq_len) {
  return 3.0 * forward_flops_per_token(spec, seq_len);
}

}  // namespace automoe
