// `automoe inspect DIR`: what a checkpoint is, without loading its weights.
#include <iostream>
#include <map>

#include "automoe/cli/commands.h"
#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/config.h"

namespace automoe::cli {
namespace {

// "2 MoE, 4 dense" for a decoder; per kind for a hybrid stack ("2 Mamba-2, 1 attention, 2 MoE,
// 1 MLP").
std::string layer_kinds(const ModelSpec& s) {
  const bool deltanet = s.has_mixer(MixerKind::kGatedDeltaNet);
  if (s.naming != Naming::kHybridBlocks && !deltanet) {
    return std::to_string(s.num_moe_layers()) + " MoE, " +
           std::to_string(s.num_layers - s.num_moe_layers()) + " dense";
  }
  int64_t recurrent = 0, attn = 0, moe = 0, mlp = 0;
  for (const LayerSpec& l : s.layers) {
    recurrent += l.mixer == MixerKind::kMamba2 || l.mixer == MixerKind::kGatedDeltaNet;
    attn += l.mixer == MixerKind::kAttention;
    moe += l.mlp == MlpKind::kMoE;
    mlp += l.mlp == MlpKind::kDense;
  }
  return std::to_string(recurrent) + (deltanet ? " gated DeltaNet, " : " Mamba-2, ") +
         std::to_string(attn) + " attention, " + std::to_string(moe) + " MoE, " +
         std::to_string(mlp) + " MLP";
}


int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string human(int64_t n) {
  char buf[32];
  if (n >= 1000000000)
    std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1000000)
    std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1000)
    std::snprintf(buf, sizeof buf, "%.2fK", n / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

}  // namespace

int inspect(const Args& args) {
  AUTOMOE_CHECK(args.size() == 1, "usage: automoe inspect DIR");
  const std::string& dir = args[0];
  const LoadedConfig cfg = load_config(dir);
  const ModelSpec& s = cfg.spec;
  const Architecture& arch = find_architecture(s.model_type, cfg.path);
  const SafetensorsCheckpoint ckpt(dir);
  const ExpertsLayout layout = detect_layout(ckpt, s, arch);

  int64_t total = 0, experts = 0;
  for (const auto& d : parameter_layout(s)) {
    if (!d.trainable) continue;  // buffers (the routers' correction bias) are not parameters
    total += numel(d.shape);
    std::string prefix;
    if (find_rule(arch.per_expert_rules, d.name, &prefix)) experts += numel(d.shape);
  }
  const int64_t active =
      total - experts + (s.moe.num_experts > 0 ? experts / s.moe.num_experts * s.moe.top_k : 0);
  std::map<std::string, int64_t> dtypes;
  int64_t bytes = 0;
  for (const auto& name : ckpt.names()) {
    const TensorInfo& info = ckpt.info(name);
    dtypes[dtype_to_safetensors(info.dtype)] += 1;
    bytes += static_cast<int64_t>(info.end - info.begin);
  }

  std::cout << "checkpoint     " << dir << "\n"
            << "architecture   " << s.model_type << " (" << arch.hf_class << ")\n"
            << "layers         " << s.num_layers << " (" << layer_kinds(s) << ")\n"
            << "hidden         " << s.hidden_size << ", vocab " << s.vocab_size
            << (s.tie_word_embeddings ? ", tied embeddings" : "") << "\n";
  const AttentionSpec& at = s.attn;
  if (!s.has_mixer(MixerKind::kAttention)) {
  } else if (at.kind == AttentionKind::kMLA) {
    std::cout << "attention      latent (MLA), " << at.num_heads << " heads, q_lora_rank "
              << at.q_lora_rank << ", kv_lora_rank " << at.kv_lora_rank << ", qk "
              << at.qk_nope_head_dim << "+" << at.qk_rope_head_dim << ", v " << at.v_head_dim
              << "\n";
  } else {
    std::cout << "attention      grouped-query" << (at.output_gate ? " with output gate" : "") << ", "
              << at.num_heads << " heads (kv " << at.num_kv_heads << ", head_dim " << at.head_dim
              << ", rotary " << s.rope.dim << ")\n";
  }
  if (s.has_mixer(MixerKind::kMamba2)) {
    const Mamba2Spec& m = s.mamba;
    std::cout << "mamba-2        " << m.num_heads << " heads x " << m.head_dim << ", state "
              << m.state_size << ", " << m.n_groups << " groups, conv " << m.conv_kernel
              << ", chunk " << m.chunk_size << "\n";
  }
  if (s.has_mixer(MixerKind::kGatedDeltaNet)) {
    const GatedDeltaNetSpec& g = s.deltanet;
    std::cout << "gated deltanet " << g.num_k_heads << " key heads x " << g.head_k_dim << ", "
              << g.num_v_heads << " value heads x " << g.head_v_dim << ", conv " << g.conv_kernel
              << ", chunk " << g.chunk_size << "\n";
  }
  if (s.num_moe_layers() > 0) {
    std::cout << "experts        " << s.moe.num_experts << " per layer, top-" << s.moe.top_k
              << ", expert intermediate " << s.moe.intermediate_size
              << (s.moe.norm_topk_prob ? ", top-k renormalised" : "")
              << (s.moe.score == RouterScore::kSigmoid ? ", sigmoid scores" : ", softmax scores");
    if (s.moe.n_group > 1) std::cout << ", " << s.moe.topk_group << " of " << s.moe.n_group << " groups";
    if (s.moe.shared_intermediate_size > 0) {
      std::cout << ", shared experts " << s.moe.shared_intermediate_size << " wide";
    }
    if (s.moe.aux_loss) std::cout << ", aux coef " << s.moe.router_aux_loss_coef;
    std::cout << "\n";
  }
  std::cout << "parameters     " << human(total) << " total (" << total << "), " << human(active)
            << " active per token, " << human(experts) << " in experts\n"
            << "layout         " << to_string(layout) << "\n"
            << "config dtype   " << dtype_to_name(s.dtype) << "\n"
            << "stored dtypes  ";
  bool first = true;
  for (const auto& [dt, n] : dtypes) {
    std::cout << (first ? "" : ", ") << dt << " x" << n;
    first = false;
  }
  std::cout << "\nfiles          " << ckpt.num_files() << " safetensors file(s), "
            << ckpt.names().size() << " tensors, " << human(bytes) << "B\n";
  return 0;
}

}  // namespace automoe::cli
