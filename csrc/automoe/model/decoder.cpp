#include "automoe/model/decoder.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <tuple>

#include "automoe/core/autocast.h"
#include "automoe/core/error.h"
#include "automoe/moe/aux_loss.h"
#include "automoe/moe/experts.h"
#include "automoe/moe/router.h"
#include "automoe/ops/cross_entropy/cross_entropy.h"
#include "automoe/ops/ops.h"
#include "automoe/ops/rmsnorm/rmsnorm.h"
#include "automoe/ops/rope/rope.h"

namespace automoe {

std::vector<ParamDecl> parameter_layout(const ModelSpec& s) {
  const int64_t H = s.hidden_size, D = s.head_dim, N = s.num_heads, KV = s.num_kv_heads;
  std::vector<ParamDecl> out;
  out.push_back({"model.embed_tokens.weight", {s.vocab_size, H}});
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const std::string att = pre + "self_attn.";
    out.push_back({att + "q_proj.weight", {N * D, H}});
    if (s.attention_bias) out.push_back({att + "q_proj.bias", {N * D}});
    out.push_back({att + "k_proj.weight", {KV * D, H}});
    if (s.attention_bias) out.push_back({att + "k_proj.bias", {KV * D}});
    out.push_back({att + "v_proj.weight", {KV * D, H}});
    if (s.attention_bias) out.push_back({att + "v_proj.bias", {KV * D}});
    out.push_back({att + "o_proj.weight", {H, N * D}});
    if (s.attention_bias) out.push_back({att + "o_proj.bias", {H}});
    if (s.qk_norm) {
      out.push_back({att + "q_norm.weight", {D}});
      out.push_back({att + "k_norm.weight", {D}});
    }
    if (s.layer_is_moe[l]) {
      const int64_t E = s.moe.num_experts, I = s.moe.intermediate_size;
      out.push_back({pre + "mlp.experts.gate_up_proj", {E, 2 * I, H}});
      out.push_back({pre + "mlp.experts.down_proj", {E, H, I}});
      out.push_back({pre + "mlp.gate.weight", {E, H}});
    } else {
      const int64_t I = s.intermediate_size;
      out.push_back({pre + "mlp.gate_proj.weight", {I, H}});
      out.push_back({pre + "mlp.up_proj.weight", {I, H}});
      out.push_back({pre + "mlp.down_proj.weight", {H, I}});
    }
    out.push_back({pre + "input_layernorm.weight", {H}});
    out.push_back({pre + "post_attention_layernorm.weight", {H}});
  }
  out.push_back({"model.norm.weight", {H}});
  if (!s.tie_word_embeddings) out.push_back({"lm_head.weight", {s.vocab_size, H}});
  return out;
}

