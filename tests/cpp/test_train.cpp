// The trainer's building blocks: recipe validation, the learning-rate schedule, the dataset file
// reader, packing/padding into micro-batches, and the decoder's document_ids (packed documents do
// not see each other).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "automoe/core/error.h"
#include "automoe/model/decoder.h"
#include "automoe/train/dataset.h"
#include "automoe/train/recipe.h"
#include "automoe/train/step.h"
#include "amds_file.h"
#include "tiny_spec.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using automoe::testing::write_amds;

const char* kMinimal = R"({"model": {"path": "m"}, "data": {"train": "t.jsonl"},
                           "checkpoint": {"dir": "run"}})";

json minimal() { return json::parse(kMinimal); }

std::string error_of(const json& j) {
  try {
    Recipe::parse(j.dump(), "r.yaml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Recipe, DefaultsAreFilledIn) {
  const Recipe r = Recipe::parse(kMinimal, "r.yaml");
  EXPECT_EQ(r.model.dtype, "bfloat16");
  ASSERT_EQ(r.data.train.size(), 1u);
  EXPECT_EQ(r.data.train[0].path, "t.jsonl");
  EXPECT_TRUE(r.data.train[0].dataset.empty());
  EXPECT_FALSE(r.data.train[0].weight.has_value());
  EXPECT_EQ(r.data.num_proc, 0);
  EXPECT_EQ(r.data.validation_split, 0.0);
  EXPECT_EQ(r.data.seq_len, 2048);
  EXPECT_TRUE(r.data.packing);
  EXPECT_EQ(r.data.train_on, "completion");
  EXPECT_EQ(r.train.global_batch_size, 1);
  EXPECT_EQ(r.optimizer.lr, 1e-5);
  EXPECT_EQ(r.schedule.type, "cosine");
  EXPECT_EQ(r.checkpoint.keep_last, 2);
  EXPECT_TRUE(r.checkpoint.resume);
  // The resolved JSON parses back to the same recipe.
  const Recipe again = Recipe::parse(r.to_json(), "resolved");
  EXPECT_EQ(again.to_json(), r.to_json());
}

TEST(Recipe, UnknownKeysAndSectionsAreNamed) {
  json j = minimal();
  j["optimizer"]["learning_rate"] = 1e-4;
  EXPECT_NE(error_of(j).find("unknown key `optimizer.learning_rate`"), std::string::npos)
      << error_of(j);
  j = minimal();
  j["trainer"] = json::object();
  EXPECT_NE(error_of(j).find("unknown section `trainer`"), std::string::npos) << error_of(j);
}

void expect(const json& j, const std::string& needle) {
  const std::string e = error_of(j);
  EXPECT_NE(e.find(needle), std::string::npos) << "expected \"" << needle << "\" in: " << e;
}

TEST(Recipe, BadValuesNameTheKey) {
  json j = minimal();
  j["train"]["micro_batch_size"] = 0;
  expect(j, "train.micro_batch_size: expected >= 1, got 0");
  j = minimal();
  j["train"]["max_steps"] = "ten";
  expect(j, "train.max_steps: expected an integer");
  j = minimal();
  j["data"]["format"] = "sharegpt";
  expect(j, "data.format: \"sharegpt\" is not one of");
  j = minimal();
  j["optimizer"]["betas"] = {0.9, 1.5};
  expect(j, "optimizer.betas");
  j = minimal();
  j["model"]["backend"] = {{"experts", "magic"}};
  expect(j, "experts");
  j = minimal();
  j["data"].erase("train");
  expect(j, "data.train: required");
  j = minimal();
  j["train"]["max_steps"] = 1e30;
  expect(j, "train.max_steps: expected an integer up to 2^63");
  j = minimal();
  j["train"]["seed"] = 18446744073709551615ull;
  expect(j, "train.seed: expected an integer up to 2^63");
  j = minimal();
  j["data"]["validation"] = "";
  expect(j, "data.validation: expected a file path, a glob or a dataset id");
  j = minimal();
  j["train"]["device"] = "tpu";
  expect(j, "train.device");
  j = minimal();
  j["train"]["micro_batch_size"] = 3;
  j["train"]["global_batch_size"] = 8;
  expect(j, "not a multiple of train.micro_batch_size");
  j = minimal();
  j["train"]["micro_batch_size"] = 2;
  j["train"]["global_batch_size"] = 8;
  j["train"]["grad_accumulation_steps"] = 2;
  expect(j, "disagrees");
  j = minimal();
  j["optimizer"]["master_weights"] = "half";
  expect(j, "optimizer.master_weights: \"half\" is not one of");
  j = minimal();
  j["optimizer"]["state_dtype"] = "int8";
  expect(j, "optimizer.state_dtype: \"int8\" is not one of");
}

TEST(Recipe, DataSourcesTakePathsDatasetIdsAndMappingsAndRoundTrip) {
  json j = minimal();
  j["data"]["train"] = json::array(
      {"shards/*.parquet",
       {{"dataset", "org/chats"}, {"subset", "en"}, {"split", "train"}, {"weight", 3},
        {"columns", {{"messages", "conversations"}}}},
       {{"path", "qa.csv"}, {"format", "prompt_completion"},
        {"columns", {{"prompt", "question"}, {"completion", "answer"}}}}});
  j["data"]["validation_split"] = 0.05;
  j["data"]["num_proc"] = 3;
  const Recipe r = Recipe::parse(j.dump(), "r.yaml");
  ASSERT_EQ(r.data.train.size(), 3u);
  EXPECT_EQ(r.data.train[0].path, "shards/*.parquet");
  EXPECT_EQ(r.data.train[1].dataset, "org/chats");
  EXPECT_EQ(r.data.train[1].subset, "en");
  EXPECT_EQ(*r.data.train[1].weight, 3.0);
  EXPECT_EQ(r.data.train[1].columns.at("messages"), "conversations");
  EXPECT_EQ(r.data.train[2].format, "prompt_completion");
  EXPECT_EQ(r.data.num_proc, 3);
  const Recipe again = Recipe::parse(r.to_json(), "resolved");
  EXPECT_EQ(again.to_json(), r.to_json());
}

TEST(Recipe, BadDataSourcesNameTheSourceAndKey) {
  auto expect_source = [](json source, const char* message) {
    json j = minimal();
    j["data"]["train"] = json::array({"a.jsonl", source});
    expect(j, message);
  };
  expect_source({{"path", "a"}, {"dataset", "o/n"}}, "data.train[1]: give exactly one of path");
  expect_source({{"split", "train"}}, "data.train[1]: give exactly one of path");
  expect_source({{"path", "a"}, {"weight", 0}}, "data.train[1]: weight: expected a number in (0");
  expect_source({{"path", "a"}, {"subset", "en"}}, "subset and revision belong to a dataset");
  expect_source({{"path", "a"}, {"columns", {{"prompt", 3}}}}, "columns.prompt: expected a column");
  expect_source({{"path", "a"}, {"colums", {}}}, "data.train[1]: unknown key `colums`");
  expect_source({{"path", "a"}, {"format", "sharegpt"}}, "format: \"sharegpt\" is not one of");
  expect_source(7, "data.train[1]: expected a path, a dataset id or a mapping");
  json j = minimal();
  j["data"]["validation"] = "v.jsonl";
  j["data"]["validation_split"] = 0.1;
  expect(j, "data.validation_split: holds part of data.train out");
  j = minimal();
  j["data"]["train"] = json::array();
  expect(j, "data.train: required");
}

TEST(Recipe, OptimizerPrecisionIsRefusedWhereItMeansNothing) {
  auto error = [](const std::string& dtype, bool peft, const char* key, const char* value) {
    json j = minimal();
    j["model"]["dtype"] = dtype;
    if (peft) j["peft"] = {{"target_modules", "all-linear"}};
    j["optimizer"][key] = value;
    return error_of(j);
  };
  EXPECT_EQ(error("bfloat16", false, "master_weights", "remainders"), "");
  EXPECT_EQ(error("bfloat16", false, "state_dtype", "bfloat16"), "");
  EXPECT_NE(error("float32", false, "master_weights", "none")
                .find("optimizer.master_weights: \"none\" is for bf16 weights; model.dtype is float32"),
            std::string::npos);
  EXPECT_NE(error("bfloat16", true, "state_dtype", "bfloat16")
                .find("optimizer.state_dtype: \"bfloat16\" with peft"),
            std::string::npos);
}

TEST(Recipe, GlobalBatchSizeSetsAccumulation) {
  json j = minimal();
  j["train"]["micro_batch_size"] = 2;
  j["train"]["global_batch_size"] = 8;
  const Recipe r = Recipe::parse(j.dump(), "r");
  EXPECT_EQ(r.train.grad_accumulation_steps, 4);
}

TEST(Schedule, WarmupThenCosineLinearConstant) {
  OptimizerSection o;
  o.lr = 1.0;
  ScheduleSection s;
  s.warmup_steps = 4;
  s.min_lr_ratio = 0.1;
  s.type = "cosine";
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 0, 14), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 3, 14), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 4, 14), 1.0);                         // decay starts
  EXPECT_NEAR(learning_rate(o, s, 9, 14), 0.1 + 0.9 * 0.5, 1e-12);           // half way
  EXPECT_NEAR(learning_rate(o, s, 14, 14), 0.1, 1e-12);                      // floor
  s.type = "linear";
  EXPECT_NEAR(learning_rate(o, s, 9, 14), 0.1 + 0.9 * 0.5, 1e-12);
  EXPECT_NEAR(learning_rate(o, s, 6, 14), 0.1 + 0.9 * 0.8, 1e-12);
  s.type = "constant";
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 13, 14), 1.0);
  s.warmup_steps = 0;
  s.warmup_ratio = 0.5;  // of 14 steps -> 7
  EXPECT_DOUBLE_EQ(learning_rate(o, s, 0, 14), 1.0 / 7);
}

