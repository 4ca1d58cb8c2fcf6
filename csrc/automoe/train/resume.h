// Resuming a run of `automoe train`: what its checkpoints must agree with (the base model, the
// training data, the LoRA configuration), restoring the weights, optimizer and data position, and
// setting aside the checkpoints a killed run left past the one resumed from.
#pragma once

#include <nlohmann/json.hpp>

#include "automoe/train/recipe.h"
#include "automoe/train/setup.h"
#include "automoe/train/state.h"

namespace automoe::train {

// What a run's checkpoints record of what they were trained from, and a resume compares:
// model_path, train_data (its cache key), train_documents, train_tokens, peft (null: full).
nlohmann::json run_identity(const Recipe& rc, const TrainData& data, const TokenDataset& train_set,
                            bool lora);

// Refuses (naming the run) a checkpoint trained as the other kind of run — full vs LoRA, or LoRA
// with another configuration — from its trainer state, before any tensor is read.
void check_same_kind_of_run(const nlohmann::json& saved, const nlohmann::json& identity,
                            const std::filesystem::path& run, bool lora);
// Refuses LoRA adapters on another base model and a checkpoint trained on other data; says on
// stderr when a full fine-tune continues from another model.path.
void check_same_origin(const nlohmann::json& saved, const nlohmann::json& identity,
                       const Recipe& rc, const std::filesystem::path& run, bool lora);

// Loads place.resume_name into m (masters, moments, buffers; this rank's expert rows) and st (step,
// data position, counters), adopting the CPU GEMM paths the run measured; then removes (or, past a
// checkpoint.resume_from, sets aside as step-N.aside) later checkpoints, and points `latest` at
// the one resumed from. Collective under a mesh.
void resume_run(const Recipe& rc, const RunPlace& place, const nlohmann::json& identity,
                int64_t train_documents, TrainModel& m, TrainerState& st);

}  // namespace automoe::train
