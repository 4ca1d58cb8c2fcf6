// AdamW over float32 master weights: one fused ATen call (at::_fused_adamw_) per group, decay and
// no-decay (1-D parameters: norms and biases), with a shared step count. Under expert parallelism
// each rank steps what it holds: the dense weights (identical on every rank, as their gradients
// are) and its own experts.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "automoe/model/components.h"
#include "automoe/parallel/world.h"
#include "automoe/train/recipe.h"

namespace automoe::train {

struct AdamW {
  std::vector<std::string> names;
  std::vector<at::Tensor> master, grad, exp_avg, exp_avg_sq, step;
  std::vector<bool> decay;
  std::vector<bool> expert;  // a routed expert's tensor: this rank's experts only

  // own_grads: float32 accumulators of our own (bf16 compute); otherwise `grad` is pointed at
  // the parameters' .grad before each step. `routed_expert[i]` marks the experts' tensors.
  void init(const NamedTensors& masters, const std::vector<bool>& routed_expert, bool own_grads);
  void update(const OptimizerSection& o, double lr);
  // Global L2 norm of the gradients (before clipping), as a host double: the dense part once,
  // the experts' part summed over the EP group (`ep` null: one process).
  double grad_norm(const parallel::Group& ep = {}) const;
  void scale_grads(double s);
  void zero_grads();
};

// Sums the gradients over the ranks that share each tensor: dense ones over the world, experts'
// over the data-parallel replicas of the same shard (the losses are normalised by the global token
// count, so sums are the single-process gradient). Flattened into buckets of about
// `bucket_bytes`, all launched before the first is waited for. Returns the bytes reduced.
int64_t sync_gradients(AdamW& opt, const parallel::World& world, int64_t bucket_bytes = 64 << 20);

}  // namespace automoe::train
