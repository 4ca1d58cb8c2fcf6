// ModelSpec: everything about an architecture that changes the math, parsed from a Hugging Face
// config.json by the architecture's file under model/arch/. It names the components each layer is
// built from (model/components.h); one generic decoder runs them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace automoe {

// kNone: no rotary embedding at all (Nemotron-H's attention has no positions).
enum class RopeType { kDefault, kLinear, kYarn, kNone };

struct RopeSpec {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;  // kLinear: positions are divided by it; kYarn: the context extension
  // Rotated dimensions of each head's rotary part (partial rotary: the first `dim` of it, the rest
  // passes through); set by the architecture from head_dim * partial_rotary_factor.
  int64_t dim = 0;
  bool interleaved = false;  // pairs (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave)
  // YaRN (Transformers' _compute_yarn_parameters): the ramp between interpolated and extrapolated
  // frequencies, and the factor cos/sin are multiplied by.
  double beta_fast = 32.0, beta_slow = 1.0;
  int64_t original_max_position_embeddings = 0;
  bool truncate = true;
  double attention_factor = 1.0;
  double mscale_all_dim = 0.0;  // DeepSeek's softmax-scale correction for scaled RoPE (0: none)
};

enum class AttentionKind {
  kGQA,  // grouped-query attention: q/k/v/o projections, optional q/k norms and biases
  kMLA,  // DeepSeek's multi-head latent attention: low-rank q and compressed kv
};

struct AttentionSpec {
  AttentionKind kind = AttentionKind::kGQA;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // MLA: = num_heads
  int64_t head_dim = 0;      // GQA: q/k/v head size; MLA: qk_nope + qk_rope (the q/k head size)
  bool qkv_bias = false;     // GQA: biases on q/k/v; MLA: on q_a_proj and kv_a_proj_with_mqa
  bool o_bias = false;
  bool qk_norm = false;  // GQA: RMSNorm on q and k before RoPE (Qwen3, GLM-4.5 optional, OLMoE)
  // true: over each projection's full width [N*D] (OLMoE); false: per head [D] (Qwen3, GLM-4.5).
  bool qk_norm_full_width = false;
  double clip_qkv = 0.0;  // > 0: q, k, v clamped to [-clip, clip] after the norms (OLMoE)
  // GPT-OSS: a learned logit per head that joins every query's softmax and is then dropped.
  bool sinks = false;
  // MLA shapes (Transformers' DeepseekV3Attention).
  int64_t q_lora_rank = 0;  // 0: a plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double softmax_scale = 0.0;  // 0: 1/sqrt(head_dim)
  // MLA's q_a_layernorm / kv_a_layernorm epsilon (Transformers builds them with the RMSNorm
  // default 1e-6, not the config's rms_norm_eps).
  double latent_norm_eps = 1e-6;
  // The per-head size of the attention values (what the attention core weighs; MLA caches its
  // compressed latent instead, see Decoder::latent_attention).
  int64_t v_dim() const { return kind == AttentionKind::kMLA ? v_head_dim : head_dim; }
  // Qwen3-Next / Qwen3.5: q_proj is doubled, each head's [query | gate] halves side by side, and the
  // attention output is multiplied by sigmoid(gate) before o_proj.
  bool output_gate = false;
  // Size of each head's rotary part before partial rotary (RopeSpec::dim may be smaller).
  int64_t rope_head_dim() const { return kind == AttentionKind::kMLA ? qk_rope_head_dim : head_dim; }
};

// The MLPs' activation: kSilu in a gated MLP (SwiGLU: down(silu(gate(x)) * up(x))); kRelu2 in a
// plain one (down(relu(up(x))²), Nemotron-H's "relu2").
enum class Activation { kSilu, kRelu2 };

enum class RouterScore { kSoftmax, kSigmoid };

