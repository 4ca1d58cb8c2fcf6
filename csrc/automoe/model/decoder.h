// The generic MoE decoder: one implementation that runs the components a ModelSpec names
// (model/components.h) with the functions its BackendConfig resolved to (ComponentOps), holding its
// parameters under Transformers v5's in-memory names and shapes (so state dicts compare 1:1).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "automoe/model/backend.h"
#include "automoe/moe/dispatcher.h"
#include "automoe/model/components.h"
#include "automoe/model/kv_cache.h"
#include "automoe/model/lora.h"
#include "automoe/model/spec.h"
#include "automoe/moe/router.h"
#include "automoe/ops/cross_entropy/cross_entropy.h"
#include "automoe/ops/quant/quant.h"

namespace automoe {

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
  // Training mode (Transformers' module.training): turns on train-time noise (Mixtral's
  // router_jitter_noise).
  bool training = false;
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
  // `params` must hold exactly parameter_layout(spec), same names and shapes (checked); buffers
  // (ParamDecl::trainable false) among them.
  Decoder(ModelSpec spec, BackendConfig backend, NamedTensors params);

  const ModelSpec& spec() const { return spec_; }
  const BackendConfig& backend() const { return backend_; }
  void set_backend(BackendConfig backend);
  // Expert parallelism: how this process's tokens reach the experts of the other ranks of its EP
  // group (the spec holds this rank's experts, ModelSpec::moe.expert_begin/expert_count). A
  // sharded model refuses to run without one.
  void set_dispatcher(std::shared_ptr<moe::Dispatcher> dispatcher);
  moe::Dispatcher* dispatcher() const { return dispatcher_.get(); }
  // Parameters and buffers, in parameter_layout order; trainable()[i] says which is which.
  const NamedTensors& named_parameters() const { return params_; }
  const std::vector<bool>& trainable() const { return trainable_; }
  const ModelSlots& slots() const { return slots_; }
  // Replaces the tensor behind `name` (same shape), e.g. by a Python nn.Parameter that aliases it,
  // so that gradients land where the caller's optimizer looks. Adapter factors go by their
  // LoraSite::a_name() / b_name().
  void set_parameter(const std::string& name, const at::Tensor& tensor);
  // A frozen weight held quantised (ops/quant/quant.h; a LoRA base's routed experts): the named
  // parameter is then a meta tensor of the dequantised shape and dtype, and the forward
  // dequantises where it multiplies. Replaces any quantised weight set before under that name.
  void set_quantized(const std::string& name, ops::QuantizedWeight q);
  // The quantised weight behind parameter `slot` (named_parameters() index), or null.
  const ops::QuantizedWeight* quantized(int64_t slot) const {
    return quantized_.empty() || !quantized_[slot].defined() ? nullptr : &quantized_[slot];
  }
  bool has_quantized() const { return !quantized_.empty(); }
  // Parameter `slot` as a dense tensor: the parameter, or its quantised weight dequantised (to
  // `dtype`, default the parameter's).
  at::Tensor dense(int64_t slot, std::optional<c10::ScalarType> dtype = std::nullopt) const;
  // LoRA adapters (model/lora.h) the forward runs beside their base weights, replacing any set
  // before (empty: none). Each site's slot, names and factor shapes are checked against the model.
  void set_adapters(std::vector<LoraSite> sites);
  const std::vector<LoraSite>& adapters() const { return adapters_; }
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
  // What every layer of one forward shares.
  struct LayerContext {
    at::Tensor cos_BSh, sin_BSh;  // RoPE half-angle tables [B, S, rope.dim / 2]
    // Per layer (its sliding window): sdpa a bool mask (true = may attend) or none (then
    // is_causal says whether SDPA applies its own causal mask); eager an additive mask (0 or the
    // dtype's lowest value), always present.
    std::vector<std::optional<at::Tensor>> mask;
    std::vector<bool> is_causal;
    KVCache* cache;  // incremental decoding, or null
    // torch.autocast's dtype when it was on for the forward (a checkpointed layer's recompute in
    // the backward, where autocast is off, restores it), else nullopt.
    std::optional<c10::ScalarType> autocast;
    bool training = false;  // ForwardArgs::training
    // Recurrent mixers (Mamba-2, gated DeltaNet): the [B, S] padding mask Transformers' create_recurrent_attention_mask gives
    // (none without padding or for one token) and the trainer's document ids (restarts).
    std::optional<at::Tensor> recurrent_keep_BS, doc_BS;
    struct Attention {  // one layer's mask
      const std::optional<at::Tensor>& mask;
      bool is_causal;
    };
  };
  const at::Tensor& p(int64_t i) const { return params_[i].second; }
  // `fixed_idx`: route to these experts instead of choosing (a checkpointed layer's recompute).
  LayerOutput layer(const LayerSlots& L, const at::Tensor& h_BSH, const LayerContext& c,
                    const at::Tensor* fixed_idx) const;
  // The layer's sequence mixer (attention, latent attention or Mamba-2) on its normed input.
  at::Tensor mixer(const LayerSlots& L, const at::Tensor& x_BSH, const LayerContext& c) const;
  // The MoE block on x [T, H]: routing, routed and shared experts; fills out's router logits and
  // chosen experts.
  at::Tensor moe_block(const MoESlots& M, const at::Tensor& x_TH, const LayerContext& c,
                       const at::Tensor* fixed_idx, LayerOutput* out) const;
  LayerOutput checkpointed_layer(const LayerSlots& L, const at::Tensor& h_BSH,
                                 const LayerContext& c,
                                 const std::shared_ptr<const Decoder>& self) const;
  // Grouped-query attention (q/k/v/o, optional q/k norms) and DeepSeek's latent attention.
  at::Tensor attention(const AttentionSlots& A, int64_t layer, const at::Tensor& x_BSH,
                       const LayerContext& c, const LayerContext::Attention& m) const;
  at::Tensor latent_attention(const AttentionSlots& A, int64_t layer, const at::Tensor& x_BSH,
                              const LayerContext& c, const LayerContext::Attention& m) const;
  at::Tensor norm(const at::Tensor& x, int64_t weight) const;
  // x·Wᵀ (+ bias) for the linear weight in slot `w`, plus its LoRA adapter when it has one
  // (dropout on the adapter's input in training).
  at::Tensor linear(const at::Tensor& x, int64_t w, int64_t bias, bool training) const;
  // The router's weight, with its LoRA adapter merged in when it has one.
  at::Tensor router_weight(const MoESlots& M) const;
  // down(silu(gate(x)) * up(x)) (or, without a gate, down(relu(up(x))²)): the dense MLP and the
  // shared experts.
  at::Tensor mlp(const at::Tensor& x, const MlpSlots& m, bool training) const;
  const LoraSite* adapter(int64_t slot) const {
    return adapter_of_.empty() || adapter_of_[slot] < 0 ? nullptr : &adapters_[adapter_of_[slot]];
  }
  // RoPE on the first rope.dim dimensions of x [B, S, N, D] (partial rotary passes the rest).
  at::Tensor rotate(const at::Tensor& x_BSND, const LayerContext& c) const;
  // `compute_dtype`: run the expert GEMMs in this dtype (autocast), the result in x's dtype.
  at::Tensor experts(const at::Tensor& x_TH, const moe::Routing& routing, const MoESlots& M,
                     std::optional<c10::ScalarType> compute_dtype) const;
  // Cross-entropy sum and count of the causal shift through the fused LM head + loss.
  ops::LossSum fused_causal_lm_loss(const at::Tensor& h_BSH, const at::Tensor& labels_BS,
                                    std::optional<c10::ScalarType> compute_dtype) const;

  ModelSpec spec_;
  BackendConfig backend_;
  ComponentOps ops_;
  NamedTensors params_;
  std::vector<bool> trainable_;
  ModelSlots slots_;
  std::vector<ops::QuantizedWeight> quantized_;  // per parameter (undefined: dense); empty: none
  std::vector<LoraSite> adapters_;
  std::vector<int64_t> adapter_of_;  // per parameter: its adapter's index, -1; empty: no adapters
  std::vector<std::vector<at::Tensor>> layer_adapters_;  // per layer: its adapters' factors
  std::vector<int8_t> lora_targets_;  // model/lora.h lora_targets(spec_), once adapters are set
  void index_adapters();  // layer_adapters_ from adapters_
  at::Tensor inv_freq_;
  double scale_ = 1.0;            // attention softmax scale
  ops::RouterParams router_;      // from spec_.moe
  std::shared_ptr<moe::Dispatcher> dispatcher_;  // expert parallelism, else null
};

}  // namespace automoe
