// `automoe bench`: the AutoMoE side of the side-by-side benchmark (bench/compare_hf.py runs the
// Transformers side). Builds a random model from a preset or a native type's config.json, runs
// warm-up then timed training steps — the trainer's own step (train/step.h: forward + loss,
// backward into float32 accumulators, clipping, fused AdamW over float32 masters) — and reports
// times, tokens/s (forward + backward, as NeMo AutoModel counts, and per whole step) and peak
// memory as JSON, with the CPU kernel paths that ran. `--peak` measures the machine's matmul
// throughput (large at::mm) instead.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/bench/presets.h"
#include "automoe/bench/profile.h"
#include "automoe/cli/commands.h"
#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/arch/registry.h"
#include "automoe/model/config.h"
#include "automoe/model/init.h"
#include "automoe/model/lora.h"
#include "automoe/ops/cpu/isa.h"
#include "automoe/train/flops.h"
#include "automoe/train/peak.h"
#include "automoe/train/step.h"

#ifdef AUTOMOE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace automoe::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kUsage = R"(usage: automoe bench [--preset NAME | --config FILE] [options]
  --preset NAME          cpu-small | cpu-medium | qwen3-30b-a3b-L{n}   (default cpu-small)
  --config FILE          a config.json instead of a preset (any type --list-types prints)
  --batch B --seq S      micro-batch and sequence length                (default 2 x 256)
  --warmup N --steps N   untimed and timed training steps               (default 1, 3)
  --dtype NAME           parameter and compute dtype                    (default bfloat16)
  --device cpu|cuda      (default cpu)
  --attn sdpa|eager      attention backend        (default sdpa; eager for GPT-OSS's sinks)
  --experts NAME         experts backend: grouped | torch_mm | eager    (default grouped)
  --linear NAME          auto | torch: the dense linear layers' GEMM (BackendConfig linear)
                                                                        (default auto)
  --loss NAME            fused_linear_ce | torch                        (default fused_linear_ce,
                         as automoe train)
  --master-weights NAME  float32 | remainders | none: where bf16 training keeps its float32
                         masters (optimizer.master_weights)                (default float32)
  --state-dtype NAME     float32 | bfloat16 | 8bit: AdamW's moments (optimizer.state_dtype)
  --optimizer-in-backward  each tensor updated in the backward, its gradient freed at once
                         (optimizer.in_backward; no clipping: the backward time includes
                         the optimizer's)
  --fake-balanced-gate   round-robin routing (balanced experts)
  --lora R               LoRA fine-tuning: rank-R adapters (alpha 2R) on q/k/v/o_proj and the
                         routed experts (gate_up_proj, down_proj), float32, the base frozen
  --seed N               weights and tokens                             (default 0)
  --json FILE            also write the result there
  --profile [N]          also record the timed steps' ops (ATen, backward nodes, AutoMoE's
                         ops and optimizer phases): the N (default 25) largest by self time
                         to stderr, all of them in the JSON ("profile")
  --print-config         print the preset's config.json and FLOPs per token, run nothing
  --peak                 measure bf16 and fp32 matmul throughput (at::mm) on the device
  --list-types           print the model types the engine implements, run nothing
)";

struct Options {
  std::string preset = "cpu-small";
  std::string config_file;
  int64_t batch = 2, seq = 256, warmup = 1, steps = 3;
  uint64_t seed = 0;
  c10::ScalarType dtype = c10::kBFloat16;
  std::string device = "cpu";
  std::string attn;  // "" = sdpa, or eager where the model's attention has sinks
  std::string experts = "grouped";
  std::string loss = "fused_linear_ce";
  std::string linear = "auto";
  bool fake_gate = false, print_config = false, peak = false, list_types = false;
  int64_t lora = 0;  // LoRA rank; 0: full fine-tune
  std::string master_weights = "float32", state_dtype = "float32";
  bool in_backward = false;
  int64_t profile = 0;  // rows of the op profile to print; 0: no profile
  std::string json_out;
};

int64_t to_int(const std::string& flag, const std::string& v, int64_t min) {
  int64_t n = 0;
  try {
    size_t used = 0;
    n = std::stoll(v, &used);
    AUTOMOE_CHECK(used == v.size(), "");
  } catch (const std::exception&) {
    fail(flag, ": expected an integer, got \"", v, "\"");
  }
  AUTOMOE_CHECK(n >= min, flag, ": expected >= ", min, ", got ", n);
  return n;
}