Decoder::Decoder(ModelSpec spec, BackendConfig backend, NamedTensors params)
    : spec_(std::move(spec)), backend_(backend), params_(std::move(params)) {
  const auto layout = parameter_layout(spec_);
  AUTOMOE_CHECK(layout.size() == params_.size(), "decoder: expected ", layout.size(),
                " parameters for this config, got ", params_.size());
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < layout.size(); ++i) {
    AUTOMOE_CHECK(params_[i].first == layout[i].name, "decoder: parameter ", i, " should be ",
                  layout[i].name, ", got ", params_[i].first);
    AUTOMOE_CHECK(params_[i].second.sizes() == at::IntArrayRef(layout[i].shape), "parameter ",
                  layout[i].name, ": expected shape ", at::IntArrayRef(layout[i].shape), ", found ",
                  params_[i].second.sizes());
    index[layout[i].name] = static_cast<int64_t>(i);
  }
  auto at_name = [&](const std::string& n) { return index.count(n) ? index.at(n) : -1; };
  embed_ = at_name("model.embed_tokens.weight");
  final_norm_ = at_name("model.norm.weight");
  lm_head_ = spec_.tie_word_embeddings ? embed_ : at_name("lm_head.weight");
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const std::string att = pre + "self_attn.";
    LayerIdx L{};
    L.index = l;
    L.input_norm = at_name(pre + "input_layernorm.weight");
    L.post_norm = at_name(pre + "post_attention_layernorm.weight");
    L.q = at_name(att + "q_proj.weight");
    L.k = at_name(att + "k_proj.weight");
    L.v = at_name(att + "v_proj.weight");
    L.o = at_name(att + "o_proj.weight");
    L.q_bias = at_name(att + "q_proj.bias");
    L.k_bias = at_name(att + "k_proj.bias");
    L.v_bias = at_name(att + "v_proj.bias");
    L.o_bias = at_name(att + "o_proj.bias");
    L.q_norm = at_name(att + "q_norm.weight");
    L.k_norm = at_name(att + "k_norm.weight");
    L.moe = spec_.layer_is_moe[l];
    L.router = at_name(pre + "mlp.gate.weight");
    L.gate_up = at_name(pre + "mlp.experts.gate_up_proj");
    L.down = at_name(pre + "mlp.experts.down_proj");
    L.mlp_gate = at_name(pre + "mlp.gate_proj.weight");
    L.mlp_up = at_name(pre + "mlp.up_proj.weight");
    L.mlp_down = at_name(pre + "mlp.down_proj.weight");
    // Every parameter of this layer, by name: what a checkpointed layer asks gradients for.
    for (size_t i = 0; i < layout.size(); ++i) {
      if (layout[i].name.rfind(pre, 0) == 0) L.all_params.push_back(static_cast<int64_t>(i));
    }
    layers_.push_back(L);
  }
  inv_freq_ = ops::rope_inv_freq(spec_.head_dim, spec_.rope.theta,
                                 spec_.rope.type == RopeType::kLinear ? spec_.rope.factor : 1.0);
}

void Decoder::set_parameter(const std::string& name, const at::Tensor& tensor) {
  for (auto& [n, t] : params_) {
    if (n != name) continue;
    AUTOMOE_CHECK(tensor.sizes() == t.sizes(), "set_parameter ", name, ": expected shape ",
                  t.sizes(), ", got ", tensor.sizes());
    t = tensor;
    return;
  }
  fail("set_parameter: no parameter named ", name);
}

void Decoder::rebind(const std::vector<std::optional<at::Tensor>>& tensors) {
  AUTOMOE_CHECK(tensors.size() == params_.size(), "rebind: expected ", params_.size(),
                " entries (one per parameter), got ", tensors.size());
  const auto& embed = tensors[embed_];
  if (embed && embed->dim() == 2 && embed->size(0) != spec_.vocab_size) {
    resize_vocab(*embed, tensors[lm_head_]);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i] || tensors[i]->is_same(params_[i].second)) continue;
    AUTOMOE_CHECK(tensors[i]->sizes() == params_[i].second.sizes(), "parameter ", params_[i].first,
                  ": expected shape ", params_[i].second.sizes(), ", got ", tensors[i]->sizes());
    params_[i].second = *tensors[i];
  }
}

void Decoder::resize_vocab(const at::Tensor& embed, const std::optional<at::Tensor>& lm_head) {
  const int64_t H = spec_.hidden_size;
  AUTOMOE_CHECK(embed.dim() == 2 && embed.size(1) == H && embed.size(0) > 0,
                "resize_vocab: expected the embedding as [vocab, ", H, "], got ", embed.sizes());
  if (spec_.tie_word_embeddings) {
    AUTOMOE_CHECK(!lm_head || lm_head->is_same(embed),
                  "resize_vocab: the LM head is tied to the embedding; got a separate tensor");
  } else {
    AUTOMOE_CHECK(lm_head && lm_head->sizes() == embed.sizes(),
                  "resize_vocab: expected the LM head as [", embed.size(0), ", ", H,
                  "] like the embedding, got ", lm_head ? lm_head->sizes() : at::IntArrayRef{});
    params_[lm_head_].second = *lm_head;
  }
  params_[embed_].second = embed;
  spec_.vocab_size = embed.size(0);
}

