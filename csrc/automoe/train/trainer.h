// The fine-tuning loop behind `automoe train`: loads a Hugging Face checkpoint, streams a tokenised
// dataset in packed or padded micro-batches, accumulates gradients normalised by the loss tokens of
// the whole accumulation window, clips, steps AdamW (fp32 master weights and state), checkpoints
// atomically and resumably, logs metrics, and exports a Hugging Face checkpoint at the end.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "automoe/parallel/world.h"
#include "automoe/train/recipe.h"

namespace automoe::train {

struct TrainData {
  std::string train;       // .amds file (automoe.data tokenises the recipe's JSONL into it)
  std::string validation;  // optional .amds file
  std::string train_key;   // the cache key of the training data (checked when resuming)
};

// Device-specific measurements the engine library cannot make itself (CUDA headers live with
// the command-line target); defaults measure the process on the CPU.
struct TrainerHooks {
  std::function<int64_t()> peak_memory_bytes;
  std::function<void()> reset_peak_memory;
  // The device memory this rank may still allocate (cudaMemGetInfo's free bytes on a GPU; 0:
  // unknown, the pre-flight check is skipped); unset: the CPU's (train/plan.h
  // available_cpu_memory, shared by the node's ranks) — on a GPU without it, no check.
  std::function<int64_t()> available_memory_bytes;
};

// Exit status: 0 done, 3 stopped after too many consecutive non-finite steps (a checkpoint is
// written first). Bad recipes, data or checkpoints throw automoe::Error.
// `world`: the processes of a distributed run (parallel/world.h; every rank calls this with the
// same recipe and data); the default is one process.
int run_training(const Recipe& recipe, const TrainData& data, const TrainerHooks& hooks = {},
                 const parallel::World& world = {});

}  // namespace automoe::train
