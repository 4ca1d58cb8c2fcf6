// The fine-tuning loop, top to bottom: run_training sets the run up (setup.h, inputs.h), then a
// Trainer resumes it (resume.h), runs its steps — each this rank's micro-batches forward and
// backward, the gradients summed over the ranks, the update (step.h) — logs (metrics.h,
// progress.h), evaluates, checkpoints (state.h) and exports (export.h).
#include "automoe/train/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <sys/resource.h>
#include <torch/cuda.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/safetensors.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/train/export.h"
#include "automoe/train/inputs.h"
#include "automoe/train/metrics.h"
#include "automoe/train/peak.h"
#include "automoe/train/plan.h"
#include "automoe/train/progress.h"
#include "automoe/train/resume.h"
#include "automoe/train/run_log.h"
#include "automoe/train/setup.h"
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

// The process's resident high-water mark since run_training began (reset there), or since it
// started where /proc cannot say.
int64_t cpu_peak_rss() {
  if (const int64_t hwm = peak_rss(); hwm > 0) return hwm;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// One step's loss over the whole step (summed over the ranks under a mesh).
struct StepLoss {
  double ce_sum = 0;        // cross-entropy, summed over the step's loss tokens
  double aux_weighted = 0;  // aux loss, each micro-batch's weighted by its share of loss tokens
  bool finite = true;
};

class Trainer {
 public:
  Trainer(const Recipe& rc, const TrainData& data, const TrainerHooks& hooks,
          const parallel::World& world, const StopSignals& stop, const RunPlace& place,
          TrainModel& m, const TrainInputs& in);
  int run();

 private:
  void start();
  bool step();  // false: too many non-finite steps in a row
  StepLoss forward_backward(const StepPlan& plan);
  void sum_over_ranks(const StepPlan& plan, StepLoss& loss);
  bool skip_update(const StepLoss& loss);
  void update(const StepPlan& plan, const StepLoss& loss, double norm, double lr);
  void log(double lr);
  void evaluate();
  void checkpoint();
  int stop_for_signal();
  int finish();
  ForwardArgs batch_args(const MicroBatch& mb) const;
  void sync() const {
    if (place_.dev.is_cuda()) torch::cuda::synchronize();
  }
  bool logged_step() const { return st_.step % rc_.log.every == 0 || st_.step == in_.total_steps; }
  void emit(const json& rec) {
    if (run_log_) run_log_->emit(rec);
  }
  std::string checkpoint_dir() const {
    return (place_.run / ("step-" + std::to_string(st_.step))).string();
  }

  const Recipe& rc_;
  const TrainData& data_;
  const TrainerHooks& hooks_;
  const parallel::World& world_;
  const StopSignals& stop_;
  const RunPlace& place_;
  TrainModel& m_;
  const TrainInputs& in_;
  AdamW& opt_;
  const double aux_coef_;
  double peak_tflops_ = 0;
  TrainerState st_;
  json identity_;
  std::unique_ptr<RunLog> run_log_;
  Progress progress_;
  Window win_;
  std::vector<at::Tensor> expert_adapters_before_;
  Clock::time_point t_start_;
  int64_t first_step_ = 0;
  int stop_signal_ = 0;  // the signal this run stops for (-1: one that reached another rank only)
};

Trainer::Trainer(const Recipe& rc, const TrainData& data, const TrainerHooks& hooks,
                 const parallel::World& world, const StopSignals& stop, const RunPlace& place,
                 TrainModel& m, const TrainInputs& in)
    : rc_(rc),
      data_(data),
      hooks_(hooks),
      world_(world),
      stop_(stop),
      place_(place),
      m_(m),
      in_(in),
      opt_(m.ts.opt),
      aux_coef_(rc.model.router_aux_loss_coef.value_or(m.spec().moe.router_aux_loss_coef)),
      progress_(place.lead ? rc.log.progress : "off", in.total_steps) {}

int Trainer::run() {
  // Measured before a resume restores the RNG state (the measurement draws random matrices).
  peak_tflops_ =
      rc_.log.peak_tflops > 0
          ? rc_.log.peak_tflops
          : measure_matmul_peak(place_.dev, place_.compute, place_.dev.is_cuda() ? 0 : 512).tflops;
  identity_ = run_identity(rc_, data_, *in_.train_set, m_.lora);
  if (!place_.resume_name.empty()) {
    resume_run(rc_, place_, identity_, in_.train_set->num_docs(), m_, st_);
  }
  start();
  t_start_ = Clock::now();
  first_step_ = st_.step;
  if (hooks_.reset_peak_memory) hooks_.reset_peak_memory();
  if (!place_.dist && stop_.requested() && st_.step < in_.total_steps) {
    std::cerr << "automoe train: stopped by " << StopSignals::name(stop_.requested())
              << " before the first step; nothing to save\n";
    return kExitStopped;
  }
  while (st_.step < in_.total_steps) {
    if (!step()) return 3;
    const bool last = st_.step == in_.total_steps;
    if (!in_.val_batches.empty() && rc_.train.eval_every > 0 &&
        st_.step % rc_.train.eval_every == 0 && !last) {
      evaluate();
    }
    if (!place_.dist && stop_.requested()) stop_signal_ = stop_.requested();
    if (stop_signal_ != 0 && !last) return stop_for_signal();
    if (rc_.checkpoint.every > 0 && st_.step % rc_.checkpoint.every == 0 && !last) checkpoint();
  }
  progress_.done();
  return finish();
}

// The run's records begin: recipe.json, the metrics log, what the run is about to do.
void Trainer::start() {
  const fs::path& run = place_.run;
  if (place_.lead) write_file_atomic((run / "recipe.json").string(), rc_.to_json() + "\n");
  const fs::path jsonl = rc_.log.jsonl.empty() ? run / "metrics.jsonl" : fs::path(rc_.log.jsonl);
  if (place_.lead) run_log_ = std::make_unique<RunLog>(jsonl.string(), rc_.log.tensorboard);
  const parallel::Mesh& mesh = m_.mesh;
  progress_.line(
      "automoe train: " + std::to_string(in_.total_steps) + " steps of " +
      std::to_string(rc_.train.global_batch_size) + " x " + std::to_string(rc_.data.seq_len) +
      " tokens, " + dtype_to_name(place_.compute) + " on " + place_.dev.str() +
      (place_.dist ? " x " + std::to_string(mesh.world) + " processes (ep " +
                         std::to_string(mesh.ep) + ", dp " + std::to_string(mesh.dp) + ")"
                   : std::string()) +
      (st_.step > 0 ? ", resuming at step " + std::to_string(st_.step) : "") + " -> " +
      run.string());
  const TokenDataset& train_set = *in_.train_set;
  if (st_.step > 0) {
    emit({{"type", "resume"}, {"step", st_.step}});  // steps after it may be logged a second time
  } else {
    emit({{"type", "start"},
          {"total_steps", in_.total_steps},
          {"train_documents", train_set.num_docs()},
          {"train_tokens", train_set.num_tokens()},
          {"peak_tflops", peak_tflops_},
          {"device", place_.dev.str()},
          {"dtype", dtype_to_name(place_.compute)},
          {"planned_peak_bytes", place_.planned_peak_bytes},
          {"memory_baseline_bytes", place_.memory_baseline},
          {"setup_peak_bytes", hooks_.peak_memory_bytes()}});
  }
  const Truncation& cut = in_.cut;
  if (cut.documents > 0) {
    progress_.line(
        "data: " + std::to_string(cut.documents) + " of " + std::to_string(train_set.num_docs()) +
        " documents are longer than data.seq_len = " + std::to_string(rc_.data.seq_len) +
        " and were cut, dropping " + std::to_string(cut.tokens) + " of " +
        std::to_string(train_set.num_tokens()) + " tokens" +
        (cut.documents_cut_to_no_loss > 0 ? "; " + std::to_string(cut.documents_cut_to_no_loss) +
                                                " of them keep no token to learn"
                                          : std::string()));
  }
  if (m_.lora) {
    char buf[160];
    const auto lora = static_cast<double>(m_.lora_parameters);
    const auto base = static_cast<double>(m_.base_parameters);
    std::snprintf(buf, sizeof buf,
                  "LoRA: %zu adapted weights, %s trainable parameters (%.2f%% of %s)",
                  m_.lora_sites.size(), human_count(lora).c_str(), 100.0 * lora / base,
                  human_count(base).c_str());
    progress_.line(buf);
  }
}

// One optimizer step: this rank's micro-batches forward and backward, the gradients (and the
// loss) summed over the ranks, then the update — or none, on a non-finite loss or gradient norm.
bool Trainer::step() {
  const auto t0 = Clock::now();
  const StepPlan plan = plan_step(*in_.batcher, st_.pos, rc_.train.grad_accumulation_steps,
                                  m_.mesh.world, world_.rank, m_.spec());
  win_.truncated += plan.truncated;
  const double lr = learning_rate(rc_.optimizer, rc_.schedule, st_.step, in_.total_steps);
  begin_step(m_.ts, rc_.optimizer, lr);  // (optimizer.in_backward: the backward updates)
  seed_step(rc_.train.seed, world_.rank, st_.step);  // the step's jitter / dropout draws
  StepLoss loss = forward_backward(plan);
  adopt_gradients(m_.ts);  // float32: the optimizer reads the gradients autograd accumulated
  if (place_.dist) sum_over_ranks(plan, loss);
  const double norm = plan.loss_tokens > 0 ? opt_.grad_norm(world_) : 0.0;
  loss.finite = loss.finite && std::isfinite(norm);
  st_.step += 1;
  st_.tokens_seen += static_cast<int64_t>(plan.tokens);
  if (!loss.finite) {
    if (!skip_update(loss)) return false;
  } else {
    update(plan, loss, norm, lr);
  }
  sync();
  win_.steps += 1;
  win_.tokens += plan.tokens;
  win_.flops += plan.flops;
  win_.seconds += seconds_since(t0);
  const double rate = seconds_since(t_start_) / static_cast<double>(st_.step - first_step_);
  progress_.update(st_.step, win_.loss_tokens > 0 ? win_.ce_sum / win_.loss_tokens : NAN,
                   win_.tokens / std::max(win_.seconds, 1e-9),
                   rate * static_cast<double>(in_.total_steps - st_.step));
  if (logged_step()) log(lr);
  return true;
}

// This rank's micro-batches of the step, each forward then backward; the gradients accumulate
// (normalised by the whole step's loss tokens), the loss sums come back.
StepLoss Trainer::forward_backward(const StepPlan& plan) {
  StepLoss loss;
  StepBatches batches(*in_.batcher, plan.start);
  // ZeRO-2 reduces the gradients after every backward: every rank runs all its micro-batches.
  const bool every_backward_meets = m_.mesh.ep > 1 || (opt_.sharded() && rc_.parallel.zero == 2);
  for (size_t k = 0; k < plan.mine.size(); ++k) {
    if (plan.loss_tokens == 0) break;  // nothing to learn in the whole step: not run
    const MicroBatch mb = batches.get(plan.mine[k]);
    // Nothing to learn in this micro-batch: not run, unless the ranks must meet in its
    // collectives (its loss and aux loss then count zero).
    if (mb.loss_tokens == 0 && !every_backward_meets) continue;
    ForwardArgs a = batch_args(mb);
    a.output_router_logits = true;
    a.output_expert_counts = true;
    a.activation_checkpointing = rc_.train.activation_checkpointing;
    a.training = true;
    a.num_items_in_batch = plan.loss_tokens;
    a.router_aux_loss_coef = aux_coef_;
    // Each micro-batch's aux loss counts with its share of the step's loss tokens, so the aux
    // term's scale does not depend on how the step is split.
    a.aux_loss_scale = static_cast<double>(mb.loss_tokens) / plan.loss_tokens;
    // Under ZeRO the gradients leave for their buckets during the backward (see AdamW::shard).
    const ForwardResult r = train_micro_batch(
        m_.ts, m_.decoder(), a, k + 1 == plan.mine.size(), [this] { sync(); }, &win_.grad_sync_s);
    const double aux = r.aux_loss ? r.aux_loss->item<double>() : 0.0;
    const double total = r.loss->item<double>();
    loss.ce_sum += (total - aux_coef_ * a.aux_loss_scale * aux) * plan.loss_tokens;
    loss.aux_weighted += a.aux_loss_scale * aux;
    loss.finite = loss.finite && std::isfinite(total);
    if (win_.expert_counts.empty()) {
      for (const auto& c : r.expert_counts) win_.expert_counts.push_back(at::zeros_like(c));
    }
    if (mb.loss_tokens > 0) {
      for (size_t l = 0; l < r.expert_counts.size(); ++l) {
        win_.expert_counts[l] += r.expert_counts[l];
      }
      m_.bias_balance->add_counts(r.expert_counts);
    }
  }
  return loss;
}

// Gradients summed where they are shared — first, so that the reductions the backward's hooks
// launched (ZeRO) and those a rank without a last backward launches here meet in the same order
// on every rank; then the step's loss and finiteness over every rank, with whether any rank was
// asked to stop (then every rank stops after this same step), and the routers' loads.
void Trainer::sum_over_ranks(const StepPlan& plan, StepLoss& loss) {
  if (plan.loss_tokens > 0) {
    const auto t_sync = Clock::now();
    opt_.reduce_grads(world_);
    sync();  // (NCCL's wait only orders the stream: time the reductions themselves)
    win_.grad_sync_s += seconds_since(t_sync);
  }
  at::Tensor t = at::tensor({loss.ce_sum, loss.aux_weighted, loss.finite ? 0.0 : 1.0,
                             static_cast<double>(stop_.requested())},
                            at::kDouble)
                     .to(world_.device);
  parallel::all_reduce_sum(world_.world, t, "step loss");
  t = t.cpu();
  loss.ce_sum = t[0].item<double>();
  loss.aux_weighted = t[1].item<double>();
  loss.finite = t[2].item<double>() == 0;
  if (t[3].item<double>() != 0 && stop_signal_ == 0) {
    stop_signal_ = stop_.requested() ? stop_.requested() : -1;
  }
  m_.bias_balance->sum_counts([&](std::vector<at::Tensor>& c) {
    parallel::all_reduce_sum(world_.world, c, "router bias loads");
  });
}

// A step whose loss or gradient norm is not finite: no update (what optimizer.in_backward already
// updated stays), said in the log; after train.max_nonfinite_steps in a row, a checkpoint and the
// end of the run (false).
bool Trainer::skip_update(const StepLoss& loss) {
  st_.skipped_steps += 1;
  st_.consecutive_nonfinite += 1;
  // (optimizer.in_backward: the tensors whose finite gradients came first were updated)
  const int64_t partial = opt_.in_backward() ? opt_.updated_in_backward() : 0;
  release_gradients(m_.ts);
  const bool loss_finite = std::isfinite(loss.ce_sum);
  emit({{"type", "skip"},
        {"step", st_.step},
        {"reason", loss_finite ? "non-finite gradient norm" : "non-finite loss"},
        {"tensors_updated", partial},
        {"consecutive", st_.consecutive_nonfinite}});
  progress_.line("step " + std::to_string(st_.step) + ": non-finite " +
                 (loss_finite ? "gradient norm" : "loss") +
                 (partial ? ", the rest of the update skipped (optimizer.in_backward had "
                            "already updated " +
                                std::to_string(partial) + " of " +
                                std::to_string(opt_.names.size()) + " tensors)"
                          : ", update skipped") +
                 " (" + std::to_string(st_.consecutive_nonfinite) + " in a row)");
  win_.skipped += 1;
  if (st_.consecutive_nonfinite < rc_.train.max_nonfinite_steps) return true;
  checkpoint();
  progress_.done();
  std::cerr << "automoe train: stopping after " << st_.consecutive_nonfinite
            << " consecutive non-finite steps (train.max_nonfinite_steps); checkpoint "
            << checkpoint_dir() << " holds the last state. Lower optimizer.lr or check the data "
            << "and model.\n";
  return false;
}

// Clipping, the AdamW update and DeepSeek-V3's bias balancing; the window's loss sums.
void Trainer::update(const StepPlan& plan, const StepLoss& loss, double norm, double lr) {
  st_.consecutive_nonfinite = 0;
  if (plan.loss_tokens > 0) {
    clip_gradients(m_.ts, norm, rc_.optimizer.max_grad_norm);
    m_.expert_adapters.add_gradients(opt_);
    // The logged step's update of the experts' adapters (a copy of their masters, then).
    if (!m_.expert_adapters.sites.empty() && logged_step()) {
      expert_adapters_before_ = m_.expert_adapters.snapshot(opt_);
    }
    update_weights(m_.ts, rc_.optimizer, lr);
    m_.bias_balance->apply();
  }
  release_gradients(m_.ts);
  win_.ce_sum += loss.ce_sum;
  win_.aux_weighted += loss.aux_weighted;
  win_.aux_steps += plan.loss_tokens > 0 && m_.spec().moe.aux_loss;
  win_.loss_tokens += plan.loss_tokens;
  win_.grad_norm = norm;
}

// A "train" record of the window since the last one. Every rank reaches this step's log together:
// the window's expert loads over all ranks, and what each rank's dispatcher moved.
void Trainer::log(double lr) {
  RankMetrics ranks;
  if (place_.dist) {
    ranks = gather_rank_metrics(win_, m_.decoder(), world_, place_.dev, m_.moe_layers.size(),
                                hooks_.peak_memory_bytes());
  }
  const parallel::Mesh& mesh = m_.mesh;
  const double tflops = win_.flops / std::max(win_.seconds, 1e-9) / 1e12;
  const auto num_docs = static_cast<double>(in_.train_set->num_docs());
  json rec = {
      {"type", "train"},
      {"step", st_.step},
      {"total_steps", in_.total_steps},
      {"epoch",
       static_cast<double>(st_.pos.epoch) + static_cast<double>(st_.pos.cursor) / num_docs},
      {"loss", win_.loss_tokens > 0 ? win_.ce_sum / win_.loss_tokens : NAN},
      {"aux_loss", win_.aux_steps > 0 ? win_.aux_weighted / win_.aux_steps : NAN},
      {"grad_norm", win_.grad_norm},
      {"lr", lr},
      {"tokens", st_.tokens_seen},
      {"tokens_per_s", win_.tokens / std::max(win_.seconds, 1e-9)},
      {"tflops", tflops},
      {"mfu", peak_tflops_ > 0 ? tflops / (peak_tflops_ * static_cast<double>(mesh.world)) : 0.0},
      {"peak_memory_gib", static_cast<double>(hooks_.peak_memory_bytes()) / (1 << 30)},
      {"skipped_steps", st_.skipped_steps},
      {"truncated_documents", win_.truncated},
      {"step_time_s", win_.seconds / static_cast<double>(win_.steps)},
      {"elapsed_s", seconds_since(t_start_)},
      {"expert_load", expert_load(win_.expert_counts, m_.moe_layers)}};
  if (m_.bias_balance->enabled()) rec["router_bias"] = m_.bias_balance->report();
  if (!m_.expert_adapters.sites.empty()) {
    rec["expert_lora"] = m_.expert_adapters.report(opt_, expert_adapters_before_, world_.ep);
    expert_adapters_before_.clear();
  }
  if (place_.dist) {
    rec["parallel"] = {{"world", mesh.world},
                       {"ep", mesh.ep},
                       {"dp", mesh.dp},
                       {"peak_memory_gib_per_rank", ranks.peak_memory_gib},
                       {"gradient_sync_wait_s", ranks.gradient_sync_wait_s}};
  }
  if (!ranks.dispatch.is_null()) rec["dispatch"] = ranks.dispatch;
  emit(rec);
  progress_.log(rec);
  win_ = Window{};
}

// The validation loss over the whole validation set, split over the ranks.
void Trainer::evaluate() {
  at::NoGradGuard no_grad;
  double ce = 0, n = 0;
  // Rank r evaluates batches r, r + world, ...; under expert parallelism every rank runs the
  // same number of forwards (a rank out of batches reruns batch 0 and ignores it).
  const auto& batches = in_.val_batches;
  const int64_t nb = static_cast<int64_t>(batches.size()), W = m_.mesh.world;
  const bool ep = m_.mesh.ep > 1;
  const int64_t rounds = ep ? (nb + W - 1) / W : nb;
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t i = ep ? j * W + world_.rank : j;
    if (!ep && i % W != world_.rank) continue;
    const bool counted = i < nb;
    const MicroBatch& mb = batches[counted ? i : 0];
    if (mb.loss_tokens == 0 && !ep) continue;
    ForwardArgs a = batch_args(mb);
    a.output_router_logits = false;
    a.num_items_in_batch = 1.0;  // the loss is then the token sum
    const double sum = m_.decoder().forward(a).loss->item<double>();
    if (!counted) continue;
    ce += sum;
    n += static_cast<double>(mb.loss_tokens);
  }
  if (place_.dist) {
    at::Tensor t = at::tensor({ce, n}, at::kDouble).to(world_.device);
    parallel::all_reduce_sum(world_.world, t, "evaluation");
    t = t.cpu();
    ce = t[0].item<double>();
    n = t[1].item<double>();
  }
  emit({{"type", "eval"},
        {"step", st_.step},
        {"eval_loss", n > 0 ? ce / n : NAN},
        {"eval_tokens", n}});
  char buf[96];
  std::snprintf(buf, sizeof buf, "eval at step %ld: loss %.4f over %.0f tokens", st_.step,
                n > 0 ? ce / n : NAN, n);
  progress_.line(buf);
}