at::Tensor Decoder::rms_norm(const at::Tensor& x, int64_t weight) const {
  // Mixed dtypes (a bf16 projection under autocast, a float32 weight) take the reference, which
  // promotes as Transformers' RMSNorm does.
  return backend_.fused_rms_norm && x.scalar_type() == p(weight).scalar_type()
             ? ops::rmsnorm(x, p(weight), spec_.rms_norm_eps)
             : ops::rms_norm_reference(x, p(weight), spec_.rms_norm_eps);
}

namespace {

std::optional<at::Tensor> opt_param(const NamedTensors& params, int64_t i) {
  if (i < 0) return std::nullopt;
  return params[i].second;
}

// [B, N_kv, S, D] -> [B, N_kv * groups, S, D], each kv head repeated for its query group.
at::Tensor repeat_kv(const at::Tensor& x, int64_t groups) {
  if (groups == 1) return x;
  const auto B = x.size(0), Nkv = x.size(1), S = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, Nkv, groups, S, D}).reshape({B, Nkv * groups, S, D});
}

void check_inputs(const ForwardArgs& a, const ModelSpec& s) {
  AUTOMOE_CHECK(a.input_ids.defined() != a.inputs_embeds.has_value(),
                "forward: pass exactly one of input_ids and inputs_embeds");
  int64_t B = 0, S = 0;
  if (a.inputs_embeds) {
    const at::Tensor& e = *a.inputs_embeds;
    AUTOMOE_CHECK(e.dim() == 3 && e.size(2) == s.hidden_size && e.size(0) > 0 && e.size(1) > 0,
                  "inputs_embeds: expected a [batch, seq, ", s.hidden_size, "] tensor, got ",
                  e.sizes());
    AUTOMOE_CHECK(at::isFloatingType(e.scalar_type()),
                  "inputs_embeds: expected floating-point values, got dtype ", e.scalar_type());
    B = e.size(0);
    S = e.size(1);
  } else {
    const at::Tensor& ids = a.input_ids;
    AUTOMOE_CHECK(ids.dim() == 2, "input_ids: expected a [batch, seq] tensor, got ", ids.sizes());
    AUTOMOE_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                  "input_ids: expected integer token ids, got dtype ", ids.scalar_type());
    AUTOMOE_CHECK(ids.size(0) > 0 && ids.size(1) > 0, "input_ids: empty batch ", ids.sizes());
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    AUTOMOE_CHECK(lo >= 0 && hi < s.vocab_size, "input_ids: token ids must be in [0, ",
                  s.vocab_size, "), found values in [", lo, ", ", hi, "]");
    B = ids.size(0);
    S = ids.size(1);
  }
  const int64_t past = a.cache ? a.cache->length() : 0;
  if (a.cache) {
    AUTOMOE_CHECK(a.cache->num_layers() == s.num_layers, "past_key_values: a cache for ",
                  a.cache->num_layers(), " layers; this model has ", s.num_layers);
    AUTOMOE_CHECK(past == 0 || a.cache->batch_size() == B, "past_key_values: holds a batch of ",
                  a.cache->batch_size(), " rows; the inputs have ", B);
    AUTOMOE_CHECK(!a.document_ids, "document_ids cannot be combined with a KV cache");
  }
  if (a.attention_mask) {
    const auto& m = *a.attention_mask;
    AUTOMOE_CHECK(m.dim() == 2 && m.size(0) == B && m.size(1) == past + S,
                  "attention_mask: expected shape [", B, ", ", past + S, "] (",
                  past ? "cached + new positions" : "like input_ids", "), got ", m.sizes());
  }
  if (a.document_ids) {
    AUTOMOE_CHECK(!a.attention_mask, "document_ids and attention_mask: pass one or the other");
    AUTOMOE_CHECK(
        a.document_ids->dim() == 2 && a.document_ids->size(0) == B && a.document_ids->size(1) == S,
        "document_ids: expected shape [", B, ", ", S, "], got ", a.document_ids->sizes());
    AUTOMOE_CHECK(!at::isFloatingType(a.document_ids->scalar_type()),
                  "document_ids: expected integer ids, got dtype ", a.document_ids->scalar_type());
  }
  if (a.position_ids) {
    const auto& pos = *a.position_ids;
    AUTOMOE_CHECK(pos.dim() == 2 && (pos.size(0) == B || pos.size(0) == 1) && pos.size(1) == S,
                  "position_ids: expected shape [", B, " or 1, ", S, "], got ", pos.sizes());
    AUTOMOE_CHECK(!at::isFloatingType(pos.scalar_type()), "position_ids: expected integers, got ",
                  pos.scalar_type());
  }
  if (a.labels) {
    const auto& lab = *a.labels;
    AUTOMOE_CHECK(lab.dim() == 2 && lab.size(0) == B && lab.size(1) == S,
                  "labels: expected shape [", B, ", ", S, "] like input_ids, got ", lab.sizes());
    const at::Tensor bad = lab.ne(-100).logical_and(lab.lt(0).logical_or(lab.ge(s.vocab_size)));
    AUTOMOE_CHECK(!bad.any().item<bool>(), "labels: expected token ids in [0, ", s.vocab_size,
                  ") or -100, found ", lab.masked_select(bad).slice(0, 0, 5));
    AUTOMOE_CHECK(a.lm_head, "labels: the backbone alone (no LM head) computes no loss");
    AUTOMOE_CHECK(a.logits_to_keep == 0 && !a.logits_indices,
                  "labels: the loss needs the logits of every position; logits_to_keep must be 0");
  }
  AUTOMOE_CHECK(a.logits_to_keep >= 0, "logits_to_keep: expected >= 0, got ", a.logits_to_keep);
  if (a.logits_indices) {
    AUTOMOE_CHECK(
        a.logits_indices->dim() == 1 && !at::isFloatingType(a.logits_indices->scalar_type()),
        "logits_to_keep: expected an int or a 1-D tensor of positions, got ",
        a.logits_indices->sizes(), " ", a.logits_indices->scalar_type());
  }
  AUTOMOE_CHECK(!(a.cache && a.activation_checkpointing && at::GradMode::is_enabled()),
                "activation checkpointing cannot be combined with a KV cache (use_cache=False, as "
                "Transformers sets when gradient checkpointing is on)");
}

