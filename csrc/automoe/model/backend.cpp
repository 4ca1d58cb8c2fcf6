#include "automoe/model/backend.h"

#include <ATen/ATen.h>

#include <vector>

#include "automoe/core/error.h"
#include "automoe/moe/experts.h"
#include "automoe/ops/mamba/mamba.h"
#include "automoe/ops/ops.h"
#include "automoe/ops/rmsnorm/rmsnorm.h"

namespace automoe {
namespace {

// field -> the values this build implements (the first is the default).
const std::map<std::string, std::vector<std::string>>& implemented() {
  static const std::map<std::string, std::vector<std::string>> fields = {
      {"attn", {"sdpa", "eager"}},      {"experts", {"grouped", "torch_mm", "eager"}},
      {"rms_norm", {"fused", "torch"}}, {"rope", {"fused", "torch"}},
      {"swiglu", {"fused", "torch"}},   {"loss", {"torch", "fused_linear_ce"}},
      {"mamba", {"fused", "torch"}},
      {"linear", {"auto", "torch"}},
      {"dispatcher", {"auto", "local", "allgather", "alltoall", "alltoall_overlap"}},        {"fake_balanced_gate", {"false", "true"}},
  };
  return fields;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

BackendConfig BackendConfig::from_map(const std::map<std::string, std::string>& fields,
                                      const std::string& origin) {
  BackendConfig cfg;
  for (const auto& [key, value] : fields) {
    auto it = implemented().find(key);
    if (it == implemented().end()) {
      std::vector<std::string> names;
      for (const auto& [k, _] : implemented()) names.push_back(k);
      fail(origin, ": unknown backend field \"", key, "\" (known: ", join(names), ")");
    }
    const auto& values = it->second;
    if (std::find(values.begin(), values.end(), value) == values.end()) {
      fail(origin, ": backend ", key, "=\"", value,
           "\" is not implemented in this build (available: ", join(values), ")");
    }
    if (key == "attn") cfg.attn = value == "eager" ? AttnBackend::kEager : AttnBackend::kSdpa;
    if (key == "fake_balanced_gate") cfg.fake_balanced_gate = value == "true";
    if (key == "experts") {
      cfg.experts = value == "eager"      ? ExpertsBackend::kEager
                    : value == "torch_mm" ? ExpertsBackend::kTorchMM
                                          : ExpertsBackend::kGrouped;
    }
    if (key == "dispatcher") cfg.dispatcher = value;
    if (key == "rms_norm") cfg.fused_rms_norm = value == "fused";
    if (key == "rope") cfg.fused_rope = value == "fused";
    if (key == "swiglu") cfg.fused_swiglu = value == "fused";
    if (key == "mamba") cfg.fused_mamba = value == "fused";
    if (key == "linear") cfg.engine_linear = value == "auto";
    if (key == "loss") {
      cfg.loss = value == "fused_linear_ce" ? LossBackend::kFusedLinearCE : LossBackend::kTorch;
    }
  }
  return cfg;
}

std::map<std::string, std::string> BackendConfig::to_map() const {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : implemented()) out[k] = v.front();
  out["attn"] = attn == AttnBackend::kEager ? "eager" : "sdpa";
  out["experts"] = experts == ExpertsBackend::kEager     ? "eager"
                   : experts == ExpertsBackend::kTorchMM ? "torch_mm"
                                                         : "grouped";
  out["rms_norm"] = fused_rms_norm ? "fused" : "torch";
  out["rope"] = fused_rope ? "fused" : "torch";
  out["swiglu"] = fused_swiglu ? "fused" : "torch";
  out["mamba"] = fused_mamba ? "fused" : "torch";
  out["linear"] = engine_linear ? "auto" : "torch";
  out["loss"] = loss == LossBackend::kFusedLinearCE ? "fused_linear_ce" : "torch";
  out["fake_balanced_gate"] = fake_balanced_gate ? "true" : "false";
  out["dispatcher"] = dispatcher;
  return out;
}

namespace {

// [B, N_kv, S, D] -> [B, N_kv * groups, S, D], each kv head repeated for its query group.
at::Tensor repeat_kv(const at::Tensor& x, int64_t groups) {
  if (groups == 1) return x;
  const auto B = x.size(0), Nkv = x.size(1), S = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, Nkv, groups, S, D}).reshape({B, Nkv * groups, S, D});
}

// Transformers' eager_attention_forward: scores in the model dtype, softmax in float32.
at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                           const std::optional<at::Tensor>& mask, bool /*is_causal*/, double scale,
                           const std::optional<at::Tensor>& sinks) {
  const int64_t groups = q.size(1) / k_in.size(1);
  const at::Tensor k = repeat_kv(k_in, groups), v = repeat_kv(v_in, groups);
  at::Tensor scores = ops::matmul(q, k.transpose(2, 3)) * scale;
  if (mask) scores = scores + *mask;
  if (sinks) {
    // GPT-OSS (Transformers' eager_attention_forward there): the sink joins the softmax, which
    // runs in the scores' dtype after subtracting the row max, and is dropped afterwards.
    const int64_t B = q.size(0), N = q.size(1), S = q.size(2);
    const at::Tensor sink = sinks->to(scores.scalar_type()).view({1, N, 1, 1}).expand({B, N, S, 1});
    at::Tensor logits = at::cat({scores, sink}, -1);
    logits = logits - std::get<0>(logits.max(-1, /*keepdim=*/true));
    const at::Tensor probs = at::softmax(logits, -1).narrow(-1, 0, scores.size(-1));
    return ops::matmul(probs.to(v.scalar_type()), v);
  }
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return ops::matmul(probs, v);
}

