#include "automoe/train/recipe.h"

#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "automoe/core/error.h"
#include "automoe/train/run_dir.h"
#include "automoe/model/backend.h"

namespace automoe::train {
namespace {

using nlohmann::json;

const char* type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "a list";
  return "a mapping";
}

// One section of the recipe: typed getters that remember which keys were read, so that finish()
// can reject the rest by name.
class Section {
 public:
  Section(const json& root, const std::string& name, const std::string& origin)
      : name_(name), origin_(origin) {
    if (root.contains(name)) {
      obj_ = root.at(name);
      AUTOMOE_CHECK(obj_.is_object() || obj_.is_null(), origin_, ": `", name_,
                    "` must be a mapping, got ", type_name(obj_));
      if (obj_.is_null()) obj_ = json::object();
    } else {
      obj_ = json::object();
    }
  }

  bool has(const std::string& key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  std::string key(const std::string& k) const { return name_ + "." + k; }

  const json* raw(const std::string& k) {
    seen_.insert(k);
    return has(k) ? &obj_.at(k) : nullptr;
  }

  std::string str(const std::string& k, std::string def, std::set<std::string> allowed = {}) {
    if (const json* v = raw(k)) {
      AUTOMOE_CHECK(v->is_string(), where(k), "expected a string, got ", type_name(*v));
      def = v->get<std::string>();
    }
    if (!allowed.empty() && !allowed.count(def)) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      fail(where(k), "\"", def, "\" is not one of: ", list);
    }
    return def;
  }

  int64_t integer(const std::string& k, int64_t def, int64_t min, int64_t max = INT64_MAX) {
    if (const json* v = raw(k)) {
      const bool integral = v->is_number_integer() ||
                            (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>());
      AUTOMOE_CHECK(v->is_number() && !v->is_boolean() && integral, where(k),
                    "expected an integer, got ", v->dump());
      const bool in_range =
          v->is_number_float()     ? std::fabs(v->get<double>()) < 9.2e18
          : v->is_number_unsigned() ? v->get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
                                    : true;
      AUTOMOE_CHECK(in_range, where(k), "expected an integer up to 2^63, got ", v->dump());
      def = v->is_number_float() ? static_cast<int64_t>(v->get<double>()) : v->get<int64_t>();
    }
    AUTOMOE_CHECK(def >= min, where(k), "expected >= ", min, ", got ", def);
    AUTOMOE_CHECK(def <= max, where(k), "expected <= ", max, ", got ", def);
    return def;
  }

  double number(const std::string& k, double def, double min, double max, bool open_min = false) {
    if (const json* v = raw(k)) {
      AUTOMOE_CHECK(v->is_number() && !v->is_boolean(), where(k), "expected a number, got ",
                    v->dump());
      def = v->get<double>();
    }
    AUTOMOE_CHECK(std::isfinite(def) && (open_min ? def > min : def >= min) && def <= max, where(k),
                  "expected a number in ", open_min ? "(" : "[", min, ", ", max, "], got ", def);
    return def;
  }

  bool boolean(const std::string& k, bool def) {
    if (const json* v = raw(k)) {
      AUTOMOE_CHECK(v->is_boolean(), where(k), "expected true or false, got ", v->dump());
      def = v->get<bool>();
    }
    return def;
  }

  // One string or a list of non-empty strings (`what` names one in errors).
  std::vector<std::string> strings(const std::string& k, const std::string& what) {
    std::vector<std::string> out;
    const json* v = raw(k);
    if (!v) return out;
    if (v->is_string()) {
      AUTOMOE_CHECK(!v->get<std::string>().empty(), where(k), "expected a ", what, ", got \"\"");
      return {v->get<std::string>()};
    }
    AUTOMOE_CHECK(v->is_array(), where(k), "expected a ", what, " or a list of them, got ",
                  type_name(*v));
    for (const auto& e : *v) {
      AUTOMOE_CHECK(e.is_string() && !e.get<std::string>().empty(), where(k), "expected a ", what,
                    ", got ", e.dump());
      out.push_back(e.get<std::string>());
    }
    return out;
  }

