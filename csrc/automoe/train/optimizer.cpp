#include "automoe/train/optimizer.h"

#include <ATen/ATen.h>

namespace automoe::train {

void AdamW::init(const NamedTensors& masters, const std::vector<bool>& routed_expert,
                 bool own_grads) {
  for (size_t i = 0; i < masters.size(); ++i) {
    const at::Tensor& t = masters[i].second;
    names.push_back(masters[i].first);
    master.push_back(t);
    grad.push_back(own_grads ? at::zeros_like(t) : at::Tensor());
    exp_avg.push_back(at::zeros_like(t));
    exp_avg_sq.push_back(at::zeros_like(t));
    step.push_back(at::zeros({}, t.options()));
    decay.push_back(t.dim() >= 2);
    expert.push_back(routed_expert[i]);
  }
}

void AdamW::update(const OptimizerSection& o, double lr) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> g[2][5];
  for (size_t i = 0; i < master.size(); ++i) {
    auto& G = g[decay[i] ? 1 : 0];
    G[0].push_back(master[i]);
    G[1].push_back(grad[i]);
    G[2].push_back(exp_avg[i]);
    G[3].push_back(exp_avg_sq[i]);
    G[4].push_back(step[i]);
  }
  at::_foreach_add_(step, 1.0);  // the fused kernel reads the step count, it does not advance it
  for (int d = 0; d < 2; ++d) {
    if (g[d][0].empty()) continue;
    at::_fused_adamw_(g[d][0], g[d][1], g[d][2], g[d][3], {}, g[d][4], lr, o.beta1, o.beta2,
                      d ? o.weight_decay : 0.0, o.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

double AdamW::grad_norm(const parallel::Group& ep) const {
  std::vector<at::Tensor> dense, experts;
  for (size_t i = 0; i < grad.size(); ++i) (expert[i] ? experts : dense).push_back(grad[i]);
  auto sq = [](const std::vector<at::Tensor>& v) -> at::Tensor {
    if (v.empty()) return {};
    return at::stack(at::_foreach_norm(v, 2)).to(at::kDouble).pow(2).sum();
  };
  at::Tensor d = sq(dense), e = sq(experts);
  if (ep && ep->getSize() > 1) {
    if (!e.defined()) e = at::zeros({}, at::TensorOptions(at::kDouble).device(grad.front().device()));
    parallel::all_reduce_sum(ep, e, "gradient norm");
  }
  double total = 0;
  if (d.defined()) total += d.item<double>();
  if (e.defined()) total += e.item<double>();
  return std::sqrt(total);
}

void AdamW::scale_grads(double s) { at::_foreach_mul_(grad, s); }
void AdamW::zero_grads() { at::_foreach_zero_(grad); }

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
      std::vector<at::Tensor> flat;
      for (size_t i : cur.members) flat.push_back(opt.grad[i].reshape({-1}));
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
      bytes += opt.grad[i].numel() * static_cast<int64_t>(opt.grad[i].element_size());
      if (bytes >= bucket_bytes) flush();
    }
    flush();
  }
  at::NoGradGuard no_grad;
  for (Bucket& b : buckets) {
    parallel::wait(b.work, "gradient all-reduce");
    int64_t at_ = 0;
    for (size_t i : b.members) {
      const int64_t n = opt.grad[i].numel();
      opt.grad[i].copy_(b.flat.narrow(0, at_, n).view(opt.grad[i].sizes()));
      at_ += n;
    }
  }
  return reduced;
}

}  // namespace automoe::train
