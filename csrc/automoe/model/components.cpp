#include "automoe/model/components.h"

namespace automoe {
namespace {

// Collects declarations; each add() returns the new parameter's index (its slot).
class Declarer {
 public:
  explicit Declarer(std::vector<ParamDecl>* out) : out_(out) {}
  int64_t add(const std::string& name, std::vector<int64_t> shape, Init init = Init::kNormal) {
    out_->push_back(ParamDecl{name, std::move(shape), init});
    return static_cast<int64_t>(out_->size()) - 1;
  }
  int64_t buffer(const std::string& name, std::vector<int64_t> shape, Init init) {
    const int64_t i = add(name, std::move(shape), init);
    out_->back().trainable = false;
    out_->back().keep_float32 = true;
    return i;
  }
  int64_t size() const { return static_cast<int64_t>(out_->size()); }
  void mark_routed_expert(int64_t slot) { (*out_)[slot].routed_expert = true; }

 private:
  std::vector<ParamDecl>* out_;
};

// nn.Linear(in, out, bias): weight [out, in] (+ bias [out]).
void linear(Declarer& d, const std::string& name, int64_t in, int64_t out, bool bias,
            int64_t* w_slot, int64_t* b_slot = nullptr) {
  *w_slot = d.add(name + ".weight", {out, in});
  if (bias) *b_slot = d.add(name + ".bias", {out}, Init::kZeros);
}

int64_t rms_norm(Declarer& d, const std::string& name, int64_t size) {
  return d.add(name + ".weight", {size}, Init::kOnes);
}

// Grouped-query attention: Transformers' Qwen3MoeAttention / Glm4MoeAttention.
AttentionSlots gqa(Declarer& d, const AttentionSpec& a, int64_t H, const std::string& pre) {
  AttentionSlots s;
  const int64_t N = a.num_heads, KV = a.num_kv_heads, D = a.head_dim;
  linear(d, pre + "q_proj", H, N * D, a.qkv_bias, &s.q, &s.q_bias);
  linear(d, pre + "k_proj", H, KV * D, a.qkv_bias, &s.k, &s.k_bias);
  linear(d, pre + "v_proj", H, KV * D, a.qkv_bias, &s.v, &s.v_bias);
  linear(d, pre + "o_proj", N * D, H, a.o_bias, &s.o, &s.o_bias);
  if (a.qk_norm) {
    s.q_norm = rms_norm(d, pre + "q_norm", a.qk_norm_full_width ? N * D : D);
    s.k_norm = rms_norm(d, pre + "k_norm", a.qk_norm_full_width ? KV * D : D);
  }
  if (a.sinks) s.sinks = d.add(pre + "sinks", {N});
  return s;
}

// Multi-head latent attention: Transformers' DeepseekV3Attention.
AttentionSlots mla(Declarer& d, const AttentionSpec& a, int64_t H, const std::string& pre) {
  AttentionSlots s;
  const int64_t N = a.num_heads, Dqk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  if (a.q_lora_rank == 0) {
    linear(d, pre + "q_proj", H, N * Dqk, false, &s.q);
  } else {
    linear(d, pre + "q_a_proj", H, a.q_lora_rank, a.qkv_bias, &s.q_a, &s.q_a_bias);
    s.q_a_norm = rms_norm(d, pre + "q_a_layernorm", a.q_lora_rank);
    linear(d, pre + "q_b_proj", a.q_lora_rank, N * Dqk, false, &s.q_b);
  }
  linear(d, pre + "kv_a_proj_with_mqa", H, a.kv_lora_rank + a.qk_rope_head_dim, a.qkv_bias,
         &s.kv_a, &s.kv_a_bias);
  s.kv_a_norm = rms_norm(d, pre + "kv_a_layernorm", a.kv_lora_rank);
  linear(d, pre + "kv_b_proj", a.kv_lora_rank, N * (a.qk_nope_head_dim + a.v_head_dim), false,
         &s.kv_b);
  linear(d, pre + "o_proj", N * a.v_head_dim, H, a.o_bias, &s.o, &s.o_bias);
  return s;
}

// SwiGLU MLP: gate_proj, up_proj [I, H], down_proj [H, I].
MlpSlots mlp(Declarer& d, int64_t H, int64_t I, const std::string& pre) {
  MlpSlots s;
  linear(d, pre + "gate_proj", H, I, false, &s.gate);
  linear(d, pre + "up_proj", H, I, false, &s.up);
  linear(d, pre + "down_proj", I, H, false, &s.down);
  return s;
}

// The MoE block: routed experts fused [E, 2I, H] / [E, H, I], the router [E, H] (and its
// correction bias), the shared experts.
MoESlots moe(Declarer& d, const MoESpec& m, int64_t H, const std::string& pre) {
  MoESlots s;
  const int64_t E = m.num_experts, I = m.intermediate_size;
  const int64_t El = m.local_experts();
  auto expert = [&](const std::string& name, std::vector<int64_t> shape, Init init = Init::kNormal) {
    shape.insert(shape.begin(), El);
    const int64_t slot = d.add(name, shape, init);
    d.mark_routed_expert(slot);
    return slot;
  };
  if (m.gpt_oss) {  // Transformers' GptOssMLP: router, then experts stored transposed with biases
    s.router = d.add(pre + "router.weight", {E, H});
    s.router_bias = d.add(pre + "router.bias", {E});  // drawn like the weight, as Transformers
    s.gate_up = expert(pre + "experts.gate_up_proj", {H, 2 * I});
    s.gate_up_bias = expert(pre + "experts.gate_up_proj_bias", {2 * I}, Init::kZeros);
    s.down = expert(pre + "experts.down_proj", {I, H});
    s.down_bias = expert(pre + "experts.down_proj_bias", {H}, Init::kZeros);
    return s;
  }
  s.gate_up = expert(pre + "experts.gate_up_proj", {2 * I, H});
  s.down = expert(pre + "experts.down_proj", {H, I});
  s.router = d.add(pre + "gate.weight", {E, H});
  if (m.correction_bias) s.correction_bias = d.buffer(pre + "gate.e_score_correction_bias", {E}, Init::kZeros);
  if (m.shared_intermediate_size >= 0) {
    s.shared = mlp(d, H, m.shared_intermediate_size, pre + m.shared_name + ".");
    if (m.shared_gate) linear(d, pre + m.shared_name + "_gate", H, 1, false, &s.shared_gate);
  }
  return s;
}

}  // namespace

ModelSlots declare_model(const ModelSpec& s, std::vector<ParamDecl>* decls) {
  Declarer d(decls);
  const int64_t H = s.hidden_size;
  ModelSlots m;
  m.embed = d.add("model.embed_tokens.weight", {s.vocab_size, H});
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const int64_t first = d.size();
    LayerSlots L;
    L.index = l;
    L.attn = s.attn.kind == AttentionKind::kMLA ? mla(d, s.attn, H, pre + "self_attn.")
                                                : gqa(d, s.attn, H, pre + "self_attn.");
    L.moe = s.is_moe(l);
    if (L.moe) {
      L.experts = moe(d, s.moe, H, pre + "mlp.");
    } else {
      L.mlp = mlp(d, H, s.intermediate_size, pre + "mlp.");
    }
    L.input_norm = rms_norm(d, pre + "input_layernorm", H);
    L.post_norm = rms_norm(d, pre + "post_attention_layernorm", H);
    for (int64_t i = first; i < d.size(); ++i) L.all.push_back(i);
    m.layers.push_back(std::move(L));
  }
  m.final_norm = rms_norm(d, "model.norm", H);
  m.lm_head = s.tie_word_embeddings ? m.embed : d.add("lm_head.weight", {s.vocab_size, H});
  return m;
}

