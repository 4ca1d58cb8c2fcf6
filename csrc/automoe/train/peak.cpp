#include "automoe/train/peak.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>
#include <limits>

namespace automoe {

MatmulPeak measure_matmul_peak(const c10::Device& dev, c10::ScalarType dtype, int64_t n,
                               int reps) {
  // CPU: without native bf16 matmul (no AVX512-BF16/AMX) bf16 at::mm is orders of magnitude
  // slower than fp32; a smaller n keeps that measurement to seconds.
  if (n <= 0) n = dev.is_cuda() ? 8192 : 1024;
  if (reps <= 0) reps = dev.is_cuda() ? 20 : 2;
  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize();
  };
  const auto opts = at::TensorOptions().dtype(dtype).device(dev);
  const at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts);
  at::Tensor c = at::empty({n, n}, opts);
  MatmulPeak best;
  best.n = n;
  best.ms = std::numeric_limits<double>::infinity();
  for (const std::string layout : {"a*b", "a*b^T"}) {
    const at::Tensor rhs = layout == "a*b" ? b : b.t();
    at::mm_out(c, a, rhs);  // warm-up
    sync();
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      at::mm_out(c, a, rhs);
      sync();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (ms < best.ms) best.ms = ms, best.layout = layout;
    }
  }
  best.tflops = 2.0 * n * n * n / (best.ms * 1e-3) / 1e12;
  return best;
}

}  // namespace automoe
