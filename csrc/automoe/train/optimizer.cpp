#include "automoe/train/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/vec.h"

namespace automoe::train {

AdamW::Masters AdamW::parse_masters(const std::string& name) {
  if (name == "float32") return Masters::kFloat32;
  if (name == "remainders") return Masters::kRemainders;
  if (name == "none") return Masters::kNone;
  fail("optimizer.master_weights: \"", name, "\" is not one of: float32, remainders, none");
}

const char* AdamW::masters_name(Masters m) {
  switch (m) {
    case Masters::kRemainders: return "remainders";
    case Masters::kNone: return "none";
    default: return "float32";
  }
}

c10::ScalarType AdamW::parse_state_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "8bit") return at::kByte;
  fail("optimizer.state_dtype: \"", name, "\" is not one of: float32, bfloat16, 8bit");
}

const char* AdamW::state_dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "8bit";
    default: return "float32";
  }
}

namespace {

using ops::cpu::vec::kQuantBlock;

// A tensor's rows for the 8-bit moments: its last dimension.
int64_t quant_cols(const at::Tensor& t) { return t.dim() == 0 ? 1 : std::max<int64_t>(1, t.size(-1)); }

// The 8-bit map's values (or midpoints) on `dev`, copied there once per process: a copy from
// host memory per call would wait for the device on every tensor of every step. (Never freed: a
// device tensor must not outlive its runtime in a static destructor.)
at::Tensor qtable(const float* values, int64_t n, const at::Device& dev) {
  static std::mutex mu;
  static auto* cache = new std::map<std::tuple<const float*, int, int>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mu);
  at::Tensor& t = (*cache)[{values, static_cast<int>(dev.type()), static_cast<int>(dev.index())}];
  if (!t.defined()) {
    t = at::from_blob(const_cast<float*>(values), {n}, at::kFloat)
            .to(dev, /*non_blocking=*/false, /*copy=*/true);
  }
  return t;
}

}  // namespace

at::Tensor AdamW::dequantize8(const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
  at::NoGradGuard no_grad;
  const int64_t cols = quant_cols(codes), rows = codes.numel() / cols, nb = scale.size(-1);
  const at::Tensor q = qtable(ops::cpu::vec::qmap8(is_signed), 256, codes.device());
  at::Tensor x = q.index_select(0, codes.reshape(-1).to(at::kInt)).view({rows, cols});
  if (nb * kQuantBlock != cols) x = at::constant_pad_nd(x, {0, nb * kQuantBlock - cols});
  x = x.view({rows, nb, kQuantBlock}) * scale.reshape({rows, nb, 1});
  // (contiguous: the fused AdamW reads its tensors as flat memory)
  return x.view({rows, nb * kQuantBlock}).narrow(1, 0, cols).contiguous().view(codes.sizes());
}

void AdamW::quantize8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      bool is_signed) {
  at::NoGradGuard no_grad;
  const int64_t cols = quant_cols(codes), rows = codes.numel() / cols, nb = scale.size(-1);
  // As the CPU kernel: a NaN stays out of its block's absmax (the block's other values keep their
  // scale) and takes the code of 0, as does anything scaled to NaN (an infinite absmax).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  at::Tensor xr = x.to(at::kFloat).reshape({rows, cols}).nan_to_num(0.0, kInf, -kInf);
  if (nb * kQuantBlock != cols) xr = at::constant_pad_nd(xr, {0, nb * kQuantBlock - cols});
  const at::Tensor blocks = xr.view({rows, nb, kQuantBlock});
  // (a block whose largest magnitude is below the smallest normal float is flushed to zero, as
  // the CPU kernel does: its reciprocal would overflow)
  at::Tensor absmax = blocks.abs().amax(-1);
  absmax = at::where(absmax >= std::numeric_limits<float>::min(), absmax, at::zeros_like(absmax));
  const at::Tensor inv = at::where(absmax > 0, absmax.reciprocal(), at::zeros_like(absmax));
  const at::Tensor mids = qtable(ops::cpu::vec::qmid8(is_signed), 255, codes.device());
  // (the number of midpoints below each value: the nearest map value, ties to the lower)
  const at::Tensor c = at::bucketize((blocks * inv.unsqueeze(-1)).nan_to_num(0.0, kInf, -kInf),
                                    mids, /*out_int32=*/true);
  codes.copy_(c.view({rows, nb * kQuantBlock}).narrow(1, 0, cols).reshape(codes.sizes()));
  scale.copy_(absmax.view(scale.sizes()));
}