TEST(TokenDataset, RejectsCorruptFilesWithTheirName) {
  const std::string good = write_amds({{1, 2, 3}}, {{0, 1, 1}});
  EXPECT_EQ(TokenDataset(good).num_tokens(), 3);
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string bad = good + ".bad";
  std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() - 2);  // truncated
  try {
    TokenDataset d(bad);
    FAIL() << "a truncated dataset was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  std::ofstream(bad, std::ios::binary) << "AMDS9999" + bytes.substr(8);
  EXPECT_THROW(TokenDataset{bad}, Error);
  // A header whose counts would overflow a byte-size computation is refused, not trusted.
  {
    const std::string header = json{{"n_docs", (1ll << 61) - 1},
                                    {"n_tokens", 3},
                                    {"offsets_at", 1024},
                                    {"tokens_at", 1024},
                                    {"mask_at", 1024}}
                                   .dump();
    std::string crafted(2048, '\0');
    std::memcpy(crafted.data(), "AMDS0001", 8);
    const uint64_t hlen = header.size();
    std::memcpy(crafted.data() + 8, &hlen, 8);
    std::memcpy(crafted.data() + 16, header.data(), hlen);
    std::ofstream(bad, std::ios::binary) << crafted;
    EXPECT_THROW(TokenDataset{bad}, Error);
  }
  fs::remove(good);
  fs::remove(bad);
}