// The lowest finite value of `dtype`: what Transformers' eager mask puts where a query may not
// look.
double lowest_value(c10::ScalarType dtype) {
  return dtype == at::kBFloat16 ? -3.3895313892515355e38
         : dtype == at::kHalf   ? -65504.0
         : dtype == at::kDouble ? std::numeric_limits<double>::lowest()
                                : std::numeric_limits<float>::lowest();
}

struct AttentionMask {
  std::optional<at::Tensor> mask;  // sdpa: bool; eager: additive in the model dtype
  bool is_causal = false;          // sdpa without a mask: whether SDPA applies its causal mask
};

// Transformers' masks (masking_utils.create_causal_mask) for S queries after `past` cached keys:
// the query at cache index past + i may see key j <= past + i, within the sliding window, of its
// own document or packed sequence, and not padding. sdpa takes it as a bool [B, 1, S, past + S]
// mask, or none at all where Transformers skips it (no padding and a plain causal pattern with
// S == 1 or no cache; SDPA's is_causal then); eager always as an additive mask (0 / the lowest
// value, so that a query that sees no key attends uniformly, as in Transformers).
AttentionMask build_mask(const ForwardArgs& a, const at::Tensor& pos_BS, int64_t B, int64_t S,
                         int64_t past, int64_t sliding_window, c10::ScalarType dtype, bool eager,
                         c10::Device dev) {
  const int64_t KV = past + S;
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(dev);
  const at::Tensor q_idx = (at::arange(S, long_opts) + past).view({S, 1});
  const at::Tensor k_idx = at::arange(KV, long_opts).view({1, KV});
  at::Tensor allowed = k_idx.le(q_idx);  // [S, KV]
  bool plain = true;                     // nothing but the causal pattern
  if (sliding_window > 0) {
    allowed = allowed.logical_and((q_idx - k_idx).lt(sliding_window));
    if (KV >= sliding_window) plain = false;  // Transformers keeps the mask once the window bites
  }
  allowed = allowed.view({1, 1, S, KV});
  if (a.document_ids) {
    const at::Tensor doc_BS = a.document_ids->to(at::kLong);
    allowed = allowed.logical_and(doc_BS.view({-1, 1, S, 1}).eq(doc_BS.view({-1, 1, 1, S})));
    plain = false;
  } else if (a.attention_mask) {
    const at::Tensor keep_B11K = a.attention_mask->ne(0).view({-1, 1, 1, KV});
    if (!keep_B11K.all().item<bool>()) plain = false;
    allowed = allowed.logical_and(keep_B11K);
  } else if (a.position_ids && a.split_packed_documents && !a.cache) {
    // Packed sequences: a position that does not follow its predecessor by one starts a document;
    // tokens attend only within their document.
    const at::Tensor first = pos_BS.narrow(1, 0, 1) - 1;
    const at::Tensor seg_BS = at::diff(pos_BS, 1, -1, first).ne(1).cumsum(-1);
    if (seg_BS.narrow(1, S - 1, 1).ne(0).any().item<bool>()) {
      allowed = allowed.logical_and(seg_BS.view({-1, 1, S, 1}).eq(seg_BS.view({-1, 1, 1, S})));
      plain = false;
    }
  }
  AttentionMask out;
  if (!eager) {
    if (plain && (S == 1 || KV == S)) {
      out.is_causal = S > 1;
      return out;
    }
    out.mask = allowed.expand({B, 1, S, KV});
    return out;
  }
  out.mask = at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(dev))
                 .masked_fill(allowed.logical_not(), lowest_value(dtype))
                 .expand({B, 1, S, KV});
  return out;
}

}  // namespace