void AdamW::init(const NamedTensors& masters_in, const std::vector<bool>& routed_expert,
                 bool own_grads, bool full_state, Masters kind, c10::ScalarType moments,
                 std::vector<at::Tensor> remainders) {
  AUTOMOE_CHECK(kind != Masters::kRemainders || remainders.size() == masters_in.size(),
                "AdamW: ", remainders.size(), " remainders for ", masters_in.size(), " weights");
  masters = kind;
  state_dtype = moments;
  own_grads_ = own_grads;
  remainder = std::move(remainders);
  for (size_t i = 0; i < masters_in.size(); ++i) {
    const at::Tensor& t = masters_in[i].second;
    names.push_back(masters_in[i].first);
    master.push_back(t);
    grad.emplace_back();  // (own_grads: taken from the first backward)
    // 8-bit: zero scales make every code stand for 0.
    const bool q8 = moments == at::kByte && t.dim() >= 2;
    const c10::ScalarType md = moments == at::kByte && !q8 ? at::kFloat : moments;
    const at::TensorOptions so = t.options().dtype(md).requires_grad(false);
    exp_avg.push_back(full_state ? at::zeros(t.sizes(), so) : at::Tensor());
    exp_avg_sq.push_back(full_state ? at::zeros(t.sizes(), so) : at::Tensor());
    at::Tensor scale;
    if (q8 && full_state) {
      // [..., blocks]: the parameter's leading dimensions kept, so that an expert's rows of the
      // scales go with its rows of the codes (checkpoints under expert parallelism).
      std::vector<int64_t> shape = t.dim() > 1 ? t.sizes().vec() : std::vector<int64_t>{1};
      shape.back() = (quant_cols(t) + kQuantBlock - 1) / kQuantBlock;
      scale = at::zeros(shape, so.dtype(at::kFloat));
    }
    exp_avg_scale.push_back(scale);
    exp_avg_sq_scale.push_back(scale.defined() ? at::zeros_like(scale) : at::Tensor());
    step.push_back(at::zeros({}, t.options().dtype(at::kFloat).requires_grad(false)));
    decay.push_back(t.dim() >= 2);
    expert.push_back(routed_expert[i]);
    shapes_.push_back(t.sizes().vec());
  }
}

void AdamW::split_master(const at::Tensor& f32, at::Tensor& bf16, at::Tensor& rem) {
  at::NoGradGuard no_grad;
  // The same bits as the adamw row kernel's split (ops/cpu/vec.cpp): the upper half rounded half
  // away from zero (+0x8000, then the upper 16 bits), the lower half as it is.
  const at::Tensor bits = f32.contiguous().view(at::kInt);
  bf16 = at::bitwise_right_shift(bits + 0x8000, 16).to(at::kShort).view(at::kBFloat16);
  rem = at::bitwise_and(bits, 0xFFFF).to(at::kShort);
}

at::Tensor AdamW::join_master(const at::Tensor& bf16, const at::Tensor& rem) {
  at::NoGradGuard no_grad;
  // (upper << 16) + the remainder read as a signed int16: the -0x10000 undoes a rounding up.
  const at::Tensor hi = at::bitwise_and(bf16.contiguous().view(at::kShort).to(at::kInt), 0xFFFF);
  return (at::bitwise_left_shift(hi, 16) + rem.to(at::kInt)).view(at::kFloat);
}

at::Tensor AdamW::master_f32(size_t i) const {
  at::NoGradGuard no_grad;
  switch (masters) {
    case Masters::kRemainders: return join_master(master[i], remainder[i]);
    case Masters::kNone: return master[i].detach().to(at::kFloat);
    default: return master[i];
  }
}

