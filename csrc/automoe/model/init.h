// Random parameters for a spec, as Transformers initialises a model from a config: normal(0, std)
// for every matrix, zero biases, ones for RMSNorm weights, the pad token's embedding row zero.
// Used by from_config, benchmarks and tests that need a model without a checkpoint.
#pragma once

#include <cstdint>

#include "automoe/model/decoder.h"

namespace automoe {

NamedTensors init_parameters(const ModelSpec& spec, c10::ScalarType dtype, c10::Device device,
                             uint64_t seed, double std = 0.02);

}  // namespace automoe
