// DeepSeek-V3's auxiliary-loss-free load balancing (recipe `router.bias_update_rate`): after each
// optimizer step, every MoE layer's e_score_correction_bias moves by `rate` per expert against
// that expert's load in the step — bias += rate * sign(mean load - load). The bias steers only
// which experts are chosen; it is a buffer the optimizer never sees.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

#include "automoe/model/decoder.h"

namespace automoe::train {

class BiasBalance {
 public:
  // Off when rate == 0. Refuses (naming the recipe key) a model whose routers have no bias.
  BiasBalance(const Decoder& model, double rate);
  bool enabled() const { return !biases_.empty(); }
  // A micro-batch's per-MoE-layer expert counts (ForwardResult::expert_counts).
  void add_counts(const std::vector<at::Tensor>& counts_per_layer);
  // Hands a copy of this step's loads to `reduce` (expert parallelism sums them over the ranks);
  // apply() then uses the reduced copy. Every rank joins, whether or not it counted anything.
  void sum_counts(const std::function<void(std::vector<at::Tensor>&)>& reduce) {
    if (!enabled()) return;
    reduced_.clear();
    for (size_t l = 0; l < biases_.size(); ++l) {
      reduced_.push_back(counts_.empty() ? at::zeros(biases_[l].sizes(), biases_[l].options())
                                         : counts_[l].clone());
    }
    reduce(reduced_);
  }
  // After the optimizer step: moves the biases by this step's loads, then forgets them.
  void apply();
  // {"<layer>": {"min": .., "max": ..}} per MoE layer: how far the balancing has moved each bias.
  nlohmann::json report() const;

 private:
  double rate_ = 0;
  std::vector<at::Tensor> biases_;  // the decoder's own tensors, one per MoE layer
  std::vector<int64_t> layers_;     // their layer numbers
  std::vector<at::Tensor> counts_;  // this step's loads
  std::vector<at::Tensor> reduced_;  // ... summed over every rank (sum_counts), when distributed
};

}  // namespace automoe::train