void AdamW::accumulate(size_t i, at::Tensor g) {
  at::NoGradGuard no_grad;
  at::Tensor& acc = grad[i];
  if (!acc.defined()) {
    acc = std::move(g);  // one micro-batch: the gradient as autograd made it, no copy
  } else if (acc.scalar_type() != at::kFloat) {
    acc = acc.to(at::kFloat).add_(g);  // a second one: from here on in float32
  } else {
    acc.add_(g);
  }
}

namespace {

// Moves a parameter's gradient into the optimizer's bucket as soon as autograd has accumulated it.
struct GradientHook : torch::autograd::PostAccumulateGradHook {
  GradientHook(AdamW* opt, size_t i) : opt(opt), i(i) {}
  void operator()(const torch::autograd::Variable& param) override { opt->on_gradient(i, param); }
  AdamW* opt;
  size_t i;
};

}  // namespace

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
        torch::autograd::impl::set_post_acc_grad_hooks(view,
                                                       std::make_unique<GradientHook>(this, i));
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

void AdamW::on_gradient(size_t i, const at::Tensor& param) {
  at::NoGradGuard no_grad;
  at::Tensor& g = const_cast<at::Tensor&>(param).mutable_grad();
  if (!g.defined()) return;
  if (in_bwd_) {
    AUTOMOE_CHECK(armed_, "gradient of ", names[i],
                  " with optimizer.in_backward, but no step was armed (AdamW::arm)");
    // (Each parameter's gradient is complete once per backward — activation checkpointing goes
    // through autograd::grad — so a second one would be a second backward in the step.)
    AUTOMOE_CHECK(!bwd_done_[i], "gradient of ", names[i],
                  " arrived twice in one step with optimizer.in_backward");
    const at::Tensor grad_i = std::move(g);
    g = at::Tensor();  // freed when this update is done: the gradients never all exist together
    const double sq = sum_squares({grad_i});
    bwd_sq_ += sq;
    if (!std::isfinite(sq)) bwd_poisoned_ = true;
    if (bwd_poisoned_) return;  // this and every later tensor of the step keep their weights
    step[i].add_(1.0);
    update_one(i, grad_i, bwd_cfg_, bwd_lr_);
    if (!param.is_same(master[i])) const_cast<at::Tensor&>(param).copy_(master[i]);
    bwd_done_[i] = true;
    ++bwd_updated_;
    return;
  }
  if (!sharded()) return;
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
      dst.narrow(0, seg.in_slice, seg.length).copy_(full.reshape({-1}).narrow(0, seg.in_member, seg.length));
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

void AdamW::update(const OptimizerSection& o, double lr) {
  AUTOMOE_CHECK(!in_bwd_, "AdamW::update: the updates run in the backward (finish_in_backward)");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> g[2][5];
  at::_foreach_add_(step, 1.0);  // the fused kernel reads the step count, it does not advance it
  if (sharded()) {
    for (Slice& s : zero_) {
      if (!s.steps.empty()) at::_foreach_add_(s.steps, 1.0);
      for (size_t k = 0; k < s.segments.size(); ++k) {
        const Slice::Segment& seg = s.segments[k];
        auto& G = g[decay[s.members[seg.member]] ? 1 : 0];
        G[0].push_back(s.master.narrow(0, seg.in_slice, seg.length));
        G[1].push_back(s.grad.narrow(0, seg.in_slice, seg.length));
        G[2].push_back(s.exp_avg.narrow(0, seg.in_slice, seg.length));
        G[3].push_back(s.exp_avg_sq.narrow(0, seg.in_slice, seg.length));
        G[4].push_back(s.steps[k]);
      }
    }
  } else if (own_grads_) {
    update_mixed(o, lr);
    return;
  } else {
    for (size_t i = 0; i < master.size(); ++i) {
      auto& G = g[decay[i] ? 1 : 0];
      G[0].push_back(master[i]);
      G[1].push_back(grad[i]);
      G[2].push_back(exp_avg[i]);
      G[3].push_back(exp_avg_sq[i]);
      G[4].push_back(step[i]);
    }
  }
  for (int d = 0; d < 2; ++d) {
    if (g[d][0].empty()) continue;
    at::_fused_adamw_(g[d][0], g[d][1], g[d][2], g[d][3], {}, g[d][4], lr, o.beta1, o.beta2,
                      d ? o.weight_decay : 0.0, o.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

void AdamW::update_mixed(const OptimizerSection& o, double lr) {
  for (size_t i = 0; i < master.size(); ++i) {
    const at::Tensor& p = master[i];
    update_one(i, grad[i].defined() ? grad[i] : at::zeros_like(p, p.options().requires_grad(false)),
               o, lr);
  }
}

void AdamW::update_one(size_t i, const at::Tensor& g_in, const OptimizerSection& o, double lr) {
  at::NoGradGuard no_grad;
  at::Tensor& p = master[i];
  at::Tensor g = g_in;
  const double wd = decay[i] ? o.weight_decay : 0.0;
  if (!own_grads_) {  // float32 masters, float32 gradients: ATen's fused kernel
    at::_fused_adamw_({p}, {g}, {exp_avg[i]}, {exp_avg_sq[i]}, {}, {step[i]}, lr, o.beta1, o.beta2,
                      wd, o.eps, /*amsgrad=*/false, /*maximize=*/false);
    return;
  }
  if (p.device().is_cpu() && !aten_update) {
    const double t = step[i].item<double>();  // (advanced by the caller)
    const double bc1 = 1.0 - std::pow(o.beta1, t), bc2 = 1.0 - std::pow(o.beta2, t);
    if (!g.is_contiguous()) g = g.contiguous();
    const bool scales_ok = !quantized(i) || (exp_avg_scale[i].is_contiguous() &&
                                             exp_avg_sq_scale[i].is_contiguous());
    AUTOMOE_CHECK(p.is_contiguous() && exp_avg[i].is_contiguous() &&
                      exp_avg_sq[i].is_contiguous() && scales_ok,
                  "AdamW: ", names[i], ": state is not contiguous");
    ops::cpu::vec::AdamwRow r;
    r.p = p.data_ptr();
    r.p_dtype = p.scalar_type();
    r.rem = masters == Masters::kRemainders ? remainder[i].data_ptr<int16_t>() : nullptr;
    r.g = g.data_ptr();
    r.g_dtype = g.scalar_type();
    r.m = exp_avg[i].data_ptr();
    r.v = exp_avg_sq[i].data_ptr();
    r.s_dtype = exp_avg[i].scalar_type();
    const bool q8 = quantized(i);
    if (q8) {
      r.m_scale = exp_avg_scale[i].data_ptr<float>();
      r.v_scale = exp_avg_sq_scale[i].data_ptr<float>();
      r.cols = quant_cols(p);
    }
    r.decay = static_cast<float>(1.0 - lr * wd);
    r.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
    r.beta2 = static_cast<float>(o.beta2);
    r.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
    r.eps = static_cast<float>(o.eps);
    r.step_size = static_cast<float>(lr / bc1);
    r.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    r.g_scale = static_cast<float>(grad_scale_);
    if (q8) {  // whole rows, so that no block is split between threads
      const int64_t rows = p.numel() / r.cols;
      at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / r.cols),
                       [&](int64_t b, int64_t e) { ops::cpu::vec::adamw8(r, b, e - b); });
      return;
    }
    at::parallel_for(0, p.numel(), 1 << 14, [&](int64_t b, int64_t e) {
      ops::cpu::vec::adamw(r, b, e - b);
    });
    return;
  }
  // Other devices: the same update through float32 copies, a chunk of rows at a time (so that the
  // temporaries stay small whatever the tensor: ~16 M elements).
  const bool q8 = quantized(i);
  const int64_t cols = quant_cols(p), rows = p.numel() / cols;
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 24) / cols);
  auto as_rows = [&](const at::Tensor& t) { return t.reshape({rows, -1}); };
  const at::Tensor p2 = as_rows(p), g2 = as_rows(g), m2 = as_rows(exp_avg[i]),
                   v2 = as_rows(exp_avg_sq[i]);
  const at::Tensor r2 = masters == Masters::kRemainders ? as_rows(remainder[i]) : at::Tensor();
  const at::Tensor ms2 = q8 ? as_rows(exp_avg_scale[i]) : at::Tensor();
  const at::Tensor vs2 = q8 ? as_rows(exp_avg_sq_scale[i]) : at::Tensor();
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    auto part = [&](const at::Tensor& t) { return t.narrow(0, r0, n); };
    at::Tensor w = masters == Masters::kRemainders ? join_master(part(p2), part(r2))
                   : masters == Masters::kNone     ? part(p2).to(at::kFloat)
                                                   : part(p2);  // (float32 masters: in place)
    at::Tensor g32 = part(g2).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    if (grad_scale_ != 1.0) g32.mul_(grad_scale_);
    at::Tensor m = q8 ? dequantize8(part(m2), part(ms2), true) : part(m2).to(at::kFloat);
    at::Tensor v = q8 ? dequantize8(part(v2), part(vs2), false) : part(v2).to(at::kFloat);
    at::_fused_adamw_({w}, {g32}, {m}, {v}, {}, {step[i]}, lr, o.beta1, o.beta2, wd, o.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    if (masters == Masters::kRemainders) {
      at::Tensor hi, lo;
      split_master(w, hi, lo);
      part(p2).copy_(hi.view(w.sizes()));
      part(r2).copy_(lo.view(w.sizes()));
    } else if (masters == Masters::kNone) {
      part(p2).copy_(w);
    }
    if (q8) {
      quantize8(m, part(m2), part(ms2), true);
      quantize8(v, part(v2), part(vs2), false);
    } else {
      if (part(m2).data_ptr() != m.data_ptr()) part(m2).copy_(m);
      if (part(v2).data_ptr() != v.data_ptr()) part(v2).copy_(v);
    }
  }
}