  std::string where(const std::string& k) const { return origin_ + ": " + key(k) + ": "; }

  void finish() const {
    for (const auto& [k, v] : obj_.items()) {
      if (seen_.count(k)) continue;
      std::string known;
      for (const auto& s : seen_) known += (known.empty() ? "" : ", ") + s;
      fail(origin_, ": unknown key `", key(k), "` (", name_, " takes: ", known, ")");
    }
  }

 private:
  json obj_;
  std::string name_, origin_;
  std::set<std::string> seen_;
};

// The recipe document as a mapping of known sections.
json parse_root(const std::string& json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(origin, ": not a valid recipe document: ", e.what());
  }
  AUTOMOE_CHECK(root.is_object(), origin, ": a recipe is a mapping of sections, got ",
                type_name(root));
  const std::set<std::string> sections = {"model",      "data", "train",  "optimizer", "schedule",
                                          "checkpoint", "log",  "router", "parallel",  "peft"};
  for (const auto& [k, v] : root.items()) {
    if (!sections.count(k)) {
      fail(origin, ": unknown section `", k,
           "` (a recipe has: model, data, train, optimizer, schedule, checkpoint, log, "
           "router, parallel, peft)");
    }
  }
  return root;
}

void parse_model(const json& root, const std::string& origin, ModelSection& model) {
  Section m(root, "model", origin);
  model.path = m.str("path", "");
  AUTOMOE_CHECK(!model.path.empty(), m.where("path"),
                "required: the Hugging Face checkpoint directory to fine-tune");
  model.dtype = m.str("dtype", model.dtype, {"float32", "bfloat16"});
  model.quantize = m.str("quantize", model.quantize, {"none", "nf4", "fp4", "int8"});
  if (m.has("quantize_blocksize")) {
    model.quantize_blocksize = m.integer("quantize_blocksize", 64, 32, 4096);
    const int64_t b = model.quantize_blocksize;
    AUTOMOE_CHECK((b & (b - 1)) == 0, m.where("quantize_blocksize"),
                  "expected a power of two from 32 to 4096 (bitsandbytes' block sizes), got ", b);
    AUTOMOE_CHECK(model.quantize == "nf4" || model.quantize == "fp4", m.where("quantize_blocksize"),
                  "is for 4-bit quantisation (model.quantize nf4 or fp4); model.quantize is ",
                  model.quantize, " (int8 has one scale per row)");
  }
  if (const json* b = m.raw("backend")) {
    AUTOMOE_CHECK(b->is_object(), m.where("backend"), "expected a mapping, got ", type_name(*b));
    for (const auto& [k, v] : b->items()) {
      AUTOMOE_CHECK(v.is_string() || v.is_boolean(), m.where("backend"), k,
                    ": expected a string, got ", v.dump());
      model.backend[k] = v.is_string() ? v.get<std::string>() : (v.get<bool>() ? "true" : "false");
    }
    BackendConfig::from_map(model.backend, origin + ": model.backend");  // validates
  }
  if (m.has("router_aux_loss_coef")) {
    model.router_aux_loss_coef = m.number("router_aux_loss_coef", 0, 0, 1e6);
  } else {
    m.raw("router_aux_loss_coef");
  }
  m.finish();
}

const std::set<std::string> kDataFormats = {"auto", "chat", "prompt_completion", "alpaca", "text"};

