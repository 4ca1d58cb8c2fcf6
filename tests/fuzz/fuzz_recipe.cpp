// libFuzzer target: a training recipe as JSON text through Recipe::parse. An accepted recipe must
// survive its own round trip: to_json() parses back to the same recipe.
#include <cstddef>
#include <cstdint>
#include <string>

#include "automoe/train/recipe.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using automoe::train::Recipe;
  std::string recorded;
  if (!automoe::fuzz::accepts([&] { recorded = Recipe::parse(text, "recipe").to_json(); })) {
    return 0;
  }
  std::string again;
  if (!automoe::fuzz::accepts([&] { again = Recipe::parse(recorded, "recorded").to_json(); })) {
    automoe::fuzz::finding("an accepted recipe's to_json() is refused:\n" + recorded);
  }
  if (again != recorded) {
    automoe::fuzz::finding("to_json() changes on a round trip:\n" + recorded + "\n---\n" + again);
  }
  return 0;
}

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned seed) {
  return automoe::fuzz::mutate_json(data, size, max_size, seed, &LLVMFuzzerMutate);
}