struct MoESpec {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // per expert
  RouterScore score = RouterScore::kSoftmax;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;  // the config default for forward(output_router_logits=None)
  // Group-limited routing (DeepSeek-V3): experts in n_group groups, the topk_group best kept.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  // e_score_correction_bias: a float32 buffer that steers the choice of experts only.
  bool correction_bias = false;
  // Shared experts beside the routed ones: an always-on MLP of this intermediate size
  // (moe_intermediate_size * n_shared_experts); -1: none. 0 is a module that adds nothing.
  int64_t shared_intermediate_size = -1;
  std::string shared_name = "shared_experts";  // its module name (Qwen2-MoE: "shared_expert")
  // Qwen2-MoE: the shared expert's output is scaled by sigmoid(shared_expert_gate(x)), [1, H].
  bool shared_gate = false;
  // GPT-OSS: the router is `mlp.router` with a bias; the experts are stored transposed
  // (`gate_up_proj` [E, H, 2I] with gate and up interleaved, `down_proj` [E, I, H]), carry biases,
  // and use the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), clamped at 7).
  bool gpt_oss = false;
  // Nemotron-H: experts without a gate projection (`experts.up_proj` [E, I, H], `down_proj`
  // [E, H, I], relu2 between them), a shared expert of the same kind, and, with latent_size > 0,
  // the routed experts run on fc1_latent_proj(x) [latent] and their sum goes through
  // fc2_latent_proj back to the hidden size (the router and the shared expert see x itself).
  bool gated = true;
  int64_t latent_size = 0;
  // Mixtral: in training, the MoE input is multiplied by uniform(1 - j, 1 + j) noise (drawn from
  // torch's default generator, as Transformers draws it) before routing and experts.
  double router_jitter_noise = 0.0;
  // Whether Transformers computes the load-balancing loss for this type (forward(
  // output_router_logits=True)); DeepSeek-V3 and GLM-4.5 train without one.
  bool aux_loss = true;
  // Expert parallelism: this process holds the routed experts [expert_begin, expert_begin +
  // expert_count) of every MoE layer (their parameters are [expert_count, ...]); 0: all of them.
  // Routing is always over all num_experts.
  int64_t expert_begin = 0, expert_count = 0;
  int64_t local_experts() const { return expert_count > 0 ? expert_count : num_experts; }
  bool sharded() const { return expert_count > 0 && expert_count < num_experts; }
};

// Mamba-2's selective state-space mixer (Transformers' NemotronHMamba2Mixer).
struct Mamba2Spec {
  int64_t num_heads = 0, head_dim = 0;  // mamba_num_heads x mamba_head_dim = the inner width
  int64_t state_size = 0;               // ssm_state_size (N)
  int64_t n_groups = 1;                 // B/C groups, each shared by num_heads / n_groups heads
  int64_t conv_kernel = 4;              // depthwise causal conv1d over x, B and C
  int64_t chunk_size = 128;             // the SSD scan's chunk length
  bool conv_bias = true, proj_bias = false;
  double dt_min = 0.0;                  // dt = softplus(dt + dt_bias) clamped below at this
  double norm_eps = 1e-5;               // the gated grouped RMSNorm's epsilon
  int64_t inner() const { return num_heads * head_dim; }
  int64_t conv_dim() const { return inner() + 2 * n_groups * state_size; }
};