// One data source: a non-empty string (a local path or glob, or a hub dataset id) or a mapping.
DataSource parse_source(const json& v, const std::string& where) {
  DataSource s;
  if (v.is_string()) {
    s.path = v.get<std::string>();
    AUTOMOE_CHECK(!s.path.empty(), where, "expected a file path, a glob or a dataset id, got \"\"");
    return s;
  }
  AUTOMOE_CHECK(v.is_object(), where,
                "expected a path, a dataset id or a mapping (path: or dataset:, ...), got ",
                type_name(v));
  static const std::set<std::string> keys = {"path",     "dataset", "subset", "split",
                                             "revision", "columns", "weight", "format"};
  for (const auto& [k, x] : v.items()) {
    AUTOMOE_CHECK(keys.count(k), where, "unknown key `", k,
                  "` (a source takes: columns, dataset, format, path, revision, split, subset, "
                  "weight)");
    if (x.is_null()) continue;
    if (k == "columns") {
      AUTOMOE_CHECK(x.is_object(), where, "columns: expected a mapping of format field to the "
                    "source's column, got ", type_name(x));
      for (const auto& [field, col] : x.items()) {
        AUTOMOE_CHECK(col.is_string() && !col.get<std::string>().empty(), where, "columns.", field,
                      ": expected a column name, got ", col.dump());
        s.columns[field] = col.get<std::string>();
      }
    } else if (k == "weight") {
      AUTOMOE_CHECK(x.is_number() && !x.is_boolean() && std::isfinite(x.get<double>()) &&
                        x.get<double>() > 0 && x.get<double>() <= 1e6,
                    where, "weight: expected a number in (0, 1e6], got ", x.dump());
      s.weight = x.get<double>();
    } else {
      AUTOMOE_CHECK(x.is_string(), where, k, ": expected a string, got ", type_name(x));
      const std::string t = x.get<std::string>();
      if (k == "path") s.path = t;
      if (k == "dataset") s.dataset = t;
      if (k == "subset") s.subset = t;
      if (k == "split") s.split = t;
      if (k == "revision") s.revision = t;
      if (k == "format") {
        AUTOMOE_CHECK(kDataFormats.count(t), where, "format: \"", t,
                      "\" is not one of: alpaca, auto, chat, prompt_completion, text");
        s.format = t;
      }
    }
  }
  AUTOMOE_CHECK(s.path.empty() != s.dataset.empty(), where,
                "give exactly one of path: (a local file, directory or glob) and dataset: (a "
                "Hugging Face dataset id)");
  AUTOMOE_CHECK(!s.dataset.empty() || (s.subset.empty() && s.revision.empty()), where,
                "subset and revision belong to a dataset: source, not to path: ", s.path);
  return s;
}

std::vector<DataSource> parse_sources(Section& d, const std::string& k) {
  std::vector<DataSource> out;
  const json* v = d.raw(k);
  if (!v) return out;
  if (!v->is_array()) return {parse_source(*v, d.where(k))};
  for (size_t i = 0; i < v->size(); ++i) {
    out.push_back(parse_source(v->at(i), d.where(k + "[" + std::to_string(i) + "]")));
  }
  return out;
}

json source_json(const DataSource& s) {
  json j = json::object();
  if (!s.path.empty()) j["path"] = s.path;
  if (!s.dataset.empty()) j["dataset"] = s.dataset;
  if (!s.subset.empty()) j["subset"] = s.subset;
  if (!s.split.empty()) j["split"] = s.split;
  if (!s.revision.empty()) j["revision"] = s.revision;
  if (!s.columns.empty()) j["columns"] = s.columns;
  if (s.weight) j["weight"] = *s.weight;
  if (!s.format.empty()) j["format"] = s.format;
  return j;
}

json sources_json(const std::vector<DataSource>& v) {
  json j = json::array();
  for (const auto& s : v) j.push_back(source_json(s));
  return j;
}

