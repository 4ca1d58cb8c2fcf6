#include "automoe/model/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <string>

namespace automoe {

NamedTensors init_parameters(const ModelSpec& spec, c10::ScalarType dtype, c10::Device device,
                             uint64_t seed, double std) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  NamedTensors out;
  for (const auto& d : parameter_layout(spec)) {
    // Drawn on the CPU in float32 (reproducible whatever the device), then cast and moved.
    at::Tensor t = d.init == Init::kOnes    ? at::ones(d.shape)
                   : d.init == Init::kZeros ? at::zeros(d.shape)
                                            : at::normal(0.0, std, d.shape, gen);
    // As nn.Embedding(padding_idx=...): the pad token's row starts at zero.
    if (d.name == "model.embed_tokens.weight" && spec.pad_token_id >= 0 &&
        spec.pad_token_id < spec.vocab_size) {
      t[spec.pad_token_id].zero_();
    }
    out.emplace_back(d.name, t.to(device, d.keep_float32 ? at::kFloat : dtype));
  }
  return out;
}

}  // namespace automoe
