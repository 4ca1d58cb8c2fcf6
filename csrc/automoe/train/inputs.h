// The data side of a run of `automoe train`: the tokenised training and validation sets opened and
// checked against the model and the recipe, the batcher, how many steps the run has — and, per
// step, which micro-batches it holds and which of them this rank trains on.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "automoe/model/spec.h"
#include "automoe/train/dataset.h"
#include "automoe/train/recipe.h"
#include "automoe/train/trainer.h"

namespace automoe::train {

struct TrainInputs {
  std::unique_ptr<TokenDataset> train_set;
  std::unique_ptr<Batcher> batcher;       // micro-batches of train_set
  Truncation cut;                         // what data.seq_len cuts off train_set's documents
  std::unique_ptr<TokenDataset> val_set;  // null without validation data
  std::vector<MicroBatch> val_batches;    // the whole validation pass, in file order
  int64_t total_steps = 0;                // train.max_steps, or the steps of train.epochs
};

// Opens `data` for `spec`: refuses token ids outside the vocabulary, a dataset with nothing to
// learn within data.seq_len, and a step larger than an epoch of the data.
TrainInputs open_inputs(const Recipe& rc, const TrainData& data, const ModelSpec& spec);

// One optimizer step's micro-batches, counted without building them: every rank counts all of
// them (the position and the loss-token total are then the same everywhere without a collective)
// and trains on its share, micro-batches rank, rank + world, ...
struct StepPlan {
  DataPosition start;            // where the step's first micro-batch begins
  std::vector<int64_t> mine;     // this rank's micro-batches: their index in the step
  double loss_tokens = 0;        // loss tokens of the whole step (the loss's normaliser)
  double tokens = 0, flops = 0;  // real tokens and training FLOPs of micro-batches with a loss
  int64_t truncated = 0;         // documents cut at data.seq_len
};

// Counts the `accum` micro-batches from `pos` (moved past them) for `rank` of `world_size`.
StepPlan plan_step(const Batcher& batcher, DataPosition& pos, int64_t accum, int64_t world_size,
                   int64_t rank, const ModelSpec& spec);

// Builds a step's micro-batches, asked for in increasing index.
class StepBatches {
 public:
  StepBatches(const Batcher& batcher, DataPosition start) : batcher_(batcher), cursor_(start) {}
  MicroBatch get(int64_t i);  // the step's i-th micro-batch

 private:
  const Batcher& batcher_;
  DataPosition cursor_;
  int64_t index_ = 0;
};

}  // namespace automoe::train
