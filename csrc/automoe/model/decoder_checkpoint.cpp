// Activation checkpointing of one decoder layer: keep only its input, recompute it in the backward
// pass with the routing decisions of the forward (Decoder::checkpointed_layer).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <functional>
#include <memory>

#include "automoe/core/autocast.h"
#include "automoe/core/error.h"
#include "automoe/model/decoder.h"

namespace automoe {

namespace {

// What a checkpointed layer needs to run again in the backward pass. It owns a snapshot of the
// decoder (spec, backend and parameter handles as they were in the forward), so the backward
// works even after the model object is gone or its parameters were re-bound.
struct LayerRecompute : torch::CustomClassHolder {
  std::function<Decoder::LayerOutput(const at::Tensor&, const at::Tensor*)> run;
  std::vector<at::Tensor> params;  // the layer's parameters (what gradients are asked for)
  // The device's default generator state before the forward ran the layer (only when the layer
  // draws random numbers): the recompute replays it, as torch.utils.checkpoint's
  // preserve_rng_state does.
  std::optional<at::Tensor> rng_state;
  c10::Device device = c10::kCPU;  // whose default generator rng_state is
};

// Runs a decoder layer without keeping its activations; the backward recomputes it from the saved
// input with the routing decisions of the forward (never re-routed, so the recomputed experts are
// exactly the ones the forward used) and back-propagates through the recomputation.
struct CheckpointedLayerFn : torch::autograd::Function<CheckpointedLayerFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& h, at::TensorList params,
                                                c10::intrusive_ptr<LayerRecompute> rec) {
    Decoder::LayerOutput out;
    {
      at::NoGradGuard no_grad;
      if (rec->rng_state) rec->rng_state = at::globalContext().defaultGenerator(rec->device).get_state();
      out = rec->run(h, nullptr);
    }
    // The parameters are saved only for autograd's version check: modifying one in place between
    // this forward and the backward is an error, as it is without checkpointing.
    std::vector<at::Tensor> saved{h};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(rec);
    ctx->set_materialize_grads(false);
    if (out.idx.defined()) {
      ctx->saved_data["idx"] = out.idx;
      ctx->mark_non_differentiable({out.idx});
      return {out.h, out.router_logits, out.idx};
    }
    return {out.h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    AUTOMOE_CHECK(!c10::GradMode::is_enabled(),
                  "activation checkpointing: no double backward (create_graph=True): the "
                  "recomputed layer's backward does not build a graph; turn activation "
                  "checkpointing off for second-order gradients");
    const auto saved = ctx->get_saved_variables();  // throws if a parameter changed in place
    auto rec = c10::static_intrusive_pointer_cast<LayerRecompute>(
        ctx->saved_data["recompute"].toCapsule());
    torch::autograd::variable_list result(1 + rec->params.size() + 1);  // h, params, closure
    const bool moe = ctx->saved_data.count("idx") > 0;
    std::vector<at::Tensor> grad_outputs;
    const at::Tensor h = saved[0].detach().requires_grad_(true);
    const at::Tensor idx = moe ? ctx->saved_data["idx"].toTensor() : at::Tensor();
    Decoder::LayerOutput out;
    {
      at::AutoGradMode enable(true);
      if (rec->rng_state) {
        // Replay the forward's random draws, then put the generator back where it was.
        at::Generator gen = at::globalContext().defaultGenerator(rec->device);
        const at::Tensor now = gen.get_state();
        gen.set_state(*rec->rng_state);
        out = rec->run(h, moe ? &idx : nullptr);
        gen.set_state(now);
      } else {
        out = rec->run(h, moe ? &idx : nullptr);
      }
    }
    std::vector<at::Tensor> outputs;
    if (grads[0].defined()) {
      outputs.push_back(out.h);
      grad_outputs.push_back(grads[0]);
    }
    if (moe && grads.size() > 1 && grads[1].defined()) {  // the router logits fed the aux loss
      outputs.push_back(out.router_logits);
      grad_outputs.push_back(grads[1]);
    }
    if (outputs.empty()) return result;
    std::vector<at::Tensor> inputs{h};
    std::vector<size_t> wanted;  // positions (in params) of parameters that need gradients
    for (size_t i = 0; i < rec->params.size(); ++i) {
      if (rec->params[i].requires_grad()) {
        inputs.push_back(rec->params[i]);
        wanted.push_back(i);
      }
    }
    const auto g = torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
    result[0] = g[0];
    for (size_t j = 0; j < wanted.size(); ++j) result[1 + wanted[j]] = g[1 + j];
    return result;
  }
};

}  // namespace

Decoder::LayerOutput Decoder::checkpointed_layer(const LayerSlots& L, const at::Tensor& h_in,
                                                 const LayerContext& c,
                                                 const std::shared_ptr<const Decoder>& self) const {
  auto rec = c10::make_intrusive<LayerRecompute>();
  for (int64_t i : L.all) rec->params.push_back(p(i));
  bool adapter_dropout = false;
  if (!layer_adapters_.empty()) {
    for (const at::Tensor& t : layer_adapters_[L.index]) rec->params.push_back(t);
    for (int64_t i : L.all) adapter_dropout = adapter_dropout || (adapter(i) && adapter(i)->dropout > 0);
  }
  if ((L.moe && c.training && spec_.moe.router_jitter_noise > 0) || (c.training && adapter_dropout)) {
    rec->rng_state = at::Tensor();  // captured in the forward
    rec->device = h_in.device();
  }
  rec->run = [self, L, c](const at::Tensor& h, const at::Tensor* idx) {
    // The backward runs outside torch.autocast: recompute under the forward's autocast state.
    const AutocastGuard autocast(h.device().type(), c.autocast);
    return self->layer(L, h, c, idx);
  };
  const std::vector<at::Tensor> params = rec->params;
  const auto outs = CheckpointedLayerFn::apply(h_in, at::TensorList(params), rec);
  LayerOutput out;
  out.h = outs[0];
  if (outs.size() > 1) {
    out.router_logits = outs[1];
    out.idx = outs[2];
  }
  return out;
}

}  // namespace automoe
