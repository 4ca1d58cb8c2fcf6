#include "automoe/train/bias_balance.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <string>

#include "automoe/core/error.h"

namespace automoe::train {

BiasBalance::BiasBalance(const Decoder& model, double rate) : rate_(rate) {
  if (rate <= 0) return;
  for (const LayerSlots& L : model.slots().layers) {
    if (!L.moe) continue;
    AUTOMOE_CHECK(L.experts.correction_bias >= 0, "router.bias_update_rate: ",
                  model.spec().model_type,
                  " routers have no e_score_correction_bias to update (the auxiliary-loss-free "
                  "balancing of DeepSeek-V3 needs one); remove the key");
    biases_.push_back(model.named_parameters()[L.experts.correction_bias].second);
    layers_.push_back(L.index);
  }
}

void BiasBalance::add_counts(const std::vector<at::Tensor>& counts) {
  if (!enabled()) return;
  AUTOMOE_CHECK(counts.size() == biases_.size(), "bias balance: expert counts for ", counts.size(),
                " MoE layers, expected ", biases_.size());
  if (counts_.empty()) {
    for (const auto& c : counts) counts_.push_back(c.to(at::kFloat));
    return;
  }
  for (size_t l = 0; l < counts.size(); ++l) counts_[l] += counts[l];
}

void BiasBalance::apply() {
  const std::vector<at::Tensor>& loads = reduced_.empty() ? counts_ : reduced_;
  if (loads.empty()) return;
  at::NoGradGuard no_grad;
  for (size_t l = 0; l < biases_.size(); ++l) {
    biases_[l].add_(at::sign(loads[l].mean() - loads[l]), rate_);
  }
  counts_.clear();
  reduced_.clear();
}

nlohmann::json BiasBalance::report() const {
  nlohmann::json out = nlohmann::json::object();
  for (size_t l = 0; l < biases_.size(); ++l) {
    const at::Tensor b = biases_[l].cpu();
    out[std::to_string(layers_[l])] = {{"min", b.min().item<double>()},
                                       {"max", b.max().item<double>()}};
  }
  return out;
}

}  // namespace automoe::train