void parse_data(const json& root, const std::string& origin, DataSection& data) {
  Section d(root, "data", origin);
  data.train = parse_sources(d, "train");
  AUTOMOE_CHECK(!data.train.empty(), d.where("train"),
                "required: the training data (a file, a directory or glob of shards, a dataset "
                "id, or a list of them)");
  data.validation = parse_sources(d, "validation");
  data.format = d.str("format", data.format, kDataFormats);
  data.seq_len = d.integer("seq_len", data.seq_len, 2, kMaxSeqLen);
  data.packing = d.boolean("packing", data.packing);
  data.train_on = d.str("train_on", data.train_on, {"completion", "all"});
  data.on_error = d.str("on_error", data.on_error, {"fail", "skip"});
  data.shuffle = d.boolean("shuffle", data.shuffle);
  data.cache_dir = d.str("cache_dir", "");
  data.num_proc = d.integer("num_proc", 0, 0, kMaxThreads);
  data.validation_split = d.number("validation_split", 0.0, 0.0, 0.5);
  AUTOMOE_CHECK(data.validation_split == 0.0 || data.validation.empty(), d.where("validation_split"),
                "holds part of data.train out for validation, but data.validation is given too; "
                "use one of them");
  data.max_samples = d.integer("max_samples", 0, 0);
  d.finish();
}

// (`seq_len`: data.seq_len, which bounds the micro-batch.)
void parse_train(const json& root, const std::string& origin, int64_t seq_len,
                 TrainSection& train) {
  Section t(root, "train", origin);
  // Bounds on what sizes memory and threads, so that a typo is refused before anything is
  // allocated (micro-batches are built one at a time, so a long accumulation costs time only).
  train.micro_batch_size = t.integer("micro_batch_size", 1, 1, kMaxMicroBatchTokens);
  AUTOMOE_CHECK(train.micro_batch_size * seq_len <= kMaxMicroBatchTokens,
                t.where("micro_batch_size"), train.micro_batch_size, " rows of data.seq_len ",
                seq_len, " tokens is more than ", kMaxMicroBatchTokens,
                " tokens in one forward; use gradient accumulation (train.global_batch_size)");
  const bool has_accum = t.has("grad_accumulation_steps");
  train.grad_accumulation_steps = t.integer("grad_accumulation_steps", 1, 1, kMaxAccumulation);
  train.global_batch_size =
      t.integer("global_batch_size", 0, 0, kMaxAccumulation * train.micro_batch_size);
  if (train.global_batch_size > 0) {
    const int64_t mb = train.micro_batch_size;
    AUTOMOE_CHECK(train.global_batch_size % mb == 0, t.where("global_batch_size"),
                  train.global_batch_size, " is not a multiple of train.micro_batch_size (", mb,
                  ")");
    const int64_t accum = train.global_batch_size / mb;
    AUTOMOE_CHECK(!has_accum || accum == train.grad_accumulation_steps,
                  t.where("global_batch_size"), train.global_batch_size,
                  " disagrees with train.micro_batch_size x train.grad_accumulation_steps = ",
                  mb * train.grad_accumulation_steps, "; give one or the other");
    train.grad_accumulation_steps = accum;
  }
  train.global_batch_size = train.micro_batch_size * train.grad_accumulation_steps;
  train.max_steps = t.integer("max_steps", 0, 0);
  train.epochs = t.number("epochs", 1.0, 0.0, 1e6, /*open_min=*/true);
  train.seed = static_cast<uint64_t>(t.integer("seed", 42, 0));
  train.eval_every = t.integer("eval_every", 0, 0);
  train.max_nonfinite_steps = t.integer("max_nonfinite_steps", 5, 1);
  train.activation_checkpointing = t.boolean("activation_checkpointing", false);
  train.device = t.str("device", "auto");
  {
    const std::string& dev = train.device;
    const bool ok = dev == "auto" || dev == "cpu" || dev == "cuda" ||
                    (dev.rfind("cuda:", 0) == 0 && dev.size() > 5 &&
                     dev.find_first_not_of("0123456789", 5) == std::string::npos);
    AUTOMOE_CHECK(ok, t.where("device"), "expected auto, cpu, cuda or cuda:N, got \"", dev, "\"");
  }
  train.threads = t.integer("threads", 0, 0, kMaxThreads);
  train.force = t.boolean("force", false);
  t.finish();
}