std::vector<ParamDecl> parameter_layout(const ModelSpec& spec) {
  std::vector<ParamDecl> decls;
  declare_model(spec, &decls);
  return decls;
}

double forward_flops_per_token(const ModelSpec& s, int64_t seq_len) {
  std::vector<ParamDecl> decls;
  const ModelSlots m = declare_model(s, &decls);
  auto matmul = [&](int64_t slot) {
    if (slot < 0) return 0.0;
    double n = 2.0;
    for (int64_t x : decls[slot].shape) n *= static_cast<double>(x);
    return n;
  };
  auto mlp_flops = [&](const MlpSlots& p) { return matmul(p.gate) + matmul(p.up) + matmul(p.down); };
  const AttentionSpec& a = s.attn;
  const double keys = (static_cast<double>(seq_len) + 1) / 2;
  const double core = 2.0 * a.num_heads * (a.head_dim + a.v_dim()) * keys;
  double total = matmul(m.lm_head);
  for (const LayerSlots& L : m.layers) {
    const AttentionSlots& t = L.attn;
    total += core;
    for (int64_t w : {t.q, t.k, t.v, t.o, t.q_a, t.q_b, t.kv_a, t.kv_b}) total += matmul(w);
    if (L.moe) {
      // Each token runs top_k experts (the declared shapes hold this process's experts).
      const double share =
          static_cast<double>(s.moe.top_k) / static_cast<double>(s.moe.local_experts());
      total += matmul(L.experts.router) +
               share * (matmul(L.experts.gate_up) + matmul(L.experts.down)) +
               mlp_flops(L.experts.shared) + matmul(L.experts.shared_gate);
    } else {
      total += mlp_flops(L.mlp);
    }
  }
  return total;
}

}  // namespace automoe
