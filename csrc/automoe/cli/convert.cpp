// `automoe convert IN OUT --layout per-expert|fused`: rewrite a checkpoint in the other experts
// layout. Without --dtype every tensor keeps its stored dtype, so the conversion is bit-exact.
#include <iostream>
#include <optional>

#include "automoe/cli/commands.h"
#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/checkpoint.h"

namespace automoe::cli {

int convert(const Args& args) {
  constexpr const char* kUsage =
      "usage: automoe convert IN OUT --layout per-expert|fused [--dtype NAME] "
      "[--max-shard-size BYTES]";
  std::vector<std::string> positional;
  std::optional<ExpertsLayout> layout;
  std::optional<c10::ScalarType> dtype;
  uint64_t max_shard = 5ull << 30;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      AUTOMOE_CHECK(i + 1 < args.size(), a, " needs a value; ", kUsage);
      return args[++i];
    };
    if (a == "--layout") {
      layout = layout_from_string(value(), "--layout");
    } else if (a == "--dtype") {
      dtype = dtype_from_name(value(), "--dtype");
    } else if (a == "--max-shard-size") {
      const std::string& v = value();
      try {
        max_shard = std::stoull(v);
      } catch (const std::exception&) {
        fail("--max-shard-size: expected a number of bytes, got \"", v, "\"");
      }
      AUTOMOE_CHECK(max_shard > 0, "--max-shard-size: expected > 0");
    } else if (a.rfind("--", 0) == 0) {
      fail("unknown option ", a, "; ", kUsage);
    } else {
      positional.push_back(a);
    }
  }
  AUTOMOE_CHECK(positional.size() == 2 && layout, kUsage);
  const PretrainedModel model = load_pretrained(positional[0], dtype);
  save_pretrained(model, positional[1], layout, max_shard);
  std::cout << "wrote " << positional[1] << " (" << to_string(*layout) << " layout, from "
            << to_string(model.layout) << ")\n";
  return 0;
}

}  // namespace automoe::cli
