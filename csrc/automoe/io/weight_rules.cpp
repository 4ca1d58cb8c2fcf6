#include "automoe/io/weight_rules.h"

#include <ATen/ATen.h>

#include "automoe/core/error.h"

namespace automoe {

std::string to_string(ExpertsLayout layout) {
  return layout == ExpertsLayout::kFused ? "fused" : "per-expert";
}

ExpertsLayout layout_from_string(const std::string& name, const std::string& what) {
  if (name == "fused") return ExpertsLayout::kFused;
  if (name == "per-expert" || name == "per_expert") return ExpertsLayout::kPerExpert;
  fail(what, ": unknown experts layout \"", name, "\" (expected \"fused\" or \"per-expert\")");
}

namespace {

std::string replace_first(const std::vector<RenameRule>& rules, const std::string& name,
                          bool to_disk) {
  for (const auto& r : rules) {
    const std::string& from = to_disk ? r.memory : r.disk;
    const std::string& to = to_disk ? r.disk : r.memory;
    const auto pos = name.find(from);
    if (!from.empty() && pos != std::string::npos) {
      return name.substr(0, pos) + to + name.substr(pos + from.size());
    }
  }
  return name;
}

}  // namespace

std::string to_disk_name(const std::vector<RenameRule>& rules, const std::string& memory_name) {
  return replace_first(rules, memory_name, /*to_disk=*/true);
}

std::string to_memory_name(const std::vector<RenameRule>& rules, const std::string& disk_name) {
  return replace_first(rules, disk_name, /*to_disk=*/false);
}

const WeightRule* find_rule(const std::vector<WeightRule>& rules, const std::string& memory_name,
                            std::string* prefix) {
  for (const auto& rule : rules) {
    const auto& s = rule.memory_suffix;
    if (memory_name.size() >= s.size() &&
        memory_name.compare(memory_name.size() - s.size(), s.size(), s) == 0) {
      if (prefix) *prefix = memory_name.substr(0, memory_name.size() - s.size());
      return &rule;
    }
  }
  return nullptr;
}

std::string disk_name(const std::string& prefix, const std::string& part, int64_t expert) {
  std::string name = prefix + part;
  auto pos = name.find("{E}");
  TORCH_INTERNAL_ASSERT(pos != std::string::npos, "weight rule part without {E}: ", part);
  return name.replace(pos, 3, std::to_string(expert));
}

at::Tensor gather_experts(const WeightRule& rule, const std::string& prefix, int64_t num_experts,
                          const std::function<at::Tensor(const std::string&)>& get,
                          int64_t first_expert) {
  std::vector<at::Tensor> parts;
  for (const auto& part : rule.parts) {
    std::vector<at::Tensor> experts;
    experts.reserve(num_experts);
    for (int64_t e = first_expert; e < first_expert + num_experts; ++e) {
      at::Tensor t = get(disk_name(prefix, part, e));
      if (!experts.empty()) {
        AUTOMOE_CHECK(t.sizes() == experts.front().sizes() && t.dtype() == experts.front().dtype(),
                      "tensor ", disk_name(prefix, part, e), ": expected shape ",
                      experts.front().sizes(), " and dtype ", experts.front().dtype(),
                      " like expert 0, found ", t.sizes(), " ", t.dtype());
      }
      experts.push_back(std::move(t));
    }
    parts.push_back(at::stack(experts, 0));
  }
  if (parts.size() > 1) {
    for (const auto& p : parts) {
      AUTOMOE_CHECK(p.sizes() == parts.front().sizes(), "tensors ", prefix, rule.memory_suffix,
                    " parts: expected equal shapes to concatenate, found ", parts.front().sizes(),
                    " and ", p.sizes());
    }
  }
  at::Tensor fused = parts.size() == 1 ? parts.front()
                    : rule.interleave
                        // [.., n, ..] with the parts innermost, then merged: p0[0], p1[0], p0[1], ...
                        ? at::stack(parts, rule.concat_dim + 1).flatten(rule.concat_dim, rule.concat_dim + 1)
                        : at::cat(parts, rule.concat_dim);
  if (rule.transpose) fused = fused.transpose(rule.transpose->first, rule.transpose->second);
  return fused.contiguous();
}

std::vector<std::pair<std::string, at::Tensor>> scatter_experts(const WeightRule& rule,
                                                                const std::string& prefix,
                                                                const at::Tensor& fused,
                                                                int64_t first_expert) {
  at::Tensor t = fused;
  if (rule.transpose) t = t.transpose(rule.transpose->first, rule.transpose->second);
  const auto n = static_cast<int64_t>(rule.parts.size());
  std::vector<at::Tensor> parts{t};
  if (n > 1) {
    AUTOMOE_CHECK(t.size(rule.concat_dim) % n == 0, "tensor ", prefix, rule.memory_suffix, ": dim ",
                  rule.concat_dim, " of size ", t.size(rule.concat_dim), " does not split into ", n,
                  " equal parts");
    if (rule.interleave) {
      parts.clear();
      const int64_t len = t.size(rule.concat_dim) / n;
      for (int64_t p = 0; p < n; ++p) parts.push_back(t.slice(rule.concat_dim, p, len * n, n));
    } else {
      parts = t.chunk(n, rule.concat_dim);
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t e = 0; e < parts[p].size(0); ++e) {
      out.emplace_back(disk_name(prefix, rule.parts[p], first_expert + e), parts[p][e]);
    }
  }
  return out;
}

}  // namespace automoe