TEST(TokenDataset, RefusesNonIntegerHeaderFieldsAndUnmapsWhatItRefuses) {
  const std::string good = write_amds({{1, 2, 3}}, {{0, 1, 1}});
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data() + 8, 8);
  json header = json::parse(bytes.substr(16, hlen));
  const std::string bad = good + ".bad";
  // Floats in the header were converted silently (1.0 as 1; out of range, undefined behaviour).
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"n_docs", 1.0}, {"tokens_at", 1.99e20}, {"offsets_at", -1024}}) {
    json h = header;
    h[key] = value;
    std::string text = h.dump();
    ASSERT_LE(text.size(), 1024u - 16);
    std::string crafted = bytes;
    const uint64_t n = text.size();
    std::memcpy(crafted.data() + 8, &n, 8);
    std::memcpy(crafted.data() + 16, text.data(), n);
    std::ofstream(bad, std::ios::binary) << crafted;
    EXPECT_THROW(TokenDataset{bad}, Error) << key << " = " << value.dump();
  }
  // A refused file is unmapped (the destructor of a constructor that throws never runs).
  std::ofstream(bad, std::ios::binary) << "AMDS9999" + bytes.substr(8);
  for (int i = 0; i < 3; ++i) EXPECT_THROW(TokenDataset{bad}, Error);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    EXPECT_EQ(line.find(bad), std::string::npos) << line;
  }
  fs::remove(good);
  fs::remove(bad);
}

