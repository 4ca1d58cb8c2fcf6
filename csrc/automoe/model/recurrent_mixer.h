// What the recurrent sequence mixers (Mamba-2, gated DeltaNet) share: their inputs beyond the
// hidden states (padding, packed documents, the decoding cache), the decoder's linear, the padding
// rule, and the depthwise causal conv1d that continues from a cached state.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

#include "automoe/model/backend.h"
#include "automoe/model/kv_cache.h"

namespace automoe {

struct RecurrentInputs {
  // [B, S] 1 = token, 0 = padding (zeroed before the projections, as Transformers'
  // apply_mask_to_padding_states), or none.
  std::optional<at::Tensor> keep_BS;
  // [B, S] document of each position: the conv and the recurrence restart at each boundary (packing).
  std::optional<at::Tensor> doc_BS;
  KVCache* cache = nullptr;  // incremental decoding: reads and replaces the layer's state
  int64_t layer = 0;
};

// y = x·wᵀ (+ bias) for the weight in slot `w` (with its LoRA adapter): the decoder's linear.
using SlotLinear = std::function<at::Tensor(const at::Tensor& x, int64_t w, int64_t bias)>;

// x with the padding positions of keep_BS zeroed (x itself without a mask).
at::Tensor zero_padding(const at::Tensor& x_BSX, const std::optional<at::Tensor>& keep_BS);

// The depthwise causal conv1d + SiLU over channels-last x [B, S, C] with w [C, K] (ops' choice):
// with a cache, after the layer's cached last inputs, which it then replaces (`state->conv`, [B, C,
// K], Transformers' conv_states layout); without one, restarting at documents.
at::Tensor causal_conv_cached(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                              const std::optional<at::Tensor>& bias_C, KVCache::Recurrent* state,
                              const RecurrentInputs& in, const ComponentOps& ops);

}  // namespace automoe
