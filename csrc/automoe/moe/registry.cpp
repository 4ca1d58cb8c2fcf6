// torch.ops.automoe.moe_experts: the routed experts by backend name, for Python callers (the
// drop-in's fallback registers it as Transformers' "automoe" experts implementation). A fragment
// of the automoe library that ops/registry.cpp defines.
#include <torch/library.h>

#include "automoe/core/error.h"
#include "automoe/moe/experts.h"

namespace automoe::moe {
namespace {

at::Tensor experts_op(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weights,
                      const at::Tensor& w_gate_up, const at::Tensor& w_down, std::string backend,
                      const std::optional<at::Tensor>& gate_up_a,
                      const std::optional<at::Tensor>& gate_up_b, double gate_up_scaling,
                      const std::optional<at::Tensor>& down_a,
                      const std::optional<at::Tensor>& down_b, double down_scaling,
                      std::string activation) {
  AUTOMOE_CHECK(activation == "swiglu" || activation == "relu2",
                "automoe.moe_experts: activation must be \"swiglu\" (w_gate_up [E, 2I, H]) or "
                "\"relu2\" (a plain up weight [E, I, H]), got \"", activation, "\"");
  ExpertLora lora;
  AUTOMOE_CHECK(gate_up_a.has_value() == gate_up_b.has_value() &&
                    down_a.has_value() == down_b.has_value(),
                "automoe.moe_experts: pass both LoRA factors of a weight (a and b) or neither");
  if (gate_up_a) lora.gate_up = {*gate_up_a, *gate_up_b, gate_up_scaling};
  if (down_a) lora.down = {*down_a, *down_b, down_scaling};
  const bool any = gate_up_a || down_a;
  return experts_by_name(backend, x, indices, weights, w_gate_up, w_down, any ? &lora : nullptr,
                         activation == "relu2" ? ExpertMlp::kRelu2 : ExpertMlp::kSwiglu);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(automoe, m) {
  m.def("moe_experts(Tensor x, Tensor indices, Tensor weights, Tensor w_gate_up, Tensor w_down, "
        "str backend=\"grouped\", Tensor? gate_up_a=None, Tensor? gate_up_b=None, "
        "float gate_up_scaling=1.0, Tensor? down_a=None, Tensor? down_b=None, "
        "float down_scaling=1.0, str activation=\"swiglu\") -> Tensor",
        TORCH_FN(experts_op));
}

}  // namespace automoe::moe
