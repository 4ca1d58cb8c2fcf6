#include "automoe/model/spec.h"

#include <algorithm>

namespace automoe {

int64_t ModelSpec::num_moe_layers() const {
  return std::count_if(layers.begin(), layers.end(),
                       [](const LayerSpec& l) { return l.mlp == MlpKind::kMoE; });
}

void ModelSpec::set_moe_layers(const std::vector<bool>& is_moe) {
  layers.assign(is_moe.size(), LayerSpec{});
  for (size_t l = 0; l < is_moe.size(); ++l) layers[l].mlp = is_moe[l] ? MlpKind::kMoE : MlpKind::kDense;
}

bool ModelSpec::has_mixer(MixerKind kind) const {
  return std::any_of(layers.begin(), layers.end(),
                     [kind](const LayerSpec& l) { return l.mixer == kind; });
}

}  // namespace automoe
