#include "automoe/model/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/safetensors.h"

namespace automoe {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The PEFT version whose file format the export follows (requirements.txt pins it).
constexpr const char* kPeftVersion = "0.21.2";

enum class Kind { kLinear, kExperts, kRouter, kEmbedding, kLmHead };

struct Candidate {
  size_t index;  // in the parameter layout
  Kind kind;
  std::string module, param;
};

std::string strip_suffix(const std::string& name, const std::string& suffix) {
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0
             ? name.substr(0, name.size() - suffix.size())
             : name;
}

bool ends_with_component(const std::string& key, const std::string& entry) {
  if (key == entry) return true;
  return key.size() > entry.size() + 1 &&
         key.compare(key.size() - entry.size(), entry.size(), entry) == 0 &&
         key[key.size() - entry.size() - 1] == '.';
}

// Every weight a LoRA target could name, with what it is.
std::vector<Candidate> candidates(const ModelSpec& spec, const std::vector<ParamDecl>& layout) {
  std::vector<ParamDecl> decls;
  const ModelSlots slots = declare_model(spec, &decls);
  std::vector<Candidate> out;
  auto add = [&](int64_t i, Kind kind) {
    if (i < 0) return;
    const std::string& name = layout[i].name;
    if (kind == Kind::kExperts) {
      const size_t dot = name.rfind('.');
      out.push_back({static_cast<size_t>(i), kind, name.substr(0, dot), name.substr(dot + 1)});
    } else {
      out.push_back({static_cast<size_t>(i), kind, strip_suffix(name, ".weight"), "weight"});
    }
  };
  add(slots.embed, Kind::kEmbedding);
  for (const LayerSlots& L : slots.layers) {
    const AttentionSlots& A = L.attn;
    for (int64_t i : {A.q, A.q_a, A.q_b, A.kv_a, A.kv_b, A.k, A.v, A.o}) add(i, Kind::kLinear);
    // Mamba-2's in_proj; not its out_proj (nor conv1d), which PEFT refuses on Mamba models.
    add(L.mamba.in_proj, Kind::kLinear);
    // Gated DeltaNet's projections (not conv1d, which PEFT wraps as a Conv1d we do not run).
    const DeltaNetSlots& G = L.deltanet;
    for (int64_t i : {G.in_proj_qkvz, G.in_proj_ba, G.in_proj_qkv, G.in_proj_z, G.in_proj_b,
                      G.in_proj_a, G.out_proj}) {
      add(i, Kind::kLinear);
    }
    if (L.moe) {
      const MoESlots& M = L.experts;
      add(M.router, Kind::kRouter);
      add(M.gate_up, Kind::kExperts);
      add(M.down, Kind::kExperts);
      for (int64_t i : {M.shared.gate, M.shared.up, M.shared.down, M.shared_gate, M.latent_in,
                        M.latent_out}) {
        add(i, Kind::kLinear);
      }
    } else {
      for (int64_t i : {L.mlp.gate, L.mlp.up, L.mlp.down}) add(i, Kind::kLinear);
    }
  }
  if (slots.lm_head != slots.embed) add(slots.lm_head, Kind::kLmHead);
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.index < b.index; });
  return out;
}

const char* refused_what(Kind k) {
  switch (k) {
    case Kind::kRouter: return "a router";
    case Kind::kEmbedding: return "the input embedding";
    case Kind::kLmHead: return "the LM head";
    default: return "";
  }
}

// PEFT's get_pattern_key: the first key k (in the config's order) with name matching (.*\.)?(k)$.
template <class Patterns>
typename Patterns::const_iterator pattern_of(const Patterns& patterns, const std::string& name) {
  for (auto it = patterns.begin(); it != patterns.end(); ++it) {
    try {
      if (std::regex_match(name, std::regex("(.*\\.)?(" + it->first + ")"))) return it;
    } catch (const std::regex_error& e) {
      fail("LoRA rank_pattern / alpha_pattern: \"", it->first, "\" is not a valid regular expression (",
           e.what(), ")");
    }
  }
  return patterns.end();
}

}  // namespace

