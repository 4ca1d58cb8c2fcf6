// The end of a run of `automoe train`: the trained model written as a Hugging Face directory
// <run>/export (checkpoint.export_dtype, checkpoint.export_layout; under a mesh written
// collectively, each rank its experts' rows) — or, for LoRA, PEFT's adapter directory there and,
// on request, the merged model in <run>/export-merged.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "automoe/parallel/world.h"
#include "automoe/train/recipe.h"
#include "automoe/train/setup.h"

namespace automoe::train {

struct Exported {
  nlohmann::json fields;  // for the "end" record: export, export_merged
  std::string where;      // for the console: the directories and what they hold
};

// Collective under a mesh (every rank calls it); only rank 0's result names what was written.
Exported export_run(const Recipe& rc, const RunPlace& place, TrainModel& m,
                    const parallel::World& world);

}  // namespace automoe::train