Options parse(const Args& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      AUTOMOE_CHECK(i + 1 < args.size(), a, " needs a value\n", kUsage);
      return args[++i];
    };
    if (a == "--preset")
      o.preset = value();
    else if (a == "--config")
      o.config_file = value();
    else if (a == "--batch")
      o.batch = to_int(a, value(), 1);
    else if (a == "--seq")
      o.seq = to_int(a, value(), 1);
    else if (a == "--warmup")
      o.warmup = to_int(a, value(), 0);
    else if (a == "--steps")
      o.steps = to_int(a, value(), 1);
    else if (a == "--seed")
      o.seed = static_cast<uint64_t>(to_int(a, value(), 0));
    else if (a == "--dtype")
      o.dtype = dtype_from_name(value(), "--dtype");
    else if (a == "--device")
      o.device = value();
    else if (a == "--attn")
      o.attn = value();
    else if (a == "--experts")
      o.experts = value();
    else if (a == "--linear")
      o.linear = value();
    else if (a == "--loss")
      o.loss = value();
    else if (a == "--json")
      o.json_out = value();
    else if (a == "--lora")
      o.lora = to_int(a, value(), 1);
    else if (a == "--master-weights")
      o.master_weights = value();
    else if (a == "--state-dtype")
      o.state_dtype = value();
    else if (a == "--optimizer-in-backward")
      o.in_backward = true;
    else if (a == "--fake-balanced-gate")
      o.fake_gate = true;
    else if (a == "--print-config")
      o.print_config = true;
    else if (a == "--profile")
      o.profile = i + 1 < args.size() && !args[i + 1].empty() && args[i + 1][0] != '-'
                      ? to_int(a, value(), 1)
                      : 25;
    else if (a == "--peak")
      o.peak = true;
    else if (a == "--list-types")
      o.list_types = true;
    else if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else {
      fail("unknown option ", a, "\n", kUsage);
    }
  }
  AUTOMOE_CHECK(o.device == "cpu" || o.device == "cuda", "--device: expected cpu or cuda, got ",
                o.device);
  AUTOMOE_CHECK(o.device == "cpu" || torch::cuda::is_available(),
                "--device cuda: no CUDA device is visible to this torch");
  AUTOMOE_CHECK(o.master_weights == "float32" || o.master_weights == "remainders" ||
                    o.master_weights == "none",
                "--master-weights: expected float32, remainders or none, got ", o.master_weights);
  AUTOMOE_CHECK(
      o.state_dtype == "float32" || o.state_dtype == "bfloat16" || o.state_dtype == "8bit",
      "--state-dtype: expected float32, bfloat16 or 8bit, got ", o.state_dtype);
  return o;
}

void sync(const c10::Device& dev) {
  if (dev.is_cuda()) torch::cuda::synchronize();
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Resident memory now (VmRSS) and at its peak (ru_maxrss), in bytes.
int64_t rss_now() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}
int64_t rss_peak() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

