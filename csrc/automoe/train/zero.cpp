// ZeRO-1/2 (AdamW::shard): the buckets of this rank's slices, their gradient hooks' side (each
// gradient into its bucket, a full bucket's reduce-scatter launched at once), the full tensors
// gathered for checkpoints; and sync_gradients, the bucketed all-reduce without ZeRO.
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <algorithm>

#include "automoe/core/error.h"
#include "automoe/train/optimizer.h"

namespace automoe::train {

void AdamW::shard(const parallel::World& world, std::vector<at::Tensor>& params, int64_t stage,
                  int64_t bucket_bytes) {
  if (!world.distributed() || sharded()) return;
  AUTOMOE_CHECK(stage == 1 || stage == 2, "ZeRO stage ", stage, ": expected 1 or 2");
  stage_ = stage;
  at::NoGradGuard no_grad;
  where_.assign(master.size(), {0, 0});
  for (const bool is_expert : {false, true}) {
    const parallel::Group& g = is_expert ? world.dp : world.world;
    const bool replicated = g && g->getSize() > 1;
    // Buckets in the reverse of the parameter order (the backward's), each about bucket_bytes of
    // float32 gradients; a class no other rank holds is one bucket (nothing to reduce).
    std::vector<std::vector<size_t>> groups(1);
    int64_t bytes = 0;
    for (size_t j = master.size(); j-- > 0;) {
      if (expert[j] != is_expert) continue;
      if (replicated && !groups.back().empty() && bytes >= bucket_bytes) {
        groups.emplace_back();
        bytes = 0;
      }
      groups.back().push_back(j);
      bytes += master[j].numel() * 4;
    }
    for (const auto& members : groups) {
      if (members.empty()) continue;
      Slice sl;
      if (replicated) {
        sl.group = g;
        sl.ranks = g->getSize();
        sl.rank = g->getRank();
      }
      sl.members = members;
      int64_t n = 0;
      for (size_t i : members) {
        sl.offset.push_back(n);
        n += master[i].numel();
      }
      sl.size = (n + sl.ranks - 1) / sl.ranks;
      sl.total = sl.size * sl.ranks;
      for (size_t k = 0; k < sl.members.size(); ++k) {
        const int64_t numel = master[sl.members[k]].numel();
        const int64_t lo = std::max(sl.offset[k], sl.begin());
        const int64_t hi = std::min(sl.offset[k] + numel, sl.begin() + sl.size);
        if (lo >= hi) continue;
        sl.segments.push_back({k, lo - sl.offset[k], lo - sl.begin(), hi - lo});
        sl.steps.push_back(step[sl.members[k]].clone());
      }
      const at::TensorOptions f32 = master[sl.members.front()].options();
      sl.master = at::zeros({sl.size}, f32);
      sl.exp_avg = at::zeros({sl.size}, f32);
      sl.exp_avg_sq = at::zeros({sl.size}, f32);
      absorb(sl);
      for (size_t i : sl.members) master[i] = exp_avg[i] = exp_avg_sq[i] = at::Tensor();
      sl.params_flat =
          at::zeros({sl.total}, params[sl.members.front()].options().requires_grad(false));
      sl.transient = stage == 2 && replicated;
      if (sl.transient) {
        sl.grad = at::zeros({sl.size}, f32);  // the slice's accumulator; grad_flat per backward
      } else {
        sl.grad_flat = at::zeros({sl.total}, f32);
        // The reduce-scatter's output; a bucket no other rank holds reads its accumulators.
        sl.grad = replicated ? at::zeros({sl.size}, f32) : sl.grad_flat;
      }
      for (size_t k = 0; k < sl.members.size(); ++k) {
        const size_t i = sl.members[k];
        at::Tensor view =
            sl.params_flat.narrow(0, sl.offset[k], params[i].numel()).view(shapes_[i]);
        view.copy_(params[i]);
        view.set_requires_grad(true);
        params[i] = view;
        grad[i] = sl.grad_flat.defined()
                      ? sl.grad_flat.narrow(0, sl.offset[k], params[i].numel()).view(shapes_[i])
                      : at::Tensor();
        add_gradient_hook(view, i);
      }
      zero_.push_back(std::move(sl));
    }
  }
  // Both classes' buckets in one order, that of the backward (the bucket holding the latest
  // parameter first), so that expert and dense buckets launch as their layers finish.
  std::stable_sort(zero_.begin(), zero_.end(), [](const Slice& a, const Slice& b) {
    return a.members.front() > b.members.front();  // members run from the latest parameter down
  });
  for (size_t b = 0; b < zero_.size(); ++b) {
    for (size_t k = 0; k < zero_[b].members.size(); ++k) where_[zero_[b].members[k]] = {b, k};
  }
  release();
}

void AdamW::begin_backward(bool last) {
  last_ = last;
  next_launch_ = 0;
  for (Slice& s : zero_) {
    s.pending = static_cast<int64_t>(s.members.size());
    if (stage_ == 2) s.launched = false;  // (stage 1: once per step, in reduce_grads)
  }
}
void AdamW::into_bucket(size_t i, at::Tensor& g) {
  const auto [b, k] = where_[i];
  Slice& s = zero_[b];
  // (Each parameter's gradient is accumulated once per backward — activation checkpointing goes
  // through autograd::grad — so this cannot happen; if it ever did, the gradient would be lost.)
  AUTOMOE_CHECK(!(s.group && reducing() && s.launched), "gradient of ", names[i],
                " arrived after its bucket was reduced");
  if (!s.grad_flat.defined()) s.grad_flat = at::zeros({s.total}, s.grad.options());
  s.grad_flat.narrow(0, s.offset[k], g.numel()).view(g.sizes()).add_(g);
  g = at::Tensor();  // released at once: the compute-dtype gradients never all exist together
  --s.pending;
  if (!reducing()) return;
  // Launch, in bucket order, every bucket whose gradients are all in.
  while (next_launch_ < zero_.size() && zero_[next_launch_].pending <= 0) launch(next_launch_++);
}

void AdamW::launch(size_t b) {
  Slice& s = zero_[b];
  if (s.launched) return;
  s.launched = true;
  if (!s.group) return;  // s.grad is s.grad_flat
  if (!s.grad_flat.defined()) s.grad_flat = at::zeros({s.total}, s.grad.options());
  if (s.transient) {
    s.reduced = at::empty({s.size}, s.grad.options());
    s.work = s.group->_reduce_scatter_base(s.reduced, s.grad_flat);
    // Keep two buckets in flight: the one before the last is folded in (and its full-size
    // accumulator freed) now.
    if (b >= 2) complete(b - 2);
  } else {
    s.work = s.group->_reduce_scatter_base(s.grad, s.grad_flat);
  }
}

void AdamW::complete(size_t b) {
  Slice& s = zero_[b];
  if (!s.work) return;
  parallel::wait(s.work, "gradient reduce-scatter (ZeRO)");
  s.work.reset();
  if (!s.transient) return;
  s.grad.add_(s.reduced);
  s.reduced = at::Tensor();
  s.grad_flat = at::Tensor();
}

void AdamW::end_backward() {
  if (!sharded() || !reducing()) return;
  at::NoGradGuard no_grad;
  // Buckets a parameter without a gradient kept waiting: launched now, still in order.
  while (next_launch_ < zero_.size()) launch(next_launch_++);
  if (stage_ == 2) {
    for (size_t b = 0; b < zero_.size(); ++b) complete(b);
  }
}

at::Tensor AdamW::gather(const Slice& s, const at::Tensor& part) const {
  if (!s.group) return part;
  at::Tensor full = at::empty({s.total}, part.options());
  at::Tensor in = part.contiguous();
  parallel::wait(s.group->_allgather_base(full, in), "optimizer state all-gather (ZeRO)");
  return full;
}

void AdamW::materialize() {
  for (const Slice& s : zero_) {
    const at::Tensor m = gather(s, s.master), a = gather(s, s.exp_avg), b = gather(s, s.exp_avg_sq);
    for (size_t k = 0; k < s.members.size(); ++k) {
      const size_t i = s.members[k];
      const int64_t n = c10::multiply_integers(shapes_[i]);
      master[i] = m.narrow(0, s.offset[k], n).view(shapes_[i]);
      exp_avg[i] = a.narrow(0, s.offset[k], n).view(shapes_[i]);
      exp_avg_sq[i] = b.narrow(0, s.offset[k], n).view(shapes_[i]);
    }
  }
}

void AdamW::absorb(Slice& s) {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < s.segments.size(); ++k) {
    const Slice::Segment& seg = s.segments[k];
    const size_t i = s.members[seg.member];
    auto copy = [&](at::Tensor& dst, const at::Tensor& full) {
      if (!full.defined()) return;  // not held in full (moments of a fresh run): zeros
      dst.narrow(0, seg.in_slice, seg.length)
          .copy_(full.reshape({-1}).narrow(0, seg.in_member, seg.length));
    };
    copy(s.master, master[i]);
    copy(s.exp_avg, exp_avg[i]);
    copy(s.exp_avg_sq, exp_avg_sq[i]);
    s.steps[k].copy_(step[i]);
  }
}