void AdamW::update_in_backward(std::vector<at::Tensor>& params) {
  AUTOMOE_CHECK(!sharded(), "optimizer.in_backward cannot be combined with ZeRO");
  AUTOMOE_CHECK(params.size() == master.size(), "AdamW: ", params.size(), " parameters for ",
                master.size(), " masters");
  in_bwd_ = true;
  bwd_done_.assign(master.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(params[i], std::make_unique<GradientHook>(this, i));
  }
}

void AdamW::arm(const OptimizerSection& o, double lr) {
  bwd_cfg_ = o;
  bwd_lr_ = lr;
  armed_ = true;
  // A new step: nothing updated, nothing summed.
  std::fill(bwd_done_.begin(), bwd_done_.end(), false);
  bwd_poisoned_ = false;
  bwd_sq_ = 0;
  bwd_updated_ = 0;
}

void AdamW::finish_in_backward(std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  AUTOMOE_CHECK(armed_, "AdamW: finish_in_backward without arm()");
  if (bwd_poisoned_) return;  // (the caller skips the step)
  for (size_t i = 0; i < master.size(); ++i) {
    if (bwd_done_[i]) continue;
    step[i].add_(1.0);
    update_one(i, at::zeros_like(master[i], master[i].options().requires_grad(false)), bwd_cfg_,
               bwd_lr_);
    if (!params[i].is_same(master[i])) params[i].copy_(master[i]);
    bwd_done_[i] = true;
  }
  armed_ = false;  // finished
}

