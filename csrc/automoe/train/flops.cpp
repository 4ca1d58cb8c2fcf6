#include "automoe/train/flops.h"

namespace automoe {

double forward_flops_per_token(const ModelSpec& s, int64_t seq_len) {
  const double H = s.hidden_size, N = s.num_heads, KV = s.num_kv_heads, D = s.head_dim;
  const double attn_proj = 2 * H * N * D + 2 * 2 * H * KV * D + 2 * N * D * H;
  const double attn_core = 2 * 2 * N * D * (static_cast<double>(seq_len) + 1) / 2;
  const double E = s.moe.num_experts, K = s.moe.top_k, I = s.moe.intermediate_size;
  const double moe = 2 * H * E + K * (2 * H * 2 * I + 2 * I * H);
  const double dense = 2 * H * 2 * s.intermediate_size + 2 * s.intermediate_size * H;
  double total = 2 * H * s.vocab_size;
  for (bool is_moe : s.layer_is_moe) total += attn_proj + attn_core + (is_moe ? moe : dense);
  return total;
}

}  // namespace automoe
