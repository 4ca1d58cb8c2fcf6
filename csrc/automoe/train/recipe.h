// The training recipe: what `automoe train RECIPE.yaml` runs. The Python front reads the YAML and
// applies dotted overrides; this is the one place that knows every key, its type, its default and
// its valid range. An unknown key or a bad value is an automoe::Error naming the dotted key.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace automoe::train {

// Bounds on recipe values that size memory or threads: beyond them a value is a typo, refused
// before anything is allocated.
inline constexpr int64_t kMaxSeqLen = int64_t{1} << 20;
inline constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 20;
inline constexpr int64_t kMaxAccumulation = int64_t{1} << 20;  // micro-batches per step
inline constexpr int64_t kMaxThreads = 4096;  // (and at most the CPUs the process may use)

struct ModelSection {
  std::string path;                            // Hugging Face checkpoint directory
  std::string dtype = "bfloat16";              // compute dtype: float32 | bfloat16
  std::map<std::string, std::string> backend;  // BackendConfig fields
  std::optional<double> router_aux_loss_coef;  // default: the checkpoint's config
  // A frozen quantised base for LoRA (docs/lora.md#a-quantised-base): the routed experts held in
  // bitsandbytes' format, quantised while loading. none | nf4 | fp4 | int8.
  std::string quantize = "none";
  int64_t quantize_blocksize = 64;  // 4-bit: elements per absmax block (bitsandbytes' sizes)
};

// One source of documents (docs/recipes.md#data-sources): a local file, directory or glob of
// shards (`path`), or a Hugging Face dataset id resolved offline from the local cache (`dataset`).
// The Python front reads it (automoe/data); the engine only validates it and records it.
struct DataSource {
  std::string path;                            // file | directory | glob | save_to_disk directory
  std::string dataset;                         // hub dataset id (org/name)
  std::string subset, split, revision;         // for `dataset` (split also for save_to_disk)
  std::map<std::string, std::string> columns;  // format field -> the source's column
  std::optional<double> weight;                // mixing weight (> 0); unset = 1 when mixing
  std::string format;                          // "" = data.format
};

struct DataSection {
  std::vector<DataSource> train;       // one or more sources, concatenated or mixed by weight
  std::vector<DataSource> validation;  // optional
  std::string format = "auto";  // auto | chat | prompt_completion | alpaca | text
  int64_t seq_len = 2048;
  bool packing = true;
  std::string train_on = "completion";  // completion (assistant / completion tokens) | all
  std::string on_error = "fail";        // fail | skip
  bool shuffle = true;
  std::string cache_dir;                // "" = $AUTOMOE_CACHE/datasets or ~/.cache/automoe/datasets
  int64_t num_proc = 0;                 // tokenising processes; 0 = the CPUs this process may use
  double validation_split = 0.0;        // held out of data.train when no validation source
  int64_t max_samples = 0;              // records read from each source; 0 = all
};

struct TrainSection {
  int64_t micro_batch_size = 1;  // rows of seq_len tokens per forward
  int64_t grad_accumulation_steps = 1;
  int64_t global_batch_size = 0;  // rows per optimizer step; 0 = micro * accumulation
  int64_t max_steps = 0;          // 0 = run `epochs` epochs
  double epochs = 1.0;
  uint64_t seed = 42;
  int64_t eval_every = 0;  // steps; 0 = at the end only (when there is validation data)
  int64_t max_nonfinite_steps = 5;
  bool activation_checkpointing = false;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  int64_t threads = 0;          // CPU threads; 0 = LibTorch's default
  // The pre-flight memory check (train/plan.h): false stops a run whose plan does not fit the
  // memory this rank has before anything large is allocated; true starts it anyway (--force).
  bool force = false;
};

struct OptimizerSection {
  std::string name = "adamw";
  double lr = 1e-5;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // not applied to 1-D parameters (norms, biases)
  double max_grad_norm = 1.0;  // 0 = no clipping
  // With model.dtype bfloat16 (docs/recipes.md#precision-and-the-optimizer): where the float32 master
  // weights live — "float32" (a float32 copy beside the bf16 weights), "remainders" (the bf16
  // weights plus the lower 16 bits of each float32 master: the same masters in 4 bytes, as
  // TransformerEngine's FusedAdam(store_param_remainders=True)) or "none" (the bf16 weights are the
  // masters: updates round to bf16, as a Transformers bf16 model with torch.optim.AdamW trains);
  // "auto": see resolve_precision.
  std::string master_weights = "auto";
  std::string state_dtype = "auto";  // AdamW's moments: float32 | bfloat16 | 8bit (block-wise) | auto
  // Each tensor's update runs in the backward, as soon as its gradient is complete, and the
  // gradient is freed at once (torchtune's optimizer_in_bwd): no gradient is ever held for the
  // whole model. Needs max_grad_norm 0 (no global norm before the first update), one micro-batch
  // per step and one process; refused by name otherwise.
  bool in_backward = false;
};

