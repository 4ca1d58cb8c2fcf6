// What the trainer measures between two log records (one window of log.every steps) and how it
// becomes metrics.jsonl fields: loss sums, tokens and FLOPs, per-layer expert loads (min, max, CV,
// empty experts), which experts' LoRA adapters received gradients, and — under a mesh — what each
// rank's dispatcher moved, its peak memory and its wait for the gradient reductions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "automoe/model/decoder.h"
#include "automoe/model/lora.h"
#include "automoe/parallel/world.h"
#include "automoe/train/optimizer.h"

namespace automoe::train {

// What one log window (log.every steps) accumulates.
struct Window {
  double ce_sum = 0, aux_weighted = 0, loss_tokens = 0, tokens = 0, flops = 0, seconds = 0;
  int64_t steps = 0, skipped = 0, aux_steps = 0, truncated = 0;
  double grad_norm = 0;
  double grad_sync_s = 0;  // time this rank waited for the step's gradient reductions
  std::vector<at::Tensor> expert_counts;  // per MoE layer, summed over the window
};

// The "expert_load" field: per MoE layer (counts[i] is layer moe_layers[i]) the tokens each expert
// received, with min, max, coefficient of variation and the number of experts that got none.
nlohmann::json expert_load(const std::vector<at::Tensor>& counts,
                           const std::vector<int64_t>& moe_layers);

// What the routed experts' adapters did in a log window: which experts' adapters received a
// gradient (per MoE layer), and how far the last step moved them — so that adapters that never
// train are visible in the metrics.
struct ExpertAdapterMetrics {
  struct Site {
    int64_t layer;
    size_t a, b;  // optimizer indices of the factors
  };
  std::vector<Site> sites;
  std::map<int64_t, at::Tensor> touched;  // per layer: bool [E]

  // The sites of `lora` that adapt routed experts, found among the optimizer's tensors.
  static ExpertAdapterMetrics of(const std::vector<LoraSite>& lora, const AdamW& opt);
  // After clipping: marks the experts whose factors have a non-zero gradient this step.
  void add_gradients(const AdamW& opt);
  // Masters of the experts' factors before an update (for report's update_norm).
  std::vector<at::Tensor> snapshot(const AdamW& opt) const;
  // The "expert_lora" field, per layer; forgets the window. `before`: snapshot() of the window's
  // last update (empty: update_norm NaN). Under expert parallelism every rank of `ep` calls it
  // at the same step (the counts and norms are summed over the group).
  nlohmann::json report(const AdamW& opt, const std::vector<at::Tensor>& before,
                        const parallel::Group& ep = {});
};

// What every rank of a mesh reports at a logged step.
struct RankMetrics {
  nlohmann::json dispatch;  // per rank: bytes, rows, waits (null without a dispatcher)
  std::vector<double> peak_memory_gib, gradient_sync_wait_s;
};

// Collective (every rank of `world`, at the same logged step): sums the window's expert loads over
// the ranks (zeros where a rank counted none) and gathers each rank's dispatcher statistics, peak
// memory and mean gradient-sync wait per step. `dev`: where the expert counts live.
RankMetrics gather_rank_metrics(Window& win, Decoder& decoder, const parallel::World& world,
                                c10::Device dev, size_t moe_layers, int64_t peak_memory_bytes);

}  // namespace automoe::train