void emit(const json& j, const std::string& path) {
  std::cout << j.dump(2) << "\n";
  if (!path.empty()) {
    std::ofstream out(path);
    AUTOMOE_CHECK(out.good(), "--json ", path, ": cannot open for writing");
    out << j.dump(2) << "\n";
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

json measure_peak(const c10::Device& dev) {
  json out = json::object();
  for (auto dtype : {c10::kBFloat16, c10::kFloat}) {
    const MatmulPeak p = measure_matmul_peak(dev, dtype);
    out[dtype_to_name(dtype)] = {
        {"n", p.n}, {"ms", p.ms}, {"layout", p.layout}, {"tflops", p.tflops}};
  }
  return out;
}

// The malloc behind the CPU allocations: jemalloc when `automoe` preloads it
// (python/automoe/engine_binary.py), else the C library's.
std::string allocator_name() {
  return dlsym(RTLD_DEFAULT, "mallctl") != nullptr ? "jemalloc" : "glibc";
}

// The model the benchmark trains: random weights of `spec` (Transformers' init), LoRA adapters as
// PEFT's get_peft_model makes them with --lora, and the trainer's own state (train/step.h).
struct BenchModel {
  std::string attn;
  int64_t num_params = 0, trainable_params = 0;
  std::unique_ptr<Decoder> decoder;
  train::OptimizerSection optim;
  train::TrainState ts;  // must not move once a step began (its hooks point into it)
};

std::unique_ptr<BenchModel> build_model(const Options& o, const ModelSpec& spec,
                                        const c10::Device& dev) {
  auto m = std::make_unique<BenchModel>();
  m->attn = !o.attn.empty() ? o.attn : spec.attn.sinks ? "eager" : "sdpa";
  BackendConfig backend = BackendConfig::from_map(
      {{"attn", m->attn}, {"experts", o.experts}, {"loss", o.loss}, {"linear", o.linear}},
      "automoe bench");
  backend.fake_balanced_gate = o.fake_gate;
  NamedTensors params = init_parameters(spec, o.dtype, dev, o.seed);
  for (const auto& [n, t] : params) m->num_params += t.numel();
  m->decoder = std::make_unique<Decoder>(spec, backend, std::move(params));
  std::vector<LoraSite> sites;
  if (o.lora > 0) {  // what PEFT's get_peft_model makes: float32 adapters, trained alone
    LoraConfig c;
    c.r = o.lora;
    c.lora_alpha = 2.0 * static_cast<double>(o.lora);
    c.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
    c.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    sites = plan_lora(spec, parameter_layout(spec), c, /*strict=*/false);
    init_lora(sites, at::TensorOptions().dtype(at::kFloat).device(dev), o.seed);
  }
  // The trainer's own state and step (train/step.h): float32 masters, the forward on compute-dtype
  // copies, gradients accumulated in float32, the fused AdamW, clipping at the recipe default.
  train::OptimizerSection& optim_cfg = m->optim;
  optim_cfg.master_weights = o.master_weights;
  optim_cfg.state_dtype = o.state_dtype;
  optim_cfg.in_backward = o.in_backward;
  AUTOMOE_CHECK(!(o.in_backward && o.lora > 0), "--optimizer-in-backward: not with --lora");
  if (o.in_backward) optim_cfg.max_grad_norm = 0;  // (the recipe demands it too)
  m->ts = train::make_train_state(*m->decoder, o.dtype, dev, std::move(sites), /*zero=*/false,
                                  optim_cfg);
  for (const auto& t : m->ts.opt.master) m->trainable_params += t.numel();
  optim_cfg.lr = 1e-4;
  optim_cfg.weight_decay = 0.01;
  return m;
}

// Per timed step, in milliseconds; the loss of every step (warm-up too).
struct Timings {
  std::vector<double> fwd, bwd, optim, losses;
};

// The trainer's step on one micro-batch of `ids`, timed by phase: forward + loss; backward into the
// float32 accumulators; the optimizer (norm, clipping, the fused AdamW, the new weights out).
Timings time_steps(const Options& o, BenchModel& m, const at::Tensor& ids, const c10::Device& dev,
                   bench::OpProfile& profiler) {
  Timings t;
  train::TrainState& ts = m.ts;
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    if (o.profile > 0 && step == o.warmup) profiler.start();
    train::seed_step(o.seed, 0, step);  // the trainer's draws (router jitter, LoRA dropout)
    sync(dev);
    auto t0 = Clock::now();
    ForwardArgs a{ids, std::nullopt, std::nullopt, ids, false, std::nullopt, true};
    a.training = true;
    const ForwardResult r = m.decoder->forward(a);
    const at::Tensor loss = *r.loss;
    sync(dev);
    const double f = ms_since(t0);
    t0 = Clock::now();
    train::begin_step(ts, m.optim, m.optim.lr);
    train::backward_micro_batch(ts, loss, /*last=*/true);
    sync(dev);
    const double b = ms_since(t0);
    t0 = Clock::now();
    train::adopt_gradients(ts);
    train::clip_gradients(ts, ts.opt.grad_norm(), m.optim.max_grad_norm);
    train::update_weights(ts, m.optim, m.optim.lr);
    train::release_gradients(ts);
    sync(dev);
    const double s = ms_since(t0);
    t.losses.push_back(loss.item<double>());
    if (step >= o.warmup) {
      t.fwd.push_back(f);
      t.bwd.push_back(b);
      t.optim.push_back(s);
    }
  }
  return t;
}

// Peak memory: the CUDA caching allocator's on a GPU, the process's peak RSS (and what it held
// before the model) on the CPU.
void add_memory(json& j, const c10::Device& dev, int64_t rss_before) {
  if (dev.is_cuda()) {
#ifdef AUTOMOE_TORCH_CUDA
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index() < 0 ? 0 : dev.index());
    j["peak_memory_bytes"] = stats.allocated_bytes[0].peak;
    j["peak_memory_kind"] = "cuda max_memory_allocated";
#else
    j["peak_memory_bytes"] = nullptr;
    j["peak_memory_kind"] = "unavailable (built without CUDA headers)";
#endif
  } else {
    j["peak_memory_bytes"] = rss_peak();
    j["peak_memory_kind"] = "process peak RSS";
    j["baseline_memory_bytes"] = rss_before;
  }
}

