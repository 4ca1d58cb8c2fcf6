#include "automoe/model/recurrent_mixer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "automoe/core/error.h"

namespace automoe {

at::Tensor zero_padding(const at::Tensor& x_BSX, const std::optional<at::Tensor>& keep_BS) {
  if (!keep_BS) return x_BSX;
  return (x_BSX * keep_BS->unsqueeze(-1)).to(x_BSX.scalar_type());
}

at::Tensor causal_conv_cached(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                              const std::optional<at::Tensor>& bias_C, KVCache::Recurrent* state,
                              const RecurrentInputs& in, const ComponentOps& ops) {
  const int64_t B = x_BSC.size(0), S = x_BSC.size(1), K = w_CK.size(1);
  if (!state) {
    const std::optional<at::Tensor> doc =
        in.doc_BS ? std::optional<at::Tensor>(in.doc_BS->to(at::kLong)) : std::nullopt;
    return ops.causal_conv1d(x_BSC, w_CK, bias_C, doc, true);
  }
  const bool continues = state->conv.defined();
  if (continues) {
    AUTOMOE_CHECK(state->conv.size(0) == B, "KVCache layer ", in.layer, ": holds a batch of ",
                  state->conv.size(0), " rows; the inputs have ", B);
  }
  const at::Tensor full =
      continues ? at::cat({state->conv.to(x_BSC.scalar_type()).transpose(1, 2), x_BSC}, 1) : x_BSC;
  const int64_t len = full.size(1);
  at::Tensor out = ops.causal_conv1d(full, w_CK, bias_C, std::nullopt, true).narrow(1, len - S, S);
  at::NoGradGuard no_grad;
  const at::Tensor last = len >= K ? full.narrow(1, len - K, K) : at::constant_pad_nd(full, {0, 0, K - len, 0}, 0);
  state->conv = last.detach().transpose(1, 2).contiguous();
  return out;
}

}  // namespace automoe
