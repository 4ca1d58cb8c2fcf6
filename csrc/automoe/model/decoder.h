// The generic MoE decoder: one implementation, parameterised by a ModelSpec, holding its
// parameters under Transformers v5's in-memory names and shapes (so state dicts compare 1:1).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "automoe/model/backend.h"
#include "automoe/model/kv_cache.h"
#include "automoe/model/spec.h"
#include "automoe/moe/router.h"
#include "automoe/ops/cross_entropy/cross_entropy.h"

namespace automoe {

struct ParamDecl {
  std::string name;
  std::vector<int64_t> shape;
};

// Every parameter the spec implies, in Transformers' named_parameters() order.
std::vector<ParamDecl> parameter_layout(const ModelSpec& spec);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct ForwardArgs {
  at::Tensor input_ids;  // [B, S] integer token ids (undefined with inputs_embeds)
  // [B, S] or, with a non-empty `cache`, [B, cached + S]: nonzero = token, 0 = padding
  std::optional<at::Tensor> attention_mask;
  std::optional<at::Tensor> position_ids;    // [B, S] or [1, S]; default 0..S-1
  std::optional<at::Tensor> labels;          // [B, S], -100 = no loss; shifted inside
  std::optional<bool> output_router_logits;  // default: the config's output_router_logits
  std::optional<double> num_items_in_batch;  // loss = sum / this (else mean over loss tokens)
  // Without attention_mask, position_ids that restart mark packed documents that must not attend
  // to each other. Transformers does this only when it runs without a KV cache (use_cache=False);
  // the drop-in passes that through, the trainer always splits.
  bool split_packed_documents = true;
  // [B, S] integer document of each token (the trainer's packed and padded batches): a token
  // attends only to earlier tokens of its own document; a negative id marks padding, which is
  // excluded from the aux loss and the expert counts. Use instead of attention_mask.
  std::optional<at::Tensor> document_ids;
  // Multiplies router_aux_loss_coef: the trainer weights each micro-batch's aux loss by its share
  // of the accumulation window's loss tokens.
  double aux_loss_scale = 1.0;
  std::optional<double> router_aux_loss_coef;  // overrides the config's (a recipe's setting)
  bool output_expert_counts = false;           // fill ForwardResult::expert_counts
  // Keep only each layer's input; recompute the layer in the backward pass (with the routing
  // decisions of the forward). Applies when gradients are being recorded.
  bool activation_checkpointing = false;
  // [B, S, H] embeddings to use instead of looking up input_ids (Transformers' inputs_embeds).
  std::optional<at::Tensor> inputs_embeds;
  // Incremental decoding: this step's keys/values are appended to `cache` and attention reads
  // everything cached; default positions continue after the cached ones.
  KVCache* cache = nullptr;
  // false: stop after the final norm (ForwardResult::last_hidden_state), as Transformers' backbone.
  bool lm_head = true;
  // Logits only for the last `logits_to_keep` positions (0 = all), or for the positions listed in
  // `logits_indices` (1-D), as Transformers' logits_to_keep. Not with labels.
  int64_t logits_to_keep = 0;
  std::optional<at::Tensor> logits_indices;
  // Fill ForwardResult::hidden_states: the embeddings, then each layer's output, the last one
  // after the final norm (Transformers' output_hidden_states).
  bool output_hidden_states = false;
};

struct ForwardResult {
  at::Tensor logits;                      // [B, S, V], model dtype
  at::Tensor last_hidden_state;           // [B, S, H] after the final norm
  std::optional<at::Tensor> loss;         // cross-entropy (+ coef * aux when router logits on)
  std::optional<at::Tensor> aux_loss;     // load-balancing loss, when router logits are on
  std::vector<at::Tensor> router_logits;  // per MoE layer [B*S, E] float32, when on
  // Per MoE layer [E] int64: token-slots routed to each expert (padding excluded), when asked.
  std::vector<at::Tensor> expert_counts;
  std::vector<at::Tensor> hidden_states;  // when output_hidden_states: num_layers + 1 of [B, S, H]
};

class Decoder {
 public:
  // `params` must hold exactly parameter_layout(spec), same names and shapes (checked).
  Decoder(ModelSpec spec, BackendConfig backend, NamedTensors params);