std::vector<int8_t> lora_targets(const ModelSpec& spec) {
  const std::vector<ParamDecl> layout = parameter_layout(spec);
  std::vector<int8_t> out(layout.size(), 0);
  for (const Candidate& c : candidates(spec, layout)) {
    if (c.kind == Kind::kLinear) out[c.index] = 1;
    if (c.kind == Kind::kExperts && !spec.moe.gpt_oss) out[c.index] = 2;
    if (c.kind == Kind::kRouter) out[c.index] = 3;
  }
  return out;
}

std::string LoraSite::a_name() const {
  return experts ? base() + ".lora_A" : module + ".lora_A.weight";
}
std::string LoraSite::b_name() const {
  return experts ? base() + ".lora_B" : module + ".lora_B.weight";
}
std::string LoraSite::peft_key(bool a) const {
  std::string k = "base_model.model." + module;
  for (int64_t i = 0; i < nesting; ++i) k += ".base_layer";
  return k + (a ? ".lora_A.weight" : ".lora_B.weight");
}

std::vector<LoraSite> plan_lora(const ModelSpec& spec, const std::vector<ParamDecl>& layout,
                                const LoraConfig& config, bool strict) {
  AUTOMOE_CHECK(config.r > 0, "LoRA: r must be a positive integer, got ", config.r);
  AUTOMOE_CHECK(std::isfinite(config.lora_alpha), "LoRA: lora_alpha must be a number");
  AUTOMOE_CHECK(config.lora_dropout >= 0 && config.lora_dropout < 1,
                "LoRA: lora_dropout must be in [0, 1), got ", config.lora_dropout);
  const bool all_linear = config.target_modules.size() == 1 && config.target_modules[0] == "all-linear";
  std::optional<std::regex> module_regex;
  if (!config.target_modules_regex.empty()) {
    try {
      module_regex.emplace(config.target_modules_regex);
    } catch (const std::regex_error& e) {
      fail("LoRA target_modules: \"", config.target_modules_regex,
           "\" is not a valid regular expression (", e.what(), ")");
    }
  }
  std::map<std::string, int> module_hits, param_hits;
  for (const auto& t : config.target_modules) module_hits[t] = 0;
  for (const auto& t : config.target_parameters) param_hits[t] = 0;
  int regex_hits = 0;

  std::vector<LoraSite> sites;
  for (const Candidate& c : candidates(spec, layout)) {
    const std::string key = c.kind == Kind::kExperts ? c.module + "." + c.param : c.module;
    bool by_module = false, by_param = false;
    if (c.kind != Kind::kExperts) {
      if (module_regex && std::regex_match(c.module, *module_regex)) {
        by_module = true;
        ++regex_hits;
      }
      if (all_linear) {
        by_module = by_module || c.kind == Kind::kLinear;
      } else {
        for (const auto& t : config.target_modules) {
          if (ends_with_component(c.module, t)) {
            by_module = true;
            ++module_hits[t];
          }
        }
      }
    }
    const std::string param_key = c.module + "." + c.param;
    for (const auto& t : config.target_parameters) {
      if (ends_with_component(param_key, t)) {
        by_param = true;
        ++param_hits[t];
      }
    }
    // PEFT (0.21.2) on Transformers v5 converts target_modules named as the Transformers v4
    // experts (gate_proj / up_proj / down_proj) into the fused experts of these types, so it would
    // load an adapter on a dense or shared-expert MLP of that name onto the experts instead. Its
    // all-linear skips those MLPs for the same reason; named ones are refused.
    const std::string leaf = c.module.substr(c.module.rfind('.') + 1);
    const bool peft_reads_as_experts =
        c.kind == Kind::kLinear && (leaf == "gate_proj" || leaf == "up_proj" || leaf == "down_proj") &&
        (spec.model_type == "qwen3_moe" || spec.model_type == "deepseek_v3" ||
         spec.model_type == "glm4_moe" || spec.model_type == "olmoe");
    if (by_module && peft_reads_as_experts) {
      const bool named = !all_linear || (module_regex && std::regex_match(c.module, *module_regex));
      AUTOMOE_CHECK(!strict || !named, "LoRA: target_modules selects ", c.module,
                    " (a dense or shared-expert MLP); PEFT on Transformers v5 reads target_modules \"",
                    leaf, "\" of a ", spec.model_type, " model as its routed experts, so it could not "
                    "load that adapter. Target attention with target_modules and the experts with "
                    "target_parameters (all-linear skips these MLPs, as PEFT's does)");
      if (!by_param) continue;
    }
    if (!by_module && !by_param) continue;
    if (c.kind == Kind::kRouter && by_param && !by_module) {
      // PEFT's target_parameters on the router's weight: accepted (lora_targets kind 3).
    } else if (c.kind == Kind::kRouter || c.kind == Kind::kEmbedding || c.kind == Kind::kLmHead) {
      fail("LoRA: ", by_module ? "target_modules" : "target_parameters", " selects ", c.module, " (",
           refused_what(c.kind), "); AutoMoE puts adapters on attention, MLP, shared-expert and "
           "routed-expert weights", c.kind == Kind::kRouter ? " and, through target_parameters "
           "(\"mlp.gate.weight\"), on routers" : "", " only. Narrow the pattern");
    }
    if (by_param && c.kind == Kind::kLinear) {
      fail("LoRA: target_parameters selects ", param_key, ", a linear layer's weight; target linear "
           "layers with target_modules (\"", c.module.substr(c.module.rfind('.') + 1), "\"), as PEFT does");
    }
    AUTOMOE_CHECK(!(c.kind == Kind::kExperts && spec.moe.gpt_oss), "LoRA: ", param_key,
                  ": adapters on GPT-OSS's experts (transposed, interleaved, with biases) are not "
                  "supported; target its attention with target_modules");
    LoraSite s;
    s.module = c.module;
    s.param = c.param;
    s.slot = static_cast<int64_t>(c.index);
    s.experts = c.kind == Kind::kExperts;
    const auto& shape = layout[c.index].shape;
    if (s.experts) {
      s.experts_count = shape[0];
      s.out = shape[1];
      s.in = shape[2];
    } else {
      s.out = shape[0];
      s.in = shape[1];
    }
    s.r = config.r;
    if (s.experts && config.moe_rank_scaling) {
      s.r = config.r / spec.moe.top_k;
      AUTOMOE_CHECK(s.r >= 1, "LoRA: moe_rank_scaling gives the experts rank r / top_k = ", config.r,
                    " / ", spec.moe.top_k, " < 1; use r >= ", spec.moe.top_k);
    }
    if (auto it = pattern_of(config.rank_pattern, key); it != config.rank_pattern.end()) s.r = it->second;
    s.alpha = config.lora_alpha;
    if (auto it = pattern_of(config.alpha_pattern, key); it != config.alpha_pattern.end()) {
      s.alpha = it->second;
    }
    AUTOMOE_CHECK(s.r >= 1, "LoRA: rank ", s.r, " on ", key, " must be at least 1");
    // PEFT accepts a rank above a weight's smaller dimension (the update cannot use it). A weight
    // the config names is checked (a mistaken rank); all-linear's tiny ones are not (Qwen2-MoE's
    // shared_expert_gate is [1, H]), as in PEFT.
    const bool named = by_param || !all_linear || (module_regex && std::regex_match(c.module, *module_regex));
    AUTOMOE_CHECK(!strict || !named || s.r <= std::min(s.in, s.out), "LoRA: rank ", s.r, " on ", key,
                  " (", s.out, " x ", s.in, s.experts ? " per expert" : "",
                  ") must be between 1 and the smaller dimension, ", std::min(s.in, s.out));
    s.scaling = config.use_rslora ? s.alpha / std::sqrt(static_cast<double>(s.r))
                                  : s.alpha / static_cast<double>(s.r);
    s.dropout = config.lora_dropout;
    sites.push_back(std::move(s));
  }
  // PEFT wraps a module's targeted tensors one inside the other, the first declared innermost.
  for (auto& s : sites) {
    if (!s.experts) continue;
    for (const auto& o : sites) s.nesting += o.experts && o.module == s.module && o.slot > s.slot;
  }
  if (strict) {
    for (const auto& [t, n] : module_hits) {
      AUTOMOE_CHECK(all_linear || n > 0, "LoRA target_modules: \"", t, "\" matches no linear layer of this ",
                    spec.model_type, " model (e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
    }
    AUTOMOE_CHECK(!module_regex || regex_hits > 0, "LoRA target_modules: the regular expression \"",
                  config.target_modules_regex, "\" matches no linear layer of this model");
    for (const auto& [t, n] : param_hits) {
      AUTOMOE_CHECK(n > 0, "LoRA target_parameters: \"", t, "\" matches no routed-experts tensor of this ",
                    spec.model_type, " model (e.g. mlp.experts.gate_up_proj, mlp.experts.down_proj)");
    }
  }
  AUTOMOE_CHECK(!sites.empty(), "LoRA: the config targets no weight of this model (target_modules ",
                json(config.target_modules).dump(), ", target_parameters ",
                json(config.target_parameters).dump(), ")");
  return sites;
}

void init_lora(std::vector<LoraSite>& sites, const at::TensorOptions& options, uint64_t seed,
               std::optional<std::pair<int64_t, int64_t>> expert_rows) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& s : sites) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    std::vector<int64_t> a_shape{s.r, s.in}, b_shape{s.out, s.r};
    if (s.experts) {
      a_shape.insert(a_shape.begin(), s.experts_count);
      b_shape.insert(b_shape.begin(), s.experts_count);
    }
    at::Tensor a = at::empty(a_shape, at::kFloat).uniform_(-bound, bound, gen);
    if (s.experts && expert_rows) {
      const auto [begin, count] = *expert_rows;
      AUTOMOE_CHECK(begin >= 0 && count > 0 && begin + count <= s.experts_count, "LoRA: experts [",
                    begin, ", ", begin + count, ") of ", s.base(), ", which has ", s.experts_count);
      a = a.narrow(0, begin, count);
      b_shape[0] = s.experts_count = count;
    }
    s.a = a.to(options, /*non_blocking=*/false, /*copy=*/true);
    s.b = at::zeros(b_shape, options);
  }
}

