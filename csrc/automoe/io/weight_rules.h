// Reversible rules between the engine's in-memory parameters (Transformers v5's names and shapes:
// experts fused as `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I])
// and the tensors of a checkpoint on disk. The same rule runs forwards on load and backwards on
// save, so load -> save -> load is bit-exact.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace automoe {

// How a checkpoint stores experts. kFused: on-disk names and shapes equal the in-memory ones.
// kPerExpert: one tensor per expert and projection (`mlp.experts.{i}.gate_proj.weight` ...).
enum class ExpertsLayout { kFused, kPerExpert };
std::string to_string(ExpertsLayout layout);
// "fused" | "per-expert" (also "per_expert"); throws automoe::Error naming `what` otherwise.
ExpertsLayout layout_from_string(const std::string& name, const std::string& what);

// One in-memory [E, ...] parameter, matched by the suffix of its name, and its on-disk parts.
//   load: part p = stack over experts e of disk tensor `prefix + parts[p]` ({E} -> e) along a new
//         dim 0; parts are concatenated along `concat_dim` (or, with `interleave`, interleaved
//         along it: element i of part p lands at i * parts + p, GPT-OSS's gate/up layout); then
//         `transpose` swaps two dims.
//   save: the exact reverse (transpose, split into equal parts or de-interleave, unbind experts).
struct WeightRule {
  std::string memory_suffix;       // "mlp.experts.gate_up_proj"
  std::vector<std::string> parts;  // {"mlp.experts.{E}.gate_proj.weight", ".{E}.up_proj.weight"}
  int64_t concat_dim = 1;          // used only with several parts
  std::optional<std::pair<int64_t, int64_t>> transpose;
  bool interleave = false;
};

// A tensor whose on-disk name differs from its in-memory one by a substring, e.g. Mixtral's
// `.block_sparse_moe.gate.` on disk for `.mlp.gate.` in memory. The first rule whose `memory`
// (or, reading back, `disk`) part occurs in a name applies, once.
struct RenameRule {
  std::string memory;
  std::string disk;
};
std::string to_disk_name(const std::vector<RenameRule>& rules, const std::string& memory_name);
std::string to_memory_name(const std::vector<RenameRule>& rules, const std::string& disk_name);

// The rule whose memory_suffix ends `memory_name` (setting *prefix to what precedes it), or null.
const WeightRule* find_rule(const std::vector<WeightRule>& rules, const std::string& memory_name,
                            std::string* prefix);

// `prefix + part` with {E} replaced by the expert index.
std::string disk_name(const std::string& prefix, const std::string& part, int64_t expert);

// Builds the in-memory tensor from its per-expert disk tensors, fetched through `get`.
// `first_expert`: the disk index of the first expert gathered (expert parallelism reads a range).
at::Tensor gather_experts(const WeightRule& rule, const std::string& prefix, int64_t num_experts,
                          const std::function<at::Tensor(const std::string&)>& get, int64_t first_expert = 0);

// Splits an in-memory tensor back into its per-expert disk tensors (views, in expert order);
// `first_expert`: the disk index of its first expert (expert parallelism holds a range).
std::vector<std::pair<std::string, at::Tensor>> scatter_experts(const WeightRule& rule,
                                                                const std::string& prefix,
                                                                const at::Tensor& fused,
                                                                int64_t first_expert = 0);

}  // namespace automoe
