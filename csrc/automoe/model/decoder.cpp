#include "automoe/model/decoder.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
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
#include "automoe/model/rope.h"
#include "automoe/ops/ops.h"
#include "automoe/model/deltanet_mixer.h"
#include "automoe/model/mamba_mixer.h"

namespace automoe {

namespace {

std::optional<at::Tensor> opt_param(const NamedTensors& params, int64_t i) {
  if (i < 0) return std::nullopt;
  return params[i].second;
}

}  // namespace

Decoder::Decoder(ModelSpec spec, BackendConfig backend, NamedTensors params)
    : spec_(std::move(spec)), backend_(backend), ops_(resolve(backend)), params_(std::move(params)) {
  std::vector<ParamDecl> layout;
  slots_ = declare_model(spec_, &layout);
  AUTOMOE_CHECK(layout.size() == params_.size(), "decoder: expected ", layout.size(),
                " parameters for this config, got ", params_.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    AUTOMOE_CHECK(params_[i].first == layout[i].name, "decoder: parameter ", i, " should be ",
                  layout[i].name, ", got ", params_[i].first);
    AUTOMOE_CHECK(params_[i].second.sizes() == at::IntArrayRef(layout[i].shape), "parameter ",
                  layout[i].name, ": expected shape ", at::IntArrayRef(layout[i].shape), ", found ",
                  params_[i].second.sizes());
    trainable_.push_back(layout[i].trainable);
  }
  inv_freq_ = rope_inv_freq(spec_.rope);
  scale_ = spec_.attn.softmax_scale > 0 ? spec_.attn.softmax_scale
                                        : 1.0 / std::sqrt(static_cast<double>(spec_.attn.head_dim));
  router_.top_k = spec_.moe.top_k;
  router_.sigmoid = spec_.moe.score == RouterScore::kSigmoid;
  router_.n_group = spec_.moe.n_group;
  router_.topk_group = spec_.moe.topk_group;
  router_.norm_topk_prob = spec_.moe.norm_topk_prob;
  router_.scaling = spec_.moe.routed_scaling_factor;
}

void Decoder::set_dispatcher(std::shared_ptr<moe::Dispatcher> dispatcher) {
  AUTOMOE_CHECK(!dispatcher || !spec_.moe.gpt_oss,
                "expert parallelism: GPT-OSS's experts (biases, transposed storage) do not run "
                "under an expert-parallel dispatcher yet; use ep = 1 (data parallelism)");
  dispatcher_ = std::move(dispatcher);
}

void Decoder::set_backend(BackendConfig backend) {
  backend_ = backend;
  ops_ = resolve(backend);
}

void Decoder::set_quantized(const std::string& name, ops::QuantizedWeight q) {
  const std::vector<ParamDecl> decls = parameter_layout(spec_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].first != name) continue;
    AUTOMOE_CHECK(decls[i].routed_expert && decls[i].shape.size() == 3 && !spec_.moe.gpt_oss,
                  name, ": only the routed experts' gated/up and down weights can be held "
                  "quantised (GPT-OSS's transposed experts excepted)");
    AUTOMOE_CHECK(at::IntArrayRef(decls[i].shape) ==
                      at::IntArrayRef({q.experts, q.out_features, q.in_features}),
                  name, ": quantised weight is [", q.experts, ", ", q.out_features, ", ",
                  q.in_features, "], the model's ", at::IntArrayRef(decls[i].shape));
    if (quantized_.empty()) quantized_.resize(params_.size());
    params_[i].second = at::empty(decls[i].shape,
                                  at::TensorOptions().dtype(q.dtype).device(at::kMeta));
    quantized_[i] = std::move(q);
    return;
  }
  fail("set_quantized: no parameter ", name);
}

at::Tensor Decoder::dense(int64_t slot, std::optional<c10::ScalarType> dtype) const {
  const ops::QuantizedWeight* q = quantized(slot);
  if (!q) return dtype ? p(slot).to(*dtype) : p(slot);
  // One expert at a time into the output (the ATen form's temporaries are per expert).
  const c10::ScalarType dt = dtype.value_or(q->dtype);
  at::Tensor out = at::empty({q->experts, q->out_features, q->in_features},
                             q->codes.options().dtype(dt));
  for (int64_t e = 0; e < q->experts; ++e) out[e].copy_(ops::dequantize(*q, e, 1, dt)[0]);
  return out;
}

