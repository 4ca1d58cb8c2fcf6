// The components a decoder is built from — embedding, attention (GQA | MLA), dense MLP, MoE block
// (router, routed experts, shared experts), RMSNorms, LM head — each declaring its parameters
// (Transformers v5's in-memory names, shapes, initialisation) once, here. The parameter layout,
// the initialisation, the FLOPs count and the decoder's parameter slots all come from these
// declarations; an architecture only says which components each layer has (ModelSpec).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "automoe/model/spec.h"

namespace automoe {

enum class Init { kNormal, kOnes, kZeros };

struct ParamDecl {
  std::string name;
  std::vector<int64_t> shape;
  Init init = Init::kNormal;
  // false: a buffer that is saved and loaded with the weights but never trained by gradients
  // (DeepSeek-V3's e_score_correction_bias).
  bool trainable = true;
  bool keep_float32 = false;  // stays float32 whatever dtype the model is loaded in
  // A routed expert tensor: dim 0 is the expert (this process's spec.moe.local_experts()).
  bool routed_expert = false;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Index of each parameter of a component in the model's parameter list; -1 where absent.
struct AttentionSlots {
  // GQA
  int64_t q = -1, q_bias = -1, k = -1, k_bias = -1, v = -1, v_bias = -1, q_norm = -1, k_norm = -1;
  // MLA
  int64_t q_a = -1, q_a_bias = -1, q_a_norm = -1, q_b = -1, kv_a = -1, kv_a_bias = -1,
          kv_a_norm = -1, kv_b = -1;
  int64_t o = -1, o_bias = -1;
  int64_t sinks = -1;  // GPT-OSS [N]
};

struct MlpSlots {
  int64_t gate = -1, up = -1, down = -1;  // gate == -1: a plain MLP, down(act(up(x)))
  int64_t up_bias = -1, down_bias = -1;   // plain MLPs with mlp_bias
};

// Mamba-2 (Transformers' NemotronHMamba2Mixer).
struct MambaSlots {
  int64_t dt_bias = -1, a_log = -1, d = -1;  // [heads] each
  int64_t conv = -1, conv_bias = -1;         // conv1d.weight [conv_dim, 1, kernel], .bias
  int64_t in_proj = -1, in_proj_bias = -1;   // [inner + conv_dim + heads, H]
  int64_t norm = -1;                         // the gated grouped RMSNorm's weight [inner]
  int64_t out_proj = -1, out_proj_bias = -1; // [H, inner]
};

// Gated DeltaNet (Transformers' Qwen3NextGatedDeltaNet; Qwen3.5's split projections).
struct DeltaNetSlots {
  int64_t dt_bias = -1, a_log = -1;       // [num_v_heads] each
  int64_t conv = -1;                       // conv1d.weight [conv_dim, 1, kernel] (no bias)
  int64_t in_proj_qkvz = -1, in_proj_ba = -1;                         // Qwen3-Next
  int64_t in_proj_qkv = -1, in_proj_z = -1, in_proj_b = -1, in_proj_a = -1;  // Qwen3.5
  int64_t norm = -1;                       // the gated RMSNorm's weight [head_v_dim]
  int64_t out_proj = -1;                   // [H, value_dim]
};

struct MoESlots {
  int64_t gate_up = -1, down = -1, router = -1, correction_bias = -1;
  int64_t router_bias = -1, gate_up_bias = -1, down_bias = -1;  // GPT-OSS
  MlpSlots shared;  // shared experts (absent: gate == -1)
  int64_t shared_gate = -1;  // Qwen2-MoE's shared_expert_gate [1, H]
  // Nemotron-H's latent projections around the routed experts (absent: -1).
  int64_t latent_in = -1, latent_in_bias = -1, latent_out = -1, latent_out_bias = -1;
};

struct LayerSlots {
  int64_t index = 0;  // the layer number (the KV cache's layer)
  MixerKind mixer = MixerKind::kAttention;
  AttentionSlots attn;
  MambaSlots mamba;
  DeltaNetSlots deltanet;
  MlpKind mlp_kind = MlpKind::kMoE;
  bool moe = false;
  MlpSlots mlp;  // dense layers
  MoESlots experts;  // MoE layers
  // The mixer's pre-norm and the MLP's; a hybrid block's one norm is whichever its component uses.
  int64_t input_norm = -1, post_norm = -1;
  std::vector<int64_t> all;  // every parameter of the layer (what a checkpointed layer differentiates)
};

struct ModelSlots {
  int64_t embed = -1, final_norm = -1, lm_head = -1;  // lm_head == embed when tied
  std::vector<LayerSlots> layers;
};

// Every parameter `spec` implies, in Transformers' named_parameters() order (buffers where
// Transformers registers them), and where each component finds its own.
ModelSlots declare_model(const ModelSpec& spec, std::vector<ParamDecl>* decls);
std::vector<ParamDecl> parameter_layout(const ModelSpec& spec);

// Matmul FLOPs per token of one forward (2 per multiply-add), per component:
//   attention  GQA: 2*H*(N*D) + 2*2*H*(KV*D) + 2*(N*D)*H; MLA: its five projections;
//              + 2*N*(Dqk + Dv)*(S+1)/2 for scores and weighted values over the (S+1)/2 keys
//              a causal query sees
//   MoE        2*H*E router + K * (2*H*2I + 2*I*H) routed experts + the shared experts' MLP
//   dense MLP  2*H*2I + 2*I*H
//   LM head    2*H*V
double forward_flops_per_token(const ModelSpec& spec, int64_t seq_len);

// The activation memory of one training micro-batch of `batch` rows of `seq_len` tokens (each row
// with document ids, as the trainer's packed batches have) in a model computing in
// `compute_bytes`-byte floats: what each component's autograd keeps from the forward to the
// backward, and the largest transients (components.cpp lists them per component).
struct ActivationDecl {
  std::vector<double> layer;   // bytes layer l keeps for its backward, weight-sized copies included
  double layer_input = 0;      // what a checkpointed layer keeps instead (its input, its routing)
  double layer_backward = 0;   // the largest layer's backward temporaries
  double head = 0;             // the embedding's, final norm's and loss's kept tensors, the masks
  double loss = 0;             // the fused LM head + loss: kept logits or one chunk, its backward's
  double scratch = 0;          // kernels' thread-local buffers (the SSD scan's chunk states)
};
ActivationDecl activation_bytes(const ModelSpec& spec, int64_t batch, int64_t seq_len,
                                int64_t compute_bytes);

}  // namespace automoe