TEST(Batcher, PacksWholeDocumentsWithRestartingPositionsAndNoLossOnFirstTokens) {
  // Documents of 3, 4, 2 and 6 tokens; rows of 8.
  const std::string path = write_amds({{10, 11, 12}, {20, 21, 22, 23}, {30, 31}, {1, 2, 3, 4, 5, 6}},
                                      {{1, 1, 1}, {0, 0, 1, 1}, {1, 1}, {1, 1, 1, 1, 1, 1}});
  const TokenDataset data(path);
  const Batcher b(data, /*rows=*/2, /*seq_len=*/8, /*packing=*/true, /*shuffle=*/false, 0, 0);
  DataPosition pos;
  const MicroBatch mb = b.next(pos);
  // Row 0: docs 0 and 1 (7 tokens; doc 2 would overflow); row 1: doc 2 and doc 3 (8 tokens).
  ASSERT_EQ(mb.input_ids.sizes(), (at::IntArrayRef{2, 8}));
  EXPECT_TRUE(mb.input_ids[0].equal(at::tensor({10, 11, 12, 20, 21, 22, 23, 0}, at::kLong)));
  EXPECT_TRUE(mb.position_ids[0].equal(at::tensor({0, 1, 2, 0, 1, 2, 3, 0}, at::kLong)));
  EXPECT_TRUE(mb.document_ids[0].equal(at::tensor({0, 0, 0, 1, 1, 1, 1, -1}, at::kLong)));
  EXPECT_TRUE(mb.labels[0].equal(at::tensor({-100, 11, 12, -100, -100, 22, 23, -100}, at::kLong)));
  EXPECT_TRUE(mb.input_ids[1].equal(at::tensor({30, 31, 1, 2, 3, 4, 5, 6}, at::kLong)));
  EXPECT_TRUE(mb.document_ids[1].equal(at::tensor({0, 0, 1, 1, 1, 1, 1, 1}, at::kLong)));
  EXPECT_EQ(mb.loss_tokens, 4 + 1 + 5);
  EXPECT_EQ(mb.real_tokens, 15);
  EXPECT_EQ(mb.documents, 4);
  EXPECT_EQ(pos, (DataPosition{1, 0}));  // the epoch is used up: the next one starts
  b.next(pos);
  EXPECT_EQ(pos, (DataPosition{2, 0}));
  fs::remove(path);
}

TEST(Batcher, PadsOneDocumentPerRowAndTruncatesAtSeqLen) {
  const std::string path = write_amds({{1, 2, 3, 4, 5, 6, 7}, {8, 9}}, {{1, 1, 1, 1, 1, 1, 1}, {1, 1}});
  const TokenDataset data(path);
  const Batcher b(data, 2, /*seq_len=*/5, /*packing=*/false, false, 0, /*pad=*/99);
  DataPosition pos;
  const MicroBatch mb = b.next(pos);
  ASSERT_EQ(mb.input_ids.sizes(), (at::IntArrayRef{2, 5}));
  EXPECT_TRUE(mb.input_ids[0].equal(at::tensor({1, 2, 3, 4, 5}, at::kLong)));
  EXPECT_TRUE(mb.input_ids[1].equal(at::tensor({8, 9, 99, 99, 99}, at::kLong)));
  EXPECT_TRUE(mb.labels[1].equal(at::tensor({-100, 9, -100, -100, -100}, at::kLong)));
  EXPECT_TRUE(mb.document_ids[1].equal(at::tensor({0, 0, -1, -1, -1}, at::kLong)));
  EXPECT_EQ(mb.truncated, 1);
  fs::remove(path);
}

