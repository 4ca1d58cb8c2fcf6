// torch.ops.automoe.moe_experts: the routed experts by backend name, for Python callers (the
// drop-in's fallback registers it as Transformers' "automoe" experts implementation). A fragment
// of the automoe library that ops/registry.cpp defines.
#include <torch/library.h>

#include "automoe/moe/experts.h"

namespace automoe::moe {
namespace {

at::Tensor experts_op(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weights,
                      const at::Tensor& w_gate_up, const at::Tensor& w_down, std::string backend) {
  return experts_by_name(backend, x, indices, weights, w_gate_up, w_down);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(automoe, m) {
  m.def("moe_experts(Tensor x, Tensor indices, Tensor weights, Tensor w_gate_up, Tensor w_down, "
        "str backend=\"grouped\") -> Tensor",
        TORCH_FN(experts_op));
}

}  // namespace automoe::moe