void Decoder::set_parameter(const std::string& name, const at::Tensor& tensor) {
  for (auto& [n, t] : params_) {
    if (n != name) continue;
    AUTOMOE_CHECK(tensor.sizes() == t.sizes(), "set_parameter ", name, ": expected shape ",
                  t.sizes(), ", got ", tensor.sizes());
    t = tensor;
    return;
  }
  for (auto& s : adapters_) {
    at::Tensor* t = name == s.a_name() ? &s.a : name == s.b_name() ? &s.b : nullptr;
    if (!t) continue;
    AUTOMOE_CHECK(tensor.sizes() == t->sizes(), "set_parameter ", name, ": expected shape ",
                  t->sizes(), ", got ", tensor.sizes());
    *t = tensor;
    index_adapters();  // the per-layer lists hold the factors too
    return;
  }
  fail("set_parameter: no parameter named ", name);
}

void Decoder::index_adapters() {
  std::vector<int64_t> layer_of(params_.size(), -1);
  for (const LayerSlots& L : slots_.layers) {
    for (int64_t i : L.all) layer_of[i] = L.index;
  }
  layer_adapters_.assign(adapters_.empty() ? 0 : spec_.num_layers, {});
  for (const LoraSite& s : adapters_) {
    layer_adapters_[layer_of[s.slot]].push_back(s.a);
    layer_adapters_[layer_of[s.slot]].push_back(s.b);
  }
}

void Decoder::set_adapters(std::vector<LoraSite> sites) {
  std::vector<int64_t> of(sites.empty() ? 0 : params_.size(), -1);
  if (!sites.empty() && lora_targets_.empty()) lora_targets_ = lora_targets(spec_);
  for (size_t k = 0; k < sites.size(); ++k) {
    const LoraSite& s = sites[k];
    AUTOMOE_CHECK(s.slot >= 0 && s.slot < static_cast<int64_t>(params_.size()) &&
                      params_[s.slot].first == s.base(),
                  "LoRA: adapter for ", s.base(), " does not name a weight of this model");
    AUTOMOE_CHECK(of[s.slot] < 0, "LoRA: two adapters on ", s.base());
    const int8_t kind = lora_targets_[s.slot];
    AUTOMOE_CHECK(s.experts ? kind == 2 : (kind == 1 || kind == 3),
                  "LoRA: the AutoMoE engine does not run an adapter on ", s.base(),
                  " (adapters go on attention, MLP and shared-expert linear layers, the routed "
                  "experts' tensors and the routers' weights; not on norms, embeddings or the LM head)");
    const at::Tensor& w = params_[s.slot].second;
    AUTOMOE_CHECK(w.dim() == (s.experts ? 3 : 2), "LoRA: ", s.base(), " is ", w.sizes(),
                  s.experts ? "; expected routed experts [E, O, K]" : "; expected a linear weight [O, K]");
    const int64_t E = s.experts ? w.size(0) : 1, O = w.size(-2), K = w.size(-1);
    std::vector<int64_t> a{s.r, K}, b{O, s.r};
    if (s.experts) {
      a.insert(a.begin(), E);
      b.insert(b.begin(), E);
    }
    AUTOMOE_CHECK(s.a.defined() && s.b.defined() && s.a.sizes() == at::IntArrayRef(a) &&
                      s.b.sizes() == at::IntArrayRef(b),
                  "LoRA: the adapter of ", s.base(), " ", w.sizes(), " needs A ", at::IntArrayRef(a),
                  " and B ", at::IntArrayRef(b), ", got ", s.a.defined() ? s.a.sizes() : at::IntArrayRef{},
                  " and ", s.b.defined() ? s.b.sizes() : at::IntArrayRef{});
    const ops::QuantizedWeight* q = quantized(s.slot);
    const c10::Device w_dev = q ? q->codes.device() : w.device();
    AUTOMOE_CHECK(s.a.device() == w_dev && s.b.device() == w_dev, "LoRA: the adapter of ",
                  s.base(), " is on ", s.a.device(), "; its weight on ", w_dev);
    AUTOMOE_CHECK(at::isFloatingType(s.a.scalar_type()) && at::isFloatingType(s.b.scalar_type()),
                  "LoRA: the adapter of ", s.base(), " must be floating point");
    AUTOMOE_CHECK(!(s.experts && spec_.moe.gpt_oss), "LoRA: adapters on GPT-OSS's experts are not supported");
    of[s.slot] = static_cast<int64_t>(k);
  }
  adapters_ = std::move(sites);
  adapter_of_ = std::move(of);
  index_adapters();
}