// (`grad_accumulation_steps`: train.grad_accumulation_steps, which in_backward needs to be 1.)
void parse_optimizer(const json& root, const std::string& origin, int64_t grad_accumulation_steps,
                     OptimizerSection& optimizer) {
  Section o(root, "optimizer", origin);
  optimizer.name = o.str("name", "adamw", {"adamw"});
  optimizer.lr = o.number("lr", optimizer.lr, 0.0, 10.0, /*open_min=*/true);
  if (const json* b = o.raw("betas")) {
    AUTOMOE_CHECK(b->is_array() && b->size() == 2 && (*b)[0].is_number() && (*b)[1].is_number(),
                  o.where("betas"), "expected [beta1, beta2], got ", b->dump());
    optimizer.beta1 = (*b)[0].get<double>();
    optimizer.beta2 = (*b)[1].get<double>();
    for (double beta : {optimizer.beta1, optimizer.beta2}) {
      AUTOMOE_CHECK(beta >= 0 && beta < 1, o.where("betas"), "each beta must be in [0, 1), got ",
                    b->dump());
    }
  }
  optimizer.eps = o.number("eps", optimizer.eps, 0.0, 1.0, /*open_min=*/true);
  optimizer.weight_decay = o.number("weight_decay", 0.0, 0.0, 1.0);
  optimizer.max_grad_norm = o.number("max_grad_norm", 1.0, 0.0, 1e12);
  optimizer.master_weights =
      o.str("master_weights", optimizer.master_weights, {"auto", "float32", "remainders", "none"});
  optimizer.state_dtype =
      o.str("state_dtype", optimizer.state_dtype, {"auto", "float32", "bfloat16", "8bit"});
  optimizer.in_backward = o.boolean("in_backward", false);
  if (optimizer.in_backward) {
    // The update of the first tensor whose gradient is complete cannot wait for the others'.
    AUTOMOE_CHECK(optimizer.max_grad_norm == 0, o.where("in_backward"),
                  "clipping needs the global gradient norm before any tensor is updated; with "
                  "in_backward: true set optimizer.max_grad_norm: 0 (it is ",
                  optimizer.max_grad_norm, ")");
    AUTOMOE_CHECK(grad_accumulation_steps == 1, o.where("in_backward"),
                  "each tensor is updated by the backward that completes its gradient, so a step "
                  "is one micro-batch; train.grad_accumulation_steps is ",
                  grad_accumulation_steps,
                  " (raise train.micro_batch_size instead, or drop in_backward)");
  }
  o.finish();
}

void parse_schedule(const json& root, const std::string& origin, ScheduleSection& schedule) {
  Section s(root, "schedule", origin);
  schedule.type = s.str("type", "cosine", {"cosine", "linear", "constant"});
  schedule.warmup_steps = s.integer("warmup_steps", 0, 0);
  schedule.warmup_ratio = s.number("warmup_ratio", 0.0, 0.0, 1.0);
  AUTOMOE_CHECK(schedule.warmup_steps == 0 || schedule.warmup_ratio == 0, s.where("warmup_ratio"),
                "give schedule.warmup_steps or schedule.warmup_ratio, not both");
  schedule.min_lr_ratio = s.number("min_lr_ratio", 0.0, 0.0, 1.0);
  s.finish();
}

void parse_checkpoint(const json& root, const std::string& origin, CheckpointSection& checkpoint) {
  Section c(root, "checkpoint", origin);
  checkpoint.dir = c.str("dir", "");
  AUTOMOE_CHECK(!checkpoint.dir.empty(), c.where("dir"),
                "required: the run directory (checkpoints, metrics and the exported model)");
  checkpoint.every = c.integer("every", 0, 0);
  checkpoint.keep_last = c.integer("keep_last", 2, 1);
  checkpoint.resume = c.boolean("resume", true);
  checkpoint.resume_from = c.str("resume_from", "");
  AUTOMOE_CHECK(checkpoint.resume_from.empty() || step_of(checkpoint.resume_from),
                c.where("resume_from"), "expected a checkpoint's name, step-N, got \"",
                checkpoint.resume_from, "\"");
  AUTOMOE_CHECK(checkpoint.resume_from.empty() || checkpoint.resume, c.where("resume_from"),
                "names a checkpoint to resume from, but checkpoint.resume is false");
  checkpoint.export_layout = c.str("export_layout", "source", {"source", "per-expert", "fused"});
  checkpoint.export_dtype = c.str("export_dtype", "auto", {"auto", "float32", "bfloat16"});
  c.finish();
}