at::Tensor Decoder::attention(const LayerIdx& L, const at::Tensor& x_BSH,
                              const LayerContext& c) const {
  const int64_t B = x_BSH.size(0), S = x_BSH.size(1), D = spec_.head_dim;
  const int64_t N = spec_.num_heads, KV = spec_.num_kv_heads;
  auto project = [&](int64_t w, int64_t b, int64_t heads) {
    return at::linear(x_BSH, p(w), opt_param(params_, b)).view({B, S, heads, D});
  };
  at::Tensor q_BSND = project(L.q, L.q_bias, N);
  at::Tensor k_BSND = project(L.k, L.k_bias, KV);
  at::Tensor v_BNSD = project(L.v, L.v_bias, KV).transpose(1, 2);
  if (spec_.qk_norm) {
    q_BSND = rms_norm(q_BSND, L.q_norm);
    k_BSND = rms_norm(k_BSND, L.k_norm);
  }
  at::Tensor q_BNSD, k_BNSD;
  if (backend_.fused_rope && q_BSND.scalar_type() == c.cos_BSD.scalar_type() &&
      k_BSND.scalar_type() == c.cos_BSD.scalar_type()) {
    // The fused op reads the half-angle tables (both halves of cos_BSD are equal) and rotates
    // q and k in their projection layout [B, S, N, D].
    const int64_t half = D / 2;
    const at::Tensor cos_BSh = c.cos_BSD.narrow(-1, 0, half);
    const at::Tensor sin_BSh = c.sin_BSD.narrow(-1, 0, half);
    q_BNSD = ops::rope(q_BSND, cos_BSh, sin_BSh, /*interleaved=*/false).transpose(1, 2);
    k_BNSD = ops::rope(k_BSND, cos_BSh, sin_BSh, /*interleaved=*/false).transpose(1, 2);
  } else {  // (also mixed dtypes under autocast: the reference promotes as Transformers does)
    q_BNSD = ops::apply_rope_reference(q_BSND.transpose(1, 2), c.cos_BSD, c.sin_BSD);
    k_BNSD = ops::apply_rope_reference(k_BSND.transpose(1, 2), c.cos_BSD, c.sin_BSD);
  }
  if (c.cache) std::tie(k_BNSD, v_BNSD) = c.cache->append(L.index, k_BNSD, v_BNSD);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor out_BNSD;
  if (c.eager) {
    const at::Tensor k = repeat_kv(k_BNSD, N / KV), v = repeat_kv(v_BNSD, N / KV);
    at::Tensor scores = at::matmul(q_BNSD, k.transpose(2, 3)) * scale;
    if (c.mask) scores = scores + *c.mask;
    const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q_BNSD.scalar_type());
    out_BNSD = at::matmul(probs, v);
  } else {
    // As Transformers' sdpa_attention_forward: grouped-query attention inside SDPA when there is
    // no mask, key/value heads repeated otherwise.
    const bool gqa_in_sdpa = !c.mask && D <= 256;
    const at::Tensor k = gqa_in_sdpa ? k_BNSD : repeat_kv(k_BNSD, N / KV);
    const at::Tensor v = gqa_in_sdpa ? v_BNSD : repeat_kv(v_BNSD, N / KV);
    out_BNSD = at::scaled_dot_product_attention(q_BNSD, k, v, c.mask, 0.0, c.is_causal, scale,
                                                /*enable_gqa=*/gqa_in_sdpa && N != KV);
  }
  const at::Tensor out_BSH = out_BNSD.transpose(1, 2).reshape({B, S, N * D});
  return at::linear(out_BSH, p(L.o), opt_param(params_, L.o_bias));
}

