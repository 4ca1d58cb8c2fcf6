// The Mamba-2 sequence mixer (Transformers' NemotronHMamba2Mixer): in_proj -> (gate, xBC, dt);
// depthwise causal conv1d + SiLU on xBC; the SSD scan (chunked over a sequence, the recurrent
// step when one token continues a cached state); the gated grouped RMSNorm; out_proj. The second
// implementation of a layer's sequence mixer beside attention (model/decoder.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

#include "automoe/model/backend.h"
#include "automoe/model/components.h"
#include "automoe/model/kv_cache.h"
#include "automoe/model/spec.h"

namespace automoe {

struct MambaInputs {
  // [B, S] 1 = token, 0 = padding (zeroed before the projections' use and after the conv, as
  // Transformers' apply_mask_to_padding_states), or none.
  std::optional<at::Tensor> keep_BS;
  // [B, S] document of each position: the conv and the scan restart at each boundary (packing).
  std::optional<at::Tensor> doc_BS;
  KVCache* cache = nullptr;  // incremental decoding: reads and replaces the layer's state
  int64_t layer = 0;
};

// y = x·wᵀ (+ bias) for the weight in slot `w` (with its LoRA adapter): the decoder's linear.
using SlotLinear = std::function<at::Tensor(const at::Tensor& x, int64_t w, int64_t bias)>;

// The conv1d and the gated norm are `ops`' (the backend's `mamba` choice).
at::Tensor mamba2_mixer(const Mamba2Spec& spec, const MambaSlots& slots, const NamedTensors& params,
                        const at::Tensor& x_BSH, const MambaInputs& in, const SlotLinear& linear,
                        const ComponentOps& ops);

}  // namespace automoe