// Gated DeltaNet linear attention (Transformers' Qwen3NextGatedDeltaNet / Qwen3_5MoeGatedDeltaNet):
// in-projections -> q, k (num_k_heads x head_k_dim), v, z (num_v_heads x head_v_dim), b, a (one per
// value head); depthwise causal conv1d + SiLU over [q | k | v]; L2-normalised q and k, each key head
// read by num_v_heads / num_k_heads value heads; beta = sigmoid(b), g = -exp(A_log) softplus(a +
// dt_bias); the chunked gated delta rule; per-head RMSNorm gated by silu(z); out_proj.
struct GatedDeltaNetSpec {
  int64_t num_k_heads = 0, num_v_heads = 0, head_k_dim = 0, head_v_dim = 0;
  int64_t conv_kernel = 4;
  int64_t chunk_size = 64;  // the chunk of Transformers' torch_chunk_gated_delta_rule
  // Qwen3-Next: in_proj_qkvz [2K + 2V, H] and in_proj_ba [2 Nv, H], interleaved per key head (each
  // key head's q, k, then its value heads' v and z). Qwen3.5: separate in_proj_qkv (q | k | v),
  // in_proj_z, in_proj_b, in_proj_a.
  bool split_projections = false;
  double norm_eps = 1e-6;
  int64_t key_dim() const { return num_k_heads * head_k_dim; }
  int64_t value_dim() const { return num_v_heads * head_v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
};

// The sequence mixer of a layer: attention (the model's AttentionSpec), Mamba-2 (its Mamba2Spec),
// gated DeltaNet (its GatedDeltaNetSpec), or none (a layer that is only an MLP or MoE block, as
// Nemotron-H's).
enum class MixerKind { kAttention, kMamba2, kGatedDeltaNet, kNone };
enum class MlpKind { kDense, kMoE, kNone };

// What one layer is built from: a sequence mixer then an MLP, each behind its own pre-norm and
// residual; a hybrid layer has exactly one of the two.
struct LayerSpec {
  MixerKind mixer = MixerKind::kAttention;
  MlpKind mlp = MlpKind::kMoE;
  int64_t sliding_window = 0;  // 0: full causal attention; else keys within this many positions
};

// How Transformers names a model's modules: kDecoder `model.embed_tokens`, `layers.{i}.self_attn` /
// `.mlp` / `.input_layernorm` / `.post_attention_layernorm`, `model.norm`; kHybridBlocks
// (Nemotron-H) `model.embeddings`, `layers.{i}.norm` + `layers.{i}.mixer` (whatever the layer's one
// component is), `model.norm_f`.
enum class Naming { kDecoder, kHybridBlocks };

struct ModelSpec {
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  AttentionSpec attn;
  RopeSpec rope;
  Activation hidden_act = Activation::kSilu;  // the dense MLP's and the shared experts'
  int64_t intermediate_size = 0;  // dense MLP layers
  bool mlp_bias = false;           // biases on the plain (kRelu2) MLPs and the latent projections
  Mamba2Spec mamba;
  GatedDeltaNetSpec deltanet;
  // Zero-centred RMSNorm weights (Qwen3-Next, Qwen3.5): the decoder's norms (layer, final, q/k)
  // scale by 1 + weight in float32, their weights initialised to zeros.
  bool zero_centered_norms = false;
  Naming naming = Naming::kDecoder;
  MoESpec moe;
  std::vector<LayerSpec> layers;  // size num_layers
  bool tie_word_embeddings = false;
  c10::ScalarType dtype = c10::kFloat;  // the checkpoint's dtype (config "dtype"/"torch_dtype")
  int64_t pad_token_id = -1;            // -1 when the config has none
  // Whether the embedding treats pad_token_id as nn.Embedding's padding_idx (its row gets no
  // gradient); Nemotron-H's embedding has none.
  bool embedding_padding_idx = true;
  // Multi-token-prediction layers a checkpoint may hold after the last layer (DeepSeek-V3's
  // num_nextn_predict_layers): skipped on load, as Transformers ignores them.
  int64_t num_mtp_layers = 0;
  // A separate `mtp.*` module a checkpoint may hold (Nemotron 3 Super / Ultra, Qwen3-Next):
  // skipped on load with one message, as Transformers ignores it.
  bool mtp_module = false;
  // GPT-OSS's released checkpoints: experts stored as MXFP4 blocks + scales (quantization_config
  // quant_method "mxfp4"), dequantised to the compute dtype on load; saves write them dequantised.
  bool mxfp4_experts = false;
  // A checkpoint bitsandbytes quantised (quantization_config quant_method "bitsandbytes"): "nf4",
  // "fp4" or "int8", else empty. Its quantised routed experts load quantised (a LoRA base), its
  // other quantised weights dequantised (io/bnb.h); saves write no quantization_config.
  std::string bnb_quantized;
  // ...and its routed experts are among the quantised tensors (a per-expert checkpoint quantised
  // one linear layer at a time; Transformers v5 leaves fused experts unquantised). Set by
  // load_config from the tensors' names.
  bool bnb_quantized_experts = false;

  bool is_moe(int64_t layer) const { return layers[layer].mlp == MlpKind::kMoE; }
  bool has_mixer(MixerKind kind) const;
  int64_t num_moe_layers() const;
  // The per-layer MLP kinds from a list of flags (true = MoE), every window 0.
  void set_moe_layers(const std::vector<bool>& is_moe);
};

}  // namespace automoe