void AdamW::absorb() {
  for (Slice& s : zero_) absorb(s);
}

void AdamW::release() {
  for (const Slice& s : zero_) {
    for (size_t i : s.members) master[i] = exp_avg[i] = exp_avg_sq[i] = at::Tensor();
  }
}

void AdamW::reduce_grads(const parallel::World& world) {
  if (!sharded()) {
    sync_gradients(*this, world);
    return;
  }
  at::NoGradGuard no_grad;
  // A rank whose last micro-batch had no backward launches here what the hooks did not.
  for (size_t b = 0; b < zero_.size(); ++b) {
    if (!zero_[b].transient) launch(b);
  }
  for (size_t b = 0; b < zero_.size(); ++b) complete(b);
  for (Slice& s : zero_) {
    if (!s.transient) s.launched = false;  // the next step accumulates afresh
  }
}
int64_t sync_gradients(AdamW& opt, const parallel::World& world, int64_t bucket_bytes) {
  if (!world.distributed()) return 0;
  int64_t reduced = 0;
  struct Bucket {
    parallel::Group group;
    std::vector<size_t> members;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<Bucket> buckets;
  for (const bool expert : {false, true}) {
    const parallel::Group& g = expert ? world.dp : world.world;
    if (!g || g->getSize() == 1) continue;
    Bucket cur;
    int64_t bytes = 0;
    auto flush = [&] {
      if (cur.members.empty()) return;
      // (bf16 gradients, or none from a rank whose micro-batches had no backward: reduced in
      // float32, as the float32 accumulators of a step with several micro-batches are)
      std::vector<at::Tensor> flat;
      for (size_t i : cur.members) {
        const at::Tensor& gi = opt.grad[i];
        flat.push_back(gi.defined() ? gi.reshape({-1}).to(at::kFloat)
                                    : at::zeros({opt.master[i].numel()},
                                                opt.master[i].options().dtype(at::kFloat)));
      }
      cur.flat = at::cat(flat);
      cur.group = g;
      std::vector<at::Tensor> one{cur.flat};
      cur.work = g->allreduce(one);  // in flight while the next bucket is packed
      reduced += cur.flat.numel() * static_cast<int64_t>(cur.flat.element_size());
      buckets.push_back(std::move(cur));
      cur = Bucket{};
      bytes = 0;
    };
    for (size_t i = 0; i < opt.grad.size(); ++i) {
      if (opt.expert[i] != expert) continue;
      cur.members.push_back(i);
      bytes += opt.master[i].numel() * 4;
      if (bytes >= bucket_bytes) flush();
    }
    flush();
  }
  at::NoGradGuard no_grad;
  for (Bucket& b : buckets) {
    parallel::wait(b.work, "gradient all-reduce");
    int64_t at_ = 0;
    for (size_t i : b.members) {
      at::Tensor& gi = opt.grad[i];
      const int64_t n = opt.master[i].numel();
      const at::Tensor sum = b.flat.narrow(0, at_, n).view(opt.master[i].sizes());
      if (gi.defined() && gi.scalar_type() == at::kFloat) {
        gi.copy_(sum);
      } else {
        gi = sum;  // the float32 sum itself (a view of the bucket)
      }
      at_ += n;
    }
  }
  return reduced;
}

}  // namespace automoe::train
