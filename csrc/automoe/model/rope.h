// RoPE angle tables for a RopeSpec, as Transformers' rotary embeddings compute them (default,
// linear and YaRN inverse frequencies; partial rotary through RopeSpec::dim). The rotation itself
// is the rope op (ops/ops.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "automoe/model/spec.h"

namespace automoe {

// inv_freq [dim/2] float32 (Transformers' ROPE_INIT_FUNCTIONS for the spec's type).
at::Tensor rope_inv_freq(const RopeSpec& rope);

// Half-angle tables cos/sin [B, S, dim/2] for integer positions [B, S]: angles in float32,
// multiplied by the spec's attention_factor (YaRN), then cast to `dtype`.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& position_ids_BS,
                                              const at::Tensor& inv_freq, double attention_factor,
                                              c10::ScalarType dtype);

}  // namespace automoe
