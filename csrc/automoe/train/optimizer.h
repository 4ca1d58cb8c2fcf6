// AdamW over float32 master weights, decay and no-decay groups (1-D parameters: norms and biases)
// with a shared step count. Float32 weights: one fused ATen call (at::_fused_adamw_) per group.
// Bf16 weights (mixed precision): the masters are a float32 copy, or the bf16 weights plus their
// 16-bit remainders, or the bf16 weights themselves (OptimizerSection::master_weights), the moments
// float32 or bf16, the gradients bf16 as autograd made them (float32 accumulators only from a
// step's second micro-batch on); on the CPU one fused pass over each tensor (ops/cpu/vec.h's
// adamw), elsewhere a composition of ATen ops. Under expert parallelism each rank steps what it
// holds: the dense weights (identical on every rank, as their gradients are) and its own experts.
// (optimizer.cpp: the update, in_backward, the gradient norm; zero.cpp: ZeRO's buckets and
// sync_gradients; moments8.cpp: the 8-bit moments through ATen ops.)
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "automoe/model/components.h"
#include "automoe/parallel/world.h"
#include "automoe/train/recipe.h"

namespace automoe::train {

struct AdamW {
  // Where the float32 masters of bf16 weights live (OptimizerSection::master_weights).
  enum class Masters { kFloat32, kRemainders, kNone };
  static Masters parse_masters(const std::string& name);  // "float32" | "remainders" | "none"
  static const char* masters_name(Masters m);

  std::vector<std::string> names;
  // Per parameter, full size. Under ZeRO (shard()) master / exp_avg / exp_avg_sq are held only
  // as this rank's slices and exist in full only between materialize() and release().
  std::vector<at::Tensor> master, grad, exp_avg, exp_avg_sq, step;
  std::vector<bool> decay;
  std::vector<bool> expert;  // a routed expert's tensor: this rank's experts only
  // Under Masters::kRemainders the lower 16 bits of each float32 master (int16); master[i] is then
  // the bf16 weight the forward reads, as it is under kNone.
  std::vector<at::Tensor> remainder;
  Masters masters = Masters::kFloat32;
  // The moments' (OptimizerSection::state_dtype): Float, BFloat16, or Byte for block-wise 8-bit
  // moments — then exp_avg[i] / exp_avg_sq[i] are uint8 codes (ops/cpu/vec.h qmap8) of the
  // parameter's shape, each block of kQuantBlock elements along its last dimension scaled by
  // exp_avg_scale[i] / exp_avg_sq_scale[i] (float32, the parameter's shape with the last
  // dimension ceil(cols / kQuantBlock));
  // 1-D tensors (norms, biases) keep float32 moments (scales undefined) — bitsandbytes and
  // torchao keep small tensors' so; by dimension rather than size, so that a routed expert
  // tensor is quantized or not whatever its share under expert parallelism.
  c10::ScalarType state_dtype = c10::ScalarType::Float;
  std::vector<at::Tensor> exp_avg_scale, exp_avg_sq_scale;
  static c10::ScalarType parse_state_dtype(const std::string& name);  // float32|bfloat16|8bit
  static const char* state_dtype_name(c10::ScalarType t);
  bool quantized(size_t i) const { return exp_avg_scale.size() > i && exp_avg_scale[i].defined(); }
  // 8-bit moments through ATen ops (any device; the CPU step uses the fused kernel): codes and
  // their block scales as float32, and float32 values into codes and scales (both written).
  // Tests: the update through ATen ops, as on devices other than the CPU, on CPU tensors too.
  bool aten_update = false;
  static at::Tensor dequantize8(const at::Tensor& codes, const at::Tensor& scale, bool is_signed);
  static void quantize8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        bool is_signed);

