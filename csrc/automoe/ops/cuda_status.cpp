#include "automoe/ops/cuda_status.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>

#include "automoe/core/error.h"

namespace automoe::ops {
namespace {

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::set<std::string> enabled() {
  const char* env = std::getenv("AUTOMOE_CUDA_KERNELS");
  const auto& validated = validated_cuda_kernels();
  if (env == nullptr || *env == '\0') return {validated.begin(), validated.end()};
  const std::string spec = env;
  const auto& names = cuda_kernel_names();
  if (spec == "all") return {names.begin(), names.end()};
  if (spec == "none") return {};
  std::set<std::string> out;
  std::stringstream ss(spec);
  for (std::string name; std::getline(ss, name, ',');) {
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    AUTOMOE_CHECK(contains(names, name), "AUTOMOE_CUDA_KERNELS=", spec, ": unknown op \"", name,
                  "\" (expected all, none, or a comma-separated list of: ", all, ")");
    out.insert(name);
  }
  return out;
}

}  // namespace

const std::vector<std::string>& cuda_kernel_names() {
  static const std::vector<std::string> names = {"router",  "permute", "grouped_gemm",
                                                 "swiglu",  "rmsnorm", "rope",
                                                 "causal_conv1d", "gated_rmsnorm", "ssd_scan"};
  return names;
}

const std::vector<std::string>& validated_cuda_kernels() {
  // Rows of docs/ops.md's "CUDA kernels" table that passed on a GPU. None has run yet.
  static const std::vector<std::string> validated = {};
  return validated;
}

bool use_cuda_kernel(const char* op) {
  static const std::set<std::string> on = enabled();
  return on.count(op) != 0;
}

}  // namespace automoe::ops
