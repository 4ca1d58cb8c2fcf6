#include "automoe/model/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace automoe {

NamedTensors init_parameters(const ModelSpec& spec, c10::ScalarType dtype, c10::Device device,
                             uint64_t seed, double std) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  NamedTensors out;
  for (const auto& d : parameter_layout(spec)) {
    const bool is_norm =
        d.name.size() >= 11 && d.name.compare(d.name.size() - 11, 11, "norm.weight") == 0;
    // Drawn on the CPU in float32 (reproducible whatever the device), then cast and moved.
    at::Tensor t = is_norm ? at::ones(d.shape) : at::normal(0.0, std, d.shape, gen);
    out.emplace_back(d.name, t.to(device, dtype));
  }
  return out;
}

}  // namespace automoe
