// The gated DeltaNet sequence mixer (Transformers' Qwen3NextGatedDeltaNet, and Qwen3.5's with split
// in-projections): in-projections -> q, k, v, z, b, a; depthwise causal conv1d + SiLU over
// [q | k | v]; the gated delta rule (chunked over a sequence, the recurrent step when one token
// continues a cached state); the per-head RMSNorm gated by silu(z); out_proj. The third
// implementation of a layer's sequence mixer beside attention and Mamba-2 (model/decoder.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "automoe/model/components.h"
#include "automoe/model/recurrent_mixer.h"
#include "automoe/model/spec.h"

namespace automoe {

// Padding is zeroed before the projections only (Transformers' order); the conv1d and the RMSNorm
// are `ops`'.
at::Tensor gated_deltanet_mixer(const GatedDeltaNetSpec& spec, const DeltaNetSlots& slots,
                                const NamedTensors& params, const at::Tensor& x_BSH,
                                const RecurrentInputs& in, const SlotLinear& linear,
                                const ComponentOps& ops);

}  // namespace automoe
