// LoRA adapters on a decoder's weights, as PEFT defines them (LoraConfig, its names, its files):
// which weights a config targets, their rank and scaling, PEFT's initialisation, the PEFT adapter
// directory (adapter_config.json + adapter_model.safetensors) both ways, and merging.
//
// Linear weights W [O, K] (attention projections, dense MLPs, shared experts) get A [r, K] and
// B [O, r]: y = x·Wᵀ + scaling·(dropout(x)·Aᵀ)·Bᵀ, PEFT's lora.Linear. Routed experts' fused
// tensors W [E, O, K] (`mlp.experts.gate_up_proj`, `down_proj`, PEFT's `target_parameters`) get
// per-expert A [E, r, K] and B [E, O, r], run inside the grouped experts (moe/experts.h); PEFT
// stores them as lora_A [E·r, K] (expert-major) and lora_B [O, r·E] (rank-major), and nests one
// wrapper per targeted tensor of a module (the first declared innermost: `experts.base_layer.`).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "automoe/model/components.h"
#include "automoe/model/spec.h"

namespace automoe {

// The PEFT LoraConfig fields the engine honours (PEFT's names and defaults).
struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  bool use_rslora = false;  // scaling alpha / sqrt(r) instead of alpha / r
  // Modules (linear weights) by PEFT's rule: a list matches a module whose name equals an entry or
  // ends with "." + entry; `target_modules_regex` (PEFT's string form) must match the whole name;
  // "all-linear" is every linear layer but the LM head (routers are not linear layers).
  std::vector<std::string> target_modules;
  std::string target_modules_regex;
  // Routed experts' tensors ("mlp.experts.gate_up_proj"): "module.param" equals or ends with
  // "." + entry.
  std::vector<std::string> target_parameters;
  // PEFT's per-weight overrides, in the config file's order: the first key k such that the name
  // matches (.*\.)?(k)$.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  // AutoMoE: the routed experts' rank is r / top_k (each token passes through top_k experts, so
  // the adapter capacity a token sees stays r). Exported as a rank_pattern entry, so that PEFT and
  // the merge compute exactly the same scaling.
  bool moe_rank_scaling = false;
};

// One adapted weight.
struct LoraSite {
  std::string module;  // "model.layers.0.self_attn.q_proj" | "model.layers.0.mlp.experts"
  std::string param;   // "weight" | "gate_up_proj" | "down_proj"
  int64_t slot = -1;   // the base weight's index in the decoder's parameters
  bool experts = false;  // a routed-experts tensor [E, O, K]
  int64_t experts_count = 1, out = 0, in = 0;
  int64_t r = 0;
  double alpha = 0, scaling = 0, dropout = 0;
  // Experts: how many other targeted tensors of the same module PEFT wraps around this one (its
  // keys carry that many ".base_layer").
  int64_t nesting = 0;
  at::Tensor a, b;  // linear A [r, K], B [O, r]; experts A [E, r, K], B [E, O, r]

  std::string base() const { return module + "." + param; }  // the base weight's name
  // The engine's names of the factors (checkpoints, Decoder::set_parameter).
  std::string a_name() const;
  std::string b_name() const;
  // PEFT's keys in adapter_model.safetensors ("base_model.model." + module + ...).
  std::string peft_key(bool a) const;
};

// The sites `config` targets on a model of `spec` with parameters `layout` (parameter_layout
// order), ranks and scalings resolved, factors not yet allocated. `strict` (the recipe's own
// config): every target entry must match something. Errors name the entry or the weight: an entry
// matching nothing, a target the engine does not adapt (routers, embeddings, the LM head, GPT-OSS's
// experts), a rank larger than a dimension.
std::vector<LoraSite> plan_lora(const ModelSpec& spec, const std::vector<ParamDecl>& layout,
                                const LoraConfig& config, bool strict);

// Per parameter of a model of `spec` (parameter_layout order), whether the forward runs an adapter
// on it: 0 no, 1 a linear layer (attention, dense MLP, shared experts), 2 a routed-experts tensor,
// 3 a router's weight (PEFT's target_parameters "mlp.gate.weight": the router runs on W + s·B·A,
// a small [E, H] tensor, as PEFT's ParamWrapper computes it).
std::vector<int8_t> lora_targets(const ModelSpec& spec);

// PEFT's initialisation: A uniform in ±1/sqrt(K) (nn.Linear's kaiming_uniform, a = sqrt(5)), B zero.
// Drawn on the CPU from `seed`, then placed with `options`. `expert_rows` (expert parallelism:
// [begin, begin + count)): the routed experts' sites keep only those experts' rows (experts_count
// becomes count) — the values one process draws for them; only one site's whole A is ever held,
// on the CPU.
void init_lora(std::vector<LoraSite>& sites, const at::TensorOptions& options, uint64_t seed,
               std::optional<std::pair<int64_t, int64_t>> expert_rows = std::nullopt);

// PEFT's adapter_config.json for `config` over `sites` (moe_rank_scaling as rank_pattern entries).
std::string peft_adapter_config(const LoraConfig& config, const std::vector<LoraSite>& sites,
                                const std::string& base_model);
// The LoraConfig of a PEFT adapter_config.json (`origin` names it in errors); features the engine
// does not run (DoRA, lora_bias, layer selection, modules_to_save, ...) are refused by name.
LoraConfig lora_config_from_peft(const nlohmann::ordered_json& j, const std::string& origin);

// Writes `dir`/adapter_config.json and adapter_model.safetensors (factors in `dtype`), atomically.
void write_peft_adapter(const std::string& dir, const LoraConfig& config,
                        const std::vector<LoraSite>& sites, const std::string& base_model,
                        c10::ScalarType dtype);
// Reads a PEFT adapter directory for a model of `spec`: its config and every site with factors
// (float32, CPU). Missing or misshapen tensors and tensors nothing targets are errors.
std::vector<LoraSite> read_peft_adapter(const std::string& dir, const ModelSpec& spec,
                                        LoraConfig* config);

// W + scaling·B·A (per expert for experts), computed in float32, returned in `dtype` (default: W's).
at::Tensor merge_lora(const LoraSite& site, const at::Tensor& w,
                      std::optional<c10::ScalarType> dtype = std::nullopt);

}  // namespace automoe