void parse_log(const json& root, const std::string& origin, LogSection& log) {
  Section l(root, "log", origin);
  log.every = l.integer("every", 10, 1);
  log.jsonl = l.str("jsonl", "");
  log.tensorboard = l.str("tensorboard", "");
  log.peak_tflops = l.number("peak_tflops", 0.0, 0.0, 1e9);
  log.progress = l.str("progress", "auto", {"auto", "bar", "lines", "off"});
  l.finish();
}

void parse_router(const json& root, const std::string& origin, RouterSection& router) {
  Section rt(root, "router", origin);
  router.bias_update_rate = rt.number("bias_update_rate", 0.0, 0.0, 1.0);
  rt.finish();
}

void parse_parallel(const json& root, const std::string& origin, ParallelSection& parallel) {
  Section pa(root, "parallel", origin);
  parallel.ep = pa.integer("ep", 1, 1);
  if (const json* dp = pa.raw("dp"); dp && dp->is_string()) {
    AUTOMOE_CHECK(dp->get<std::string>() == "auto", pa.where("dp"),
                  "expected a positive integer or \"auto\", got \"", dp->get<std::string>(), "\"");
  } else if (dp) {
    parallel.dp = pa.integer("dp", 0, 1);
  }
  parallel.zero = pa.integer("zero", 1, 0);
  AUTOMOE_CHECK(parallel.zero <= 2, pa.where("zero"), parallel.zero,
                ": expected 0 (optimizer state whole), 1 (float32 masters and AdamW moments of "
                "every replicated tensor sharded over its replicas) or 2 (their gradients too); "
                "ZeRO-3 (sharded weights) is not implemented");
  parallel.bucket_mb = pa.number("bucket_mb", 32.0, 0.0, 1e6, /*open_min=*/true);
  parallel.timeout_s = pa.number("timeout_s", 600.0, 0.0, 1e7, /*open_min=*/true);
  pa.finish();
}

// The section is there (not null): LoRA is on.
void parse_peft(const json& root, const std::string& origin, PeftSection& peft) {
  Section pe(root, "peft", origin);
  peft.enabled = true;
  peft.r = pe.integer("r", 8, 1);
  peft.lora_alpha = pe.number("lora_alpha", 16.0, 0.0, 1e9, /*open_min=*/true);
  peft.lora_dropout = pe.number("lora_dropout", 0.0, 0.0, 0.99);
  peft.use_rslora = pe.boolean("use_rslora", false);
  if (const json* t = pe.raw("target_modules")) {
    if (t->is_string()) {
      const std::string v = t->get<std::string>();
      if (v == "all-linear") {
        peft.target_modules = {v};
      } else {
        peft.target_modules_regex = v;
      }
      AUTOMOE_CHECK(!v.empty(), pe.where("target_modules"),
                    "expected module names or a regular expression");
    } else {
      peft.target_modules = pe.strings("target_modules", "module name");
    }
  }
  peft.target_parameters = pe.strings("target_parameters", "parameter name");
  AUTOMOE_CHECK(!peft.target_modules.empty() || !peft.target_modules_regex.empty() ||
                    !peft.target_parameters.empty(),
                pe.where("target_modules"),
                "say which weights get adapters: target_modules (e.g. [q_proj, k_proj, v_proj, "
                "o_proj] or all-linear) and/or target_parameters (the routed experts: "
                "[mlp.experts.gate_up_proj, mlp.experts.down_proj])");
  peft.moe_rank_scaling = pe.boolean("moe_rank_scaling", false);
  peft.export_merged = pe.boolean("export_merged", false);
  pe.finish();
}

