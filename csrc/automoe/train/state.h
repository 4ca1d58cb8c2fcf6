// Resumable training state: <run>/step-N/ holds the float32 master weights and buffers
// (model.safetensors), the AdamW moments, step count and RNG state (optimizer.safetensors), the
// trainer's position (trainer_state.json) and, under expert parallelism, one
// experts-RRRRR-of-EEEEE.safetensors per EP rank with that rank's rows of every routed expert
// tensor (master and moments; metadata expert_begin / expert_count). A checkpoint loads under any
// ep: each rank reads the rows of its experts from whichever files hold them. Written under a
// temporary name, fsynced, renamed into place, then `latest` points at it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "automoe/parallel/world.h"
#include "automoe/train/dataset.h"
#include "automoe/train/optimizer.h"
#include "automoe/train/run_dir.h"

namespace automoe::train {

struct TrainerState {
  int64_t step = 0;
  DataPosition pos;
  int64_t tokens_seen = 0, skipped_steps = 0, consecutive_nonfinite = 0;
};

// Collective under a distributed world (every rank calls it): rank 0 writes the dense state and
// the trainer state, the ranks of the first data-parallel replica their experts' rows. Then prunes
// to `keep_last` checkpoints.
void save_checkpoint(const std::filesystem::path& run, const TrainerState& st, const AdamW& opt,
                     const NamedTensors& buffers, const nlohmann::json& extra, int64_t keep_last,
                     const parallel::World& world, int64_t expert_begin);

// The checkpoint `latest` in `run` names (step-N).
std::string latest_checkpoint(const std::filesystem::path& run);

// Reads the checkpoint `run`/`name` into `opt`, `buffers` and `st`; returns its trainer state JSON.
// Expert tensors hold rows [expert_begin, expert_begin + rows) of the saved ones. `check` sees the
// trainer state JSON before any tensor is read (a run that cannot continue is refused with its own
// reason, not a tensor's shape). A damaged checkpoint is refused with the reason and, where an
// older one is complete, how to resume from that.
nlohmann::json load_checkpoint(const std::filesystem::path& run, const std::string& name,
                               AdamW& opt, NamedTensors& buffers, TrainerState& st,
                               int64_t expert_begin,
                               const std::function<void(const nlohmann::json&)>& check = {});

// load_checkpoint of one checkpoint directory, without the advice.
nlohmann::json load_checkpoint_dir(const std::filesystem::path& dir, AdamW& opt,
                                   NamedTensors& buffers, TrainerState& st, int64_t expert_begin,
                                   const std::function<void(const nlohmann::json&)>& check = {});

}  // namespace automoe::train