std::string peft_adapter_config(const LoraConfig& config, const std::vector<LoraSite>& sites,
                                const std::string& base_model) {
  nlohmann::ordered_json rank_pattern = nlohmann::ordered_json::object(),
                         alpha_pattern = nlohmann::ordered_json::object();
  for (const auto& [k, v] : config.rank_pattern) rank_pattern[k] = v;
  for (const auto& [k, v] : config.alpha_pattern) alpha_pattern[k] = v;
  if (config.moe_rank_scaling) {
    // The experts' scaled rank, per targeted tensor name (PEFT matches "(.*\.)?(key)$").
    for (const auto& s : sites) {
      if (!s.experts) continue;
      const std::string key = s.module.substr(s.module.rfind('.') + 1) + "." + s.param;  // experts.gate_up_proj
      if (pattern_of(config.rank_pattern, s.base()) == config.rank_pattern.end()) rank_pattern[key] = s.r;
    }
  }
  nlohmann::ordered_json target_modules;
  if (!config.target_modules_regex.empty()) {
    target_modules = config.target_modules_regex;
  } else if (config.target_modules.size() == 1 && config.target_modules[0] == "all-linear") {
    std::set<std::string> leaves;  // what all-linear selected, by module name
    for (const auto& s : sites) {
      if (!s.experts) leaves.insert(s.module.substr(s.module.rfind('.') + 1));
    }
    target_modules = leaves;
  } else if (!config.target_modules.empty()) {
    target_modules = config.target_modules;
  }
  nlohmann::ordered_json j = {{"peft_type", "LORA"},
            {"peft_version", kPeftVersion},
            {"task_type", "CAUSAL_LM"},
            {"base_model_name_or_path", base_model},
            {"r", config.r},
            {"lora_alpha", config.lora_alpha},
            {"lora_dropout", config.lora_dropout},
            {"use_rslora", config.use_rslora},
            {"target_modules", target_modules},
            {"target_parameters", config.target_parameters.empty()
                                      ? nlohmann::ordered_json(nullptr)
                                      : nlohmann::ordered_json(config.target_parameters)},
            {"rank_pattern", rank_pattern},
            {"alpha_pattern", alpha_pattern},
            {"bias", "none"},
            {"fan_in_fan_out", false},
            {"init_lora_weights", true},
            {"inference_mode", true},
            {"use_dora", false},
            {"lora_bias", false},
            {"modules_to_save", nullptr},
            {"layers_to_transform", nullptr},
            {"layers_pattern", nullptr},
            {"exclude_modules", nullptr},
            {"revision", nullptr}};
  return j.dump(2) + "\n";
}

