#include "automoe/model/components.h"

#include <algorithm>
#include <cmath>

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

int64_t rms_norm(Declarer& d, const std::string& name, int64_t size, bool zero_centered = false) {
  return d.add(name + ".weight", {size}, zero_centered ? Init::kZeros : Init::kOnes);
}

// Grouped-query attention: Transformers' Qwen3MoeAttention / Glm4MoeAttention.
// Qwen3-Next's gated attention doubles q_proj (each head's query and output gate).
AttentionSlots gqa(Declarer& d, const AttentionSpec& a, int64_t H, const std::string& pre,
                   bool zero_centered) {
  AttentionSlots s;
  const int64_t N = a.num_heads, KV = a.num_kv_heads, D = a.head_dim;
  linear(d, pre + "q_proj", H, N * D * (a.output_gate ? 2 : 1), a.qkv_bias, &s.q, &s.q_bias);
  linear(d, pre + "k_proj", H, KV * D, a.qkv_bias, &s.k, &s.k_bias);
  linear(d, pre + "v_proj", H, KV * D, a.qkv_bias, &s.v, &s.v_bias);
  linear(d, pre + "o_proj", N * D, H, a.o_bias, &s.o, &s.o_bias);
  if (a.qk_norm) {
    s.q_norm = rms_norm(d, pre + "q_norm", a.qk_norm_full_width ? N * D : D, zero_centered);
    s.k_norm = rms_norm(d, pre + "k_norm", a.qk_norm_full_width ? KV * D : D, zero_centered);
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

// A plain MLP (Nemotron-H's NemotronHMLP): up_proj [I, H], down_proj [H, I], relu2 between, biases
// with mlp_bias.
MlpSlots plain_mlp(Declarer& d, int64_t H, int64_t I, bool bias, const std::string& pre) {
  MlpSlots s;
  linear(d, pre + "up_proj", H, I, bias, &s.up, &s.up_bias);
  linear(d, pre + "down_proj", I, H, bias, &s.down, &s.down_bias);
  return s;
}

MlpSlots any_mlp(Declarer& d, const ModelSpec& spec, int64_t I, const std::string& pre) {
  return spec.hidden_act == Activation::kRelu2 ? plain_mlp(d, spec.hidden_size, I, spec.mlp_bias, pre)
                                               : mlp(d, spec.hidden_size, I, pre);
}

// Mamba-2: Transformers' NemotronHMamba2Mixer, its own parameters (dt_bias, A_log, D) first, then its
// submodules' in the order it builds them (conv1d, in_proj, norm, out_proj).
MambaSlots mamba2(Declarer& d, const Mamba2Spec& m, int64_t H, const std::string& pre) {
  MambaSlots s;
  const int64_t heads = m.num_heads, C = m.conv_dim();
  s.dt_bias = d.add(pre + "dt_bias", {heads}, Init::kOnes);
  s.a_log = d.add(pre + "A_log", {heads}, Init::kZeros);
  s.d = d.add(pre + "D", {heads}, Init::kOnes);
  s.conv = d.add(pre + "conv1d.weight", {C, 1, m.conv_kernel});
  if (m.conv_bias) s.conv_bias = d.add(pre + "conv1d.bias", {C}, Init::kZeros);
  linear(d, pre + "in_proj", H, m.inner() + C + heads, m.proj_bias, &s.in_proj, &s.in_proj_bias);
  s.norm = rms_norm(d, pre + "norm", m.inner());
  linear(d, pre + "out_proj", m.inner(), H, m.proj_bias, &s.out_proj, &s.out_proj_bias);
  return s;
}

// Gated DeltaNet: its own parameters (dt_bias, A_log) first, then its submodules in the order
// Transformers builds them: Qwen3-Next conv1d, in_proj_qkvz, in_proj_ba, norm, out_proj; Qwen3.5
// conv1d, norm, out_proj, then its four in-projections.
DeltaNetSlots deltanet(Declarer& d, const GatedDeltaNetSpec& g, int64_t H, const std::string& pre) {
  DeltaNetSlots s;
  const int64_t Nv = g.num_v_heads, K = g.key_dim(), V = g.value_dim();
  s.dt_bias = d.add(pre + "dt_bias", {Nv}, Init::kOnes);
  s.a_log = d.add(pre + "A_log", {Nv}, Init::kZeros);
  s.conv = d.add(pre + "conv1d.weight", {g.conv_dim(), 1, g.conv_kernel});
  if (!g.split_projections) {
    linear(d, pre + "in_proj_qkvz", H, 2 * K + 2 * V, false, &s.in_proj_qkvz);
    linear(d, pre + "in_proj_ba", H, 2 * Nv, false, &s.in_proj_ba);
  }
  s.norm = rms_norm(d, pre + "norm", g.head_v_dim);
  linear(d, pre + "out_proj", V, H, false, &s.out_proj);
  if (g.split_projections) {
    linear(d, pre + "in_proj_qkv", H, 2 * K + V, false, &s.in_proj_qkv);
    linear(d, pre + "in_proj_z", H, V, false, &s.in_proj_z);
    linear(d, pre + "in_proj_b", H, Nv, false, &s.in_proj_b);
    linear(d, pre + "in_proj_a", H, Nv, false, &s.in_proj_a);
  }
  return s;
}

// Nemotron-H's MoE block (NemotronHMoE): experts without a gate projection, the router `gate` with
// its correction bias, the shared expert, the latent projections.
MoESlots plain_moe(Declarer& d, const ModelSpec& spec, const std::string& pre) {
  const MoESpec& m = spec.moe;
  MoESlots s;
  const int64_t H = spec.hidden_size, E = m.num_experts, I = m.intermediate_size;
  const int64_t X = m.latent_size > 0 ? m.latent_size : H;  // what the experts read and write
  s.gate_up = d.add(pre + "experts.up_proj", {m.local_experts(), I, X});
  d.mark_routed_expert(s.gate_up);
  s.down = d.add(pre + "experts.down_proj", {m.local_experts(), X, I});
  d.mark_routed_expert(s.down);
  s.router = d.add(pre + "gate.weight", {E, H});
  if (m.correction_bias) s.correction_bias = d.buffer(pre + "gate.e_score_correction_bias", {E}, Init::kZeros);
  if (m.shared_intermediate_size >= 0) {
    s.shared = plain_mlp(d, H, m.shared_intermediate_size, spec.mlp_bias, pre + m.shared_name + ".");
  }
  if (m.latent_size > 0) {
    linear(d, pre + "fc1_latent_proj", H, X, spec.mlp_bias, &s.latent_in, &s.latent_in_bias);
    linear(d, pre + "fc2_latent_proj", X, H, spec.mlp_bias, &s.latent_out, &s.latent_out_bias);
  }
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
  const bool hybrid = s.naming == Naming::kHybridBlocks;
  ModelSlots m;
  m.embed = d.add(hybrid ? "model.embeddings.weight" : "model.embed_tokens.weight", {s.vocab_size, H});
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    const int64_t first = d.size();
    const LayerSpec& spec = s.layers[l];
    LayerSlots L;
    L.index = l;
    L.mixer = spec.mixer;
    L.mlp_kind = spec.mlp;
    L.moe = spec.mlp == MlpKind::kMoE;
    // Nemotron-H's block: its norm, then its one component under `mixer.`.
    if (hybrid) {
      L.input_norm = L.post_norm = rms_norm(d, pre + "norm", H);
    }
    const std::string mixer_pre = hybrid                                  ? pre + "mixer."
                                  : spec.mixer == MixerKind::kGatedDeltaNet ? pre + "linear_attn."
                                                                            : pre + "self_attn.";
    const std::string mlp_pre = hybrid ? pre + "mixer." : pre + "mlp.";
    if (spec.mixer == MixerKind::kAttention) {
      L.attn = s.attn.kind == AttentionKind::kMLA ? mla(d, s.attn, H, mixer_pre)
                                                  : gqa(d, s.attn, H, mixer_pre, s.zero_centered_norms);
    } else if (spec.mixer == MixerKind::kMamba2) {
      L.mamba = mamba2(d, s.mamba, H, mixer_pre);
    } else if (spec.mixer == MixerKind::kGatedDeltaNet) {
      L.deltanet = deltanet(d, s.deltanet, H, mixer_pre);
    }
    if (spec.mlp == MlpKind::kMoE) {
      L.experts = s.moe.gated ? moe(d, s.moe, H, mlp_pre) : plain_moe(d, s, mlp_pre);
    } else if (spec.mlp == MlpKind::kDense) {
      L.mlp = any_mlp(d, s, s.intermediate_size, mlp_pre);
    }
    if (!hybrid) {
      L.input_norm = rms_norm(d, pre + "input_layernorm", H, s.zero_centered_norms);
      L.post_norm = rms_norm(d, pre + "post_attention_layernorm", H, s.zero_centered_norms);
    }
    for (int64_t i = first; i < d.size(); ++i) L.all.push_back(i);
    m.layers.push_back(std::move(L));
  }
  m.final_norm = rms_norm(d, hybrid ? "model.norm_f" : "model.norm", H, s.zero_centered_norms);
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
  const Mamba2Spec& mb = s.mamba;
  // Mamba-2's SSD scan per token, chunked (Q = chunk): within its chunk C·Bᵀ (Q/2 positions on
  // average, N each) and the weighted x (P), the chunk state B·x (N·P) and its read-out C·state (N·P).
  const double q = static_cast<double>(std::min<int64_t>(mb.chunk_size, seq_len) + 1) / 2;
  const double ssd = 2.0 * mb.num_heads * (q * (mb.state_size + mb.head_dim) +
                                           2.0 * mb.state_size * mb.head_dim);
  // The chunked gated delta rule per token and value head (Q = chunk, Dk, Dv): within its chunk
  // q·kᵀ and k_β·kᵀ (Q/2 positions, Dk each), the triangular solves for v and k (Q/2 · (Dv + Dk)),
  // the weighted new values (Q/2 · Dv), and against the carried state k·S, q·S and kᵀ·v (3 Dk·Dv).
  const GatedDeltaNetSpec& gd = s.deltanet;
  const double qd = static_cast<double>(std::min<int64_t>(gd.chunk_size, seq_len) + 1) / 2;
  const double delta_rule =
      2.0 * gd.num_v_heads *
      (qd * (2.0 * gd.head_k_dim + gd.head_v_dim + gd.head_k_dim + gd.head_v_dim) +
       3.0 * gd.head_k_dim * gd.head_v_dim);
  const AttentionSpec& a = s.attn;
  const double keys = (static_cast<double>(seq_len) + 1) / 2;
  const double core = 2.0 * a.num_heads * (a.head_dim + a.v_dim()) * keys;
  double total = matmul(m.lm_head);
  for (const LayerSlots& L : m.layers) {
    const AttentionSlots& t = L.attn;
    if (L.mixer == MixerKind::kAttention) {
      total += core;
      for (int64_t w : {t.q, t.k, t.v, t.o, t.q_a, t.q_b, t.kv_a, t.kv_b}) total += matmul(w);
    } else if (L.mixer == MixerKind::kMamba2) {
      total += ssd + matmul(L.mamba.in_proj) + matmul(L.mamba.out_proj);
    } else if (L.mixer == MixerKind::kGatedDeltaNet) {
      const DeltaNetSlots& g = L.deltanet;
      total += delta_rule;
      for (int64_t w : {g.in_proj_qkvz, g.in_proj_ba, g.in_proj_qkv, g.in_proj_z, g.in_proj_b,
                        g.in_proj_a, g.out_proj}) {
        total += matmul(w);
      }
    }
    if (L.mlp_kind == MlpKind::kNone) continue;
    if (L.moe) {
      // Each token runs top_k experts (the declared shapes hold this process's experts).
      const double share =
          static_cast<double>(s.moe.top_k) / static_cast<double>(s.moe.local_experts());
      total += matmul(L.experts.router) +
               share * (matmul(L.experts.gate_up) + matmul(L.experts.down)) +
               mlp_flops(L.experts.shared) + matmul(L.experts.shared_gate) +
               matmul(L.experts.latent_in) + matmul(L.experts.latent_out);
    } else {
      total += mlp_flops(L.mlp);
    }
  }
  return total;
}

}  // namespace automoe

