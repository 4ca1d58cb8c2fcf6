#include "automoe/train/setup.h"

#include <ATen/Parallel.h>
#include <sched.h>
#include <unistd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/log.h"
#include "automoe/model/config.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/io/safetensors.h"
#include "automoe/train/plan.h"
#include "automoe/train/run_dir.h"
#include "automoe/train/state.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;


// Every rank must run the same recipe on the same checkpoint and data: compared before any weight
// is read (a rank started with other settings would meet its peers in the wrong collectives, or
// train something else silently).
void check_same_run_on_every_rank(const Recipe& rc, const TrainData& data,
                                  const LoadedConfig& config, const parallel::World& world) {
  nlohmann::json ident = nlohmann::json::parse(rc.to_json());
  ident["train"].erase("device");  // each rank's own GPU
  const std::string mine = ident.dump() + "\n" + config.json->dump() + "\n" + data.train_key;
  const auto all = parallel::all_gather_strings(world.world, mine, world.device, "run identity");
  for (size_t r = 0; r < all.size(); ++r) {
    AUTOMOE_CHECK(all[r] == all[0], "rank ", r,
                  " was started with a different recipe, model "
                  "config or training data than rank 0; every rank must run the same command");
  }
}

// The CPU GEMM paths are chosen by timing, in each process: ranks near the margin could pick
// differently and compute the same layer with different rounding. Every rank measures now and
// takes rank 0's choice, which is also the one its checkpoints record for a resume.
void agree_cpu_gemm_paths(const parallel::World& world) {
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

// The recipe's mesh against the model and the process groups; the dispatcher against the mesh.
parallel::Mesh check_mesh(const Recipe& rc, const parallel::World& world, const ModelSpec& spec,
                          const BackendConfig& backend) {
  const parallel::Mesh mesh = parallel::make_mesh(world.mesh.world, rc.parallel.ep, rc.parallel.dp,
                                                  spec.moe.num_experts, "parallel");
  AUTOMOE_CHECK(mesh.ep == world.mesh.ep && mesh.dp == world.mesh.dp,
                "parallel: the recipe's ep = ", mesh.ep, " and dp = ", mesh.dp,
                " differ from the process groups' (ep = ", world.mesh.ep, ", dp = ", world.mesh.dp,
                ")");
  AUTOMOE_CHECK(backend.dispatcher == "auto" || (backend.dispatcher == "local") == (mesh.ep == 1),
                "model.backend.dispatcher: \"", backend.dispatcher, "\" ",
                mesh.ep == 1
                    ? "exchanges tokens between expert-parallel ranks, but parallel.ep is 1"
                    : "cannot reach the experts of other ranks; with parallel.ep > 1 use "
                      "allgather, alltoall or alltoall_overlap");
  return mesh;
}

// LoRA: which weights get adapters (PEFT's rules), refused where the engine or the export cannot
// honour the recipe; the adapters initialised as PEFT does, float32 on the device. Under expert
// parallelism the routed experts' adapters are planned and drawn for every expert, as one process
// draws them, and each rank keeps its own experts' rows (beside their weights).
std::vector<LoraSite> plan_adapters(const Recipe& rc, const TrainModel& m, c10::Device dev) {
  AUTOMOE_CHECK(rc.router.bias_update_rate == 0,
                "router.bias_update_rate: ", rc.router.bias_update_rate,
                " with peft: the routers' correction bias would train "
                "beside the adapters, but the PEFT adapter export cannot carry it (PEFT would load "
                "the adapter onto the untrained bias); use 0 with LoRA");
  ModelSpec whole = m.spec();
  whole.moe.expert_begin = whole.moe.expert_count = 0;
  std::vector<LoraSite> sites;
  try {
    sites = plan_lora(whole, parameter_layout(whole), m.lora_config, /*strict=*/true);
  } catch (const Error& e) {
    fail("peft: ", e.what());
  }
  for (const auto& site : sites) {
    AUTOMOE_CHECK(!(site.experts && rc.peft.lora_dropout > 0),
                  "peft.lora_dropout: ", rc.peft.lora_dropout, " with routed experts targeted (",
                  site.base(),
                  "): PEFT's target_parameters adapters, the format the export writes, have no "
                  "dropout; use 0");
  }
  init_lora(sites, at::TensorOptions().dtype(at::kFloat).device(dev), rc.train.seed,
            m.mesh.ep > 1 ? std::optional(std::make_pair(m.own.begin, m.own.count)) : std::nullopt);
  return sites;
}

}  // namespace

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

