// Which of our CUDA kernels run by default (DESIGN.md principle 7: a kernel that has never run on a
// GPU is never the default). An op whose kernel is not in the table runs its ATen reference on
// CUDA tensors (cuBLAS matmuls, ATen's elementwise ops; the experts block takes
// torch._grouped_mm), and ours is selectable by name for validation:
//
//   AUTOMOE_CUDA_KERNELS=all | none | <op>[,<op>...]    (ops: router, permute, grouped_gemm,
//                                                         swiglu, rmsnorm, rope,
//                                                         causal_conv1d, gated_rmsnorm, ssd_scan)
//
// The table is docs/ops.md's "CUDA kernels" table, filled from bench/gpu.sh's evidence (the op
// harness passing on a named GPU); kValidatedCudaKernels below must list exactly its passed rows.
#pragma once

#include <string>
#include <vector>

namespace automoe::ops {

// The op families with a CUDA kernel of ours.
const std::vector<std::string>& cuda_kernel_names();
// Those that passed bench/gpu.sh on a GPU (empty: none has run yet).
const std::vector<std::string>& validated_cuda_kernels();
// Whether CUDA tensors run our kernel for `op` (one of cuda_kernel_names()) or ATen's reference:
// the validated table, overridden by AUTOMOE_CUDA_KERNELS (an unknown name there is an error).
bool use_cuda_kernel(const char* op);

}  // namespace automoe::ops