void AdamW::disarm() {
  if (!in_bwd_ || !armed_) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < master.size(); ++i) {
    if (bwd_done_[i]) step[i].sub_(1.0);
  }
  armed_ = false;
}

void AdamW::publish(std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  if (!sharded()) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].is_same(master[i])) params[i].copy_(master[i]);
    }
    return;
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;
  inputs.reserve(zero_.size());
  for (Slice& s : zero_) {
    // This rank's slice in the compute dtype, gathered straight into the forward's flat buffer.
    at::Tensor mine = s.master.to(s.params_flat.scalar_type());
    if (!s.group) {
      s.params_flat.copy_(mine);
      continue;
    }
    inputs.push_back(mine);
    works.push_back(s.group->_allgather_base(s.params_flat, inputs.back()));
  }
  for (const auto& w : works) parallel::wait(w, "weights all-gather (ZeRO)");
}

namespace {

// The sum of squares of a bf16 tensor on the CPU: fixed chunks widened into a float32 buffer and
// summed there, the chunks' sums added in double in order (at::_foreach_norm asked for a float32
// result copies the whole tensor to float32 first: 1.6 GB for one Qwen3-30B-A3B expert tensor).
double bf16_sum_squares(const at::Tensor& t) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t n = t.numel(), chunks = (n + kChunk - 1) / kChunk;
  const auto* data = static_cast<const uint16_t*>(t.const_data_ptr());
  std::vector<double> part(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(kChunk);
    for (int64_t c = b; c < e; ++c) {
      const int64_t len = std::min(kChunk, n - c * kChunk);
      ops::cpu::vec::load(data + c * kChunk, at::kBFloat16, buf.data(), len);
      part[c] = ops::cpu::vec::sum_sq(buf.data(), len);
    }
  });
  double total = 0;
  for (double x : part) total += x;
  return total;
}

