#include "automoe/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <sched.h>
#include <sys/resource.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/safetensors.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/config.h"
#include "automoe/model/lora.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/train/bias_balance.h"
#include "automoe/train/dataset.h"
#include "automoe/train/flops.h"
#include "automoe/train/optimizer.h"
#include "automoe/train/peak.h"
#include "automoe/train/run_dir.h"
#include "automoe/train/run_log.h"
#include "automoe/train/state.h"
#include "automoe/train/step.h"
#include "automoe/train/stop_signal.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

c10::Device resolve_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? c10::Device("cuda") : c10::Device("cpu");
  const c10::Device dev(name);
  AUTOMOE_CHECK(!dev.is_cuda() || torch::cuda::is_available(), "train.device: \"", name,
                "\" but no CUDA device is visible to this torch");
  AUTOMOE_CHECK(!dev.is_cuda() || dev.index() < static_cast<int>(torch::cuda::device_count()),
                "train.device: \"", name, "\" but this machine has ", torch::cuda::device_count(),
                " CUDA device(s)");
  return dev;
}

// ---- metrics ----------------------------------------------------------------------------------

int64_t cpu_peak_rss() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

std::string human_count(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

// What one log window (log.every steps) accumulates.
struct Window {
  double ce_sum = 0, aux_weighted = 0, loss_tokens = 0, tokens = 0, flops = 0, seconds = 0;
  int64_t steps = 0, skipped = 0, aux_steps = 0, truncated = 0;
  double grad_norm = 0;
  double grad_sync_s = 0;  // time this rank waited for the step's gradient reductions
  std::vector<at::Tensor> expert_counts;  // per MoE layer, summed over the window
};

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

class Progress {
 public:
  Progress(const std::string& mode, int64_t total) : total_(total) {
    const bool tty = ::isatty(STDERR_FILENO);
    bar_ = mode == "bar" || (mode == "auto" && tty);
    lines_ = mode == "lines" || (mode == "auto" && !tty);
  }
  void update(int64_t step, double loss, double tok_s, double eta_s) {
    if (!bar_) return;
    const int width = 24;
    const int filled = total_ ? static_cast<int>(width * step / total_) : width;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r  step %ld/%ld [%s] loss %.4f | %s tok/s | ETA %s   ", step, total_,
                 bar.c_str(), loss, human_count(tok_s).c_str(), human_time(eta_s).c_str());
    std::fflush(stderr);
    dirty_ = true;
  }
  void line(const std::string& text) {
    if (!bar_ && !lines_) return;
    if (dirty_) std::fputs("\n", stderr);
    dirty_ = false;
    std::fprintf(stderr, "%s\n", text.c_str());
  }
  void log(const json& rec) {
    if (!lines_) return;
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "step %ld/%ld  loss %.4f  aux %.4f  grad_norm %.3f  lr %.3g  %s tok/s  "
                  "%.3g TFLOP/s",
                  rec["step"].get<int64_t>(), total_, rec["loss"].get<double>(),
                  rec["aux_loss"].get<double>(), rec["grad_norm"].get<double>(),
                  rec["lr"].get<double>(), human_count(rec["tokens_per_s"].get<double>()).c_str(),
                  rec["tflops"].get<double>());
    line(buf);
  }
  void done() {
    if (dirty_) std::fputs("\n", stderr);
    dirty_ = false;
  }

 private:
  int64_t total_;
  bool bar_ = false, lines_ = false, dirty_ = false;
};

LoraConfig lora_config_of(const PeftSection& p) {
  LoraConfig c;
  c.r = p.r;
  c.lora_alpha = p.lora_alpha;
  c.lora_dropout = p.lora_dropout;
  c.use_rslora = p.use_rslora;
  c.target_modules = p.target_modules;
  c.target_modules_regex = p.target_modules_regex;
  c.target_parameters = p.target_parameters;
  c.moe_rank_scaling = p.moe_rank_scaling;
  return c;
}

// The layer number in a parameter name ("model.layers.12.mlp.experts" -> 12).
int64_t layer_of(const std::string& name) {
  const size_t at = name.find("layers.");
  return at == std::string::npos ? -1 : std::stoll(name.substr(at + 7));
}

// What the routed experts' adapters did in a log window: which experts' adapters received a
// gradient (per MoE layer), and how far the last step moved them — so that adapters that never
// train are visible in the metrics.
struct ExpertAdapterMetrics {
  struct Site {
    int64_t layer;
    size_t a, b;  // optimizer indices of the factors
  };
  std::vector<Site> sites;
  std::map<int64_t, at::Tensor> touched;  // per layer: bool [E]

  void add_gradients(const AdamW& opt) {
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
  // Masters of the experts' factors before an update (for update_norms).
  std::vector<at::Tensor> snapshot(const AdamW& opt) const {
    std::vector<at::Tensor> out;
    for (const Site& s : sites) {
      out.push_back(opt.master[s.a].detach().clone());
      out.push_back(opt.master[s.b].detach().clone());
    }
    return out;
  }
  json report(const AdamW& opt, const std::vector<at::Tensor>& before) {
    std::map<int64_t, double> sq;
    for (size_t k = 0; k < sites.size() && !before.empty(); ++k) {
      for (int w = 0; w < 2; ++w) {
        const size_t i = w == 0 ? sites[k].a : sites[k].b;
        sq[sites[k].layer] += (opt.master[i] - before[2 * k + w]).pow(2).sum().item<double>();
      }
    }
    json out = json::array();
    for (const auto& [layer, t] : touched) {
      out.push_back({{"layer", layer},
                     {"experts_with_grad", t.sum().item<int64_t>()},
                     {"experts", t.numel()},
                     {"update_norm", before.empty() ? NAN : std::sqrt(sq[layer])}});
    }
    touched.clear();
    return out;
  }
};

}  // namespace

