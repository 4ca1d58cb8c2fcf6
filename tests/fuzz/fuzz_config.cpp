// libFuzzer target: config.json text through parse_config (JSON, model_type, the architecture's
// parser under model/arch/). An accepted config must give a ModelSpec whose per-layer list has one
// entry per layer.
#include <cstddef>
#include <cstdint>
#include <string>

#include "automoe/model/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  automoe::fuzz::accepts([&] {
    const automoe::LoadedConfig c = automoe::parse_config(text, "config.json");
    const automoe::ModelSpec& s = c.spec;
    if (static_cast<int64_t>(s.layers.size()) != s.num_layers) {
      automoe::fuzz::finding("spec.layers has " + std::to_string(s.layers.size()) +
                             " entries for " + std::to_string(s.num_layers) + " layers");
    }
  });
  return 0;
}

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned seed) {
  return automoe::fuzz::mutate_json(data, size, max_size, seed, &LLVMFuzzerMutate);
}
