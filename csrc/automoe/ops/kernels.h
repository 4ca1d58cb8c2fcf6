// The kernel layer of the fused ops: one declaration per kernel, implemented once per backend in
// namespace automoe::ops::cpu (ops/<op>/<op>_cpu.cpp) and automoe::ops::cuda (ops/<op>/<op>_cuda.cu,
// compiled when the CUDA toolchain matches torch). The autograd layer (ops/<op>/<op>.cpp) checks
// shapes, dtypes and devices, makes inputs contiguous and picks the backend from the device, so
// every kernel may assume:
//   - all tensors contiguous and on the same device;
//   - floating tensors in float32, bfloat16 (float32 accumulation) or, on CPU, float64 (for
//     finite-difference checks); index tensors int64; "fp32" below means exactly float32;
//   - every output is allocated by the kernel with new_output() below and fully written.
// Shape letters: T tokens, K top-k, E experts, H hidden, N permuted rows (= T*K), I expert
// intermediate, O output features, G groups, R rows, C columns, V vocabulary.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <utility>

namespace automoe::ops {

struct RouterParams {
  int64_t top_k = 1;
  bool sigmoid = false;       // scores = sigmoid(logits) instead of softmax(logits)
  int64_t n_group = 1;        // group-limited top-k: E experts in n_group equal groups...
  int64_t topk_group = 1;     // ...of which the topk_group best (sum of top-2 biased scores) stay
  bool norm_topk_prob = true; // weights /= sum of the K selected scores (+1e-20 for sigmoid)
  double scaling = 1.0;       // routed_scaling_factor, applied last
};

// Every kernel allocates its outputs here: at::empty, except that while poisoning is on (the op
// tests turn it on) floating outputs are filled with NaN and integer ones with -7777 first, so
// that an element a kernel forgets to write fails the comparison with the reference.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);
void set_poison_outputs(bool on);
bool poison_outputs();

namespace cpu {
#include "automoe/ops/kernel_decls.inc"
}  // namespace cpu

#if defined(AUTOMOE_WITH_CUDA)
namespace cuda {
#include "automoe/ops/kernel_decls.inc"
}  // namespace cuda
#endif

}  // namespace automoe::ops