ForwardResult Decoder::forward(const ForwardArgs& a) const {
  check_inputs(a, spec_);
  // padding_idx: the pad token's embedding row gets no gradient, as nn.Embedding(padding_idx=...).
  at::Tensor h_BSH = a.inputs_embeds
                         ? *a.inputs_embeds
                         : at::embedding(p(embed_), a.input_ids.to(at::kLong), spec_.pad_token_id);
  const int64_t B = h_BSH.size(0), S = h_BSH.size(1);
  const bool want_router = a.output_router_logits.value_or(spec_.moe.output_router_logits);
  const auto dev = h_BSH.device();
  const c10::ScalarType dtype = h_BSH.scalar_type();
  const int64_t past = a.cache ? a.cache->length() : 0;
  const at::Tensor pos_BS =
      a.position_ids
          ? a.position_ids->to(at::kLong).expand({B, S})
          : (at::arange(S, at::TensorOptions().dtype(at::kLong).device(dev)) + past).expand({B, S});
  const bool eager_attn = backend_.attn == AttnBackend::kEager;
  const AttentionMask mask =
      build_mask(a, pos_BS, B, S, past, spec_.sliding_window, dtype, eager_attn, dev);
  const auto [cos_BSD, sin_BSD] = ops::rope_cos_sin(pos_BS, inv_freq_, dtype);

  // Real (non-padding) tokens of this step, flattened: what the aux loss and the expert counts see.
  std::optional<at::Tensor> token_mask_BS;
  if (a.attention_mask) token_mask_BS = a.attention_mask->narrow(1, past, S);
  if (a.document_ids) token_mask_BS = a.document_ids->ge(0);
  std::optional<at::Tensor> token_mask_T;
  if (a.output_expert_counts && token_mask_BS) token_mask_T = token_mask_BS->reshape({-1}).ne(0);

  ForwardResult r;
  const LayerContext ctx{
      cos_BSD, sin_BSD, mask.mask, mask.is_causal, eager_attn, a.cache, autocast_dtype(dev.type())};
  // Activation checkpointing applies only when something needs gradients.
  bool needs_grad = false;
  if (a.activation_checkpointing && at::GradMode::is_enabled()) {
    for (const auto& [n, t] : params_) needs_grad = needs_grad || t.requires_grad();
  }
  // The backward of a checkpointed layer runs on a snapshot of this decoder (parameter handles,
  // spec, backend), not on `this`, which may be gone or re-bound by then.
  const std::shared_ptr<const Decoder> snapshot =
      needs_grad ? std::make_shared<const Decoder>(*this) : nullptr;
  if (a.output_hidden_states) r.hidden_states.push_back(h_BSH);
  for (const LayerIdx& L : layers_) {
    const LayerOutput out =
        needs_grad ? checkpointed_layer(L, h_BSH, ctx, snapshot) : layer(L, h_BSH, ctx, nullptr);
    h_BSH = out.h;
    if (a.output_hidden_states) r.hidden_states.push_back(h_BSH);
    if (!L.moe) continue;
    if (want_router) r.router_logits.push_back(out.router_logits);
    if (a.output_expert_counts) {
      at::Tensor idx = out.idx;
      if (token_mask_T) idx = idx.index({*token_mask_T});
      r.expert_counts.push_back(
          at::bincount(idx.reshape({-1}), {}, spec_.moe.num_experts).to(at::kLong));
    }
  }
  h_BSH = rms_norm(h_BSH, final_norm_);
  r.last_hidden_state = h_BSH;
  if (a.output_hidden_states) r.hidden_states.back() = h_BSH;  // as Transformers: the normed one
  const bool fused_loss = a.labels && backend_.loss == LossBackend::kFusedLinearCE;
  // With the fused loss the [B, S, V] logits are never formed (r.logits stays undefined).
  if (a.lm_head && !fused_loss) {
    at::Tensor kept_BSH = h_BSH;
    if (a.logits_indices) {
      kept_BSH = h_BSH.index_select(1, a.logits_indices->to(dev, at::kLong));
    } else if (a.logits_to_keep > 0) {
      kept_BSH = h_BSH.narrow(1, std::max<int64_t>(S - a.logits_to_keep, 0),
                              std::min(a.logits_to_keep, S));
    }
    r.logits = at::linear(kept_BSH, p(lm_head_));
  }

  if (a.labels) {
    const auto ce = fused_loss ? fused_causal_lm_loss(h_BSH, *a.labels, ctx.autocast)
                               : ops::causal_lm_cross_entropy_reference(r.logits, *a.labels);
    if (a.num_items_in_batch) {
      AUTOMOE_CHECK(*a.num_items_in_batch > 0, "num_items_in_batch: expected > 0, got ",
                    *a.num_items_in_batch);
      r.loss = ce.sum / *a.num_items_in_batch;
    } else {
      r.loss = ce.sum / ce.count.to(at::kFloat);
    }
  }
  if (want_router) {
    r.aux_loss = r.router_logits.empty()
                     ? at::zeros({}, h_BSH.options().dtype(at::kFloat))
                     : moe::load_balancing_loss(r.router_logits, spec_.moe.num_experts,
                                                spec_.moe.top_k, token_mask_BS);
    if (r.loss) {
      const double coef = a.router_aux_loss_coef.value_or(spec_.moe.router_aux_loss_coef);
      r.loss = *r.loss + coef * a.aux_loss_scale * *r.aux_loss;
    }
  }
  return r;
}