// The checks that read several sections.
void check_across_sections(const Recipe& r, const std::string& origin) {
  // The optimizer's precision options are about bf16 weights trained in full: refused by name
  // where they would mean nothing (float32 weights are their own masters; LoRA's adapters are
  // float32).
  for (const auto& [key, value, def] :
       {std::tuple{"master_weights", r.optimizer.master_weights, "float32"},
        std::tuple{"state_dtype", r.optimizer.state_dtype, "float32"}}) {
    if (value == def || value == "auto") continue;
    AUTOMOE_CHECK(r.model.dtype == "bfloat16", origin, ": optimizer.", key, ": \"", value,
                  "\" is for bf16 weights; model.dtype is ", r.model.dtype,
                  " (float32 weights are their own float32 masters): remove the key");
    AUTOMOE_CHECK(!r.peft.enabled, origin, ": optimizer.", key, ": \"", value,
                  "\" with peft: LoRA's adapters train in float32 (the frozen base has no "
                  "optimizer state); remove the key");
  }
  AUTOMOE_CHECK(r.model.quantize == "none" || r.peft.enabled, origin, ": model.quantize: ",
                r.model.quantize, " holds the base frozen and quantised: it trains only with a "
                "peft: section (LoRA adapters); remove the key to train the whole model");
  AUTOMOE_CHECK(
      !(r.optimizer.in_backward && r.peft.enabled), origin,
      ": optimizer.in_backward with peft: LoRA's adapter gradients are a few MB, there is "
      "nothing to save by updating in the backward; remove the key");
}

}  // namespace

OptimizerSection resolve_precision(const Recipe& rc, int64_t world,
                                   const std::string& resumed_masters,
                                   const std::string& resumed_state) {
  OptimizerSection o = rc.optimizer;
  const bool lean = rc.model.dtype == "bfloat16" && !rc.peft.enabled &&
                    (world <= 1 || rc.parallel.zero == 0);
  if (o.master_weights == "auto") {
    o.master_weights = !resumed_masters.empty() ? resumed_masters : lean ? "remainders" : "float32";
  }
  if (o.state_dtype == "auto") {
    o.state_dtype = !resumed_state.empty() ? resumed_state : lean ? "8bit" : "float32";
  }
  return o;
}

Recipe Recipe::parse(const std::string& json_text, const std::string& origin) {
  const json root = parse_root(json_text, origin);
  Recipe r;
  parse_model(root, origin, r.model);
  parse_data(root, origin, r.data);
  parse_train(root, origin, r.data.seq_len, r.train);
  parse_optimizer(root, origin, r.train.grad_accumulation_steps, r.optimizer);
  parse_schedule(root, origin, r.schedule);
  parse_checkpoint(root, origin, r.checkpoint);
  parse_log(root, origin, r.log);
  parse_router(root, origin, r.router);
  parse_parallel(root, origin, r.parallel);
  if (root.contains("peft") && !root.at("peft").is_null()) parse_peft(root, origin, r.peft);
  check_across_sections(r, origin);
  return r;
}

