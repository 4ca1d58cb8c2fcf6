#include "automoe/ops/common.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <atomic>

namespace automoe::ops {
namespace {
std::atomic<bool> g_poison{false};
}  // namespace

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (g_poison.load(std::memory_order_relaxed)) {
    if (at::isFloatingType(t.scalar_type())) {
      t.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      t.fill_(-7777);
    }
  }
  return t;
}

void set_poison_outputs(bool on) { g_poison.store(on); }
bool poison_outputs() { return g_poison.load(); }

}  // namespace automoe::ops

namespace automoe::ops::detail {

void check_float(const char* op, const char* name, const at::Tensor& t) {
  AUTOMOE_CHECK(t.defined(), op, ": ", name, " is undefined");
  const auto d = t.scalar_type();
  AUTOMOE_CHECK(d == at::kFloat || d == at::kBFloat16 || (d == at::kDouble && t.is_cpu()), op,
                ": ", name, " must be float32 or bfloat16 (float64 on CPU), got ", d);
}

void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  AUTOMOE_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ",
                t.sizes());
}

void check_same_device(const char* op,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> ts) {
  const auto& [first_name, first] = *ts.begin();
  for (const auto& [name, t] : ts) {
    AUTOMOE_CHECK(t->device() == first->device(), op, ": ", name, " is on ", t->device(), " but ",
                  first_name, " is on ", first->device());
  }
}

void check_same_dtype(const char* op, const char* a, const at::Tensor& ta, const char* b,
                      const at::Tensor& tb) {
  AUTOMOE_CHECK(ta.scalar_type() == tb.scalar_type(), op, ": ", a, " is ", ta.scalar_type(),
                " but ", b, " is ", tb.scalar_type(), "; they must match");
}

void no_kernel(const char* op, const at::Tensor& t) {
#if defined(AUTOMOE_WITH_CUDA)
  fail(op, ": no kernel for device ", t.device(), " (CPU and CUDA are supported)");
#else
  fail(op, ": no kernel for device ", t.device(),
       t.is_cuda() ? " (this build of automoe has no CUDA kernels: nvcc was missing or did not "
                     "match torch's CUDA version at build time)"
                   : " (CPU is supported)");
#endif
}

void no_double_backward(const char* op) {
  AUTOMOE_CHECK(!c10::GradMode::is_enabled(), "automoe.", op,
                ": no double backward — the fused op's gradients are computed outside autograd, "
                "so a backward with create_graph=True (second-order gradients) would miss them. "
                "Use the reference backends for it (backend: experts eager, rms_norm / rope / "
                "swiglu / linear / loss torch)");
}

}  // namespace automoe::ops::detail