  // own_grads (bf16 compute): the optimizer takes each backward's gradients from the parameters
  // (grad[i]: bf16 as autograd made it, float32 once a second micro-batch adds to it); otherwise
  // `grad` is pointed at the parameters' .grad before each step. `routed_expert[i]` marks the
  // experts' tensors. `full_state` false: no moments yet (shard() follows and makes them
  // slice-sized). `kind` other than kFloat32: `masters` are the bf16 weights themselves, with
  // `remainders` under kRemainders.
  void init(const NamedTensors& masters, const std::vector<bool>& routed_expert, bool own_grads,
            bool full_state = true, Masters kind = Masters::kFloat32,
            c10::ScalarType state_dtype = c10::ScalarType::Float,
            std::vector<at::Tensor> remainders = {});
  // Parameter i's float32 master: master[i] itself, or rebuilt from the bf16 weight (and its
  // remainder) as a new tensor.
  at::Tensor master_f32(size_t i) const;
  // A float32 tensor as a bf16 weight and its remainder (ATen ops, any device), and back.
  static void split_master(const at::Tensor& f32, at::Tensor& bf16, at::Tensor& rem);
  static at::Tensor join_master(const at::Tensor& bf16, const at::Tensor& rem);
  // A backward's gradient of parameter i (own_grads): kept as it is, or added to what the step's
  // earlier micro-batches left (in float32).
  void accumulate(size_t i, at::Tensor g);

  // ZeRO (stage 1 or 2): from now on each rank keeps the float32 masters and AdamW moments of
  // only its slice of every tensor that other ranks also hold — dense tensors split over the
  // world, experts over their data-parallel replicas. Each class of tensors is cut into buckets
  // of about `bucket_bytes` (in the reverse of the parameter order: the order the backward
  // produces their gradients), each bucket flattened, padded and cut into equal slices.
  // Gradients are reduce-scattered to the slices, the slices updated, and the new weights
  // all-gathered. `params` (what the forward reads, names[i]'s at i) are replaced by views of one
  // flat buffer per bucket (the caller re-binds the model to them); a hook on each moves its
  // gradient into the bucket's float32 accumulator as soon as autograd has produced it, and a
  // bucket whose gradients are all in is reduce-scattered at once while the backward goes on —
  // on the step's last backward (stage 1), or after every backward into a slice-sized
  // accumulator, the full-size one living only while its bucket is in flight (stage 2).
  void shard(const parallel::World& world, std::vector<at::Tensor>& params, int64_t stage,
             int64_t bucket_bytes = 32 << 20);
  bool sharded() const { return !zero_.empty(); }
  int64_t stage() const { return stage_; }  // ZeRO's stage (0: not sharded)
  // Around each backward pass (ZeRO): `last`, the step's last backward on this rank.
  void begin_backward(bool last);
  void end_backward();
  // Full master / moment tensors from the slices (collective), for checkpoints and the export;
  // release() drops them again. No-ops when not sharded.
  void materialize();
  void release();
  // After loading a checkpoint into the materialised full tensors: this rank's slices from them.
  void absorb();

  // The step's gradients summed over the ranks that share each tensor (see sync_gradients);
  // under ZeRO into this rank's slices (what the backward's hooks did not launch is launched
  // here, in bucket order, and everything is waited for).
  void reduce_grads(const parallel::World& world);
  void update(const OptimizerSection& o, double lr);
  // Global L2 norm of the gradients (before clipping), as a host double: the dense part once,
  // the experts' part summed over the EP group (`world` one process: local).
  double grad_norm(const parallel::World& world = {}) const;
  // The sum of squares of tensors (each accumulated in float32, the tensors' in double), as
  // grad_norm() sums them.
  static double sum_squares(const std::vector<at::Tensor>& v);
  // (own_grads: remembered, and applied in float32 by update(), so that bf16 gradients are not
  // rounded again.)
  void scale_grads(double s);
  void zero_grads();
  // The updated weights into the tensors the forward reads (`params[i]` for names[i]): a copy
  // (bf16 compute) or nothing (float32: they are the masters); under ZeRO an all-gather.
  void publish(std::vector<at::Tensor>& params);
  // Called by the gradient hook of parameter i (ZeRO, in_backward).
  void on_gradient(size_t i, const at::Tensor& param);

  // optimizer.in_backward (one process, no ZeRO): from now on parameter i's update runs in the
  // hook autograd calls once its gradient in `params[i]` (what the forward reads, names[i]'s at i)
  // is complete, with the gradient freed at once; `this` must not move afterwards. Before each
  // backward, arm() gives the step's settings and learning rate.
  void update_in_backward(std::vector<at::Tensor>& params);
  bool in_backward() const { return in_bwd_; }
  void arm(const OptimizerSection& o, double lr);
  // After the backward (in_backward): the tensors no gradient reached are updated with a zero
  // one, as update() does, and published into `params`.
  void finish_in_backward(std::vector<at::Tensor>& params);
  // Tensors the step's backward has updated (in_backward); a non-finite gradient stops the
  // step's updates (those already made stay) and makes grad_norm() non-finite.
  int64_t updated_in_backward() const { return bwd_updated_; }
  // No tensor of this step is updated from here on (a non-finite loss, before its backward).
  void stop_updates() { bwd_poisoned_ = true; }
  // The step is over (in_backward): when it was skipped rather than finished, the step counts
  // of the tensors its backward had updated go back, so that every tensor keeps the one count
  // a checkpoint records (their weights and moments keep the update: it cannot be undone).
  void disarm();