void use_threads(int64_t threads) {
  if (threads <= 0) return;
  cpu_set_t cpus;
  const int usable = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 0;
  AUTOMOE_CHECK(usable == 0 || threads <= usable, "train.threads: ", threads, " is more than the ",
                usable,
                " CPUs this process may run on (more threads "
                "than CPUs only slows every step); use at most ",
                usable, ", or 0 for all");
  at::set_num_threads(static_cast<int>(threads));
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

RunPlace open_run(const Recipe& rc, const parallel::World& world, c10::Device dev) {
  RunPlace p;
  p.dev = dev;
  p.compute = dtype_from_name(rc.model.dtype, "model.dtype");
  p.run = rc.checkpoint.dir;
  // Rank 0 owns the run directory: the lock, metrics, the recipe record; every rank reads it.
  p.lead = world.rank == 0;
  p.dist = world.distributed();
  AUTOMOE_CHECK(!(p.dist && rc.optimizer.in_backward), "optimizer.in_backward: one process only (",
                world.mesh.world,
                " here): each rank's gradients must be summed over the ranks before any update");
  if (p.lead) claim_run_dir(p.run);  // ours (marker), locked, cleaned of a killed save's leftovers
  // Every rank sees the directory as rank 0 left it (a shared file system across nodes).
  if (p.dist) parallel::all_gather_ints(world.world, {0}, world.device, "run directory");
  const bool has_latest = fs::exists(p.run / "latest");
  AUTOMOE_CHECK(!has_latest || rc.checkpoint.resume, "checkpoint.dir ", p.run.string(),
                " already holds a run (", (p.run / "latest").string(),
                "); set checkpoint.resume=true to continue it, or choose another directory");
  // The checkpoint to resume from: the one `latest` names, or the one the recipe names.
  p.resume_name = rc.checkpoint.resume_from;
  if (p.resume_name.empty() && has_latest) p.resume_name = latest_checkpoint(p.run);
  if (!rc.checkpoint.resume_from.empty()) {
    std::string complete;
    for (const auto& n : complete_checkpoints(p.run, INT64_MAX)) complete += " " + n;
    AUTOMOE_CHECK(fs::is_directory(p.run / p.resume_name),
                  "checkpoint.resume_from: ", p.resume_name, " is not a checkpoint in ",
                  p.run.string(),
                  complete.empty() ? " (it holds none)" : "; complete ones:" + complete);
  }
  // "auto" precision: a resumed run keeps what its checkpoint was written with (checkpoints from
  // before the setting: float32); an unreadable state is the resume's to report.
  std::string masters, state;
  if (!p.resume_name.empty()) {
    std::ifstream in(p.run / p.resume_name / "trainer_state.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      const nlohmann::json prec = j.value("optimizer_precision", nlohmann::json::object());
      masters = prec.is_object() ? prec.value("master_weights", "float32") : "float32";
      state = prec.is_object() ? prec.value("state_dtype", "float32") : "float32";
    }
  }
  p.optimizer = resolve_precision(rc, world.mesh.world, masters, state);
  return p;
}

void check_memory(const Recipe& rc, const parallel::World& world, int64_t available,
                  RunPlace& place) {
  const bool cuda = place.dev.is_cuda();
  const int64_t ranks = world.mesh.world;
  // The ranks on one machine share its memory: counted by host name (whatever the launcher).
  int64_t local = 1;
  if (place.dist) {
    char host[256] = {0};
    ::gethostname(host, sizeof host - 1);
    const auto hosts = parallel::all_gather_strings(world.world, host, world.device, "host names");
    local = std::count(hosts.begin(), hosts.end(), std::string(host));
  }
  // This rank's memory (a malformed AUTOMOE_AVAILABLE_MEMORY stops every rank with its message,
  // never leaving the others waiting in a collective) and plan. A recipe the plan cannot be made
  // for (a LoRA target matching nothing, a bad config) is the engine's set-up to report, in its
  // own words: the check is then skipped.
  std::string error;
  try {
    if (available < 0) available = available_cpu_memory() / local;
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (place.dist) parallel::agree(world.world, error, world.device, "the memory available");
  if (!error.empty()) fail(error);
  std::optional<LoadedConfig> config;
  RankPlan mine;
  Recipe planned = rc;  // with the precision this run resolved
  planned.optimizer = place.optimizer;
  try {
    config = load_config(rc.model.path);
    mine = plan_rank(config->spec, planned, ranks, 0, cuda);  // memory only: the engine checks the rest
  } catch (const std::exception&) {
    config.reset();
    mine = RankPlan();
  }
  place.planned_peak_bytes = mine.peak_bytes;
  // Every rank stops, or none: which ranks are short, and whether every rank was told to start
  // anyway, are shared.
  const bool short_here = available > 0 && mine.peak_bytes > static_cast<double>(available);
  std::vector<int64_t> short_ranks;
  bool forced = rc.train.force;
  if (place.dist) {
    const auto all = parallel::all_gather_ints(
        world.world, {short_here ? 1 : 0, rc.train.force ? 1 : 0}, world.device, "memory plan");
    for (int64_t r = 0; r < ranks; ++r) {
      if (all[2 * r] != 0) short_ranks.push_back(r);
      forced = forced && all[2 * r + 1] != 0;
    }
  } else if (short_here) {
    short_ranks.push_back(0);
  }
  // The whole plan, with suggestions when it does not fit, on rank 0 (who writes and prints it).
  std::optional<Plan> plan;
  if (place.lead && config) {
    PlanTarget target;
    target.nproc_per_node = local;
    target.nnodes = std::max<int64_t>(1, (ranks + local - 1) / local);
    target.device = cuda ? "cuda" : "cpu";
    target.rank_memory_bytes = static_cast<double>(available);
    target.peak_tflops = rc.log.peak_tflops;
    plan = make_plan(config->spec, planned, target, short_ranks.empty() ? 0 : 5);
    write_file_atomic((place.run / "plan.json").string(), plan->to_json() + "\n");
  }
  if (short_ranks.empty()) return;
  if (place.lead && !plan) plan.emplace();  // (another rank's plan: rank 0 could not make its own)
  std::string which;
  for (int64_t r : short_ranks) which += (which.empty() ? "" : ", ") + std::to_string(r);
  char buf[240];
  std::snprintf(buf, sizeof buf, "%.2f GiB per rank, and %s has %.2f GiB available%s",
                mine.peak_bytes / double(1 << 30), cuda ? "the GPU" : "this machine",
                static_cast<double>(available) / double(1 << 30),
                place.dist ? (" (short: rank " + which + ")").c_str() : "");
  if (forced) {
    if (place.lead) {
      std::cerr << "automoe train: warning: not enough memory: the run's plan needs " << buf
                << "; starting anyway (train.force)\n";
    }
    return;
  }
  if (!place.lead) fail("not enough memory (rank ", which, "): rank 0 prints the plan");
  fail("not enough memory: the run's plan needs ", buf,
       " (it would be killed by the out-of-memory killer, or fail mid-run); nothing was "
       "loaded.\n",
       plan->to_text(),
       plan->suggestions.empty() ? "Nothing searched fits; start anyway with --force (train.force: true). "
                                 : "Change the recipe to one of these, or start anyway with --force "
                                   "(train.force: true). ",
       "The plan is in ", (place.run / "plan.json").string());
}

std::unique_ptr<TrainModel> load_train_model(const Recipe& rc, const TrainData& data,
                                             const parallel::World& world, const RunPlace& place) {
  auto m = std::make_unique<TrainModel>();
  // Training never needs the [B, S, V] logits: the fused LM head + loss is the default here.
  auto backend_fields = rc.model.backend;
  backend_fields.emplace("loss", "fused_linear_ce");
  const LoadedConfig config = load_config(rc.model.path);
  if (place.dist) check_same_run_on_every_rank(rc, data, config, world);
  if (place.dist && !place.dev.is_cuda()) agree_cpu_gemm_paths(world);
  // Attention sinks (GPT-OSS) have no SDPA kernel: eager unless the recipe chose (then an error).
  if (config.spec.attn.sinks) backend_fields.emplace("attn", "eager");
  const BackendConfig backend = BackendConfig::from_map(backend_fields, "model.backend");
  // The mesh is checked against the model before any weight is read.
  m->mesh = check_mesh(rc, world, config.spec, backend);
  const int64_t num_experts = config.spec.moe.num_experts;
  m->own = m->mesh.ep > 1 ? parallel::experts_of(world.ep_rank(), m->mesh.ep, num_experts)
                          : parallel::ExpertRange{0, 0};
  std::optional<QuantizeOptions> quantize;
  if (rc.model.quantize != "none") {
    quantize = QuantizeOptions{ops::quant_type_from_name(rc.model.quantize, "model.quantize"),
                               rc.model.quantize_blocksize};
  }
  m->pm = load_pretrained(rc.model.path, std::nullopt, backend, std::nullopt,
                          {m->own.begin, m->own.count}, quantize);
  if (quantize && place.lead) {
    int64_t held = 0, dense = 0;
    c10::ScalarType dense_dtype = at::kBFloat16;
    const auto& params = m->pm.decoder->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (const ops::QuantizedWeight* q = m->pm.decoder->quantized(static_cast<int64_t>(i))) {
        held += q->bytes();
        dense += params[i].second.numel() * static_cast<int64_t>(c10::elementSize(q->dtype));
        dense_dtype = q->dtype;
      }
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "%.3f GiB (%.3f GiB in %s)", held / 1073741824.0,
                  dense / 1073741824.0, dtype_to_name(dense_dtype).c_str());
    log_info("model.quantize ", rc.model.quantize,
             rc.model.quantize == "int8" ? "" : " (blocks of " + std::to_string(rc.model.quantize_blocksize) + ")",
             ": the routed experts are held quantised and frozen", m->mesh.ep > 1 ? " (this rank's)" : "",
             ", ", buf);
  }
  if (m->mesh.ep > 1) {
    m->pm.decoder->set_dispatcher(moe::make_dispatcher(
        backend.dispatcher == "auto" ? "alltoall" : backend.dispatcher, world.ep, num_experts));
  }
  AUTOMOE_CHECK(rc.train.grad_accumulation_steps % m->mesh.world == 0,
                "train.global_batch_size: ", rc.train.global_batch_size, " rows are ",
                rc.train.grad_accumulation_steps, " micro-batches of ", rc.train.micro_batch_size,
                ", which do not split evenly over ", m->mesh.world,
                " processes (each trains on its own micro-batches of every step)");
  const ModelSpec& spec = m->spec();
  m->stored = m->pm.decoder->named_parameters().front().second.scalar_type();
  // LoRA: the base weights stay frozen in the compute dtype (no masters, no moments, no
  // gradients); the optimizer holds the adapters' float32 masters.
  m->lora = rc.peft.enabled;
  m->lora_config = lora_config_of(rc.peft);
  if (m->lora) m->lora_sites = plan_adapters(rc, *m, place.dev);
  // float32 masters (or LoRA's adapters) and the compute copies the forward reads (train/step.h).
  // ZeRO-1 makes the moments and gradient accumulators slice-sized below: not allocated here.
  // (LoRA: the adapters are small; every rank keeps their whole state.)
  const bool zero = place.dist && rc.parallel.zero >= 1 && !m->lora;
  m->ts = make_train_state(*m->pm.decoder, place.compute, place.dev, m->lora_sites, zero,
                           place.optimizer);
  AdamW& opt = m->ts.opt;
  m->bias_balance.emplace(*m->pm.decoder, rc.router.bias_update_rate);
  AUTOMOE_CHECK(
      !rc.model.router_aux_loss_coef || *rc.model.router_aux_loss_coef == 0 || spec.moe.aux_loss,
      "model.router_aux_loss_coef: ", spec.model_type,
      " trains without a load-balancing loss (as in Transformers); remove the key, or use "
      "router.bias_update_rate for DeepSeek-V3's auxiliary-loss-free balancing");
  // ZeRO-1: from here each rank keeps only its slice of the optimizer state of shared tensors;
  // the forward's weights become views of one buffer per class (re-bound here).
  if (zero) {
    opt.shard(world, m->ts.model_params, rc.parallel.zero,
              static_cast<int64_t>(rc.parallel.bucket_mb * (1 << 20)));
    for (size_t i = 0; i < opt.names.size(); ++i) {
      m->pm.decoder->set_parameter(opt.names[i], m->ts.model_params[i]);
    }
  }
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (spec.is_moe(l)) m->moe_layers.push_back(l);
  }
  m->expert_adapters = ExpertAdapterMetrics::of(m->lora_sites, opt);
  // (the whole model's counts: under expert parallelism each rank holds 1/ep of the experts)
  const std::vector<ParamDecl> decls = parameter_layout(spec);
  const int64_t shards = spec.moe.sharded() ? spec.moe.num_experts / spec.moe.local_experts() : 1;
  for (const auto& site : m->lora_sites) {
    m->lora_parameters += (site.a.numel() + site.b.numel()) * (site.experts ? shards : 1);
  }
  const auto& params = m->pm.decoder->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    m->base_parameters += params[i].second.numel() * (decls[i].routed_expert ? shards : 1);
  }
  return m;
}

}  // namespace automoe::train