TEST(Batcher, OrderIsFixedBySeedAndEpochAndCountsMatchTheStream) {
  std::vector<std::vector<int32_t>> docs;
  std::vector<std::vector<uint8_t>> masks;
  for (int d = 0; d < 37; ++d) {
    docs.push_back(std::vector<int32_t>(1 + (d * 7) % 11, d));
    masks.push_back(std::vector<uint8_t>(docs.back().size(), 1));
  }
  const std::string path = write_amds(docs, masks);
  const TokenDataset data(path);
  const Batcher a(data, 3, 16, true, /*shuffle=*/true, /*seed=*/5, 0);
  const Batcher b(data, 3, 16, true, true, 5, 0);
  const Batcher c(data, 3, 16, true, true, 6, 0);
  DataPosition pa, pb, pc;
  bool differs = false;
  for (int i = 0; i < 10; ++i) {
    const MicroBatch x = a.next(pa), y = b.next(pb), z = c.next(pc);
    EXPECT_TRUE(x.input_ids.equal(y.input_ids));
    differs = differs || !x.input_ids.sizes().equals(z.input_ids.sizes()) ||
              !x.input_ids.equal(z.input_ids);
  }
  EXPECT_TRUE(differs) << "another seed gave the same order";
  // Resuming from a saved position gives the batch the uninterrupted stream gives.
  DataPosition saved = pa;
  const MicroBatch next_a = a.next(pa);
  EXPECT_TRUE(Batcher(data, 3, 16, true, true, 5, 0).next(saved).input_ids.equal(next_a.input_ids));
  // count_until agrees with stepping the stream.
  DataPosition p;
  int64_t n = 0;
  while (static_cast<double>(p.epoch) + static_cast<double>(p.cursor) / 37 < 2.0) {
    a.next(p);
    ++n;
  }
  EXPECT_EQ(a.count_until({}, 2.0), n);
  fs::remove(path);
}

using automoe::testing::tiny_spec;

TEST(DocumentIds, PackedDocumentsGiveTheLogitsOfSeparateForwards) {
  ModelSpec s = tiny_spec();
  s.set_moe_layers({true, true});
  at::manual_seed(0);
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::randn(d.shape) * 0.3);
  const Decoder model(s, {}, std::move(params));
  const at::Tensor a = at::randint(1, s.vocab_size, {1, 5}, at::kLong);
  const at::Tensor b = at::randint(1, s.vocab_size, {1, 4}, at::kLong);
  ForwardArgs packed;
  packed.input_ids = at::cat({a, b, at::zeros({1, 2}, at::kLong)}, 1);
  packed.position_ids = at::tensor({0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1}, at::kLong).view({1, 11});
  packed.document_ids = at::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1}, at::kLong).view({1, 11});
  packed.output_expert_counts = true;
  const ForwardResult rp = model.forward(packed);
  ForwardArgs fa;
  fa.input_ids = a;
  const at::Tensor la = model.forward(fa).logits;
  ForwardArgs fb;
  fb.input_ids = b;
  const at::Tensor lb = model.forward(fb).logits;
  EXPECT_TRUE(at::allclose(rp.logits.narrow(1, 0, 5), la, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(rp.logits.narrow(1, 5, 4), lb, 1e-5, 1e-6));
  // Expert counts see the 9 real tokens x top-2, not the padding.
  ASSERT_EQ(rp.expert_counts.size(), 2u);
  for (const auto& c : rp.expert_counts) EXPECT_EQ(c.sum().item<int64_t>(), 9 * 2);
  packed.attention_mask = at::ones({1, 11}, at::kLong);
  EXPECT_THROW(model.forward(packed), Error);
}

