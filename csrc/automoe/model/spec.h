// ModelSpec: everything about an architecture that changes the math, parsed from a Hugging Face
// config.json by the architecture's file under model/arch/. One generic decoder is built from it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace automoe {

enum class RopeType { kDefault, kLinear };

struct RopeSpec {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;  // kLinear: positions are divided by it
};

enum class Activation { kSilu };

enum class RouterScore { kSoftmax };

struct MoESpec {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // per expert
  RouterScore score = RouterScore::kSoftmax;
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.0;
  bool output_router_logits = false;  // the config default for forward(output_router_logits=None)
};

struct ModelSpec {
  std::string model_type;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;
  bool qk_norm = true;         // per-head RMSNorm on q and k before RoPE (Qwen3)
  int64_t sliding_window = 0;  // 0: full causal attention; else keys within this many positions
  RopeSpec rope;
  Activation hidden_act = Activation::kSilu;
  int64_t intermediate_size = 0;  // dense MLP layers
  MoESpec moe;
  std::vector<bool> layer_is_moe;  // size num_layers
  bool tie_word_embeddings = false;
  c10::ScalarType dtype = c10::kFloat;  // the checkpoint's dtype (config "dtype"/"torch_dtype")
  int64_t pad_token_id = -1;            // -1 when the config has none

  int64_t num_moe_layers() const;
};

}  // namespace automoe