LoraConfig lora_config_from_peft(const nlohmann::ordered_json& j, const std::string& origin) {
  using json = nlohmann::ordered_json;
  AUTOMOE_CHECK(j.is_object(), origin, ": expected a JSON object");
  const std::string type = j.value("peft_type", std::string("LORA"));
  AUTOMOE_CHECK(type == "LORA", origin, ": peft_type \"", type,
                "\": the AutoMoE engine runs LoRA adapters only");
  auto flag = [&](const char* k) { return j.contains(k) && j[k].is_boolean() && j[k].get<bool>(); };
  auto set = [&](const char* k) {
    return j.contains(k) && !j[k].is_null() && !(j[k].is_array() && j[k].empty()) &&
           !(j[k].is_object() && j[k].empty()) && !(j[k].is_boolean() && !j[k].get<bool>());
  };
  for (const char* k : {"use_dora", "lora_bias", "fan_in_fan_out", "use_qalora", "use_bdlora"}) {
    AUTOMOE_CHECK(!flag(k), origin, ": ", k, " = true is a PEFT feature the AutoMoE engine does not run");
  }
  for (const char* k : {"layers_to_transform", "layers_pattern", "modules_to_save", "exclude_modules",
                        "trainable_token_indices", "alora_invocation_tokens", "layer_replication",
                        "megatron_config", "velora_config", "kasa_config", "arrow_config"}) {
    AUTOMOE_CHECK(!set(k), origin, ": ", k, " is a PEFT feature the AutoMoE engine does not run");
  }
  AUTOMOE_CHECK(j.value("bias", std::string("none")) == "none", origin, ": bias \"",
                j.value("bias", std::string()), "\" (trained biases) is not supported; use \"none\"");
  LoraConfig c;
  try {
    c.r = j.value("r", int64_t{8});
    c.lora_alpha = j.value("lora_alpha", 8.0);
    c.lora_dropout = j.value("lora_dropout", 0.0);
    c.use_rslora = j.value("use_rslora", false);
    if (j.contains("target_modules") && !j["target_modules"].is_null()) {
      const json& t = j["target_modules"];
      if (t.is_string()) {
        if (t.get<std::string>() == "all-linear") c.target_modules = {"all-linear"};
        else c.target_modules_regex = t.get<std::string>();
      } else {
        c.target_modules = t.get<std::vector<std::string>>();
      }
    }
    if (j.contains("target_parameters") && !j["target_parameters"].is_null()) {
      c.target_parameters = j["target_parameters"].get<std::vector<std::string>>();
    }
    if (j.contains("rank_pattern") && j["rank_pattern"].is_object()) {
      for (const auto& [k, v] : j["rank_pattern"].items()) {
        AUTOMOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= INT32_MAX,
                      origin, ": rank_pattern[\"", k, "\"] must be a positive integer rank, found ",
                      v.dump());
        c.rank_pattern.emplace_back(k, v.get<int64_t>());
      }
    }
    if (j.contains("alpha_pattern") && j["alpha_pattern"].is_object()) {
      for (const auto& [k, v] : j["alpha_pattern"].items()) c.alpha_pattern.emplace_back(k, v.get<double>());
    }
  } catch (const json::exception& e) {
    fail(origin, ": a field has the wrong type (", e.what(), ")");
  }
  const json init = j.value("init_lora_weights", json(true));
  AUTOMOE_CHECK(init.is_boolean() || init == "gaussian", origin, ": init_lora_weights ", init.dump(),
                " is not supported for training here (true, false or \"gaussian\")");
  return c;
}