// A micro-batch as forward arguments on the device; callers add what the pass needs.
ForwardArgs Trainer::batch_args(const MicroBatch& mb) const {
  auto to_dev = [&](const at::Tensor& t) { return t.to(place_.dev, /*non_blocking=*/true); };
  ForwardArgs a;
  a.input_ids = to_dev(mb.input_ids);
  a.position_ids = to_dev(mb.position_ids);
  a.document_ids = to_dev(mb.document_ids);
  a.labels = to_dev(mb.labels);
  return a;
}

void Trainer::checkpoint() {
  opt_.materialize();
  json extra = identity_;
  // The CPU GEMM paths this run measured: a resumed run adopts them and computes identically.
  if (!place_.dev.is_cuda()) extra["cpu_gemm"] = ops::cpu::gemm_decisions();
  save_checkpoint(place_.run, st_, opt_, m_.ts.buffers, extra, rc_.checkpoint.keep_last, world_,
                  m_.own.begin);
  opt_.release();
}

// A SIGTERM / SIGINT / SIGHUP (on any rank) stops the run after its step, with a checkpoint.
int Trainer::stop_for_signal() {
  checkpoint();
  progress_.done();
  const std::string by =
      stop_signal_ > 0 ? StopSignals::name(stop_signal_) : "a signal to another rank";
  emit({{"type", "stopped"}, {"step", st_.step}, {"signal", by}});
  if (place_.lead) {
    std::cerr << "automoe train: stopped by " << by << " after step " << st_.step << " of "
              << in_.total_steps << "; checkpoint " << checkpoint_dir()
              << " saved. Run the same command again to resume.\n";
  }
  return kExitStopped;
}

