// The Mamba-2 sequence mixer (Transformers' NemotronHMamba2Mixer): in_proj -> (gate, xBC, dt);
// depthwise causal conv1d + SiLU on xBC; the SSD scan (chunked over a sequence, the recurrent
// step when one token continues a cached state); the gated grouped RMSNorm; out_proj. The second
// implementation of a layer's sequence mixer beside attention (model/decoder.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "automoe/model/components.h"
#include "automoe/model/recurrent_mixer.h"
#include "automoe/model/spec.h"

namespace automoe {

// The conv1d and the gated norm are `ops`' (the backend's `mamba` choice). Padding is zeroed before
// the projections and again after the conv (Transformers' apply_mask_to_padding_states).
at::Tensor mamba2_mixer(const Mamba2Spec& spec, const MambaSlots& slots, const NamedTensors& params,
                        const at::Tensor& x_BSH, const RecurrentInputs& in, const SlotLinear& linear,
                        const ComponentOps& ops);

}  // namespace automoe
