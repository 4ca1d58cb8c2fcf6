// Matmul throughput of a device (the denominator of MFU): square at::mm large enough to reach the
// BLAS's steady state, best of the a*b and a*b^T layouts (on CPUs without native bf16, the two
// differ by 10x and more; the model's linear layers use the b^T layout).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace automoe {

struct MatmulPeak {
  int64_t n = 0;
  double ms = 0;
  std::string layout;
  double tflops = 0;
};

// n = 0: a size that suits the device (8192 on CUDA, 1024 on CPU).
MatmulPeak measure_matmul_peak(const c10::Device& dev, c10::ScalarType dtype, int64_t n = 0,
                               int reps = 0);

}  // namespace automoe