 private:
  // One bucket of tensors sharing a group (ZeRO): their flat layout and this rank's slice.
  struct Slice {
    parallel::Group group;  // null: this class is not replicated (the slice is everything)
    int64_t ranks = 1, rank = 0;
    std::vector<size_t> members;  // parameter indices, in flat order
    std::vector<int64_t> offset;  // each member's first element in the flat layout
    int64_t total = 0, size = 0;  // padded flat length (a multiple of ranks), slice length
    at::Tensor master, exp_avg, exp_avg_sq, grad;  // [size] float32
    at::Tensor params_flat;  // [total] the forward's weights (compute dtype), members are views
    // [total] float32 gradient accumulators (members' grad[i] are views); under stage 2 for a
    // replicated bucket only while one backward's gradients are collected and reduced.
    at::Tensor grad_flat;
    bool transient = false;  // stage 2 and replicated: grad_flat is per backward
    // The parts of members inside the slice: member index, first element in the member, first
    // element in the slice, length.
    struct Segment {
      size_t member;
      int64_t in_member, in_slice, length;
    };
    std::vector<Segment> segments;
    std::vector<at::Tensor> steps;  // one step count per segment (what the fused kernel reads)
    int64_t pending = 0;            // members whose gradient this backward has not produced yet
    bool launched = false;          // reduced (or in flight) for this step / backward
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor reduced;  // stage 2: the in-flight reduce-scatter's output
    int64_t begin() const { return rank * size; }
  };
  std::vector<Slice> zero_;
  std::vector<std::pair<size_t, size_t>> where_;  // parameter -> (bucket, member index)
  std::vector<std::vector<int64_t>> shapes_;      // each parameter's shape
  int64_t stage_ = 0;
  bool own_grads_ = false;
  // A tensor's rows for the 8-bit moments: its last dimension.
  static int64_t quant_cols(const at::Tensor& t);
  // on_gradient(i, ...) from now on, once autograd has accumulated `param`'s gradient.
  void add_gradient_hook(const at::Tensor& param, size_t i);
  // ZeRO: gradient `g` of parameter i into its bucket (released), launching full buckets.
  void into_bucket(size_t i, at::Tensor& g);
  double grad_scale_ = 1.0;  // own_grads: clipping's factor, applied in update()
  void update_mixed(const OptimizerSection& o, double lr);
  // Parameter i's AdamW update with gradient `g` (own_grads: any dtype; else float32), reading
  // step[i] (already advanced).
  void update_one(size_t i, const at::Tensor& g, const OptimizerSection& o, double lr);
  // in_backward: the armed step's settings; per parameter whether the step has updated it; the
  // gradients' sum of squares so far; a non-finite gradient seen.
  bool in_bwd_ = false, bwd_poisoned_ = false, armed_ = false;
  OptimizerSection bwd_cfg_;
  double bwd_lr_ = 0, bwd_sq_ = 0;
  int64_t bwd_updated_ = 0;
  std::vector<bool> bwd_done_;
  bool last_ = false;       // this backward ends the step's accumulation
  size_t next_launch_ = 0;  // buckets launch in order (the same on every rank)
  at::Tensor gather(const Slice& s, const at::Tensor& part) const;  // [size] -> [total]
  void absorb(Slice& s);
  bool reducing() const { return stage_ == 2 || last_; }
  void launch(size_t b);
  void complete(size_t b);  // stage 2: the reduce-scatter's output into the slice accumulator
};

// Sums the gradients over the ranks that share each tensor: dense ones over the world, experts'
// over the data-parallel replicas of the same shard (the losses are normalised by the global token
// count, so sums are the single-process gradient). Flattened into buckets of about
// `bucket_bytes`, all launched before the first is waited for. Returns the bytes reduced.
int64_t sync_gradients(AdamW& opt, const parallel::World& world, int64_t bucket_bytes = 64 << 20);

}  // namespace automoe::train