at::Tensor Decoder::experts(const at::Tensor& x_in, const moe::Routing& routing,
                            const at::Tensor& w_gate_up_in, const at::Tensor& w_down_in,
                            std::optional<c10::ScalarType> compute_dtype) const {
  if (compute_dtype && *compute_dtype != x_in.scalar_type()) {
    return experts(x_in.to(*compute_dtype), routing, w_gate_up_in.to(*compute_dtype),
                   w_down_in.to(*compute_dtype), std::nullopt)
        .to(x_in.scalar_type());
  }
  const at::Tensor &x_TH = x_in, &w_gate_up = w_gate_up_in, &w_down = w_down_in;
  switch (backend_.experts) {
    case ExpertsBackend::kEager:
      return moe::experts_eager(x_TH, routing.idx_TK, routing.weights_TK, w_gate_up, w_down);
    case ExpertsBackend::kTorchMM:
      return moe::experts_torch_mm(x_TH, routing.idx_TK, routing.weights_TK, w_gate_up, w_down);
    case ExpertsBackend::kGrouped:
      break;
  }
  if (!backend_.fused_swiglu) {  // the fused dispatch and GEMMs around ATen's SwiGLU
    const ops::DispatchPlan plan = ops::dispatch_plan(routing.idx_TK, w_gate_up.size(0));
    const at::Tensor gu = ops::grouped_gemm(ops::permute(x_TH, plan), w_gate_up, plan.offsets);
    return ops::unpermute(ops::grouped_gemm(ops::swiglu_reference(gu), w_down, plan.offsets), plan,
                          routing.weights_TK);
  }
  return moe::experts_grouped(x_TH, routing.idx_TK, routing.weights_TK, w_gate_up, w_down);
}

