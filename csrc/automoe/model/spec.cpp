#include "automoe/model/spec.h"

#include <algorithm>

namespace automoe {

int64_t ModelSpec::num_moe_layers() const {
  return std::count(layer_is_moe.begin(), layer_is_moe.end(), true);
}

}  // namespace automoe