std::string Recipe::to_json() const {
  json j;
  j["model"] = {{"path", model.path}, {"dtype", model.dtype}, {"backend", model.backend},
                {"router_aux_loss_coef", model.router_aux_loss_coef
                                             ? json(*model.router_aux_loss_coef)
                                             : json(nullptr)},
                {"quantize", model.quantize}};
  if (model.quantize == "nf4" || model.quantize == "fp4") {
    j["model"]["quantize_blocksize"] = model.quantize_blocksize;
  }
  j["data"] = {{"train", sources_json(data.train)},
               {"validation", sources_json(data.validation)},
               {"num_proc", data.num_proc},
               {"validation_split", data.validation_split},
               {"max_samples", data.max_samples},
               {"format", data.format},     {"seq_len", data.seq_len},
               {"packing", data.packing},   {"train_on", data.train_on},
               {"on_error", data.on_error}, {"shuffle", data.shuffle},
               {"cache_dir", data.cache_dir}};
  j["train"] = {{"micro_batch_size", train.micro_batch_size},
                {"grad_accumulation_steps", train.grad_accumulation_steps},
                {"global_batch_size", train.global_batch_size},
                {"max_steps", train.max_steps},
                {"epochs", train.epochs},
                {"seed", train.seed},
                {"eval_every", train.eval_every},
                {"max_nonfinite_steps", train.max_nonfinite_steps},
                {"activation_checkpointing", train.activation_checkpointing},
                {"device", train.device},
                {"threads", train.threads},
                {"force", train.force}};
  j["optimizer"] = {{"name", optimizer.name},
                    {"lr", optimizer.lr},
                    {"betas", {optimizer.beta1, optimizer.beta2}},
                    {"eps", optimizer.eps},
                    {"weight_decay", optimizer.weight_decay},
                    {"max_grad_norm", optimizer.max_grad_norm},
                    {"master_weights", optimizer.master_weights},
                    {"state_dtype", optimizer.state_dtype},
                    {"in_backward", optimizer.in_backward}};
  j["schedule"] = {{"type", schedule.type},
                   {"warmup_steps", schedule.warmup_steps},
                   {"warmup_ratio", schedule.warmup_ratio},
                   {"min_lr_ratio", schedule.min_lr_ratio}};
  j["checkpoint"] = {{"dir", checkpoint.dir},
                     {"every", checkpoint.every},
                     {"keep_last", checkpoint.keep_last},
                     {"resume", checkpoint.resume},
                     {"resume_from", checkpoint.resume_from},
                     {"export_layout", checkpoint.export_layout},
                     {"export_dtype", checkpoint.export_dtype}};
  j["log"] = {{"every", log.every},
              {"jsonl", log.jsonl},
              {"tensorboard", log.tensorboard},
              {"peak_tflops", log.peak_tflops},
              {"progress", log.progress}};
  j["router"] = {{"bias_update_rate", router.bias_update_rate}};
  j["parallel"] = {{"ep", parallel.ep},
                   {"dp", parallel.dp > 0 ? json(parallel.dp) : json("auto")},
                   {"zero", parallel.zero},
                   {"bucket_mb", parallel.bucket_mb},
                   {"timeout_s", parallel.timeout_s}};
  if (peft.enabled) {
    j["peft"] = {{"r", peft.r},
                 {"lora_alpha", peft.lora_alpha},
                 {"lora_dropout", peft.lora_dropout},
                 {"use_rslora", peft.use_rslora},
                 {"target_modules", peft.target_modules_regex.empty()
                                        ? json(peft.target_modules)
                                        : json(peft.target_modules_regex)},
                 {"target_parameters", peft.target_parameters},
                 {"moe_rank_scaling", peft.moe_rank_scaling},
                 {"export_merged", peft.export_merged}};
  }
  return j.dump(2);
}

double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int64_t step,
                     int64_t total) {
  const int64_t warmup =
      sched.warmup_steps > 0 ? sched.warmup_steps
                             : static_cast<int64_t>(std::ceil(sched.warmup_ratio * total));
  // Linear warm-up: step i < warmup trains at lr * (i + 1) / warmup, so step warmup - 1 is the
  // first at the full rate. The decay then runs over the remaining steps; like Transformers'
  // schedules, its last step is one step short of the floor (lr * min_lr_ratio).
  if (step < warmup) return opt.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (sched.type == "constant") return opt.lr;
  const double span = static_cast<double>(std::max<int64_t>(total - warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  const double floor = sched.min_lr_ratio;
  const double shape = sched.type == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress))
                                              : 1.0 - progress;
  return opt.lr * (floor + (1.0 - floor) * shape);
}

}  // namespace automoe::train