int run_training(const Recipe& rc, const TrainData& data, const TrainerHooks& hooks_in,
                 const parallel::World& world) {
  TrainerHooks hooks = hooks_in;
  if (!hooks.peak_memory_bytes) hooks.peak_memory_bytes = cpu_peak_rss;
  if (rc.train.threads > 0) {
    cpu_set_t cpus;
    const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
    AUTOMOE_CHECK(usable == 0 || rc.train.threads <= usable, "train.threads: ", rc.train.threads,
                  " is more than the ", usable, " CPUs this process may run on (more threads "
                  "than CPUs only slows every step); use at most ", usable, ", or 0 for all");
    at::set_num_threads(static_cast<int>(rc.train.threads));
  }
  // From here a SIGTERM / SIGINT / SIGHUP ends the run after its step, with a checkpoint.
  const StopSignals stop;
  const c10::Device dev = resolve_device(rc.train.device);
  c10::OptionalDeviceGuard device_guard;  // cuda:N: N is the current device for the whole run
  if (dev.is_cuda()) device_guard.reset_device(dev);
  const c10::ScalarType compute = dtype_from_name(rc.model.dtype, "model.dtype");
  const fs::path run(rc.checkpoint.dir);
  // Rank 0 owns the run directory: the lock, metrics, the recipe record; every rank reads it.
  const bool lead = world.rank == 0;
  const bool dist = world.distributed();
  AUTOMOE_CHECK(!(dist && rc.optimizer.in_backward),
                "optimizer.in_backward: one process only (", world.mesh.world,
                " here): each rank's gradients must be summed over the ranks before any update");
  if (lead) claim_run_dir(run);  // ours (marker), locked, cleaned of a killed save's leftovers
  // Every rank sees the directory as rank 0 left it (a shared file system across nodes).
  if (dist) parallel::all_gather_ints(world.world, {0}, world.device, "run directory");
  const bool has_latest = fs::exists(run / "latest");
  AUTOMOE_CHECK(!has_latest || rc.checkpoint.resume, "checkpoint.dir ", run.string(),
                " already holds a run (", (run / "latest").string(),
                "); set checkpoint.resume=true to continue it, or choose another directory");
  // The checkpoint to resume from: the one `latest` names, or the one the recipe names.
  std::string resume_name = rc.checkpoint.resume_from;
  if (resume_name.empty() && has_latest) resume_name = latest_checkpoint(run);
  if (!rc.checkpoint.resume_from.empty()) {
    std::string complete;
    for (const auto& n : complete_checkpoints(run, INT64_MAX)) complete += " " + n;
    AUTOMOE_CHECK(fs::is_directory(run / resume_name), "checkpoint.resume_from: ", resume_name,
                  " is not a checkpoint in ", run.string(),
                  complete.empty() ? " (it holds none)" : "; complete ones:" + complete);
  }

  // Model: weights as stored, then float32 masters and (for bf16) the compute copies.
  // Training never needs the [B, S, V] logits: the fused LM head + loss is the default here.
  auto backend_fields = rc.model.backend;
  backend_fields.emplace("loss", "fused_linear_ce");
  // Attention sinks (GPT-OSS) have no SDPA kernel: eager unless the recipe chose (then an error).
  const LoadedConfig config = load_config(rc.model.path);
  if (dist) {
    // Every rank must run the same recipe on the same checkpoint and data: compare before any
    // weight is read (a rank started with other settings would meet its peers in the wrong
    // collectives, or train something else silently).
    nlohmann::json ident = nlohmann::json::parse(rc.to_json());
    ident["train"].erase("device");  // each rank's own GPU
    const std::string mine = ident.dump() + "\n" + config.json->dump() + "\n" + data.train_key;
    const auto all = parallel::all_gather_strings(world.world, mine, world.device, "run identity");
    for (size_t r = 0; r < all.size(); ++r) {
      AUTOMOE_CHECK(all[r] == all[0], "rank ", r, " was started with a different recipe, model "
                    "config or training data than rank 0; every rank must run the same command");
    }
  }
  if (dist && !dev.is_cuda()) {
    // The CPU GEMM paths are chosen by timing, in each process: ranks near the margin could pick
    // differently and compute the same layer with different rounding. Every rank measures now and
    // takes rank 0's choice, which is also the one its checkpoints record for a resume.
    ops::cpu::gemm_path(/*bf16_operands=*/true);
    ops::cpu::aten_faster_fp32();
    const auto all = parallel::all_gather_strings(world.world, ops::cpu::gemm_decisions(),
                                                  world.device, "CPU GEMM choice");
    if (!ops::cpu::adopt_gemm_decisions(all[0], "rank 0")) {
      std::cerr << "automoe train: warning: rank " << world.rank << " runs the CPU kernels at "
                << "another instruction-set level (" << ops::cpu::gemm_decisions() << ") than "
                << "rank 0 (" << all[0] << "): the ranks' sums will round differently; set the "
                << "same AUTOMOE_CPU_ISA on every rank for identical arithmetic\n";
    }
  }
  if (config.spec.attn.sinks) backend_fields.emplace("attn", "eager");
  const BackendConfig backend = BackendConfig::from_map(backend_fields, "model.backend");
  // The mesh is checked against the model before any weight is read.
  const parallel::Mesh mesh = parallel::make_mesh(world.mesh.world, rc.parallel.ep, rc.parallel.dp,
                                                  config.spec.moe.num_experts, "parallel");
  AUTOMOE_CHECK(mesh.ep == world.mesh.ep && mesh.dp == world.mesh.dp, "parallel: the recipe's ep = ",
                mesh.ep, " and dp = ", mesh.dp, " differ from the process groups' (ep = ",
                world.mesh.ep, ", dp = ", world.mesh.dp, ")");
  AUTOMOE_CHECK(backend.dispatcher == "auto" || (backend.dispatcher == "local") == (mesh.ep == 1),
                "model.backend.dispatcher: \"", backend.dispatcher, "\" ",
                mesh.ep == 1 ? "exchanges tokens between expert-parallel ranks, but parallel.ep is 1"
                             : "cannot reach the experts of other ranks; with parallel.ep > 1 use "
                               "allgather, alltoall or alltoall_overlap");
  const parallel::ExpertRange own =
      mesh.ep > 1 ? parallel::experts_of(world.ep_rank(), mesh.ep, config.spec.moe.num_experts)
                  : parallel::ExpertRange{0, 0};
  PretrainedModel pm =
      load_pretrained(rc.model.path, std::nullopt, backend, std::nullopt, {own.begin, own.count});
  if (mesh.ep > 1) {
    pm.decoder->set_dispatcher(moe::make_dispatcher(
        backend.dispatcher == "auto" ? "alltoall" : backend.dispatcher, world.ep,
        config.spec.moe.num_experts));
  }
  AUTOMOE_CHECK(rc.train.grad_accumulation_steps % mesh.world == 0, "train.global_batch_size: ",
                rc.train.global_batch_size, " rows are ", rc.train.grad_accumulation_steps,
                " micro-batches of ", rc.train.micro_batch_size,
                ", which do not split evenly over ", mesh.world,
                " processes (each trains on its own micro-batches of every step)");
  const ModelSpec& spec = pm.decoder->spec();
  const c10::ScalarType stored = pm.decoder->named_parameters().front().second.scalar_type();
  // LoRA: the base weights stay frozen in the compute dtype (no masters, no moments, no gradients);
  // the optimizer holds the adapters' float32 masters.
  const bool lora = rc.peft.enabled;
  const LoraConfig lora_config = lora_config_of(rc.peft);
  std::vector<LoraSite> lora_sites;
  if (lora) {
    AUTOMOE_CHECK(mesh.ep == 1, "peft: LoRA under expert parallelism (parallel.ep = ", mesh.ep,
                  ") is not supported yet; use parallel.ep: 1 (data parallelism)");
    AUTOMOE_CHECK(rc.router.bias_update_rate == 0, "router.bias_update_rate: ",
                  rc.router.bias_update_rate, " with peft: the routers' correction bias would train "
                  "beside the adapters, but the PEFT adapter export cannot carry it (PEFT would load "
                  "the adapter onto the untrained bias); use 0 with LoRA");
    try {
      lora_sites = plan_lora(spec, parameter_layout(spec), lora_config, /*strict=*/true);
    } catch (const Error& e) {
      fail("peft: ", e.what());
    }
    for (const auto& site : lora_sites) {
      AUTOMOE_CHECK(!(site.experts && rc.peft.lora_dropout > 0), "peft.lora_dropout: ",
                    rc.peft.lora_dropout, " with routed experts targeted (", site.base(),
                    "): PEFT's target_parameters adapters, the format the export writes, have no "
                    "dropout; use 0");
    }
    init_lora(lora_sites, at::TensorOptions().dtype(at::kFloat).device(dev), rc.train.seed);
  }
  // float32 masters (or LoRA's adapters) and the compute copies the forward reads (train/step.h).
  // ZeRO-1 makes the moments and gradient accumulators slice-sized below: not allocated here.
  // (LoRA: the adapters are small; every rank keeps their whole state.)
  const bool zero = dist && rc.parallel.zero >= 1 && !lora;
  TrainState ts = make_train_state(*pm.decoder, compute, dev, lora_sites, zero, rc.optimizer);
  AdamW& opt = ts.opt;
  NamedTensors& buffers = ts.buffers;
  std::vector<at::Tensor>& model_params = ts.model_params;
  BiasBalance bias_balance(*pm.decoder, rc.router.bias_update_rate);  // router.bias_update_rate
  AUTOMOE_CHECK(
      !rc.model.router_aux_loss_coef || *rc.model.router_aux_loss_coef == 0 || spec.moe.aux_loss,
      "model.router_aux_loss_coef: ", spec.model_type,
      " trains without a load-balancing loss (as in Transformers); remove the key, or use "
      "router.bias_update_rate for DeepSeek-V3's auxiliary-loss-free balancing");
  // ZeRO-1: from here each rank keeps only its slice of the optimizer state of shared tensors;
  // the forward's weights become views of one buffer per class (re-bound here).
  if (zero) {
    opt.shard(world, model_params, rc.parallel.zero,
              static_cast<int64_t>(rc.parallel.bucket_mb * (1 << 20)));
    for (size_t i = 0; i < opt.names.size(); ++i) pm.decoder->set_parameter(opt.names[i], model_params[i]);
  }
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (spec.is_moe(l)) moe_layers.push_back(l);
  }
  ExpertAdapterMetrics expert_adapters;
  int64_t lora_parameters = 0, base_parameters = 0;
  for (const auto& site : lora_sites) {
    lora_parameters += site.a.numel() + site.b.numel();
    if (!site.experts) continue;
    ExpertAdapterMetrics::Site s{layer_of(site.module), 0, 0};
    for (size_t i = 0; i < opt.names.size(); ++i) {
      if (opt.names[i] == site.a_name()) s.a = i;
      if (opt.names[i] == site.b_name()) s.b = i;
    }
    expert_adapters.sites.push_back(s);
  }
  for (const auto& [n, t] : pm.decoder->named_parameters()) base_parameters += t.numel();

  // Data.
  const TokenDataset train_set(data.train);
  const int64_t max_tok = train_set.max_token();
  AUTOMOE_CHECK(max_tok < spec.vocab_size, data.train, ": token id ", max_tok,
                " is outside the model's vocabulary (", spec.vocab_size,
                "): was the data tokenised with another tokenizer?");
  // Cutting documents at data.seq_len: said on the console; a dataset left without a single loss
  // token is refused (it would train nothing and export the model unchanged).
  const Truncation cut = truncation_at(train_set, rc.data.seq_len);
  AUTOMOE_CHECK(cut.documents_without_loss < train_set.num_docs(), data.train,
                ": none of its ", train_set.num_docs(), " documents has a token to learn within "
                "data.seq_len = ", rc.data.seq_len, " tokens (", cut.documents_cut_to_no_loss,
                " have them only past that length: their prompts are longer); raise data.seq_len "
                "or shorten the prompts");
  const int64_t pad = spec.pad_token_id >= 0 ? spec.pad_token_id : 0;
  const Batcher batcher(train_set, rc.train.micro_batch_size, rc.data.seq_len, rc.data.packing,
                        rc.data.shuffle, rc.train.seed, pad);
  {
    // A step larger than the data itself repeats documents within the step: a typo, not a plan.
    const int64_t rows_per_epoch =
        Batcher(train_set, 1, rc.data.seq_len, rc.data.packing, false, 0, pad).count_until({}, 1.0);
    AUTOMOE_CHECK(rc.train.global_batch_size <= rows_per_epoch, "train.global_batch_size: a step of ",
                  rc.train.global_batch_size, " rows (", rc.train.micro_batch_size, " x ",
                  rc.train.grad_accumulation_steps, ") is more than the ", rows_per_epoch,
                  " rows of data.seq_len tokens that ", data.train,
                  " holds: every step would repeat documents; use at most ", rows_per_epoch);
  }
  std::unique_ptr<TokenDataset> val_set;
  std::vector<MicroBatch> val_batches;
  if (!data.validation.empty()) {
    val_set = std::make_unique<TokenDataset>(data.validation);
    AUTOMOE_CHECK(val_set->max_token() < spec.vocab_size, data.validation,
                  ": token ids outside the model's vocabulary");
    val_batches = Batcher(*val_set, rc.train.micro_batch_size, rc.data.seq_len, rc.data.packing,
                          false, 0, pad)
                      .all_in_order();
  }
  const int64_t accum = rc.train.grad_accumulation_steps;
  const int64_t total_steps =
      rc.train.max_steps > 0
          ? rc.train.max_steps
          : (batcher.count_until({}, rc.train.epochs) + accum - 1) / accum;

  // Measured before a resume restores the RNG state (the measurement draws random matrices).
  const double peak_tflops =
      rc.log.peak_tflops > 0 ? rc.log.peak_tflops
                             : measure_matmul_peak(dev, compute, dev.is_cuda() ? 0 : 512).tflops;
  TrainerState st;
  // What a LoRA run's checkpoints depend on (export_merged only changes the export).
  json peft_identity = json::parse(rc.to_json()).value("peft", json(nullptr));
  if (peft_identity.is_object()) peft_identity.erase("export_merged");
  const json run_identity = {{"model_path", rc.model.path},
                             {"train_data", data.train_key},
                             {"train_documents", train_set.num_docs()},
                             {"train_tokens", train_set.num_tokens()},
                             {"peft", lora ? peft_identity : json(nullptr)}};
  if (!resume_name.empty()) {
    opt.materialize();  // ZeRO-1: full tensors to load into, then this rank's slices of them
    const json saved = load_checkpoint(run, resume_name, opt, buffers, st, own.begin, [&](const json& state) {
      const json saved_peft = state.value("peft", json(nullptr));
      AUTOMOE_CHECK(saved_peft == run_identity["peft"], "cannot resume ", run.string(), ": its checkpoint ",
                    saved_peft.is_null() ? "is a full fine-tune" : "holds LoRA adapters " + saved_peft.dump(),
                    ", but the recipe asks for ",
                    lora ? "LoRA " + run_identity["peft"].dump() : std::string("a full fine-tune"),
                    "; use another checkpoint.dir, or the recipe's peft section as it was");
    });
    opt.absorb();
    opt.release();
    if (!dev.is_cuda() && saved.contains("cpu_gemm") && saved["cpu_gemm"].is_string()) {
      ops::cpu::adopt_gemm_decisions(saved["cpu_gemm"].get<std::string>());
    }
    AUTOMOE_CHECK(!lora || !saved.contains("model_path") || saved["model_path"] == rc.model.path,
                  "cannot resume ", run.string(), ": its LoRA adapters were trained on ",
                  saved["model_path"].get<std::string>(), ", and model.path is now ", rc.model.path,
                  " (the adapters only make sense on the base they were trained on); use another "
                  "checkpoint.dir, or the model.path it started from");
    if (saved.contains("model_path") && saved["model_path"] != rc.model.path) {
      std::cerr << "automoe train: note: resuming a run that started from "
                << saved["model_path"].get<std::string>() << "; its weights come from the "
                << "checkpoint, config and tokenizer from " << rc.model.path << "\n";
    }
    for (const auto& key : {"train_data", "train_documents", "train_tokens"}) {
      AUTOMOE_CHECK(!saved.contains(key) || saved.at(key) == run_identity.at(key), "cannot resume ",
                    run.string(), ": its checkpoint was trained on other data (", key, " ",
                    saved.value(key, json()).dump(), ", now ", run_identity.at(key).dump(),
                    "); use another checkpoint.dir (or remove this one to start over)");
    }
    // Checkpoints past the one `latest` names are leftovers of a killed run (renamed into place,
    // `latest` never moved): this run recreates them, and they must not count for keep_last.
    // Past one the recipe names (resume_from), they are set aside as step-N.aside, never deleted.
    for (const auto& e : fs::directory_iterator(run)) {
      if (!lead) break;
      const auto s = step_of(e.path().filename().string());
      if (!s || *s <= st.step) continue;
      if (rc.checkpoint.resume_from.empty()) {
        fs::remove_all(e.path());
        continue;
      }
      const fs::path aside = e.path().string() + ".aside";
      AUTOMOE_CHECK(!fs::exists(aside), "checkpoint.resume_from: cannot set ", e.path().string(),
                    " aside: ", aside.string(), " exists; move one of them away");
      fs::rename(e.path(), aside);
      std::cerr << "automoe train: note: checkpoint.resume_from: " << e.path().string()
                << " set aside as " << aside.string() << "\n";
    }
    if (lead && !rc.checkpoint.resume_from.empty()) {
      write_file_atomic((run / "latest").string(), resume_name + "\n");
    }
    AUTOMOE_CHECK(st.pos.epoch >= 0 && st.pos.cursor >= 0 && st.pos.cursor < train_set.num_docs(),
                  (run / "latest").string(), ": data position (epoch ", st.pos.epoch, ", document ",
                  st.pos.cursor, ") is outside the training data's ", train_set.num_docs(),
                  " documents");
    opt.publish(model_params);
  }
  if (lead) write_file_atomic((run / "recipe.json").string(), rc.to_json() + "\n");
  auto checkpoint = [&] {
    opt.materialize();
    json extra = run_identity;
    // The CPU GEMM paths this run measured: a resumed run adopts them and computes identically.
    if (!dev.is_cuda()) extra["cpu_gemm"] = ops::cpu::gemm_decisions();
    save_checkpoint(run, st, opt, buffers, extra, rc.checkpoint.keep_last, world, own.begin);
    opt.release();
  };

  // Metrics (rank 0 writes them).
  const fs::path jsonl_path = rc.log.jsonl.empty() ? run / "metrics.jsonl" : fs::path(rc.log.jsonl);
  std::unique_ptr<RunLog> run_log;
  if (lead) run_log = std::make_unique<RunLog>(jsonl_path.string(), rc.log.tensorboard);
  auto emit = [&](const json& rec) {
    if (run_log) run_log->emit(rec);
  };
  Progress progress(lead ? rc.log.progress : "off", total_steps);
  progress.line("automoe train: " + std::to_string(total_steps) + " steps of " +
                std::to_string(rc.train.global_batch_size) + " x " +
                std::to_string(rc.data.seq_len) + " tokens, " + dtype_to_name(compute) + " on " +
                dev.str() +
                (dist ? " x " + std::to_string(mesh.world) + " processes (ep " +
                            std::to_string(mesh.ep) + ", dp " + std::to_string(mesh.dp) + ")"
                      : std::string()) +
                (st.step > 0 ? ", resuming at step " + std::to_string(st.step) : "") +
                " -> " + run.string());
  if (st.step > 0) {
    emit({{"type", "resume"}, {"step", st.step}});  // steps after it may be logged a second time
  } else {
    emit({{"type", "start"},
          {"total_steps", total_steps},
          {"train_documents", train_set.num_docs()},
          {"train_tokens", train_set.num_tokens()},
          {"peak_tflops", peak_tflops},
          {"device", dev.str()},
          {"dtype", dtype_to_name(compute)}});
  }
  if (cut.documents > 0) {
    progress.line("data: " + std::to_string(cut.documents) + " of " +
                  std::to_string(train_set.num_docs()) + " documents are longer than data.seq_len = " +
                  std::to_string(rc.data.seq_len) + " and were cut, dropping " +
                  std::to_string(cut.tokens) + " of " + std::to_string(train_set.num_tokens()) +
                  " tokens" +
                  (cut.documents_cut_to_no_loss > 0
                       ? "; " + std::to_string(cut.documents_cut_to_no_loss) +
                             " of them keep no token to learn"
                       : std::string()));
  }
  if (lora) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "LoRA: %zu adapted weights, %s trainable parameters (%.2f%% of %s)",
                  lora_sites.size(), human_count(static_cast<double>(lora_parameters)).c_str(),
                  100.0 * static_cast<double>(lora_parameters) / static_cast<double>(base_parameters),
                  human_count(static_cast<double>(base_parameters)).c_str());
    progress.line(buf);
  }

  const double aux_coef = rc.model.router_aux_loss_coef.value_or(spec.moe.router_aux_loss_coef);
  // A micro-batch as forward arguments on the device; callers add what the pass needs.
  auto batch_args = [&](const MicroBatch& mb) {
    auto to_dev = [&](const at::Tensor& t) { return t.to(dev, /*non_blocking=*/true); };
    ForwardArgs a;
    a.input_ids = to_dev(mb.input_ids);
    a.position_ids = to_dev(mb.position_ids);
    a.document_ids = to_dev(mb.document_ids);
    a.labels = to_dev(mb.labels);
    return a;
  };
  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize();
  };

  auto evaluate = [&]() {
    at::NoGradGuard no_grad;
    double ce = 0, n = 0;
    // Rank r evaluates batches r, r + world, ...; under expert parallelism every rank runs the
    // same number of forwards (a rank out of batches reruns batch 0 and ignores it).
    const int64_t nb = static_cast<int64_t>(val_batches.size()), W = mesh.world;
    const int64_t rounds = mesh.ep > 1 ? (nb + W - 1) / W : nb;
    for (int64_t j = 0; j < rounds; ++j) {
      const int64_t i = mesh.ep > 1 ? j * W + world.rank : j;
      if (mesh.ep == 1 && i % W != world.rank) continue;
      const bool counted = i < nb;
      const MicroBatch& mb = val_batches[counted ? i : 0];
      if (mb.loss_tokens == 0 && mesh.ep == 1) continue;
      ForwardArgs a = batch_args(mb);
      a.output_router_logits = false;
      a.num_items_in_batch = 1.0;  // the loss is then the token sum
      const double sum = pm.decoder->forward(a).loss->item<double>();
      if (!counted) continue;
      ce += sum;
      n += static_cast<double>(mb.loss_tokens);
    }
    if (dist) {
      at::Tensor t = at::tensor({ce, n}, at::kDouble).to(world.device);
      parallel::all_reduce_sum(world.world, t, "evaluation");
      t = t.cpu();
      ce = t[0].item<double>();
      n = t[1].item<double>();
    }
    emit({{"type", "eval"}, {"step", st.step}, {"eval_loss", n > 0 ? ce / n : NAN},
          {"eval_tokens", n}});
    char buf[96];
    std::snprintf(buf, sizeof buf, "eval at step %ld: loss %.4f over %.0f tokens", st.step,
                  n > 0 ? ce / n : NAN, n);
    progress.line(buf);
  };

  Window win;
  std::vector<at::Tensor> expert_adapters_before;
  const auto t_start = Clock::now();
  const int64_t first_step = st.step;
  if (hooks.reset_peak_memory) hooks.reset_peak_memory();
  int exit_code = 0;
  int stop_signal = 0;  // the signal this run stops for (-1: one that reached another rank only)
  if (!dist && stop.requested() && st.step < total_steps) {  // before any step: nothing to save
    std::cerr << "automoe train: stopped by " << StopSignals::name(stop.requested())
              << " before the first step; nothing to save\n";
    return kExitStopped;
  }
  while (st.step < total_steps) {
    const auto t0 = Clock::now();
    // Every rank counts every micro-batch of the step (counts only, no tensors: the position and
    // the step's loss-token total are then the same everywhere without a collective), then builds
    // and trains on its micro-batches rank, rank + world, ... one at a time.
    const DataPosition step_start = st.pos;
    std::vector<int64_t> mine;  // this rank's micro-batches: their index in the step
    double window_loss_tokens = 0, all_tokens = 0, all_flops = 0;
    for (int64_t i = 0; i < accum; ++i) {
      const MicroBatch c = batcher.next(st.pos, /*tensors=*/false);
      window_loss_tokens += static_cast<double>(c.loss_tokens);
      win.truncated += c.truncated;
      if (c.loss_tokens > 0) {
        all_tokens += static_cast<double>(c.real_tokens);
        all_flops += static_cast<double>(c.real_tokens) * training_flops_per_token(spec, c.length);
      }
      if (i % mesh.world == world.rank) mine.push_back(i);
    }
    DataPosition cursor = step_start;
    int64_t cursor_index = 0;
    auto micro_batch = [&](int64_t i) {  // the step's i-th micro-batch, in increasing i
      for (; cursor_index < i; ++cursor_index) batcher.next(cursor, /*tensors=*/false);
      ++cursor_index;
      return batcher.next(cursor);
    };
    const double lr = learning_rate(rc.optimizer, rc.schedule, st.step, total_steps);
    begin_step(ts, rc.optimizer, lr);  // (optimizer.in_backward: the backward updates)
    seed_step(rc.train.seed, world.rank, st.step);  // the step's jitter / dropout draws
    double ce_sum = 0, aux_weighted = 0, step_tokens = 0, step_flops = 0;
    bool finite = true;
    // ZeRO-2 reduces the gradients after every backward: every rank runs all its micro-batches.
    const bool every_backward_meets = mesh.ep > 1 || (opt.sharded() && rc.parallel.zero == 2);
    for (size_t m = 0; m < mine.size(); ++m) {
      if (window_loss_tokens == 0) break;  // nothing to learn in the whole step: not run
      const MicroBatch mb = micro_batch(mine[m]);
      // Nothing to learn in this micro-batch: not run, unless the ranks must meet in its
      // collectives (its loss and aux loss then count zero).
      if (mb.loss_tokens == 0 && !every_backward_meets) continue;
      ForwardArgs a = batch_args(mb);
      a.output_router_logits = true;
      a.output_expert_counts = true;
      a.activation_checkpointing = rc.train.activation_checkpointing;
      a.training = true;
      a.num_items_in_batch = window_loss_tokens;
      a.router_aux_loss_coef = aux_coef;
      // Each micro-batch's aux loss counts with its share of the window's loss tokens, so the
      // aux term's scale does not depend on how the window is split.
      a.aux_loss_scale = static_cast<double>(mb.loss_tokens) / window_loss_tokens;
      // Under ZeRO the gradients leave for their buckets during the backward (see AdamW::shard).
      const ForwardResult r =
          train_micro_batch(ts, *pm.decoder, a, m + 1 == mine.size(), sync, &win.grad_sync_s);
      const double aux = r.aux_loss ? r.aux_loss->item<double>() : 0.0;
      const double total = r.loss->item<double>();
      ce_sum += (total - aux_coef * a.aux_loss_scale * aux) * window_loss_tokens;
      aux_weighted += a.aux_loss_scale * aux;
      finite = finite && std::isfinite(total);
      if (win.expert_counts.empty()) {
        for (const auto& c : r.expert_counts) win.expert_counts.push_back(at::zeros_like(c));
      }
      if (mb.loss_tokens > 0) {
        for (size_t l = 0; l < r.expert_counts.size(); ++l) win.expert_counts[l] += r.expert_counts[l];
        bias_balance.add_counts(r.expert_counts);
      }
    }
    adopt_gradients(ts);  // float32: the optimizer reads the gradients autograd accumulated
    auto release_grads = [&] { release_gradients(ts); };
    step_tokens = all_tokens;
    step_flops = all_flops;
    if (dist) {
      // Gradients summed where they are shared — first, so that the reductions the backward's
      // hooks launched (ZeRO) and those a rank without a last backward launches here meet in
      // the same order on every rank; then the step's loss and finiteness over every rank.
      if (window_loss_tokens > 0) {
        const auto t_sync = Clock::now();
        opt.reduce_grads(world);
        sync();  // (NCCL's wait only orders the stream: time the reductions themselves)
        win.grad_sync_s += seconds_since(t_sync);
      }
      // (with whether any rank was asked to stop: then every rank stops after this same step)
      at::Tensor t = at::tensor({ce_sum, aux_weighted, finite ? 0.0 : 1.0,
                                 static_cast<double>(stop.requested())},
                                at::kDouble)
                         .to(world.device);
      parallel::all_reduce_sum(world.world, t, "step loss");
      t = t.cpu();
      ce_sum = t[0].item<double>();
      aux_weighted = t[1].item<double>();
      finite = t[2].item<double>() == 0;
      if (t[3].item<double>() != 0 && stop_signal == 0) stop_signal = stop.requested() ? stop.requested() : -1;
      bias_balance.sum_counts([&](std::vector<at::Tensor>& c) {
        parallel::all_reduce_sum(world.world, c, "router bias loads");
      });
    }
    const double norm = window_loss_tokens > 0 ? opt.grad_norm(world) : 0.0;
    finite = finite && std::isfinite(norm);
    st.step += 1;
    st.tokens_seen += static_cast<int64_t>(step_tokens);
    if (!finite) {
      st.skipped_steps += 1;
      st.consecutive_nonfinite += 1;
      // (optimizer.in_backward: the tensors whose finite gradients came first were updated)
      const int64_t partial = opt.in_backward() ? opt.updated_in_backward() : 0;
      release_grads();
      emit({{"type", "skip"},
            {"step", st.step},
            {"reason", std::isfinite(ce_sum) ? "non-finite gradient norm" : "non-finite loss"},
            {"tensors_updated", partial},
            {"consecutive", st.consecutive_nonfinite}});
      progress.line("step " + std::to_string(st.step) + ": non-finite " +
                    (std::isfinite(ce_sum) ? "gradient norm" : "loss") +
                    (partial ? ", the rest of the update skipped (optimizer.in_backward had "
                               "already updated " + std::to_string(partial) + " of " +
                               std::to_string(opt.names.size()) + " tensors)"
                             : ", update skipped") +
                    " (" + std::to_string(st.consecutive_nonfinite) + " in a row)");
      win.skipped += 1;
      if (st.consecutive_nonfinite >= rc.train.max_nonfinite_steps) {
        checkpoint();
        progress.done();
        std::cerr << "automoe train: stopping after " << st.consecutive_nonfinite
                  << " consecutive non-finite steps (train.max_nonfinite_steps); checkpoint "
                  << (run / ("step-" + std::to_string(st.step))).string()
                  << " holds the last state. Lower optimizer.lr or check the data and model.\n";
        exit_code = 3;
        break;
      }
    } else {
      st.consecutive_nonfinite = 0;
      if (window_loss_tokens > 0) {
        clip_gradients(ts, norm, rc.optimizer.max_grad_norm);
        expert_adapters.add_gradients(opt);
        // The logged step's update of the experts' adapters (a copy of their masters, then).
        if (!expert_adapters.sites.empty() &&
            ((st.step) % rc.log.every == 0 || st.step == total_steps)) {
          expert_adapters_before = expert_adapters.snapshot(opt);
        }
        update_weights(ts, rc.optimizer, lr);
        bias_balance.apply();
      }
      release_grads();
      win.ce_sum += ce_sum;
      win.aux_weighted += aux_weighted;
      win.aux_steps += window_loss_tokens > 0 && spec.moe.aux_loss;
      win.loss_tokens += window_loss_tokens;
      win.grad_norm = norm;
    }
    sync();
    const double dt = seconds_since(t0);
    win.steps += 1;
    win.tokens += step_tokens;
    win.flops += step_flops;
    win.seconds += dt;

    const double elapsed = seconds_since(t_start);
    const double rate = elapsed / static_cast<double>(st.step - first_step);
    const double shown_loss = win.loss_tokens > 0 ? win.ce_sum / win.loss_tokens : NAN;
    progress.update(st.step, shown_loss, win.tokens / std::max(win.seconds, 1e-9),
                    rate * static_cast<double>(total_steps - st.step));
    if (st.step % rc.log.every == 0 || st.step == total_steps) {
      // Every rank reaches this step's log together: the window's expert loads over all ranks,
      // and what each rank's dispatcher moved.
      json dispatch;
      std::vector<double> peak_per_rank, grad_sync_per_rank;
      if (dist) {
        if (win.expert_counts.empty()) {
          for (size_t l = 0; l < moe_layers.size(); ++l) {
            win.expert_counts.push_back(
                at::zeros({spec.moe.num_experts}, at::TensorOptions(at::kLong).device(dev)));
          }
        }
        parallel::all_reduce_sum(world.world, win.expert_counts, "expert load metrics");
        moe::DispatchStats ds;
        if (pm.decoder->dispatcher()) ds = pm.decoder->dispatcher()->take_stats();
        const auto all = parallel::all_gather_ints(
            world.world,
            {ds.bytes_sent, ds.bytes_received, ds.rows_computed,
             static_cast<int64_t>(ds.wait_s * 1e6), hooks.peak_memory_bytes(),
             static_cast<int64_t>(ds.backward_wait_s * 1e6),
             static_cast<int64_t>(win.grad_sync_s / static_cast<double>(win.steps) * 1e6)},
            world.device, "dispatch metrics");
        std::vector<int64_t> sent, received, rows;
        std::vector<double> wait, backward_wait;
        for (int64_t r = 0; r < mesh.world; ++r) {
          sent.push_back(all[7 * r]);
          received.push_back(all[7 * r + 1]);
          rows.push_back(all[7 * r + 2]);
          wait.push_back(static_cast<double>(all[7 * r + 3]) / 1e6);
          peak_per_rank.push_back(static_cast<double>(all[7 * r + 4]) / (1 << 30));
          backward_wait.push_back(static_cast<double>(all[7 * r + 5]) / 1e6);
          grad_sync_per_rank.push_back(static_cast<double>(all[7 * r + 6]) / 1e6);
        }
        if (pm.decoder->dispatcher()) {
          dispatch = {{"dispatcher", pm.decoder->dispatcher()->kind()},
                      {"bytes_sent", sent},
                      {"bytes_received", received},
                      {"expert_rows", rows},
                      {"collective_wait_s", wait},
                      {"backward_collective_wait_s", backward_wait}};
        }
      }
      const double tflops = win.flops / std::max(win.seconds, 1e-9) / 1e12;
      json rec = {{"type", "train"},
                  {"step", st.step},
                  {"total_steps", total_steps},
                  {"epoch", static_cast<double>(st.pos.epoch) +
                                static_cast<double>(st.pos.cursor) /
                                    static_cast<double>(train_set.num_docs())},
                  {"loss", shown_loss},
                  {"aux_loss", win.aux_steps > 0 ? win.aux_weighted / win.aux_steps : NAN},
                  {"grad_norm", win.grad_norm},
                  {"lr", lr},
                  {"tokens", st.tokens_seen},
                  {"tokens_per_s", win.tokens / std::max(win.seconds, 1e-9)},
                  {"tflops", tflops},
                  {"mfu", peak_tflops > 0 ? tflops / (peak_tflops * static_cast<double>(mesh.world)) : 0.0},
                  {"peak_memory_gib", static_cast<double>(hooks.peak_memory_bytes()) / (1 << 30)},
                  {"skipped_steps", st.skipped_steps},
                  {"truncated_documents", win.truncated},
                  {"step_time_s", win.seconds / static_cast<double>(win.steps)},
                  {"elapsed_s", elapsed},
                  {"expert_load", expert_load(win.expert_counts, moe_layers)}};
      if (bias_balance.enabled()) rec["router_bias"] = bias_balance.report();
      if (!expert_adapters.sites.empty()) {
        rec["expert_lora"] = expert_adapters.report(opt, expert_adapters_before);
        expert_adapters_before.clear();
      }
      if (dist) {
        rec["parallel"] = {{"world", mesh.world},
                           {"ep", mesh.ep},
                           {"dp", mesh.dp},
                           {"peak_memory_gib_per_rank", peak_per_rank},
                           {"gradient_sync_wait_s", grad_sync_per_rank}};
      }
      if (!dispatch.is_null()) rec["dispatch"] = dispatch;
      emit(rec);
      progress.log(rec);
      win = Window{};
    }
    if (!val_batches.empty() && rc.train.eval_every > 0 && st.step % rc.train.eval_every == 0 &&
        st.step != total_steps) {
      evaluate();
    }
    if (!dist && stop.requested()) stop_signal = stop.requested();
    if (stop_signal != 0 && st.step < total_steps) {
      checkpoint();
      progress.done();
      const std::string by = stop_signal > 0 ? StopSignals::name(stop_signal) : "a signal to another rank";
      emit({{"type", "stopped"}, {"step", st.step}, {"signal", by}});
      if (lead) {
        std::cerr << "automoe train: stopped by " << by << " after step " << st.step << " of "
                  << total_steps << "; checkpoint " << (run / ("step-" + std::to_string(st.step))).string()
                  << " saved. Run the same command again to resume.\n";
      }
      return kExitStopped;
    }
    if (rc.checkpoint.every > 0 && st.step % rc.checkpoint.every == 0 && st.step != total_steps) {
      checkpoint();
    }
  }
  progress.done();
  if (exit_code != 0) return exit_code;

  if (!val_batches.empty()) evaluate();
  checkpoint();

  // Export: a Hugging Face directory in the checkpoint's dtype (or the one asked for).
  const c10::ScalarType export_dtype =
      rc.checkpoint.export_dtype == "auto" ? stored
                                           : dtype_from_name(rc.checkpoint.export_dtype,
                                                             "checkpoint.export_dtype");
  ExpertsLayout layout = pm.layout;
  if (rc.checkpoint.export_layout == "per-expert") layout = ExpertsLayout::kPerExpert;
  if (rc.checkpoint.export_layout == "fused") layout = ExpertsLayout::kFused;
  if (lora) {
    // The adapters as trained (their float32 masters) as PEFT's adapter directory, which PEFT
    // loads onto Transformers' model of model.path; on request also the merged model. Every rank
    // holds the same adapters (no expert parallelism): rank 0 writes.
    std::vector<LoraSite> trained = lora_sites;
    for (auto& site : trained) {
      for (size_t i = 0; i < opt.names.size(); ++i) {
        if (opt.names[i] == site.a_name()) site.a = opt.master[i];
        if (opt.names[i] == site.b_name()) site.b = opt.master[i];
      }
    }
    if (!lead) return 0;
    const c10::ScalarType adapter_dtype =
        rc.checkpoint.export_dtype == "auto" ? at::kFloat : export_dtype;
    write_peft_adapter((run / "export").string(), lora_config, trained,
                       fs::absolute(rc.model.path).lexically_normal().string(), adapter_dtype);
    json end = {{"type", "end"}, {"step", st.step}, {"export", (run / "export").string()}};
    std::string where = (run / "export").string() + " (PEFT adapter)";
    if (rc.peft.export_merged) {
      std::map<int64_t, const LoraSite*> by_slot;
      for (const auto& site : trained) by_slot[site.slot] = &site;
      NamedTensors merged;
      const auto& params = pm.decoder->named_parameters();
      const auto& trainable = pm.decoder->trainable();
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& [name, t] = params[i];
        const auto it = by_slot.find(static_cast<int64_t>(i));
        merged.emplace_back(name, it != by_slot.end()
                                      ? merge_lora(*it->second, t, export_dtype).cpu()
                                      : t.detach().to(at::kCPU, trainable[i] ? export_dtype : t.scalar_type()));
      }
      write_pretrained(pm.config, layout, pm.source_dir, spec, merged,
                       (run / "export-merged").string(), SaveOptions{}, nullptr);
      end["export_merged"] = (run / "export-merged").string();
      where += " and " + (run / "export-merged").string() + " (merged Hugging Face model)";
    }
    end["elapsed_s"] = seconds_since(t_start);
    emit(end);
    progress.line("automoe train: done at step " + std::to_string(st.step) + "; " + where);
    return 0;
  }
  // In parameter_layout order: the trained weights, the buffers as they are (float32). Under
  // expert parallelism the export is collective: each rank of replica 0 writes its experts' rows
  // into the shard files and rank 0 the dense tensors (the others pass only their shapes).
  NamedTensors exported;
  opt.materialize();
  std::string error;  // (a copy failing on one rank fails the export on every rank)
  try {
    const bool writes_experts = world.dp_rank() == 0;
    auto mine = [&](const at::Tensor& t, bool expert, c10::ScalarType dt) {
      if (expert ? writes_experts : lead) return t.detach().to(at::kCPU, dt);
      return at::empty(t.sizes(), at::TensorOptions().dtype(dt).device(at::kMeta));
    };
    size_t next_param = 0, next_buffer = 0;
    for (const bool trainable : pm.decoder->trainable()) {
      if (trainable) {
        const size_t i = next_param++;
        // (bf16 masters exported as bf16: the weights as trained, no copy; otherwise the float32
        // master, rebuilt from its remainder where it has one)
        const at::Tensor w = opt.master[i].scalar_type() == export_dtype ? opt.master[i]
                                                                          : opt.master_f32(i);
        exported.emplace_back(opt.names[i], mine(w, opt.expert[i], export_dtype));
      } else {
        const auto& [name, t] = buffers[next_buffer++];
        exported.emplace_back(name, mine(t, false, t.scalar_type()));
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  opt.release();
  if (dist) {
    parallel::agree(world.world, error, world.device, "export");
  } else if (!error.empty()) {
    throw Error(error);
  }
  write_pretrained(pm.config, layout, pm.source_dir, spec, exported, (run / "export").string(),
                   SaveOptions{}, dist ? &world : nullptr);
  exported.clear();
  if (!lead) return 0;
  emit({{"type", "end"},
        {"step", st.step},
        {"export", (run / "export").string()},
        {"elapsed_s", seconds_since(t_start)}});
  progress.line("automoe train: done at step " + std::to_string(st.step) + "; Hugging Face model in " +
                (run / "export").string());
  return 0;
}

}  // namespace automoe::train
