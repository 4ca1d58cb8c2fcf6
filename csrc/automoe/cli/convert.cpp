// `automoe convert IN OUT --layout per-expert|fused`: rewrite a checkpoint in the other experts
// layout. Without --dtype every tensor keeps its stored dtype, so the conversion is bit-exact.
#include <iostream>
#include <optional>
#include <regex>

#include "automoe/cli/commands.h"
#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/checkpoint.h"

namespace automoe::cli {
namespace {

// "5000000", "500MB", "5GB", "2GiB" -> bytes (units as Transformers' max_shard_size).
uint64_t parse_size(const std::string& v) {
  static const std::regex kSize(R"(([0-9]+(\.[0-9]+)?)\s*(|B|KB|MB|GB|KIB|MIB|GIB))",
                                std::regex::icase);
  std::smatch m;
  AUTOMOE_CHECK(std::regex_match(v, m, kSize), "--max-shard-size: expected bytes or a size like ",
                "500MB / 5GB / 2GiB, got \"", v, "\"");
  std::string unit = m[3].str();
  for (auto& c : unit) c = static_cast<char>(std::toupper(c));
  const double mult = unit == "KB"    ? 1e3
                      : unit == "MB"  ? 1e6
                      : unit == "GB"  ? 1e9
                      : unit == "KIB" ? 1024.0
                      : unit == "MIB" ? 1048576.0
                      : unit == "GIB" ? 1073741824.0
                                      : 1.0;
  const double bytes = std::stod(m[1].str()) * mult;
  AUTOMOE_CHECK(bytes >= 1 && bytes < 1.8e19, "--max-shard-size: out of range: \"", v, "\"");
  return static_cast<uint64_t>(bytes);
}

}  // namespace

int convert(const Args& args) {
  constexpr const char* kUsage =
      "usage: automoe convert IN OUT --layout per-expert|fused [--dtype NAME] "
      "[--max-shard-size SIZE]";
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
      max_shard = parse_size(value());
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