// optimizer.in_backward through the real hooks: a step whose backward meets a non-finite gradient
// after updating some tensors is skipped with every tensor's step count where it was (the one
// count a checkpoint records); a finite step then advances them all by one and updates every
// tensor, the one no gradient reached too (with a zero gradient, as the ordinary step).
TEST(OptimizerInBackward, SkippedStepsKeepOneStepCountAndFiniteStepsUpdateEverything) {
  at::manual_seed(3);
  TrainState s;
  NamedTensors masters;
  for (const char* n : {"a", "b", "c"}) masters.emplace_back(n, at::randn({4, 3}));
  s.opt.init(masters, {false, false, false}, /*own_grads=*/false);
  for (const auto& [n, t] : masters) {
    t.set_requires_grad(true);
    s.model_params.push_back(t);
  }
  OptimizerSection o;
  o.in_backward = true;
  o.max_grad_norm = 0;
  o.weight_decay = 0.1;
  const std::vector<at::Tensor> before{masters[0].second.detach().clone(),
                                       masters[1].second.detach().clone(),
                                       masters[2].second.detach().clone()};
  // Step 1: a finite loss whose gradient for b is NaN (sqrt's derivative at 0, times 0); a's
  // finite gradient is complete first (autograd runs the first operand's branch first here)
  // and is applied.
  begin_step(s, o, 1e-2);
  const at::Tensor loss1 = (s.model_params[0] * 2).sum() + at::sqrt(s.model_params[1] * 0).sum();
  backward_micro_batch(s, loss1, true);
  EXPECT_FALSE(std::isfinite(s.opt.grad_norm()));
  EXPECT_EQ(s.opt.updated_in_backward(), 1);  // a partly applied step
  EXPECT_FALSE(at::equal(s.model_params[0].detach(), before[0]));
  EXPECT_TRUE(at::equal(s.model_params[1].detach(), before[1]));  // never updated
  release_gradients(s);                                             // skipped
  for (const auto& st : s.opt.step) EXPECT_EQ(st.item<double>(), 0.0);
  // Step 2: finite; c gets no gradient and is updated after the backward (weight decay).
  begin_step(s, o, 1e-2);
  const at::Tensor a_before = s.model_params[0].detach().clone();
  backward_micro_batch(s, (s.model_params[0] * 3).sum() + s.model_params[1].sum(), true);
  EXPECT_EQ(s.opt.updated_in_backward(), 2);
  EXPECT_NEAR(s.opt.grad_norm(), std::sqrt(12 * 9.0 + 12 * 1.0), 1e-5);  // (float32 norms)
  update_weights(s, o, 1e-2);
  release_gradients(s);
  for (const auto& st : s.opt.step) EXPECT_EQ(st.item<double>(), 1.0);
  EXPECT_FALSE(at::equal(s.model_params[0].detach(), a_before));
  EXPECT_FALSE(at::equal(s.model_params[1].detach(), before[1]));
  EXPECT_TRUE(at::allclose(s.model_params[2].detach(), before[2] * (1 - 1e-2 * 0.1)));
  // A non-finite loss (here with finite gradients: inf * 0 is not in the graph) updates nothing.
  begin_step(s, o, 1e-2);
  const at::Tensor w_before = s.model_params[0].detach().clone();
  const at::Tensor loss3 = s.model_params[0].sum() + at::scalar_tensor(INFINITY);
  backward_micro_batch(s, loss3, true);
  EXPECT_EQ(s.opt.updated_in_backward(), 0);
  release_gradients(s);
  EXPECT_TRUE(at::equal(s.model_params[0].detach(), w_before));
  for (const auto& st : s.opt.step) EXPECT_EQ(st.item<double>(), 1.0);
}

}  // namespace
}  // namespace automoe::train

namespace automoe::train {
namespace {

TEST(ActivationCheckpointing, GivesTheSameLossAndGradients) {
  const ModelSpec s = tiny_spec();  // an MoE layer and a dense one
  for (const ExpertsBackend experts : {ExpertsBackend::kGrouped, ExpertsBackend::kEager}) {
    BackendConfig backend;
    backend.experts = experts;
    at::manual_seed(1);
    NamedTensors params;
    for (const auto& d : parameter_layout(s)) {
      params.emplace_back(d.name, (at::randn(d.shape, at::kDouble) * 0.3).requires_grad_(true));
    }
    const Decoder model(s, backend, params);
    ForwardArgs a;
    a.input_ids = at::randint(1, s.vocab_size, {2, 9}, at::kLong);
    a.labels = a.input_ids.clone();
    a.document_ids = at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, -1, -1},
                                at::kLong).view({2, 9});
    a.position_ids = at::tensor({0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1},
                                at::kLong).view({2, 9});
    a.output_router_logits = true;
    a.output_expert_counts = true;
    auto grads = [&](bool ckpt) {
      a.activation_checkpointing = ckpt;
      const ForwardResult r = model.forward(a);
      std::vector<at::Tensor> g;
      for (const auto& [n, t] : params) g.push_back(t);
      auto out = torch::autograd::grad({*r.loss}, g);
      out.push_back(r.loss->detach());
      out.push_back(r.expert_counts[0]);
      return out;
    };
    const auto plain = grads(false), ckpt = grads(true);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(at::allclose(plain[i], ckpt[i], 1e-12, 1e-12)) << "tensor " << i;
    }
  }
}

}  // namespace
}  // namespace automoe::train
