#include "automoe/train/step.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <chrono>
#include <cmath>
#include <utility>

#include "automoe/core/error.h"
#include "automoe/model/components.h"

namespace automoe::train {

void seed_step(uint64_t seed, int64_t rank, int64_t step) {
  // splitmix64's finaliser over the three: nearby (seed, rank, step) give unrelated seeds.
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(rank) + 1) +
               0xD1B54A32D192ED03ull * (static_cast<uint64_t>(step) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  at::manual_seed(z ^ (z >> 31));
}

TrainState make_train_state(Decoder& decoder, c10::ScalarType compute, const c10::Device& dev,
                            std::vector<LoraSite> lora_sites, bool zero,
                            const OptimizerSection& precision) {
  TrainState s;
  s.lora = !lora_sites.empty();
  const AdamW::Masters kind = AdamW::parse_masters(precision.master_weights);
  const c10::ScalarType moments = AdamW::parse_state_dtype(precision.state_dtype);
  const bool lean = kind != AdamW::Masters::kFloat32 || moments != at::kFloat;
  AUTOMOE_CHECK(!lean || (compute == at::kBFloat16 && !s.lora && !zero),
                "optimizer.master_weights: ", precision.master_weights, ", state_dtype: ",
                precision.state_dtype, ": only for bf16 weights trained in full without ZeRO "
                "(model.dtype bfloat16, no peft, parallel.zero: 0 when training on several "
                "processes); here model.dtype is ", c10::toString(compute),
                s.lora ? ", with LoRA" : "", zero ? ", with ZeRO" : "");
  // Without float32 masters the bf16 weights are the masters (with their remainders): each is
  // made from the loaded tensor in turn, so the float32 copies never all exist.
  const bool bf16_masters = kind != AdamW::Masters::kFloat32;
  NamedTensors masters;
  std::vector<at::Tensor> remainders;
  const auto& trainable = decoder.trainable();
  NamedTensors params = decoder.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [n, t] = params[i];
    if (const ops::QuantizedWeight* q = decoder.quantized(static_cast<int64_t>(i))) {
      AUTOMOE_CHECK(s.lora, n, ": held quantised (model.quantize, or a bitsandbytes-quantised "
                    "checkpoint), so frozen: it trains only under LoRA (a peft: section)");
      decoder.set_quantized(n, q->to(dev, compute));  // dequantises to the compute dtype
      continue;
    }
    if (s.lora && trainable[i]) {  // frozen, as loaded (no copy when already the compute dtype)
      decoder.set_parameter(n, t.to(dev, compute));
      continue;
    }
    if (trainable[i] && bf16_masters) {
      if (kind == AdamW::Masters::kRemainders) {
        at::Tensor hi, lo;
        AdamW::split_master(t.to(dev, at::kFloat), hi, lo);
        masters.emplace_back(n, hi.view(t.sizes()));
        remainders.push_back(lo.view(t.sizes()));
      } else {
        masters.emplace_back(n, t.to(dev, at::kBFloat16, /*non_blocking=*/false, /*copy=*/true));
      }
      // The loaded tensor goes now (the decoder and `params` held it).
      decoder.set_parameter(n, masters.back().second);
      params[i].second = at::Tensor();
      continue;
    }
    at::Tensor f32 = t.to(dev, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    if (trainable[i]) {
      masters.emplace_back(n, std::move(f32));
    } else {
      decoder.set_parameter(n, f32);
      s.buffers.emplace_back(n, std::move(f32));
    }
  }
  std::vector<bool> routed;
  const std::vector<ParamDecl> layout = parameter_layout(decoder.spec());
  for (size_t i = 0; i < params.size(); ++i) {
    if (trainable[i] && !s.lora) routed.push_back(layout[i].routed_expert);
  }
  for (const auto& site : lora_sites) {
    masters.emplace_back(site.a_name(), site.a);
    masters.emplace_back(site.b_name(), site.b);
    routed.insert(routed.end(), {site.experts, site.experts});  // (rows of the routed experts)
  }
  if (s.lora) decoder.set_adapters(std::move(lora_sites));
  // LoRA's adapters compute in float32 (their masters themselves), as PEFT's float32 adapters on
  // a bf16 base do; ZeRO makes the moments and accumulators slice-sized later.
  const bool sharded = zero && !s.lora;
  s.mixed = compute != at::kFloat && !s.lora;
  s.own_grads = s.mixed && !sharded;
  s.opt.init(masters, routed, s.own_grads, /*full_state=*/!sharded, kind, moments,
             std::move(remainders));
  for (size_t i = 0; i < s.opt.names.size(); ++i) {
    // (bf16 masters: the weight the forward reads is the master itself)
    at::Tensor p = s.mixed && !bf16_masters ? s.opt.master[i].to(compute) : s.opt.master[i];
    p.set_requires_grad(true);
    decoder.set_parameter(s.opt.names[i], p);
    s.model_params.push_back(p);
  }
  return s;
}

void begin_step(TrainState& s, const OptimizerSection& o, double lr) {
  if (!o.in_backward) return;
  if (!s.opt.in_backward()) {
    AUTOMOE_CHECK(!s.lora, "optimizer.in_backward: not with LoRA (peft)");
    AUTOMOE_CHECK(!s.opt.sharded(), "optimizer.in_backward: not with ZeRO (parallel.zero)");
    s.opt.update_in_backward(s.model_params);
  }
  s.opt.arm(o, lr);
}

ForwardResult train_micro_batch(TrainState& s, Decoder& decoder, const ForwardArgs& a, bool last,
                                const std::function<void()>& device_sync, double* wait_s) {
  ForwardResult r = decoder.forward(a);
  backward_micro_batch(s, *r.loss, last, device_sync, wait_s);
  return r;
}

void backward_micro_batch(TrainState& s, const at::Tensor& loss, bool last,
                          const std::function<void()>& device_sync, double* wait_s) {
  // (in_backward: a non-finite loss can come with finite gradients; its step updates nothing)
  if (s.opt.in_backward() && !std::isfinite(loss.item<double>())) s.opt.stop_updates();
  if (s.opt.sharded()) s.opt.begin_backward(last);
  loss.backward();
  if (s.opt.sharded()) {
    const auto t0 = std::chrono::steady_clock::now();
    s.opt.end_backward();
    if (s.opt.stage() == 2) {  // ZeRO-2 waits for its reductions here
      if (device_sync) device_sync();
      if (wait_s) {
        *wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
  }
  if (s.own_grads || s.opt.sharded()) {  // taken from autograd at once
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < s.model_params.size(); ++i) {
      at::Tensor& g = s.model_params[i].mutable_grad();
      if (!g.defined()) continue;
      if (s.own_grads) {
        s.opt.accumulate(i, std::move(g));
      } else {
        s.opt.grad[i].add_(g);
      }
      g = at::Tensor();
    }
  }
}

void adopt_gradients(TrainState& s) {
  RECORD_FUNCTION("automoe::optimizer: adopt gradients", c10::ArrayRef<const c10::IValue>{});
  if (s.own_grads || s.opt.sharded() || s.opt.in_backward()) return;
  for (size_t i = 0; i < s.model_params.size(); ++i) {
    at::Tensor& g = s.model_params[i].mutable_grad();
    if (!g.defined()) g = at::zeros_like(s.model_params[i]);
    s.opt.grad[i] = g;
  }
}

void clip_gradients(TrainState& s, double norm, double max_norm) {
  RECORD_FUNCTION("automoe::optimizer: clip", c10::ArrayRef<const c10::IValue>{});
  AUTOMOE_CHECK(!(s.opt.in_backward() && max_norm > 0),
                "optimizer.in_backward: the weights were updated in the backward, they cannot be "
                "clipped now (optimizer.max_grad_norm must be 0)");
  if (max_norm > 0 && norm > max_norm) s.opt.scale_grads(max_norm / (norm + 1e-6));
}

void update_weights(TrainState& s, const OptimizerSection& o, double lr) {
  RECORD_FUNCTION("automoe::optimizer: AdamW", c10::ArrayRef<const c10::IValue>{});
  if (s.opt.in_backward()) {
    s.opt.finish_in_backward(s.model_params);
    return;
  }
  s.opt.update(o, lr);
  s.opt.publish(s.model_params);
}

void release_gradients(TrainState& s) {
  s.opt.disarm();  // (in_backward)
  if (s.own_grads || s.opt.sharded()) {
    s.opt.zero_grads();
  } else {
    for (auto& p : s.model_params) p.mutable_grad() = at::Tensor();
    for (auto& g : s.opt.grad) g = at::Tensor();
  }
}

}  // namespace automoe::train
