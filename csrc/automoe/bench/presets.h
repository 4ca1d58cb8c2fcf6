// Named Qwen3-MoE geometries for `automoe bench` and bench/compare_hf.py, as config.json text so
// that both sides (AutoMoE and Transformers) build the same model from the same source.
#pragma once

#include <string>
#include <vector>

namespace automoe::bench {

// "cpu-small", "cpu-medium", "qwen3-30b-a3b-L{n}" (Qwen3-30B-A3B's layer geometry, n layers).
// Throws automoe::Error naming the known presets for anything else.
std::string preset_config_json(const std::string& name);
std::vector<std::string> preset_names();  // with "qwen3-30b-a3b-L{n}" spelled as a pattern

}  // namespace automoe::bench