at::Tensor Decoder::linear(const at::Tensor& x, int64_t w, int64_t bias, bool training) const {
  at::Tensor y = ops_.linear(x, p(w), opt_param(params_, bias));
  const LoraSite* s = adapter(w);
  if (!s) return y;
  // PEFT's lora.Linear: base(x) + lora_B(lora_A(dropout(x))) * scaling with x cast to the
  // adapter's dtype (float32 adapters on a bf16 base compute in float32; under torch.autocast the
  // linears take autocast's dtype, as there), the sum back in the base output's dtype.
  const at::Tensor xd = s->dropout > 0 && training ? at::dropout(x, s->dropout, true) : x;
  const at::Tensor l = at::linear(at::linear(xd.to(s->a.scalar_type()), s->a), s->b.to(s->a.scalar_type()));
  return (y + l * s->scaling).to(y.scalar_type());
}

at::Tensor Decoder::router_weight(const MoESlots& M) const {
  const LoraSite* s = adapter(M.router);
  if (!s) return p(M.router);
  // PEFT's ParamWrapper on the router's weight: W + (B·A)·s in W's dtype, a small [E, H] tensor.
  const at::Tensor& w = p(M.router);
  return w + (at::mm(s->b, s->a) * s->scaling).to(w.scalar_type());
}

at::Tensor Decoder::mlp(const at::Tensor& x, const MlpSlots& m, bool training) const {
  if (m.gate < 0) {  // a plain MLP: relu2 between up and down (Nemotron-H)
    return linear(at::square(at::relu(linear(x, m.up, m.up_bias, training))), m.down, m.down_bias,
                  training);
  }
  if (!adapter(m.gate) && !adapter(m.up) && !adapter(m.down)) {
    return ops_.mlp(x, p(m.gate), p(m.up), p(m.down));
  }
  const at::Tensor gate = linear(x, m.gate, -1, training), up = linear(x, m.up, -1, training);
  const at::Tensor h = backend_.fused_swiglu && gate.scalar_type() == up.scalar_type()
                           ? ops::swiglu(at::cat({gate, up}, -1))
                           : at::silu(gate) * up;
  return linear(h, m.down, -1, training);
}

void Decoder::rebind(const std::vector<std::optional<at::Tensor>>& tensors) {
  AUTOMOE_CHECK(tensors.size() == params_.size(), "rebind: expected ", params_.size(),
                " entries (one per parameter), got ", tensors.size());
  const auto& embed = tensors[slots_.embed];
  if (embed && embed->dim() == 2 && embed->size(0) != spec_.vocab_size) {
    resize_vocab(*embed, tensors[slots_.lm_head]);
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
    params_[slots_.lm_head].second = *lm_head;
  }
  params_[slots_.embed].second = embed;
  spec_.vocab_size = embed.size(0);
}