// The sum of squares of tensors, as a double tensor (undefined for none): each tensor's
// accumulated in float32 (bf16 gradients too), the tensors' in double.
at::Tensor sum_squares_tensor(const std::vector<at::Tensor>& v) {
    std::vector<at::Tensor> rest;
    double cpu_bf16 = 0;
    bool any_bf16 = false;
    for (const at::Tensor& t : v) {
      if (t.device().is_cpu() && t.scalar_type() == at::kBFloat16) {
        cpu_bf16 += bf16_sum_squares(t.contiguous());
        any_bf16 = true;
      } else {
        rest.push_back(t);
      }
    }
    at::Tensor out;
    if (!rest.empty()) {
      bool all_float = true;
      for (const at::Tensor& t : rest) all_float = all_float && t.scalar_type() == at::kFloat;
      // (a float32 result asked of bf16 tensors on a GPU: a float32 copy of one tensor at a time)
      const std::vector<at::Tensor> norms =
          all_float ? at::_foreach_norm(rest, 2) : at::_foreach_norm(rest, 2, at::kFloat);
      out = at::stack(norms).to(at::kDouble).pow(2).sum();
    }
    if (any_bf16) {
      const at::Tensor c = at::scalar_tensor(cpu_bf16, at::kDouble);
      out = out.defined() ? out + c : c;
    }
    return out;
}

}  // namespace

double AdamW::sum_squares(const std::vector<at::Tensor>& v) {
  const at::Tensor t = sum_squares_tensor(v);
  return t.defined() ? t.item<double>() : 0.0;
}

double AdamW::grad_norm(const parallel::World& world) const {
  if (in_bwd_) return std::sqrt(bwd_sq_);  // (one process: summed by the backward's hooks)
  const auto sq = sum_squares_tensor;
  if (sharded()) {  // each element lies in exactly one rank's slice: one sum over the world
    std::vector<at::Tensor> parts;
    for (const Slice& s : zero_) parts.push_back(s.grad);
    at::Tensor total = sq(parts);
    parallel::all_reduce_sum(world.world, total, "gradient norm");
    return std::sqrt(total.item<double>());
  }
  std::vector<at::Tensor> dense, experts;
  for (size_t i = 0; i < grad.size(); ++i) {
    if (grad[i].defined()) (expert[i] ? experts : dense).push_back(grad[i]);
  }
  at::Tensor d = sq(dense), e = sq(experts);
  if (world.ep && world.ep->getSize() > 1) {
    if (!e.defined()) e = at::zeros({}, at::TensorOptions(at::kDouble).device(master.front().device()));
    parallel::all_reduce_sum(world.ep, e, "gradient norm");
  }
  double total = 0;
  if (d.defined()) total += d.item<double>();
  if (e.defined()) total += e.item<double>();
  return std::sqrt(total);
}

void AdamW::scale_grads(double s) {
  if (!sharded() && own_grads_) {
    grad_scale_ *= s;
    return;
  }
  if (!sharded()) {
    at::_foreach_mul_(grad, s);
    return;
  }
  for (Slice& sl : zero_) sl.grad.mul_(s);
}

void AdamW::zero_grads() {
  if (!sharded()) {
    if (own_grads_) {
      for (auto& g : grad) g = at::Tensor();
      grad_scale_ = 1.0;
    } else {
      at::_foreach_zero_(grad);
    }
    return;
  }
  for (Slice& s : zero_) {
    s.grad.zero_();
    if (s.grad_flat.defined() && !s.transient) s.grad_flat.zero_();
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