namespace automoe {

// What each component's autograd keeps, per token unless said otherwise (s: compute bytes; f32: 4,
// int64: 8), on the default CPU/CUDA backends: fused norms/rope/swiglu, sdpa, grouped experts,
// fused linear cross-entropy. Training batches carry document ids, so attention runs with a mask.
ActivationDecl activation_bytes(const ModelSpec& spec, int64_t batch, int64_t seq_len,
                                int64_t compute_bytes) {
  ActivationDecl out;
  const double s = static_cast<double>(compute_bytes), T = static_cast<double>(batch * seq_len);
  const double S = static_cast<double>(seq_len), H = static_cast<double>(spec.hidden_size);
  const double f32 = 4, i64 = 8;
  const bool bf16 = compute_bytes == 2;
  // A norm keeps its input (its own, or an f32 copy for zero-centred weights in bf16) and 1/rms.
  const double norm = (spec.zero_centered_norms && bf16 ? f32 : s) * H + f32;
  const AttentionSpec& a = spec.attn;
  const double N = static_cast<double>(a.num_heads), KV = static_cast<double>(a.num_kv_heads);
  const double D = static_cast<double>(a.head_dim);
  double attention = 0, attention_bwd = 0;
  if (a.kind == AttentionKind::kMLA) {
    const double Dqk = static_cast<double>(a.qk_nope_head_dim + a.qk_rope_head_dim);
    const double Dv = static_cast<double>(a.v_head_dim), R = static_cast<double>(a.kv_lora_rank);
    // normed x; q's and kv's latent norms (output and the b-projection's input); the math kernel's
    // f32 q, k, v and probabilities [N, S]; o_proj's input.
    attention = s * H + 2 * s * static_cast<double>(a.q_lora_rank) + 2 * s * R +
                f32 * N * (2 * Dqk + Dv) + f32 * N * S + s * N * Dv;
    attention_bwd = 2 * f32 * N * S + f32 * N * (2 * Dqk + Dv);
  } else {
    // normed x; q (rope output) and the output; k and v expanded to every head (the masked path);
    // logsumexp; the mask's additive form [S] per token.
    attention = s * H + 2 * s * N * D + 2 * s * N * D + f32 * N + s * S;
    if (a.qk_norm) attention += s * (N + KV) * D + f32 * (N + KV);
    if (a.output_gate) attention += 2 * s * N * D;
    if (a.clip_qkv > 0) attention += s * (N + 2 * KV) * D;
    if (a.sinks) attention += s * N * (S + 1) + s * N * D + i64 * N;  // eager: the probabilities
    attention_bwd = f32 * (3 + 2) * N * D + (a.sinks ? 2 * s * N * (S + 1) : f32 * S);
  }
  const Mamba2Spec& m = spec.mamba;
  const double I_m = static_cast<double>(m.inner()), GN = static_cast<double>(m.n_groups * m.state_size);
  const double Hm = static_cast<double>(m.num_heads), G = static_cast<double>(m.n_groups);
  // in_proj's input and its padding-zeroed copy; the conv's xBC; dt's chain; the scan's x, B, C;
  // the gated norm's f32 y, z and 1/rms; out_proj's input.
  const double mamba = s * (2 * H + 4 * I_m + 4 * GN + 3 * Hm) + f32 * (I_m + G);
  const GatedDeltaNetSpec& g = spec.deltanet;
  const double Kd = static_cast<double>(g.key_dim()), Vd = static_cast<double>(g.value_dim());
  const double Nv = static_cast<double>(g.num_v_heads), conv = 2 * Kd + Vd;
  const double repeat = g.num_v_heads > g.num_k_heads ? 2 * s * Nv * static_cast<double>(g.head_k_dim) : 0;
  // normed x; the conv's input (a copy in Qwen3-Next) and output; q/k repeated to the value heads;
  // beta and the decay chain; the chunk states [Dk, Dv] per 64-token chunk (f32); the gated norm's
  // o, z (f32), silu (f32), normed, out_proj's input.
  const double deltanet =
      s * H + (g.split_projections ? 0 : s * conv) + s * conv + repeat + s * Nv + f32 * 4 * Nv +
      f32 * Nv * static_cast<double>(g.head_k_dim * g.head_v_dim) / static_cast<double>(std::max<int64_t>(1, g.chunk_size)) +
      s * 3 * Vd + f32 * 2 * Vd;
  const MoESpec& e = spec.moe;
  const double K = static_cast<double>(e.top_k), I = static_cast<double>(e.intermediate_size);
  const double E = static_cast<double>(e.num_experts);
  const double X = e.latent_size > 0 ? static_cast<double>(e.latent_size) : H;
  const bool relu2 = spec.hidden_act == Activation::kRelu2;
  // A SwiGLU MLP of width i: normed x, gate_up, h (+ the fused op's cat(gate, up) weight copy,
  // per layer); relu2: normed x and two [i].
  auto mlp = [&](double i) { return relu2 ? s * (H + 2 * i) : s * (H + 3 * i); };
  auto mlp_weights = [&](double i) { return relu2 ? 0.0 : s * 2 * i * H; };
  // Routed experts per token: the router's f32 x, scores, choices and weights, the permuted rows,
  // the experts' inner tensors, their outputs; the aux loss's logits, probabilities and choices.
  double moe = f32 * H + f32 * E + 2 * i64 * K + s * K + K * s * (e.gated ? 2 * X + 3 * I : 2 * X + 2 * I);
  if (e.aux_loss) moe += 2 * f32 * E + i64 * K + f32;
  if (e.latent_size > 0) moe += s * X;
  double moe_weights = bf16 ? f32 * E * H : 0;  // the router weight's f32 copy
  if (e.shared_intermediate_size > 0) {
    const double Is = static_cast<double>(e.shared_intermediate_size);
    moe += mlp(Is) + (e.shared_gate ? s * (1 + H) : 0);
    moe_weights += mlp_weights(Is);
  }
  const double moe_bwd = K * s * (2 * I + H) + f32 * H;
  const double dense = mlp(static_cast<double>(spec.intermediate_size));
  const double dense_weights = mlp_weights(static_cast<double>(spec.intermediate_size));
  const bool hybrid = spec.naming == Naming::kHybridBlocks;
  for (const LayerSpec& l : spec.layers) {
    double per_token = hybrid ? norm : 2 * norm, weights = 0, bwd = 0;
    if (l.mixer == MixerKind::kAttention) per_token += attention, bwd = attention_bwd;
    if (l.mixer == MixerKind::kMamba2) per_token += mamba, bwd = s * 4 * I_m;
    if (l.mixer == MixerKind::kGatedDeltaNet) per_token += deltanet, bwd = s * 2 * conv;
    if (l.mlp == MlpKind::kMoE) per_token += moe, weights += moe_weights, bwd = std::max(bwd, moe_bwd);
    if (l.mlp == MlpKind::kDense) per_token += dense, weights += dense_weights;
    out.layer.push_back(per_token * T + weights);
    out.layer_backward = std::max(out.layer_backward, bwd * T);
  }
  // A checkpointed layer keeps its input and, in an MoE layer, its routing (and the aux loss's).
  out.layer_input = s * H * T + (e.num_experts > 0 ? (i64 * K + (e.aux_loss ? 2 * f32 * E + i64 * K : 0)) * T : 0);
  // The embedding's ids; the final norm's input, its output (the last hidden state) and the loss's
  // copy of the labelled rows, their indices, labels and log-sum-exp; the masks and RoPE tables.
  const double rows = T - static_cast<double>(batch);  // each row's last position has no label
  out.head = T * (i64 + 2 * s * H + f32) + rows * (s * H + 2 * i64 + f32) + static_cast<double>(batch) * S * S +
             2 * s * T * static_cast<double>(a.rope_head_dim()) + 2 * i64 * T;
  // The fused loss keeps all [rows, V] logits when they are at most 8 x 2^24 elements (compute
  // dtype under bf16), else one 64 MiB chunk; its backward adds f32 and compute-dtype [rows, H].
  const double V = static_cast<double>(spec.vocab_size);
  const double logits = rows * V <= 8.0 * (1 << 24) ? rows * V * s : 64.0 * (1 << 20);
  out.loss = logits + rows * H * (f32 + s) + T * H * s;
  if (spec.has_mixer(MixerKind::kMamba2)) {
    const double chunks = std::ceil(S / static_cast<double>(std::max<int64_t>(1, m.chunk_size))) + 1;
    out.scratch = 3 * chunks * static_cast<double>(m.state_size) * I_m * f32 * static_cast<double>(batch);
  }
  return out;
}

}  // namespace automoe