struct ScheduleSection {
  std::string type = "cosine";  // cosine | linear | constant
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;  // of the total steps, when warmup_steps is 0
  double min_lr_ratio = 0.0;  // the decay ends at lr * min_lr_ratio
};

struct CheckpointSection {
  std::string dir;            // the run directory: step-N/, latest, export/, metrics.jsonl
  int64_t every = 0;          // steps; 0 = only at the end
  int64_t keep_last = 2;
  bool resume = true;         // continue from dir/latest when it exists
  std::string resume_from;    // "" = the checkpoint `latest` names; else step-N of dir
  std::string export_layout = "source";  // source | per-expert | fused
  std::string export_dtype = "auto";     // auto (the checkpoint's) | float32 | bfloat16
};

struct LogSection {
  int64_t every = 10;
  std::string jsonl;        // "" = <checkpoint.dir>/metrics.jsonl
  std::string tensorboard;  // "" = off; else a directory for event files
  double peak_tflops = 0;   // for MFU; 0 = measure the device's matmul peak at start
  std::string progress = "auto";  // auto (a bar on a terminal) | bar | lines | off
};

struct RouterSection {
  // DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every expert's
  // e_score_correction_bias moves by this much against its load (up when it got fewer than the
  // mean token-slots, down when more). 0 = off; only for routers with a correction bias.
  double bias_update_rate = 0.0;
};

// Multi-process training (docs/parallelism.md): world = dp x ep processes under torchrun or
// `automoe train --nproc-per-node N`; every rank trains on its own slice of each step's batch.
struct ParallelSection {
  int64_t ep = 1;          // expert-parallel ranks: each holds num_experts / ep experts
  int64_t dp = 0;          // data-parallel replicas; 0 (auto) = world / ep
  // 1: ZeRO-1 (masters and moments of shared tensors sharded); 2: their gradients too; 0: none
  int64_t zero = 1;
  double bucket_mb = 32;   // gradients are reduced in buckets of about this size (MiB)
  double timeout_s = 600;  // a collective waiting longer than this fails the run on every rank
};

// LoRA fine-tuning (docs/lora.md): PEFT's LoraConfig names and meanings. Present = on: the base
// weights stay frozen in model.dtype, only the adapters train (float32 masters), checkpoints hold
// the adapters and their optimizer state, and the export is a PEFT adapter directory.
struct PeftSection {
  bool enabled = false;
  int64_t r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0.0;
  bool use_rslora = false;
  std::vector<std::string> target_modules;  // ["q_proj", ...] or ["all-linear"]
  std::string target_modules_regex;         // target_modules given as one string (PEFT: a regex)
  std::vector<std::string> target_parameters;  // routed experts: ["mlp.experts.gate_up_proj", ...]
  bool moe_rank_scaling = false;  // experts' rank r / top_k
  bool export_merged = false;     // also write <dir>/export-merged: base + adapters, full checkpoint
};

struct Recipe {
  ModelSection model;
  DataSection data;
  TrainSection train;
  OptimizerSection optimizer;
  ScheduleSection schedule;
  CheckpointSection checkpoint;
  LogSection log;
  RouterSection router;
  ParallelSection parallel;
  PeftSection peft;

  // From the recipe as JSON text (the YAML document converted). `origin` names it in errors.
  static Recipe parse(const std::string& json_text, const std::string& origin);
  // Every key, defaults filled in, as JSON text (what the run directory records).
  std::string to_json() const;
};

// optimizer.master_weights / state_dtype "auto" made concrete for a run of `world` processes: bf16
// full fine-tuning without ZeRO (one process, or parallel.zero 0) keeps its float32 masters as
// remainders (the same masters) with 8-bit moments — as little memory as Transformers' own bf16
// training (docs/recipes.md#precision-and-the-optimizer has the evidence); every other run float32
// (ZeRO shards float32 state, float32 weights are their own masters, LoRA's adapters are float32).
// A resumed run keeps what its checkpoint was written with (`resumed_*`, "" when starting afresh).
OptimizerSection resolve_precision(const Recipe& rc, int64_t world,
                                   const std::string& resumed_masters = "",
                                   const std::string& resumed_state = "");

// Learning rate at optimizer step `step` (0-based) of `total` steps.
double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int64_t step,
                     int64_t total);

}  // namespace automoe::train
