#include "automoe/model/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <string>

namespace automoe {

NamedTensors init_parameters(const ModelSpec& spec, c10::ScalarType dtype, c10::Device device,
                             uint64_t seed, double std) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  NamedTensors out;
  for (const auto& d : parameter_layout(spec)) {
    // Drawn on the CPU in float32 (reproducible whatever the device), then cast and moved. A large
    // tensor is drawn in row blocks (the generator's stream is the same when each block is a
    // multiple of 16 values), so that no float32 copy of a whole embedding or expert stack exists
    // next to the model: the benchmark's peak memory is then the model's, not its initialisation's.
    const c10::ScalarType out_dtype = d.keep_float32 ? at::kFloat : dtype;
    int64_t numel = 1;
    for (int64_t n : d.shape) numel *= n;
    const int64_t inner = d.shape.empty() || d.shape[0] == 0 ? 0 : numel / d.shape[0];
    const int64_t block_rows = inner > 0 ? std::max<int64_t>(1, (int64_t{4} << 20) / inner) : 0;
    if (d.init == Init::kNormal && numel > (int64_t{16} << 20) && (block_rows * inner) % 16 == 0) {
      at::Tensor t = at::empty(d.shape, at::TensorOptions().dtype(out_dtype).device(device));
      const at::Tensor rows = t.view({d.shape[0], inner});
      for (int64_t r0 = 0; r0 < d.shape[0]; r0 += block_rows) {
        const int64_t n = std::min(block_rows, d.shape[0] - r0);
        rows.narrow(0, r0, n).copy_(at::normal(0.0, std, {n, inner}, gen));
      }
      if (d.name == "model.embed_tokens.weight" && spec.pad_token_id >= 0 &&
          spec.pad_token_id < spec.vocab_size) {
        t[spec.pad_token_id].zero_();
      }
      out.emplace_back(d.name, t);
      continue;
    }
    at::Tensor t = d.init == Init::kOnes    ? at::ones(d.shape)
                   : d.init == Init::kZeros ? at::zeros(d.shape)
                                            : at::normal(0.0, std, d.shape, gen);
    // As nn.Embedding(padding_idx=...): the pad token's row starts at zero.
    if (d.name == "model.embed_tokens.weight" && spec.pad_token_id >= 0 &&
        spec.pad_token_id < spec.vocab_size) {
      t[spec.pad_token_id].zero_();
    }
    out.emplace_back(d.name, t.to(device, out_dtype));
  }
  return out;
}

}  // namespace automoe
