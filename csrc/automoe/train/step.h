// The training step shared by `automoe train` (trainer.cpp) and `automoe bench`: the trainable
// state (float32 masters and AdamW moments, the compute copies the forward reads, frozen LoRA
// bases) and the pieces of one optimizer step — a micro-batch's forward and backward with its
// gradients moved into the float32 accumulators, the gradient norm, clipping, the fused AdamW
// update and the publication of the new weights. The trainer adds data, metrics, checkpoints and
// collectives around them; the benchmark times them. One training step in the code base.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <vector>

#include "automoe/model/decoder.h"
#include "automoe/model/lora.h"
#include "automoe/parallel/world.h"
#include "automoe/train/optimizer.h"
#include "automoe/train/recipe.h"

namespace automoe::train {

struct TrainState {
  AdamW opt;
  // Buffers saved with the weights (the routers' correction bias): float32 on the device, never
  // touched by the optimizer.
  NamedTensors buffers;
  // What the forward reads for opt.names[i] (requires grad): bf16 copies of the float32 masters
  // (mixed precision), the bf16 masters themselves (optimizer.master_weights remainders / none),
  // or the float32 masters themselves.
  std::vector<at::Tensor> model_params;
  bool mixed = false;      // compute dtype below float32, no LoRA: copies of the masters
  bool own_grads = false;  // gradients accumulate in opt.grad (AdamW::accumulate), not in .grad
  bool lora = false;
};

// Takes the decoder's weights (as loaded or initialised) to the device: float32 masters of every
// trainable tensor (or, with `lora_sites`, the adapters' masters, the base frozen in `compute`),
// the forward re-bound to compute-dtype copies. `zero`: ZeRO will shard the state next (the
// moments are not allocated here).
// `precision`: its master_weights and state_dtype (bf16 masters and / or moments, for bf16
// weights trained in full without ZeRO; anything else is refused by name).
TrainState make_train_state(Decoder& decoder, c10::ScalarType compute, const c10::Device& dev,
                            std::vector<LoraSite> lora_sites, bool zero = false,
                            const OptimizerSection& precision = {});

// Seeds the default generators (CPU and every CUDA device) for one step's random draws — Mixtral's
// router jitter, LoRA dropout — from (train.seed, rank, step): two runs of a recipe draw the same,
// data-parallel ranks draw differently, and a resumed run (on as many processes) draws what the
// uninterrupted one did, with no generator state in the checkpoint.
void seed_step(uint64_t seed, int64_t rank, int64_t step);

// Before a step's micro-batches: with optimizer.in_backward (`o`), the step's learning rate for
// the updates its backward runs (the gradient hooks are registered on the first call, so `s` must
// not move after it); otherwise nothing.
void begin_step(TrainState& s, const OptimizerSection& o, double lr);

// One micro-batch's forward and backward: decoder.forward(a) (`a` complete: training flags, loss
// normalisation), then backward_micro_batch on its loss. train_micro_batch does both.
//
// The backward's gradients leave autograd for the optimizer (own_grads: bf16 as made, float32
// from a step's second micro-batch on). Under ZeRO they leave
// during the backward (AdamW::begin_backward; `last`: the step's last backward on this rank), and
// ZeRO-2 waits for their reductions here: `device_sync` (if any) then completes the device's
// work, and the wait's seconds are added to `*wait_s`.
void backward_micro_batch(TrainState& s, const at::Tensor& loss, bool last,
                          const std::function<void()>& device_sync = {}, double* wait_s = nullptr);
ForwardResult train_micro_batch(TrainState& s, Decoder& decoder, const ForwardArgs& a, bool last,
                                const std::function<void()>& device_sync = {},
                                double* wait_s = nullptr);
// After the step's micro-batches (float32 without own accumulators): the optimizer reads the
// gradients autograd accumulated, a zero tensor for a parameter that got none.
void adopt_gradients(TrainState& s);
// Scales the gradients to `max_norm` when their norm (from AdamW::grad_norm) exceeds it (> 0).
void clip_gradients(TrainState& s, double norm, double max_norm);
// The fused AdamW update of the masters, then the new weights into what the forward reads
// (in_backward: only of the tensors the backward did not update, with a zero gradient).
void update_weights(TrainState& s, const OptimizerSection& o, double lr);
// Drops the step's gradients (set to none, as torch.optim's zero_grad does).
void release_gradients(TrainState& s);

}  // namespace automoe::train
