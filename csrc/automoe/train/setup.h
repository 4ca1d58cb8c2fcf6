// Setting up a run of `automoe train`, in the order the trainer does it and with every recipe check
// made before the first step: where it computes and keeps its files (RunPlace), the model with its
// trainable state (TrainModel), and the data (TrainInputs, inputs.h). Under a mesh every rank calls
// these together; their collectives meet in the same order on every rank.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "automoe/model/checkpoint.h"
#include "automoe/model/lora.h"
#include "automoe/parallel/world.h"
#include "automoe/train/bias_balance.h"
#include "automoe/train/metrics.h"
#include "automoe/train/recipe.h"
#include "automoe/train/step.h"
#include "automoe/train/trainer.h"

namespace automoe::train {

// The recipe's peft: section as the LoRA planner's config (PEFT's LoraConfig names).
LoraConfig lora_config_of(const PeftSection& p);

// train.threads: the intra-op threads (0: all); refuses more than the CPUs this process may use.
void use_threads(int64_t threads);

// train.device: "auto" (CUDA when visible), "cpu", "cuda" or "cuda:N", checked against the machine.
c10::Device resolve_device(const std::string& name);

// Where a run computes and keeps its files.
struct RunPlace {
  c10::Device dev = c10::kCPU;
  c10::ScalarType compute = c10::kFloat;  // model.dtype
  std::filesystem::path run;              // checkpoint.dir
  bool lead = true;                       // rank 0: owns the run directory, writes the logs
  bool dist = false;                      // more than one process
  std::string resume_name;                // the checkpoint to resume from; "" starts afresh
  // The optimizer's precision for this run: optimizer.master_weights / state_dtype with "auto"
  // resolved (recipe.h resolve_precision; a resumed run keeps its checkpoint's).
  OptimizerSection optimizer;
  // The pre-flight check's plan (check_memory): this rank's predicted peak above the process's
  // memory when the run started (`memory_baseline`, the resident bytes then).
  double planned_peak_bytes = 0;
  int64_t memory_baseline = 0;
};

// Rank 0 claims checkpoint.dir (marker, lock, a killed save's leftovers removed); every rank then
// sees it as rank 0 left it, and learns which checkpoint to resume from — the one `latest` names,
// or checkpoint.resume_from — and the optimizer precision the run keeps. A directory holding a run is refused unless checkpoint.resume is set.
RunPlace open_run(const Recipe& rc, const parallel::World& world, c10::Device dev);

// The pre-flight check: this rank's memory plan (train/plan.h) for the recipe's model and mesh
// against the memory it has (`available` bytes; < 0: the CPU's, shared by LOCAL_WORLD_SIZE ranks;
// 0: unknown, nothing compared),
// before any weight is read. A plan that does not fit stops every rank with the plan and what would
// fit, unless train.force; rank 0 writes the plan to <checkpoint.dir>/plan.json either way.
void check_memory(const Recipe& rc, const parallel::World& world, int64_t available,
                  RunPlace& place);

// The model side of a run: the checkpoint as loaded (this rank's experts under a mesh), the LoRA
// adapters, the optimizer with its masters and moments, DeepSeek-V3's bias balancing.
struct TrainModel {
  PretrainedModel pm;
  parallel::Mesh mesh;
  parallel::ExpertRange own;  // this rank's experts (count 0: all of them, no expert parallelism)
  c10::ScalarType stored;     // the checkpoint's dtype (the export's default)
  bool lora = false;          // a peft: section: the base frozen, the adapters trained
  LoraConfig lora_config;
  std::vector<LoraSite> lora_sites;
  TrainState ts;  // must not move once a step began (its hooks point into it)
  std::optional<BiasBalance> bias_balance;
  std::vector<int64_t> moe_layers;
  ExpertAdapterMetrics expert_adapters;
  int64_t lora_parameters = 0, base_parameters = 0;

  Decoder& decoder() const { return *pm.decoder; }
  const ModelSpec& spec() const { return pm.decoder->spec(); }
};

// Checks that every rank runs the same recipe, checkpoint and data, agrees the CPU GEMM paths over
// the ranks, checks the mesh against the model, loads the checkpoint (each rank its own experts),
// plans and initialises LoRA, and builds the optimizer state (ZeRO-sharded when asked).
std::unique_ptr<TrainModel> load_train_model(const Recipe& rc, const TrainData& data,
                                             const parallel::World& world, const RunPlace& place);

}  // namespace automoe::train
