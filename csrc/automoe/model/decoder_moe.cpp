// The decoder's MoE block: routing (with Mixtral's jitter, a checkpointed layer's fixed experts,
// the balanced-gate benchmark mode), the routed experts (fused or plain, local or expert-parallel,
// Nemotron-H's latent projections around them) and the shared experts.
#include <ATen/ATen.h>

#include "automoe/core/error.h"
#include "automoe/model/decoder.h"
#include "automoe/moe/experts.h"
#include "automoe/moe/router.h"

namespace automoe {

at::Tensor Decoder::moe_block(const MoESlots& M, const at::Tensor& x_in, const LayerContext& c,
                              const at::Tensor* fixed_idx, LayerOutput* out) const {
  at::Tensor x_TH = x_in;
  if (c.training && spec_.moe.router_jitter_noise > 0) {
    // Mixtral's jitter, drawn as Transformers draws it (a checkpointed layer's recompute replays
    // the generator state of its forward, so it draws the same noise).
    const double j = spec_.moe.router_jitter_noise;
    x_TH = x_TH * at::empty_like(x_TH).uniform_(1.0 - j, 1.0 + j);
  }
  const std::optional<at::Tensor> bias =
      M.correction_bias >= 0 ? std::optional<at::Tensor>(p(M.correction_bias)) : std::nullopt;
  moe::Routing routing;
  const at::Tensor w_router = router_weight(M);
  const std::optional<at::Tensor> router_bias =
      M.router_bias >= 0 ? std::optional<at::Tensor>(p(M.router_bias)) : std::nullopt;
  if (backend_.fake_balanced_gate) {
    routing = moe::route_round_robin(x_TH, w_router, spec_.moe.top_k);
  } else if (fixed_idx) {
    routing = moe::route_given(x_TH, w_router, bias, router_, *fixed_idx, ops_.router,
                               ops_.router_fused, router_bias);
  } else {
    routing = moe::route(x_TH, w_router, bias, router_, ops_.router, router_bias);
  }
  at::Tensor y_TH;
  if (spec_.moe.gpt_oss) {
    y_TH = ops_.gpt_oss_experts(x_TH, routing.idx_TK, routing.weights_TK, p(M.gate_up),
                                p(M.gate_up_bias), p(M.down), p(M.down_bias), c.autocast);
  } else if (M.latent_in >= 0) {  // Nemotron-H's latent MoE: experts between fc1 and fc2
    const at::Tensor latent = linear(x_TH, M.latent_in, M.latent_in_bias, c.training);
    y_TH = linear(experts(latent, routing, M, c.autocast), M.latent_out, M.latent_out_bias, c.training);
  } else {
    y_TH = experts(x_TH, routing, M, c.autocast);
  }
  if (spec_.moe.shared_intermediate_size > 0) {
    at::Tensor shared = mlp(x_TH, M.shared, c.training);
    if (M.shared_gate >= 0) shared = at::sigmoid(linear(x_TH, M.shared_gate, -1, c.training)) * shared;
    y_TH = y_TH + shared;
  }
  out->router_logits = routing.logits_TE;
  out->idx = routing.idx_TK;
  return y_TH;
}

at::Tensor Decoder::experts(const at::Tensor& x_TH, const moe::Routing& routing, const MoESlots& M,
                            std::optional<c10::ScalarType> compute_dtype) const {
  const at::Tensor& w_gate_up = p(M.gate_up);
  const at::Tensor& w_down = p(M.down);
  moe::ExpertLora lora_factors;
  const LoraSite* gu_site = adapter(M.gate_up);
  const LoraSite* d_site = adapter(M.down);
  if (gu_site) lora_factors.gate_up = {gu_site->a, gu_site->b, gu_site->scaling};
  if (d_site) lora_factors.down = {d_site->a, d_site->b, d_site->scaling};
  const moe::ExpertLora* lora = gu_site || d_site ? &lora_factors : nullptr;
  const moe::ExpertMlp kind = spec_.moe.gated ? moe::ExpertMlp::kSwiglu : moe::ExpertMlp::kRelu2;
  if (quantized(M.gate_up) || quantized(M.down)) {  // a quantised LoRA base
    const moe::QuantizedExperts q{quantized(M.gate_up), quantized(M.down)};
    const c10::ScalarType mm = compute_dtype.value_or(x_TH.scalar_type());
    const std::string backend = backend_.to_map().at("experts");
    const bool fused_swiglu = backend_.fused_swiglu;
    if (!spec_.moe.sharded()) {
      return moe::experts_quantized(backend, x_TH.to(mm), routing.idx_TK, routing.weights_TK, q,
                                    fused_swiglu, lora, kind)
          .to(x_TH.scalar_type());
    }
    AUTOMOE_CHECK(dispatcher_, "this model holds experts [", spec_.moe.expert_begin, ", ",
                  spec_.moe.expert_begin + spec_.moe.expert_count, ") of ", spec_.moe.num_experts,
                  " and needs an expert-parallel dispatcher to run");
    auto local = [&](const at::Tensor& x_NH, const at::Tensor& offsets_L1) {
      return moe::experts_on_rows_quantized(backend, x_NH, offsets_L1, q, fused_swiglu, lora, kind);
    };
    return dispatcher_
        ->run(x_TH.to(mm), routing.idx_TK, routing.weights_TK, local,
              backend_.experts == ExpertsBackend::kGrouped)
        .to(x_TH.scalar_type());
  }
  if (spec_.moe.sharded()) {
    AUTOMOE_CHECK(dispatcher_, "this model holds experts [", spec_.moe.expert_begin, ", ",
                  spec_.moe.expert_begin + spec_.moe.expert_count, ") of ", spec_.moe.num_experts,
                  " and needs an expert-parallel dispatcher to run");
    const c10::ScalarType mm = compute_dtype.value_or(x_TH.scalar_type());
    const at::Tensor gu = w_gate_up.to(mm), dn = w_down.to(mm);
    const std::string backend = backend_.to_map().at("experts");
    const bool fused_swiglu = backend_.fused_swiglu;
    auto local = [&](const at::Tensor& x_NH, const at::Tensor& offsets_L1) {
      return moe::experts_on_rows(backend, x_NH, offsets_L1, gu, dn, fused_swiglu, lora, kind);
    };
    return dispatcher_
        ->run(x_TH.to(mm), routing.idx_TK, routing.weights_TK, local,
              backend_.experts == ExpertsBackend::kGrouped)
        .to(x_TH.scalar_type());
  }
  if (compute_dtype && *compute_dtype != x_TH.scalar_type()) {
    return ops_
        .experts(x_TH.to(*compute_dtype), routing.idx_TK, routing.weights_TK,
                 w_gate_up.to(*compute_dtype), w_down.to(*compute_dtype), lora, kind)
        .to(x_TH.scalar_type());
  }
  return ops_.experts(x_TH, routing.idx_TK, routing.weights_TK, w_gate_up, w_down, lora, kind);
}

}  // namespace automoe
