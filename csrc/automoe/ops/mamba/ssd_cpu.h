// The SSD scan's CPU kernels (ssd_cpu.cpp): the chunked scan of mamba.h's ssd_scan as GEMMs on the
// CPU GEMM engine (gemm_cpu.h: brgemm with bf16 operands on AMX / AVX-512-BF16, float32
// accumulation) and row kernels per instruction-set level, forward and a hand-derived backward
// that recomputes the chunk states instead of saving them. CPU only, float32 or bf16 x / B / C
// (the products take x's dtype: bf16 operands for a bf16 model, as Mamba-2's own kernels do;
// float32 stays float32); the autograd layer (mamba.cpp) sends anything else to the ATen form.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace automoe::ops::cpu {

struct SsdArgs {  // every tensor contiguous, on the CPU
  at::Tensor x;      // [Bn, S, H, P] float32 or bf16
  at::Tensor dt;     // [Bn, S, H] any float dtype (softplus'd and clamped)
  at::Tensor A;      // [H] float32
  at::Tensor B, C;   // [Bn, S, G, N] x's dtype
  at::Tensor D;      // [H]
  std::optional<at::Tensor> initial;  // [Bn, H, P, N] float32
  std::optional<at::Tensor> doc;      // [Bn, S] int64, documents contiguous in a row
  int64_t chunk = 0;
};

// (y [Bn, S, H, P] float32, final state [Bn, H, P, N] float32 or undefined).
std::pair<at::Tensor, at::Tensor> ssd_scan_fwd(const SsdArgs& a, bool final_state);

struct SsdGrads {
  at::Tensor dx, ddt, dA, dB, dC, dD, dinitial;  // each in its input's dtype (dinitial float32)
};
// From dy [Bn, S, H, P] float32 and the final state's gradient (undefined: none).
SsdGrads ssd_scan_bwd(const SsdArgs& a, const at::Tensor& dy, const at::Tensor& dfinal);

}  // namespace automoe::ops::cpu
