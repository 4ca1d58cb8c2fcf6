// The processes of a run and how they split the work: world = dp x ep. Each rank holds the
// experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of every MoE layer and a full copy of every
// dense weight; the ep ranks of one data-parallel replica are consecutive (rank = dp_rank * ep +
// ep_rank), so that an EP group stays within a node when ep divides the GPUs per node.
//
// The processes and their collectives are c10d's (Gloo on CPUs, NCCL on GPUs): torch.distributed
// creates the groups (from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets them, or as the
// user initialised it) and registers them by name; the engine resolves them by name. NCCL and
// Gloo run the same engine code.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace automoe::parallel {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

struct Mesh {
  int64_t world = 1, ep = 1, dp = 1;
  int64_t ep_rank(int64_t rank) const { return rank % ep; }
  int64_t dp_rank(int64_t rank) const { return rank / ep; }
};

// ep must divide both the world size and the number of experts; dp = world / ep (`dp` 0: auto,
// otherwise it must equal that). Errors name `origin` (a recipe section, a Python argument).
Mesh make_mesh(int64_t world_size, int64_t ep, int64_t dp, int64_t num_experts,
               const std::string& origin);

// The experts [begin, begin + count) that EP rank `ep_rank` of `ep` owns.
struct ExpertRange {
  int64_t begin = 0, count = 0;
  int64_t end() const { return begin + count; }
};
ExpertRange experts_of(int64_t ep_rank, int64_t ep, int64_t num_experts);

// This rank's view of the run: its rank, the mesh and its three groups (world; its EP group:
// the ep ranks of its replica; its DP group: the ranks holding the same experts).
struct World {
  int64_t rank = 0;
  Mesh mesh;
  Group world, ep, dp;
  // Where the collectives' tensors live (NCCL needs them on the GPU, Gloo takes either).
  c10::Device device = c10::kCPU;

  bool distributed() const { return mesh.world > 1; }
  int64_t ep_rank() const { return mesh.ep_rank(rank); }
  int64_t dp_rank() const { return mesh.dp_rank(rank); }
};

// The groups torch.distributed registered under these names (ProcessGroup.group_name).
// Checks that each group has the size and this rank the place the mesh says.
World world_from_group_names(const std::string& world_group, const std::string& ep_group,
                             const std::string& dp_group, const Mesh& mesh, c10::Device device);

// Waits for a collective, turning c10d's failure (a dead or stalled peer: the group's timeout)
// into an automoe::Error naming the operation and this rank.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what);

// In-place sums over `group`, each tensor on its own (no-op for a null group or one of size 1).
void all_reduce_sum(const Group& group, std::vector<at::Tensor> tensors, const char* what);
void all_reduce_sum(const Group& group, const at::Tensor& t, const char* what);
// Every rank's copy of a small int64 vector (equal lengths), rank-major; on the host.
std::vector<int64_t> all_gather_ints(const Group& group, const std::vector<int64_t>& mine,
                                     c10::Device device, const char* what);
// Every rank's `rows` (equal shapes) concatenated along dim 0 in rank order — over an EP group,
// the whole [E, ...] tensor of which each rank holds its experts' rows. Bitwise copies, on
// `rows`' device.
at::Tensor all_gather_rows(const Group& group, const at::Tensor& rows, const char* what);
// Each rank's error message (empty: none); if any rank has one, throws on every rank, naming
// the first such rank and its message — so that a failure on one rank (a check, a full disk)
// fails a collective operation everywhere instead of leaving the others waiting in it.
void agree(const Group& group, const std::string& error, c10::Device device, const char* what);
// Every rank's string (any lengths), in rank order.
std::vector<std::string> all_gather_strings(const Group& group, const std::string& mine,
                                            c10::Device device, const char* what);

}  // namespace automoe::parallel
