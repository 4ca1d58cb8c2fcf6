#include "automoe/train/metrics.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

namespace automoe::train {
namespace {

using nlohmann::json;

// The layer number in a parameter name ("model.layers.12.mlp.experts" -> 12).
int64_t layer_of(const std::string& name) {
  const size_t at = name.find("layers.");
  return at == std::string::npos ? -1 : std::stoll(name.substr(at + 7));
}

}  // namespace

json expert_load(const std::vector<at::Tensor>& counts, const std::vector<int64_t>& moe_layers) {
  json out = json::array();
  for (size_t i = 0; i < counts.size(); ++i) {
    const at::Tensor c = counts[i].to(at::kDouble).cpu();
    const double mean = c.mean().item<double>();
    const double sd = c.numel() > 1 ? c.std(/*unbiased=*/false).item<double>() : 0.0;
    std::vector<int64_t> v(c.numel());
    const at::Tensor ci = counts[i].cpu().to(at::kLong).contiguous();
    std::copy(ci.data_ptr<int64_t>(), ci.data_ptr<int64_t>() + ci.numel(), v.begin());
    out.push_back({{"layer", moe_layers[i]},
                   {"min", c.min().item<double>()},
                   {"max", c.max().item<double>()},
                   {"cv", mean > 0 ? sd / mean : 0.0},
                   {"empty", c.eq(0).sum().item<int64_t>()},
                   {"counts", v}});
  }
  return out;
}

ExpertAdapterMetrics ExpertAdapterMetrics::of(const std::vector<LoraSite>& lora, const AdamW& opt) {
  ExpertAdapterMetrics m;
  for (const auto& site : lora) {
    if (!site.experts) continue;
    Site s{layer_of(site.module), 0, 0};
    for (size_t i = 0; i < opt.names.size(); ++i) {
      if (opt.names[i] == site.a_name()) s.a = i;
      if (opt.names[i] == site.b_name()) s.b = i;
    }
    m.sites.push_back(s);
  }
  return m;
}

void ExpertAdapterMetrics::add_gradients(const AdamW& opt) {
  at::NoGradGuard no_grad;
  for (const Site& s : sites) {
    at::Tensor any = at::zeros({opt.grad[s.a].size(0)}, opt.grad[s.a].options().dtype(at::kBool));
    for (size_t i : {s.a, s.b}) {
      if (opt.grad[i].defined()) any = any.logical_or(opt.grad[i].flatten(1).ne(0).any(1));
    }
    at::Tensor& t = touched[s.layer];
    t = t.defined() ? t.logical_or(any) : any;
  }
}

std::vector<at::Tensor> ExpertAdapterMetrics::snapshot(const AdamW& opt) const {
  std::vector<at::Tensor> out;
  for (const Site& s : sites) {
    out.push_back(opt.master[s.a].detach().clone());
    out.push_back(opt.master[s.b].detach().clone());
  }
  return out;
}

json ExpertAdapterMetrics::report(const AdamW& opt, const std::vector<at::Tensor>& before,
                                 const parallel::Group& ep) {
  // Per layer (touched's order): experts with a gradient, experts, the update's squared norm —
  // summed over the EP group, whose ranks hold the layer's experts between them.
  std::map<int64_t, double> sq;
  for (size_t k = 0; k < sites.size() && !before.empty(); ++k) {
    for (int w = 0; w < 2; ++w) {
      const size_t i = w == 0 ? sites[k].a : sites[k].b;
      sq[sites[k].layer] += (opt.master[i] - before[2 * k + w]).pow(2).sum().item<double>();
    }
  }
  std::vector<double> sums;
  for (const auto& [layer, t] : touched) {
    sums.insert(sums.end(), {t.sum().item<double>(), static_cast<double>(t.numel()), sq[layer]});
  }
  if (ep && ep->getSize() > 1 && !sums.empty()) {
    const at::Device dev = touched.begin()->second.device();
    at::Tensor all = at::tensor(sums, at::kDouble).to(dev);
    parallel::all_reduce_sum(ep, all, "expert adapter metrics");
    all = all.cpu();
    sums.assign(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
  }
  json out = json::array();
  size_t j = 0;
  for (const auto& [layer, t] : touched) {
    out.push_back({{"layer", layer},
                   {"experts_with_grad", static_cast<int64_t>(sums[3 * j])},
                   {"experts", static_cast<int64_t>(sums[3 * j + 1])},
                   {"update_norm", before.empty() ? NAN : std::sqrt(sums[3 * j + 2])}});
    ++j;
  }
  touched.clear();
  return out;
}

RankMetrics gather_rank_metrics(Window& win, Decoder& decoder, const parallel::World& world,
                                c10::Device dev, size_t moe_layers, int64_t peak_memory_bytes) {
  if (win.expert_counts.empty()) {
    for (size_t l = 0; l < moe_layers; ++l) {
      win.expert_counts.push_back(
          at::zeros({decoder.spec().moe.num_experts}, at::TensorOptions(at::kLong).device(dev)));
    }
  }
  parallel::all_reduce_sum(world.world, win.expert_counts, "expert load metrics");
  moe::DispatchStats ds;
  if (decoder.dispatcher()) ds = decoder.dispatcher()->take_stats();
  const auto all = parallel::all_gather_ints(
      world.world,
      {ds.bytes_sent, ds.bytes_received, ds.rows_computed, static_cast<int64_t>(ds.wait_s * 1e6),
       peak_memory_bytes, static_cast<int64_t>(ds.backward_wait_s * 1e6),
       static_cast<int64_t>(win.grad_sync_s / static_cast<double>(win.steps) * 1e6)},
      world.device, "dispatch metrics");
  RankMetrics out;
  std::vector<int64_t> sent, received, rows;
  std::vector<double> wait, backward_wait;
  for (size_t r = 0; r < all.size() / 7; ++r) {
    sent.push_back(all[7 * r]);
    received.push_back(all[7 * r + 1]);
    rows.push_back(all[7 * r + 2]);
    wait.push_back(static_cast<double>(all[7 * r + 3]) / 1e6);
    out.peak_memory_gib.push_back(static_cast<double>(all[7 * r + 4]) / (1 << 30));
    backward_wait.push_back(static_cast<double>(all[7 * r + 5]) / 1e6);
    out.gradient_sync_wait_s.push_back(static_cast<double>(all[7 * r + 6]) / 1e6);
  }
  if (decoder.dispatcher()) {
    out.dispatch = {{"dispatcher", decoder.dispatcher()->kind()},
                    {"bytes_sent", sent},
                    {"bytes_received", received},
                    {"expert_rows", rows},
                    {"collective_wait_s", wait},
                    {"backward_collective_wait_s", backward_wait}};
  }
  return out;
}

}  // namespace automoe::train