ops::LossSum Decoder::fused_causal_lm_loss(const at::Tensor& h_BSH, const at::Tensor& labels_BS,
                                           std::optional<c10::ScalarType> compute_dtype) const {
  // Position s predicts labels[s + 1]; the last position of each row predicts nothing.
  const int64_t ignore = -100;
  const at::Tensor shifted_BS = at::constant_pad_nd(labels_BS.to(at::kLong), {0, 1}, ignore)
                                    .narrow(1, 1, labels_BS.size(1))
                                    .to(h_BSH.device());
  // Under autocast the LM head runs in the autocast dtype, as an ATen linear would.
  const at::Tensor x_NH = h_BSH.reshape({-1, h_BSH.size(-1)});
  const auto r =
      compute_dtype
          ? ops::linear_cross_entropy(x_NH.to(*compute_dtype), p(lm_head_).to(*compute_dtype),
                                      shifted_BS.reshape({-1}), ignore)
          : ops::linear_cross_entropy(x_NH, p(lm_head_), shifted_BS.reshape({-1}), ignore);
  return {r.sum, r.count};
}

Decoder::LayerOutput Decoder::layer(const LayerIdx& L, const at::Tensor& h_in,
                                    const LayerContext& c, const at::Tensor* fixed_idx) const {
  const int64_t B = h_in.size(0), S = h_in.size(1), H = spec_.hidden_size;
  LayerOutput out;
  at::Tensor h_BSH = h_in + attention(L, rms_norm(h_in, L.input_norm), c);
  const at::Tensor x_TH = rms_norm(h_BSH, L.post_norm).reshape({B * S, H});
  at::Tensor y_TH;
  if (L.moe) {
    moe::Routing routing;
    if (backend_.fake_balanced_gate) {
      routing = moe::route_round_robin(x_TH, p(L.router), spec_.moe);
    } else if (fixed_idx) {
      routing = moe::route_softmax_given(x_TH, p(L.router), spec_.moe, *fixed_idx,
                                         /*fused=*/backend_.experts != ExpertsBackend::kEager);
    } else {
      routing = moe::route_topk_softmax(x_TH, p(L.router), spec_.moe,
                                        /*fused=*/backend_.experts != ExpertsBackend::kEager);
    }
    y_TH = experts(x_TH, routing, p(L.gate_up), p(L.down), c.autocast);
    out.router_logits = routing.logits_TE;
    out.idx = routing.idx_TK;
  } else {
    if (backend_.fused_swiglu) {
      const at::Tensor gate_up = at::cat({p(L.mlp_gate), p(L.mlp_up)}, 0);
      y_TH = at::linear(ops::swiglu(at::linear(x_TH, gate_up)), p(L.mlp_down));
    } else {
      y_TH = at::linear(at::silu(at::linear(x_TH, p(L.mlp_gate))) * at::linear(x_TH, p(L.mlp_up)),
                        p(L.mlp_down));
    }
  }
  out.h = h_BSH + y_TH.view({B, S, H});
  return out;
}

namespace {

// What a checkpointed layer needs to run again in the backward pass. It owns a snapshot of the
// decoder (spec, backend and parameter handles as they were in the forward), so the backward
// works even after the model object is gone or its parameters were re-bound.
struct LayerRecompute : torch::CustomClassHolder {
  std::function<Decoder::LayerOutput(const at::Tensor&, const at::Tensor*)> run;
  std::vector<at::Tensor> params;  // the layer's parameters (what gradients are asked for)
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
      out = rec->run(h, moe ? &idx : nullptr);
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

Decoder::LayerOutput Decoder::checkpointed_layer(const LayerIdx& L, const at::Tensor& h_in,
                                                 const LayerContext& c,
                                                 const std::shared_ptr<const Decoder>& self) const {
  auto rec = c10::make_intrusive<LayerRecompute>();
  for (int64_t i : L.all_params) rec->params.push_back(p(i));
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
