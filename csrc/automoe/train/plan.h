// What a training run will need before it starts (`automoe plan`, the pre-flight check of
// `automoe train`): the per-rank peak memory, broken down, and the step's FLOPs and time, for a
// model (its ModelSpec: a config.json is enough), a recipe and a mesh. Parameter counts come from
// the components' declarations (model/components.h parameter_layout), activations from their
// per-token declarations (activation_bytes_per_token), FLOPs from forward_flops_per_token: a new
// architecture is planned by what it declares, not by this file. Nothing here allocates a tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "automoe/model/spec.h"
#include "automoe/train/recipe.h"

namespace automoe::train {

// Where the run goes.
struct PlanTarget {
  int64_t nproc_per_node = 1, nnodes = 1;
  std::string device = "cpu";  // cpu | cuda
  // Memory one rank may use, in bytes; 0: this machine's (CPU: the memory available to this
  // process's cgroup / MemAvailable, shared by the node's ranks; CUDA: 80 GiB, an H100's).
  double rank_memory_bytes = 0;
  // Dense matmul peak of one rank's device in the compute dtype, TFLOP/s; 0: measured here (CPU)
  // or the datasheet's (CUDA: an H100 SXM's, 989 dense bf16, 67 float32).
  double peak_tflops = 0;
  std::string peak_source = "given";  // where peak_tflops came from
  // The fraction of peak the training step reaches (MFU); 0: this project's measured value for
  // the path (plan.cpp kMfu*).
  double mfu = 0;
  int64_t world() const { return nproc_per_node * nnodes; }
};

struct MemoryItem {
  std::string name;
  double bytes = 0;
  std::string what;  // how it was counted
};

// One configuration and what it needs on each rank.
struct RankPlan {
  int64_t world = 1, ep = 1, dp = 1, zero = 0;
  std::string master_weights, state_dtype;  // full bf16 training; "" otherwise
  bool checkpointing = false;
  int64_t micro_batch = 1, accumulation = 1;  // micro-batches per step on this rank
  std::vector<MemoryItem> memory;             // what the peak is made of
  double static_bytes = 0;    // held for the whole run
  double dynamic_bytes = 0;   // the largest of the step's transient needs
  double peak_bytes = 0;      // static + dynamic, with the allocator's overhead
  double available_bytes = 0;
  bool fits = false;
  std::string invalid;        // why this configuration cannot run at all ("" = it can)
  double flops_per_step = 0;  // this rank's, matmul FLOPs of forward + backward (+ recompute)
  double tokens_per_step = 0; // all ranks'
  double step_s = 0, tokens_per_s = 0;
  std::string describe() const;  // "ep 2 x dp 1, ZeRO-1, masters float32, moments float32, ..."
};

struct Plan {
  std::string model;  // model_type and size
  double parameters = 0, active_parameters = 0;
  std::string device;
  double peak_tflops = 0, mfu = 0;
  std::string peak_source, mfu_source;
  RankPlan chosen;                    // the recipe as it is
  std::vector<RankPlan> suggestions;  // configurations that fit, fastest first
  // Generation caches, per sequence: the KV cache per 1,000 tokens and the recurrent state.
  double kv_bytes_per_1k_tokens = 0, recurrent_state_bytes = 0;
  std::string to_json() const;
  std::string to_text() const;
};

// The plan for `spec` (the whole model: expert_count 0) trained by `rc` on `target`. Suggestions
// are searched over ep, ZeRO, optimizer precision, activation checkpointing and micro-batch size
// for the target's ranks, then for more ranks when none fits.
Plan make_plan(const ModelSpec& spec, const Recipe& rc, const PlanTarget& target,
               int64_t max_suggestions = 5);

// The memory of one configuration (no suggestions, no peak measurement): what the pre-flight
// check compares with the memory the rank has.
RankPlan plan_rank(const ModelSpec& spec, const Recipe& rc, int64_t world, int64_t rank_memory,
                   bool cuda);

// One rank's weights under expert parallelism `ep` (1: all experts), `bytes` per element (buffers
// float32): what loading a model needs before anything else (the drop-in's pre-flight check).
double weight_bytes(const ModelSpec& spec, int64_t ep, double bytes);

// The memory this process may still use, in bytes: the smaller of MemAvailable and the cgroup's
// limit less its usage (v2 or v1, less its reclaimable page cache); AUTOMOE_AVAILABLE_MEMORY
// (bytes) instead where set (tests, and machines shared with other jobs).
int64_t available_cpu_memory();

// The process's resident memory now and its high-water mark since reset_peak_rss() (Linux
// /proc/self/status VmRSS / VmHWM), in bytes; 0 where unknown.
int64_t current_rss();
int64_t peak_rss();
void reset_peak_rss();  // /proc/self/clear_refs "5"

}  // namespace automoe::train