namespace {


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

at::Tensor Decoder::norm(const at::Tensor& x, int64_t weight) const {
  if (spec_.zero_centered_norms) {  // Qwen3NextRMSNorm: x·rsqrt(mean x² + eps)·(1 + w) in float32
    return ops_.rms_norm(x.to(at::kFloat), p(weight).to(at::kFloat) + 1.0, spec_.rms_norm_eps)
        .to(x.scalar_type());
  }
  return ops_.rms_norm(x, p(weight), spec_.rms_norm_eps);
}

at::Tensor Decoder::rotate(const at::Tensor& x_BSND, const LayerContext& c) const {
  const int64_t D = x_BSND.size(3), rot = spec_.rope.dim;
  if (spec_.rope.type == RopeType::kNone) return x_BSND;
  if (rot == D) return ops_.rope(x_BSND, c.cos_BSh, c.sin_BSh, spec_.rope.interleaved);
  // Partial rotary: the first `rot` dimensions rotate, the rest pass through.
  return at::cat({ops_.rope(x_BSND.narrow(3, 0, rot), c.cos_BSh, c.sin_BSh, spec_.rope.interleaved),
                  x_BSND.narrow(3, rot, D - rot)},
                 3);
}

at::Tensor Decoder::attention(const AttentionSlots& A, int64_t layer, const at::Tensor& x_BSH,
                              const LayerContext& c, const LayerContext::Attention& m) const {
  const int64_t B = x_BSH.size(0), S = x_BSH.size(1);
  const AttentionSpec& a = spec_.attn;
  const int64_t N = a.num_heads, KV = a.num_kv_heads, D = a.head_dim;
  at::Tensor q = linear(x_BSH, A.q, A.q_bias, c.training);
  at::Tensor gate_BSX;  // Qwen3-Next's output gate: the second half of each head's q_proj rows
  if (a.output_gate) {
    const at::Tensor qg = q.view({B, S, N, 2 * D});
    gate_BSX = qg.narrow(3, D, D).reshape({B, S, N * D});
    q = qg.narrow(3, 0, D).reshape({B, S, N * D});
  }
  at::Tensor k = linear(x_BSH, A.k, A.k_bias, c.training);
  at::Tensor v = linear(x_BSH, A.v, A.v_bias, c.training);
  if (a.qk_norm && a.qk_norm_full_width) {  // OLMoE: over the whole projection
    q = norm(q, A.q_norm);
    k = norm(k, A.k_norm);
  }
  if (a.clip_qkv > 0) {  // OLMoE's clip_qkv
    q = q.clamp(-a.clip_qkv, a.clip_qkv);
    k = k.clamp(-a.clip_qkv, a.clip_qkv);
    v = v.clamp(-a.clip_qkv, a.clip_qkv);
  }
  at::Tensor q_BSND = q.view({B, S, N, D});
  at::Tensor k_BSND = k.view({B, S, KV, D});
  at::Tensor v_BNSD = v.view({B, S, KV, D}).transpose(1, 2);
  if (a.qk_norm && !a.qk_norm_full_width) {  // Qwen3, GLM-4.5: per head
    q_BSND = norm(q_BSND, A.q_norm);
    k_BSND = norm(k_BSND, A.k_norm);
  }
  const at::Tensor q_BNSD = rotate(q_BSND, c).transpose(1, 2);
  at::Tensor k_BNSD = rotate(k_BSND, c).transpose(1, 2);
  if (c.cache) std::tie(k_BNSD, v_BNSD) = c.cache->append(layer, k_BNSD, v_BNSD);
  const at::Tensor out_BNSD = ops_.attention(q_BNSD, k_BNSD, v_BNSD, m.mask, m.is_causal, scale_,
                                             opt_param(params_, A.sinks));
  at::Tensor out_BSH = out_BNSD.transpose(1, 2).reshape({B, S, N * D});
  if (a.output_gate) out_BSH = out_BSH * at::sigmoid(gate_BSX);
  return linear(out_BSH, A.o, A.o_bias, c.training);
}

at::Tensor Decoder::latent_attention(const AttentionSlots& A, int64_t layer,
                                     const at::Tensor& x_BSH, const LayerContext& c,
                                     const LayerContext::Attention& m) const {
  const int64_t B = x_BSH.size(0), S = x_BSH.size(1);
  const AttentionSpec& a = spec_.attn;
  const int64_t N = a.num_heads, Dn = a.qk_nope_head_dim, Dr = a.qk_rope_head_dim;
  const int64_t Dv = a.v_head_dim, R = a.kv_lora_rank;
  const at::Tensor q_flat =
      A.q >= 0 ? linear(x_BSH, A.q, -1, c.training)
               : linear(ops_.rms_norm(linear(x_BSH, A.q_a, A.q_a_bias, c.training),
                                      p(A.q_a_norm), a.latent_norm_eps),
                        A.q_b, -1, c.training);
  const at::Tensor q_BSND = q_flat.view({B, S, N, Dn + Dr});
  const at::Tensor compressed = linear(x_BSH, A.kv_a, A.kv_a_bias, c.training);
  // The compressed latent (normed) and the single rotary key head: what the KV cache holds, as
  // Transformers' cache does ([B, 1, S, R] and [B, 1, S, Dr]).
  at::Tensor kv_B1SR =
      ops_.rms_norm(compressed.narrow(2, 0, R), p(A.kv_a_norm), a.latent_norm_eps).unsqueeze(1);
  at::Tensor k_rot_BSND = rotate(compressed.narrow(2, R, Dr).unsqueeze(2), c);
  at::Tensor q_rot_BSND = rotate(q_BSND.narrow(3, Dn, Dr), c);
  if (spec_.rope.interleaved) {
    // The rope op keeps the pairs in place; Transformers writes the rotated even elements first,
    // then the odd ones. Same dot products either way; this keeps the cached keys Transformers'.
    auto split_pairs = [&](const at::Tensor& t) {
      return t.unflatten(3, {Dr / 2, 2}).transpose(3, 4).flatten(3);
    };
    k_rot_BSND = split_pairs(k_rot_BSND);
    q_rot_BSND = split_pairs(q_rot_BSND);
  }
  at::Tensor k_rot_B1SD = k_rot_BSND.transpose(1, 2);
  if (c.cache) std::tie(kv_B1SR, k_rot_B1SD) = c.cache->append(layer, kv_B1SR, k_rot_B1SD);
  const int64_t Skv = kv_B1SR.size(2);
  const at::Tensor q_BNSD = at::cat({q_BSND.narrow(3, 0, Dn), q_rot_BSND}, 3).transpose(1, 2);
  const at::Tensor kv_BNSD =
      linear(kv_B1SR.squeeze(1), A.kv_b, -1, c.training).view({B, Skv, N, Dn + Dv}).transpose(1, 2);
  const at::Tensor k_BNSD =
      at::cat({kv_BNSD.narrow(3, 0, Dn), k_rot_B1SD.expand({B, N, Skv, Dr})}, 3);
  const at::Tensor v_BNSD = kv_BNSD.narrow(3, Dn, Dv);
  const at::Tensor out_BNSD =
      ops_.attention(q_BNSD, k_BNSD, v_BNSD, m.mask, m.is_causal, scale_, std::nullopt);
  const at::Tensor out_BSH = out_BNSD.transpose(1, 2).reshape({B, S, N * Dv});
  return linear(out_BSH, A.o, A.o_bias, c.training);
}

ForwardResult Decoder::forward(const ForwardArgs& a) const {
  check_inputs(a, spec_);
  // padding_idx: the pad token's embedding row gets no gradient, as nn.Embedding(padding_idx=...).
  at::Tensor h_BSH = a.inputs_embeds
                         ? *a.inputs_embeds
                         : at::embedding(p(slots_.embed), a.input_ids.to(at::kLong),
                                        spec_.embedding_padding_idx ? spec_.pad_token_id : -1);
  const int64_t B = h_BSH.size(0), S = h_BSH.size(1);
  // Router logits and the aux loss exist only for types whose Transformers model computes one.
  const bool want_router =
      spec_.moe.aux_loss && a.output_router_logits.value_or(spec_.moe.output_router_logits);
  const auto dev = h_BSH.device();
  const c10::ScalarType dtype = h_BSH.scalar_type();
  const int64_t past = a.cache ? a.cache->length() : 0;
  const at::Tensor pos_BS =
      a.position_ids
          ? a.position_ids->to(at::kLong).expand({B, S})
          : (at::arange(S, at::TensorOptions().dtype(at::kLong).device(dev)) + past).expand({B, S});
  // One mask per distinct sliding window among the layers.
  std::map<int64_t, AttentionMask> masks;
  for (const LayerSpec& l : spec_.layers) {
    if (!masks.count(l.sliding_window)) {
      masks[l.sliding_window] = build_mask(a, pos_BS, B, S, past, l.sliding_window, dtype,
                                           ops_.eager_attention, dev);
    }
  }
  const auto [cos_BSh, sin_BSh] =
      rope_tables(pos_BS, inv_freq_, spec_.rope.attention_factor, dtype);

  // Real (non-padding) tokens of this step, flattened: what the aux loss and the expert counts see.
  std::optional<at::Tensor> token_mask_BS;
  if (a.attention_mask) token_mask_BS = a.attention_mask->narrow(1, past, S);
  if (a.document_ids) token_mask_BS = a.document_ids->ge(0);
  std::optional<at::Tensor> token_mask_T;
  if (a.output_expert_counts && token_mask_BS) token_mask_T = token_mask_BS->reshape({-1}).ne(0);

  ForwardResult r;
  LayerContext ctx{cos_BSh, sin_BSh, {}, {}, a.cache, autocast_dtype(dev.type()), a.training};
  if (spec_.has_mixer(MixerKind::kMamba2) || spec_.has_mixer(MixerKind::kGatedDeltaNet)) {
    // Transformers' create_recurrent_attention_mask: this step's part of a 2-D mask with padding,
    // for more than one token; the trainer's documents restart the recurrence, padding zeroed.
    if (a.attention_mask && S > 1) {
      const at::Tensor keep = a.attention_mask->narrow(1, past, S);
      if (!keep.ne(0).all().item<bool>()) ctx.recurrent_keep_BS = keep;
    }
    if (a.document_ids) {
      ctx.doc_BS = *a.document_ids;
      ctx.recurrent_keep_BS = a.document_ids->ge(0).to(at::kLong);
    }
  }
  for (const LayerSpec& l : spec_.layers) {
    ctx.mask.push_back(masks.at(l.sliding_window).mask);
    ctx.is_causal.push_back(masks.at(l.sliding_window).is_causal);
  }
  // Activation checkpointing applies only when something needs gradients.
  bool needs_grad = false;
  if (a.activation_checkpointing && at::GradMode::is_enabled()) {
    for (const auto& [n, t] : params_) needs_grad = needs_grad || t.requires_grad();
    for (const auto& s : adapters_) needs_grad = needs_grad || s.a.requires_grad() || s.b.requires_grad();
  }
  // The backward of a checkpointed layer runs on a snapshot of this decoder (parameter handles,
  // spec, backend), not on `this`, which may be gone or re-bound by then.
  const std::shared_ptr<const Decoder> snapshot =
      needs_grad ? std::make_shared<const Decoder>(*this) : nullptr;
  if (a.output_hidden_states) r.hidden_states.push_back(h_BSH);
  for (const LayerSlots& L : slots_.layers) {
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
  h_BSH = norm(h_BSH, slots_.final_norm);
  r.last_hidden_state = h_BSH;
  if (a.output_hidden_states) r.hidden_states.back() = h_BSH;  // as Transformers: the normed one
  const bool fused_loss = a.labels && ops_.fused_loss;
  // With the fused loss the [B, S, V] logits are never formed (r.logits stays undefined).
  if (a.lm_head && !fused_loss) {
    at::Tensor kept_BSH = h_BSH;
    if (a.logits_indices) {
      kept_BSH = h_BSH.index_select(1, a.logits_indices->to(dev, at::kLong));
    } else if (a.logits_to_keep > 0) {
      kept_BSH = h_BSH.narrow(1, std::max<int64_t>(S - a.logits_to_keep, 0),
                              std::min(a.logits_to_keep, S));
    }
    r.logits = ops_.linear(kept_BSH, p(slots_.lm_head), std::nullopt);
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
          ? ops::linear_cross_entropy(x_NH.to(*compute_dtype), p(slots_.lm_head).to(*compute_dtype),
                                      shifted_BS.reshape({-1}), ignore)
          : ops::linear_cross_entropy(x_NH, p(slots_.lm_head), shifted_BS.reshape({-1}), ignore);
  return {r.sum, r.count};
}


Decoder::LayerOutput Decoder::layer(const LayerSlots& L, const at::Tensor& h_in,
                                    const LayerContext& c, const at::Tensor* fixed_idx) const {
  const int64_t B = h_in.size(0), S = h_in.size(1), H = spec_.hidden_size;
  LayerOutput out;
  out.h = h_in;
  if (L.mixer != MixerKind::kNone) out.h = h_in + mixer(L, norm(h_in, L.input_norm), c);
  if (L.mlp_kind == MlpKind::kNone) return out;
  const at::Tensor x_TH = norm(out.h, L.post_norm).reshape({B * S, H});
  const at::Tensor y_TH = L.moe ? moe_block(L.experts, x_TH, c, fixed_idx, &out)
                                : mlp(x_TH, L.mlp, c.training);
  out.h = out.h + y_TH.view({B, S, H});
  return out;
}

at::Tensor Decoder::mixer(const LayerSlots& L, const at::Tensor& x_BSH, const LayerContext& c) const {
  if (L.mixer == MixerKind::kMamba2 || L.mixer == MixerKind::kGatedDeltaNet) {
    RecurrentInputs in;
    in.keep_BS = c.recurrent_keep_BS;
    in.doc_BS = c.doc_BS;
    in.cache = c.cache;
    in.layer = L.index;
    const SlotLinear lin = [&](const at::Tensor& x, int64_t w, int64_t b) { return linear(x, w, b, c.training); };
    return L.mixer == MixerKind::kMamba2
               ? mamba2_mixer(spec_.mamba, L.mamba, params_, x_BSH, in, lin, ops_)
               : gated_deltanet_mixer(spec_.deltanet, L.deltanet, params_, x_BSH, in, lin, ops_);
  }
  const LayerContext::Attention ac{c.mask[L.index], c.is_causal[L.index]};
  return spec_.attn.kind == AttentionKind::kMLA ? latent_attention(L.attn, L.index, x_BSH, c, ac)
                                                : attention(L.attn, L.index, x_BSH, c, ac);
}

}  // namespace automoe