// The last evaluation and checkpoint, then the export.
int Trainer::finish() {
  if (!in_.val_batches.empty()) evaluate();
  checkpoint();
  const Exported out = export_run(rc_, place_, m_, world_);
  if (!place_.lead) return 0;
  // The peak above the process's memory at the start, against the plan (train/plan.h).
  json end = {{"type", "end"},
              {"step", st_.step},
              {"elapsed_s", seconds_since(t_start_)},
              {"peak_memory_bytes", hooks_.peak_memory_bytes()},
              {"memory_baseline_bytes", place_.memory_baseline},
              {"planned_peak_bytes", place_.planned_peak_bytes}};
  end.update(out.fields);
  emit(end);
  progress_.line("automoe train: done at step " + std::to_string(st_.step) + "; " + out.where);
  return 0;
}

}  // namespace

int run_training(const Recipe& rc, const TrainData& data, const TrainerHooks& hooks_in,
                 const parallel::World& world) {
  TrainerHooks hooks = hooks_in;
  // What the process holds before the run: the plan predicts the memory above it.
  const int64_t baseline = hooks.peak_memory_bytes ? 0 : current_rss();
  if (!hooks.peak_memory_bytes) {
    reset_peak_rss();
    hooks.peak_memory_bytes = cpu_peak_rss;
  }
  use_threads(rc.train.threads);
  // From here a SIGTERM / SIGINT / SIGHUP ends the run after its step, with a checkpoint.
  const StopSignals stop;
  const c10::Device dev = resolve_device(rc.train.device);
  // cuda:N: N is the current device for the whole run.
  const c10::OptionalDeviceGuard device_guard(dev.is_cuda() ? std::optional(dev) : std::nullopt);
  RunPlace place = open_run(rc, world, dev);
  place.memory_baseline = baseline;
  // Before any weight is read: does the plan fit the memory this rank has?
  check_memory(rc, world,
               hooks.available_memory_bytes ? hooks.available_memory_bytes()
               : dev.is_cuda()              ? 0
                                            : -1,
               place);
  const std::unique_ptr<TrainModel> model = load_train_model(rc, data, world, place);
  const TrainInputs inputs = open_inputs(rc, data, model->spec());
  return Trainer(rc, data, hooks, world, stop, place, *model, inputs).run();
}

}  // namespace automoe::train