json result(const Options& o, const BenchModel& m, const Timings& t, double flops_per_token) {
  const double tokens = static_cast<double>(o.batch * o.seq);
  const double fwd_ms = median(t.fwd), bwd_ms = median(t.bwd), opt_ms = median(t.optim);
  return {
      {"side", "automoe"},
      {"impl", "automoe (experts=" + o.experts + ", attn=" + m.attn + ", loss=" + o.loss +
                   (o.linear != "auto" ? ", linear=" + o.linear : std::string()) +
                   (o.lora > 0 ? ", LoRA r=" + std::to_string(o.lora) : std::string()) +
                   (o.master_weights != "float32" || o.state_dtype != "float32"
                        ? ", masters=" + o.master_weights + ", moments=" + o.state_dtype
                        : std::string()) +
                   (o.in_backward ? ", in backward" : "") + ")"},
      {"lora", o.lora},
      {"trainable_parameters", m.trainable_params},
      {"device", o.device},
      {"dtype", dtype_to_name(o.dtype)},
      {"batch", o.batch},
      {"seq", o.seq},
      {"tokens_per_step", tokens},
      {"warmup", o.warmup},
      {"steps", o.steps},
      {"fake_balanced_gate", o.fake_gate},
      {"master_weights", o.master_weights},
      {"state_dtype", o.state_dtype},
      {"optimizer_in_backward", o.in_backward},
      {"num_parameters", m.num_params},
      {"forward_ms", fwd_ms},
      {"backward_ms", bwd_ms},
      {"optimizer_ms", opt_ms},
      {"step_ms", fwd_ms + bwd_ms + opt_ms},
      {"tokens_per_s", tokens / ((fwd_ms + bwd_ms) * 1e-3)},  // NeMo's: forward + backward
      {"tokens_per_s_step", tokens / ((fwd_ms + bwd_ms + opt_ms) * 1e-3)},  // the whole step
      {"train_flops_per_token", flops_per_token},
      {"loss_first", t.losses.front()},
      {"loss_last", t.losses.back()},
      {"threads", at::get_num_threads()},
      {"cpu_kernels", ops::cpu::kernel_paths()},
      {"allocator", allocator_name()},
      {"torch_version", TORCH_VERSION},
  };
}

// The config.json to benchmark: --config's file, or the preset's.
LoadedConfig bench_config(const Options& o) {
  if (o.config_file.empty()) {
    return parse_config(bench::preset_config_json(o.preset), "preset " + o.preset);
  }
  std::ifstream in(o.config_file);
  AUTOMOE_CHECK(in.good(), o.config_file, ": cannot open config");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), o.config_file);
}

}  // namespace

int bench(const Args& args) {
  const Options o = parse(args);
  const c10::Device dev(o.device == "cuda" ? c10::kCUDA : c10::kCPU);
  if (o.list_types) {
    emit({{"model_types", supported_model_types()}}, o.json_out);
    return 0;
  }
  if (o.peak) {
    emit({{"device", o.device},
          {"threads", at::get_num_threads()},
          {"cpu_kernels", ops::cpu::kernel_paths()},
          {"matmul_peak", measure_peak(dev)}},
         o.json_out);
    return 0;
  }
  const LoadedConfig cfg = bench_config(o);
  const ModelSpec& spec = cfg.spec;
  const double flops_per_token = training_flops_per_token(spec, o.seq);
  if (o.print_config) {
    emit({{"config", *cfg.json}, {"seq", o.seq}, {"train_flops_per_token", flops_per_token}},
         o.json_out);
    return 0;
  }

  const int64_t rss_before = rss_now();
  const std::unique_ptr<BenchModel> m = build_model(o, spec, dev);
#ifdef AUTOMOE_TORCH_CUDA
  if (dev.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(dev.index() < 0 ? 0 : dev.index());
#endif
  at::Generator gen = at::detail::createCPUGenerator(o.seed + 1);
  const at::Tensor ids = at::randint(0, spec.vocab_size, {o.batch, o.seq}, gen).to(dev);
  bench::OpProfile profiler;
  const Timings t = time_steps(o, *m, ids, dev, profiler);
  const nlohmann::json profile = o.profile > 0 ? profiler.stop(o.steps) : nlohmann::json();
  if (o.profile > 0) {
    double mean_step = 0;
    for (size_t i = 0; i < t.fwd.size(); ++i) mean_step += t.fwd[i] + t.bwd[i] + t.optim[i];
    mean_step /= static_cast<double>(std::max<size_t>(t.fwd.size(), 1));
    std::cerr << bench::profile_table(profile, mean_step, static_cast<size_t>(o.profile));
  }
  json j = result(o, *m, t, flops_per_token);
  add_memory(j, dev, rss_before);
  if (o.profile > 0) j["profile"] = profile;
  emit(j, o.json_out);
  return 0;
}

}  // namespace automoe::cli
