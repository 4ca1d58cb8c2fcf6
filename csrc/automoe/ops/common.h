// Shared by the ops' autograd layers: input checks with messages that name the op and tensor,
// and the device switch between the CPU and CUDA kernels of ops/kernels.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>

#include "automoe/core/error.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::detail {

// Float tensor of a supported dtype: float32, bfloat16, or float64 (CPU only).
void check_float(const char* op, const char* name, const at::Tensor& t);
void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim);
void check_same_device(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> ts);
void check_same_dtype(const char* op, const char* a, const at::Tensor& ta, const char* b,
                      const at::Tensor& tb);
[[noreturn]] void no_kernel(const char* op, const at::Tensor& t);
// Called first by every op's backward: the kernels compute gradients on raw memory, outside
// autograd, so a backward that builds a graph (create_graph=True: second-order gradients) would
// silently miss their part of it. Refused by name instead, pointing at the reference backends.
void no_double_backward(const char* op);

}  // namespace automoe::ops::detail

// AUTOMOE_KERNEL(fn, t, args...): ops::cuda::fn(args...) for CUDA tensors t (when built with
// CUDA), ops::cpu::fn(args...) for CPU tensors, else an error naming the device.
#if defined(AUTOMOE_WITH_CUDA)
#define AUTOMOE_KERNEL(fn, t, ...)                                                           \
  ((t).is_cuda()  ? ::automoe::ops::cuda::fn(__VA_ARGS__)                                    \
   : (t).is_cpu() ? ::automoe::ops::cpu::fn(__VA_ARGS__)                                     \
                  : (::automoe::ops::detail::no_kernel(#fn, t), ::automoe::ops::cpu::fn(__VA_ARGS__)))
#else
#define AUTOMOE_KERNEL(fn, t, ...)                                                           \
  ((t).is_cpu() ? ::automoe::ops::cpu::fn(__VA_ARGS__)                                       \
                : (::automoe::ops::detail::no_kernel(#fn, t), ::automoe::ops::cpu::fn(__VA_ARGS__)))
#endif
