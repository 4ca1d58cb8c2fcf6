#include "automoe/train/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>

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

}  // namespace

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
  // The same bits as the adamw row kernel's split (ops/cpu/vec_adamw_step.h): the upper half
  // rounded half away from zero (+0x8000, then the upper 16 bits), the lower half as it is.
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

void AdamW::add_gradient_hook(const at::Tensor& param, size_t i) {
  torch::autograd::impl::set_post_acc_grad_hooks(param, std::make_unique<GradientHook>(this, i));
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
  into_bucket(i, g);
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
    add_gradient_hook(params[i], i);
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
}  // namespace automoe::train
