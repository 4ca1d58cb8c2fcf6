// The trainer's units apart from a run: the step plan (which micro-batches a step holds, which a
// rank trains on, what the whole step counts), building the planned micro-batches, the metrics'
// expert loads, the console's numbers, and what a resume refuses.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "amds_file.h"
#include "automoe/core/error.h"
#include "automoe/train/flops.h"
#include "automoe/train/inputs.h"
#include "automoe/train/metrics.h"
#include "automoe/train/progress.h"
#include "automoe/train/recipe.h"
#include "automoe/train/resume.h"
#include "tiny_spec.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;
using automoe::testing::tiny_spec;
using automoe::testing::write_amds;
using nlohmann::json;

// Seven documents of awkward lengths; the third (a prompt alone) and the fifth (one token: the
// first token of a document has no loss) have nothing to learn.
struct SevenDocs {
  std::string path = write_amds(
      {{1, 2, 3},
       {4, 5, 6, 7, 8},
       {9, 10},
       {11, 12, 13, 14},
       {15},
       {16, 17, 18, 19, 20, 21},
       {22, 23}},
      {{1, 1, 1}, {0, 0, 1, 1, 1}, {0, 0}, {1, 1, 1, 1}, {1}, {0, 1, 1, 1, 1, 1}, {0, 1}});
  ~SevenDocs() { fs::remove(path); }
};

TEST(StepPlan, SplitsTheMicroBatchesOverTheRanksAndCountsTheWholeStep) {
  const SevenDocs docs;
  const TokenDataset data(docs.path);
  // Padded rows of one document each: micro-batch i holds document i (no shuffle).
  const Batcher batcher(data, /*rows=*/1, /*seq_len=*/8, /*packing=*/false, /*shuffle=*/false, 0,
                        0);
  const ModelSpec spec = tiny_spec();
  std::vector<MicroBatch> each;
  DataPosition expected;
  for (int i = 0; i < 5; ++i) each.push_back(batcher.next(expected, /*tensors=*/false));

  for (int64_t rank = 0; rank < 2; ++rank) {
    DataPosition pos;
    const StepPlan plan = plan_step(batcher, pos, /*accum=*/5, /*world_size=*/2, rank, spec);
    EXPECT_EQ(plan.start, DataPosition{});
    EXPECT_EQ(pos, expected);  // every rank moves past the whole step
    EXPECT_EQ(plan.mine,
              rank == 0 ? (std::vector<int64_t>{0, 2, 4}) : (std::vector<int64_t>{1, 3}));
    double loss = 0, tokens = 0, flops = 0;
    for (const MicroBatch& mb : each) {
      loss += static_cast<double>(mb.loss_tokens);
      if (mb.loss_tokens == 0) continue;  // documents 2 and 4: not counted as trained
      tokens += static_cast<double>(mb.real_tokens);
      flops += static_cast<double>(mb.real_tokens) * training_flops_per_token(spec, mb.length);
    }
    EXPECT_EQ(plan.loss_tokens, loss);
    EXPECT_EQ(plan.tokens, tokens);
    EXPECT_EQ(plan.tokens, 3 + 5 + 4);
    EXPECT_DOUBLE_EQ(plan.flops, flops);
  }
}

TEST(StepPlan, AStepCanRunIntoTheNextEpoch) {
  const SevenDocs docs;
  const TokenDataset data(docs.path);
  const Batcher batcher(data, 2, 8, /*packing=*/false, /*shuffle=*/false, 0, 0);
  DataPosition pos;
  plan_step(batcher, pos, 3, 1, 0, tiny_spec());  // documents 0-5
  const StepPlan second = plan_step(batcher, pos, 3, 1, 0, tiny_spec());
  EXPECT_EQ(second.start, (DataPosition{0, 6}));
  EXPECT_EQ(second.start.epoch + 1, pos.epoch);
  EXPECT_EQ(second.mine, (std::vector<int64_t>{0, 1, 2}));
}

