// `automoe bench --profile`: where a training step's time goes. Records, between start() and
// stop(), the ATen ops, the autograd backward nodes and AutoMoE's own op scopes (RECORD_FUNCTION
// in ops/*.cpp and the trainer's optimizer phases), then aggregates them by name with self time
// (an event's time less its nested events'), so a fused op's ATen calls are not counted twice.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace automoe::bench {

class OpProfile {
 public:
  void start();
  // The ops by self time, largest first: [{name, calls, self_ms, total_ms}], per step.
  nlohmann::json stop(int64_t steps);

 private:
  bool running_ = false;
};

// A text table of the first `top` rows of stop()'s result, with each row's share of step_ms.
std::string profile_table(const nlohmann::json& rows, double step_ms, size_t top);

}  // namespace automoe::bench