// Transformers' sdpa_attention_forward: grouped-query attention inside SDPA when there is no mask,
// key/value heads repeated otherwise.
at::Tensor sdpa_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                          const std::optional<at::Tensor>& mask, bool is_causal, double scale,
                          const std::optional<at::Tensor>& sinks) {
  AUTOMOE_CHECK(!sinks, "backend attn=sdpa: attention sinks (GPT-OSS) are not supported by SDPA "
                        "(Transformers has no sdpa for GPT-OSS either); use attn=eager");
  const int64_t groups = q.size(1) / k_in.size(1);
  if (ops::sdpa_bf16_float_backward_applies(q, k_in, v_in, mask)) {
    return ops::sdpa_bf16_float_backward(q, repeat_kv(k_in, groups), repeat_kv(v_in, groups), mask,
                                         is_causal, scale);
  }
  const bool gqa_in_sdpa = !mask && q.size(3) <= 256;
  const at::Tensor k = gqa_in_sdpa ? k_in : repeat_kv(k_in, groups);
  const at::Tensor v = gqa_in_sdpa ? v_in : repeat_kv(v_in, groups);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale,
                                          /*enable_gqa=*/gqa_in_sdpa && groups != 1);
}

}  // namespace

ComponentOps resolve(const BackendConfig& b) {
  ComponentOps o;
  if (b.fused_rms_norm) {
    o.rms_norm = [](const at::Tensor& x, const at::Tensor& w, double eps) {
      return x.scalar_type() == w.scalar_type() ? ops::rmsnorm(x, w, eps)
                                                : ops::rms_norm_reference(x, w, eps);
    };
  } else {
    o.rms_norm = &ops::rms_norm_reference;
  }
  if (b.fused_rope) {
    o.rope = [](const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, bool interleaved) {
      // Mixed dtypes (a bf16 projection under autocast) take the reference, which promotes.
      return x.scalar_type() == c.scalar_type() ? ops::rope(x, c, s, interleaved)
                                                : ops::rope_reference(x, c, s, interleaved);
    };
  } else {
    o.rope = &ops::rope_reference;
  }
  if (b.fused_mamba) {
    // Mixed dtypes (autocast) take the reference, which computes in the weight's dtype.
    o.causal_conv1d = [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& doc, bool silu) {
      const bool one_dtype = x.scalar_type() == w.scalar_type() &&
                             (!bias || bias->scalar_type() == x.scalar_type());
      return one_dtype ? ops::causal_conv1d(x, w, bias, doc, silu)
                       : ops::causal_conv1d_reference(x, w, bias, doc, silu);
    };
  } else {
    o.causal_conv1d = &ops::causal_conv1d_reference;
  }
  o.gated_rms_norm = b.fused_mamba ? &ops::gated_rms_norm : &ops::gated_rms_norm_reference;
  o.delta_rule = b.fused_mamba ? &ops::chunk_gated_delta_rule : &ops::chunk_gated_delta_rule_reference;
  using Linear = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
  const Linear linear = b.engine_linear
                            ? static_cast<Linear>(&ops::linear)
                            : [](const at::Tensor& x, const at::Tensor& w,
                                 const std::optional<at::Tensor>& bias) { return at::linear(x, w, bias); };
  o.linear = linear;
  if (b.fused_swiglu) {
    o.mlp = [linear](const at::Tensor& x, const at::Tensor& g, const at::Tensor& u,
                     const at::Tensor& d) {
      return linear(ops::swiglu(linear(x, at::cat({g, u}, 0), std::nullopt)), d, std::nullopt);
    };
  } else {
    // Transformers' separate gate and up projections, then the SwiGLU reference.
    o.mlp = [linear](const at::Tensor& x, const at::Tensor& g, const at::Tensor& u,
                     const at::Tensor& d) {
      return linear(ops::swiglu_reference(at::cat({linear(x, g, std::nullopt),
                                                   linear(x, u, std::nullopt)}, -1)),
                    d, std::nullopt);
    };
  }
  switch (b.experts) {
    case ExpertsBackend::kEager:
      o.experts = &moe::experts_eager;
      break;
    case ExpertsBackend::kTorchMM:
      o.experts = &moe::experts_torch_mm;
      break;
    case ExpertsBackend::kGrouped:
      o.experts = b.fused_swiglu ? &moe::experts_grouped : &moe::experts_grouped_reference_swiglu;
      break;
  }
  {
    const std::string name = b.experts == ExpertsBackend::kEager     ? "eager"
                             : b.experts == ExpertsBackend::kTorchMM ? "torch_mm"
                                                                     : "grouped";
    const bool fused = b.fused_swiglu;
    o.gpt_oss_experts = [name, fused](const at::Tensor& x, const at::Tensor& idx,
                                      const at::Tensor& w, const at::Tensor& gu,
                                      const at::Tensor& gub, const at::Tensor& d,
                                      const at::Tensor& db, std::optional<c10::ScalarType> dt) {
      return moe::experts_gpt_oss(name, x, idx, w, gu, gub, d, db, fused, dt);
    };
  }
  // The eager experts keep Transformers' semantics end to end, the router's reference included.
  o.router_fused = b.experts != ExpertsBackend::kEager;
  o.router = o.router_fused ? &ops::router : &ops::router_reference;
  o.eager_attention = b.attn == AttnBackend::kEager;
  o.attention = o.eager_attention ? &eager_attention : &sdpa_attention;
  o.fused_loss = b.loss == LossBackend::kFusedLinearCE;
  return o;
}

}  // namespace automoe