TEST(StepBatches, BuildsTheMicroBatchesThePlanCounted) {
  const SevenDocs docs;
  const TokenDataset data(docs.path);
  const Batcher batcher(data, 2, 6, /*packing=*/true, /*shuffle=*/true, /*seed=*/3, 0);
  DataPosition pos{0, 0};
  const StepPlan plan = plan_step(batcher, pos, 4, 2, 1, tiny_spec());
  StepBatches batches(batcher, plan.start);
  DataPosition walk = plan.start;
  std::vector<MicroBatch> all;
  for (int i = 0; i < 4; ++i) all.push_back(batcher.next(walk));
  for (const int64_t i : plan.mine) {  // 1 and 3: the ones before are skipped, not built
    const MicroBatch mb = batches.get(i);
    EXPECT_TRUE(mb.input_ids.equal(all[i].input_ids)) << i;
    EXPECT_TRUE(mb.labels.equal(all[i].labels)) << i;
    EXPECT_EQ(mb.loss_tokens, all[i].loss_tokens) << i;
  }
}

TEST(Metrics, ExpertLoadGivesMinMaxCvAndEmptyExpertsPerLayer) {
  const json load =
      expert_load({at::tensor({4, 0, 2, 2}, at::kLong), at::tensor({3, 3}, at::kLong)}, {1, 3});
  ASSERT_EQ(load.size(), 2u);
  EXPECT_EQ(load[0]["layer"], 1);
  EXPECT_EQ(load[0]["min"], 0.0);
  EXPECT_EQ(load[0]["max"], 4.0);
  EXPECT_EQ(load[0]["empty"], 1);
  EXPECT_NEAR(load[0]["cv"].get<double>(), std::sqrt(2.0) / 2.0, 1e-12);  // sd sqrt(2), mean 2
  EXPECT_EQ(load[0]["counts"], (std::vector<int64_t>{4, 0, 2, 2}));
  EXPECT_EQ(load[1]["layer"], 3);
  EXPECT_EQ(load[1]["cv"], 0.0);
  EXPECT_EQ(load[1]["empty"], 0);
}

TEST(Progress, CountsAndTimesAreShortAndHonestAboutUnknowns) {
  EXPECT_EQ(human_count(12), "12");
  EXPECT_EQ(human_count(4321), "4.3k");
  EXPECT_EQ(human_count(1234567), "1.23M");
  EXPECT_EQ(human_count(30.53e9), "30.53B");
  EXPECT_EQ(human_time(59.6), "1:00");
  EXPECT_EQ(human_time(3725), "1:02:05");
  EXPECT_EQ(human_time(NAN), "?");
  EXPECT_EQ(human_time(-1), "?");
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Resume, RefusesTheOtherKindOfRunBeforeReadingATensor) {
  const json full = {{"peft", nullptr}};
  const json lora = {{"peft", {{"r", 8}}}};
  EXPECT_EQ(error_of([&] { check_same_kind_of_run(full, full, "run", false); }), "");
  EXPECT_EQ(error_of([&] { check_same_kind_of_run(lora, lora, "run", true); }), "");
  EXPECT_NE(error_of([&] {
              check_same_kind_of_run(full, lora, "run", true);
            }).find("its checkpoint is a full fine-tune, but the recipe asks for LoRA"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              check_same_kind_of_run(lora, full, "run", false);
            }).find("holds LoRA adapters {\"r\":8}, but the recipe asks for a full fine-tune"),
            std::string::npos);
}

TEST(Resume, RefusesOtherDataAndAdaptersOnAnotherBase) {
  const SevenDocs docs;
  const TokenDataset data(docs.path);
  Recipe rc;
  rc.model.path = "base";
  const json identity = run_identity(rc, TrainData{docs.path, "", "key-1"}, data, false);
  EXPECT_EQ(identity["train_documents"], 7);
  EXPECT_EQ(identity["train_tokens"], 23);
  EXPECT_TRUE(identity["peft"].is_null());
  EXPECT_EQ(error_of([&] { check_same_origin(identity, identity, rc, "run", false); }), "");
  json other_data = identity;
  other_data["train_data"] = "key-2";
  EXPECT_NE(error_of([&] {
              check_same_origin(other_data, identity, rc, "run", false);
            }).find("was trained on other data (train_data \"key-2\", now \"key-1\")"),
            std::string::npos);
  json other_base = identity;
  other_base["model_path"] = "another";
  // A full fine-tune continues (its weights are in the checkpoint); LoRA adapters cannot.
  EXPECT_EQ(error_of([&] { check_same_origin(other_base, identity, rc, "run", false); }), "");
  EXPECT_NE(error_of([&] {
              check_same_origin(other_base, identity, rc, "run", true);
            }).find("its LoRA adapters were trained on another"),
            std::string::npos);
}

}  // namespace
}  // namespace automoe::train