  const ModelSpec& spec() const { return spec_; }
  const BackendConfig& backend() const { return backend_; }
  void set_backend(BackendConfig backend) { backend_ = backend; }
  const NamedTensors& named_parameters() const { return params_; }
  // Replaces the tensor behind `name` (same shape), e.g. by a Python nn.Parameter that aliases it,
  // so that gradients land where the caller's optimizer looks.
  void set_parameter(const std::string& name, const at::Tensor& tensor);
  // A new vocabulary size (Transformers' resize_token_embeddings): the embedding [V', H] and, when
  // the LM head is not tied, the LM head [V', H] replace the current ones.
  void resize_vocab(const at::Tensor& embed_VH, const std::optional<at::Tensor>& lm_head_VH);
  // The tensors the owner holds now, one per named_parameters() entry (nullopt: keep the current
  // one): those that are not the tensor already bound replace it (same shape), and a new row
  // count on the embedding resizes the vocabulary.
  void rebind(const std::vector<std::optional<at::Tensor>>& tensors);

  // Under torch.autocast (float32 parameters, bfloat16/float16 matmuls) the forward follows
  // Transformers' modules under autocast: ATen's matmuls take autocast's casts, the residual
  // stream, norms and RoPE stay in the parameters' dtype, the experts' grouped GEMMs run in the
  // autocast dtype, and the router stays float32 (our rule, autocast or not).
  ForwardResult forward(const ForwardArgs& args) const;

  // One decoder layer's results (used by the activation-checkpointing machinery).
  struct LayerOutput {
    at::Tensor h;              // [B, S, H] the layer's output hidden states
    at::Tensor router_logits;  // MoE layers: [B*S, E] float32
    at::Tensor idx;            // MoE layers: [B*S, K] chosen experts
  };

 private:
  struct LayerIdx {
    int64_t index;  // layer number (the KV cache's layer)
    int64_t input_norm, post_norm;
    int64_t q, k, v, o, q_bias = -1, k_bias = -1, v_bias = -1, o_bias = -1, q_norm, k_norm;
    bool moe;
    int64_t router = -1, gate_up = -1, down = -1;       // MoE
    int64_t mlp_gate = -1, mlp_up = -1, mlp_down = -1;  // dense
    std::vector<int64_t> all_params;                    // every parameter of the layer
  };
  // What every layer of one forward shares.
  struct LayerContext {
    at::Tensor cos_BSD, sin_BSD;
    // sdpa: a bool mask (true = may attend) or none (then is_causal says whether SDPA applies its
    // own causal mask); eager: an additive mask (0 or the dtype's lowest value), always present.
    std::optional<at::Tensor> mask;
    bool is_causal;
    bool eager;
    KVCache* cache;  // incremental decoding, or null
    // torch.autocast's dtype when it was on for the forward (a checkpointed layer's recompute in
    // the backward, where autocast is off, restores it), else nullopt.
    std::optional<c10::ScalarType> autocast;
  };
  const at::Tensor& p(int64_t i) const { return params_[i].second; }
  // `fixed_idx`: route to these experts instead of choosing (a checkpointed layer's recompute).
  LayerOutput layer(const LayerIdx& L, const at::Tensor& h_BSH, const LayerContext& c,
                    const at::Tensor* fixed_idx) const;
  LayerOutput checkpointed_layer(const LayerIdx& L, const at::Tensor& h_BSH, const LayerContext& c,
                                 const std::shared_ptr<const Decoder>& self) const;
  at::Tensor attention(const LayerIdx& L, const at::Tensor& x_BSH, const LayerContext& c) const;
  at::Tensor rms_norm(const at::Tensor& x, int64_t weight) const;
  // `compute_dtype`: run the expert GEMMs in this dtype (autocast), the result in x's dtype.
  at::Tensor experts(const at::Tensor& x_TH, const moe::Routing& routing,
                     const at::Tensor& w_gate_up, const at::Tensor& w_down,
                     std::optional<c10::ScalarType> compute_dtype) const;
  // Cross-entropy sum and count of the causal shift through the fused LM head + loss.
  ops::LossSum fused_causal_lm_loss(const at::Tensor& h_BSH, const at::Tensor& labels_BS,
                                    std::optional<c10::ScalarType> compute_dtype) const;

  ModelSpec spec_;
  BackendConfig backend_;
  NamedTensors params_;
  std::vector<LayerIdx> layers_;
  int64_t embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  at::Tensor inv_freq_;
};

}  // namespace automoe