void write_peft_adapter(const std::string& dir, const LoraConfig& config,
                        const std::vector<LoraSite>& sites, const std::string& base_model,
                        c10::ScalarType dtype) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& s : sites) {
    at::Tensor a = s.a.detach().to(at::kCPU, dtype), b = s.b.detach().to(at::kCPU, dtype);
    if (s.experts) {  // PEFT: lora_A [E·r, K] expert-major, lora_B [O, r·E] rank-major
      a = a.reshape({s.experts_count * s.r, s.in});
      b = b.permute({1, 2, 0}).reshape({s.out, s.r * s.experts_count});
    }
    tensors.emplace_back(s.peft_key(true), a.contiguous());
    tensors.emplace_back(s.peft_key(false), b.contiguous());
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  save_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "adapter_config.json").string(),
                    peft_adapter_config(config, sites, base_model));
}

std::vector<LoraSite> read_peft_adapter(const std::string& dir, const ModelSpec& spec,
                                        LoraConfig* config_out) {
  const fs::path cfg_path = fs::path(dir) / "adapter_config.json";
  AUTOMOE_CHECK(fs::exists(cfg_path), dir, ": no adapter_config.json (not a PEFT adapter directory)");
  nlohmann::ordered_json j;  // rank_pattern's order decides between overlapping keys
  {
    std::ifstream f(cfg_path);
    std::stringstream ss;
    ss << f.rdbuf();
    try {
      j = nlohmann::ordered_json::parse(ss.str());
    } catch (const json::exception& e) {
      fail(cfg_path.string(), ": not valid JSON (", e.what(), ")");
    }
  }
  const LoraConfig config = lora_config_from_peft(j, cfg_path.string());
  const fs::path st_path = fs::path(dir) / "adapter_model.safetensors";
  AUTOMOE_CHECK(fs::exists(st_path), dir, ": no adapter_model.safetensors",
                fs::exists(fs::path(dir) / "adapter_model.bin")
                    ? " (adapter_model.bin, a pickle, is not read: save with safe_serialization=True)"
                    : "");
  std::vector<LoraSite> sites = plan_lora(spec, parameter_layout(spec), config, /*strict=*/false);
  const SafetensorsFile file(st_path.string());
  std::set<std::string> unused;
  for (const auto& n : file.names()) unused.insert(n);
  for (auto& s : sites) {
    at::Tensor ab[2];
    for (int which = 0; which < 2; ++which) {
      const std::string key = s.peft_key(which == 0);
      AUTOMOE_CHECK(file.contains(key), st_path.string(), ": no tensor ", key, " (the adapter of ",
                    s.base(), " that adapter_config.json targets)");
      unused.erase(key);
      ab[which] = file.get(key).to(at::kFloat);
    }
    const std::vector<int64_t> want_a{s.experts_count * s.r, s.in}, want_b{s.out, s.r * s.experts_count};
    AUTOMOE_CHECK(ab[0].sizes() == at::IntArrayRef(want_a) && ab[1].sizes() == at::IntArrayRef(want_b),
                  st_path.string(), ": the adapter of ", s.base(), " has lora_A ", ab[0].sizes(),
                  " and lora_B ", ab[1].sizes(), "; this model needs ", at::IntArrayRef(want_a), " and ",
                  at::IntArrayRef(want_b), " (r = ", s.r, "): was it trained on another base model?");
    if (s.experts) {
      s.a = ab[0].reshape({s.experts_count, s.r, s.in});
      s.b = ab[1].view({s.out, s.r, s.experts_count}).permute({2, 0, 1}).contiguous();
    } else {
      s.a = ab[0];
      s.b = ab[1];
    }
  }
  AUTOMOE_CHECK(unused.empty(), st_path.string(), ": tensor ", *unused.begin(),
                " adapts nothing this model has under adapter_config.json's targets");
  if (config_out) *config_out = config;
  return sites;
}

at::Tensor merge_lora(const LoraSite& s, const at::Tensor& w, std::optional<c10::ScalarType> dtype) {
  const at::Tensor a = s.a.detach().to(w.device(), at::kFloat), b = s.b.detach().to(w.device(), at::kFloat);
  // PEFT's get_delta_weight: (B @ A) * scaling, added to the weight.
  const at::Tensor delta = (s.experts ? at::bmm(b, a) : at::mm(b, a)) * s.scaling;
  return (w.detach().to(at::kFloat) + delta).to(dtype.value_or(w.scalar_type()));
}

}  // namespace automoe
