#include "automoe/model/checkpoint.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/log.h"
#include "automoe/io/bnb.h"
#include "automoe/io/mxfp4.h"
#include "automoe/model/init.h"
#include "automoe/parallel/world.h"

namespace automoe {
namespace fs = std::filesystem;

namespace {

// Whether the checkpoint keeps the language model under the architecture's container prefix
// (a vision-language checkpoint's model.language_model.).
bool is_contained(const SafetensorsCheckpoint& ckpt, const Architecture& arch) {
  if (arch.container_prefix.empty()) return false;
  for (const std::string& name : ckpt.names()) {
    if (name.rfind(arch.container_prefix, 0) == 0) return true;
  }
  return false;
}

// `name` (on-disk after the layout's renames) as the checkpoint stores it.
std::string in_container(const std::string& name, bool contained, const Architecture& arch) {
  if (!contained || name.rfind("model.", 0) != 0) return name;
  return arch.container_prefix + name.substr(6);
}

}  // namespace

ExpertsLayout detect_layout(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                            const Architecture& arch) {
  // config.json's layer count against the layers the tensors hold, before it sizes anything.
  int64_t held = 0;
  for (const std::string& name : ckpt.names()) {
    const size_t at = name.find("layers.");
    if (at == std::string::npos || (at > 0 && name[at - 1] != '.')) continue;
    const size_t digits = at + 7;
    size_t end = digits;
    while (end < name.size() && end - digits < 9 && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end > digits) held = std::max<int64_t>(held, std::stoll(name.substr(digits, end - digits)) + 1);
  }
  AUTOMOE_CHECK(held >= spec.num_layers, (fs::path(ckpt.dir()) / "config.json").string(),
                ": num_hidden_layers is ", spec.num_layers, ", but the checkpoint's tensors hold ",
                held, " layer(s)", held > 0 ? " (layers.0 .. layers." + std::to_string(held - 1) + ")" : "",
                "; the config does not belong to these weights");
  if (arch.per_expert_rules.empty()) return ExpertsLayout::kFused;
  const bool contained = is_contained(ckpt, arch);
  for (const auto& decl : parameter_layout(spec)) {
    std::string prefix;
    const WeightRule* rule = find_rule(arch.per_expert_rules, decl.name, &prefix);
    if (!rule) continue;
    // Renames belong to the original (per-expert) format; the fused one uses in-memory names.
    const std::string fused = in_container(decl.name, contained, arch);
    const std::string first =
        in_container(to_disk_name(arch.renames, disk_name(prefix, rule->parts.front(), 0)), contained, arch);
    if (ckpt.contains(fused)) return ExpertsLayout::kFused;
    if (ckpt.contains(first)) return ExpertsLayout::kPerExpert;
    fail(ckpt.dir(), ": missing tensor ", fused, " (fused layout) or ", first,
         " (per-expert layout)");
  }
  return ExpertsLayout::kPerExpert;  // no MoE layer: both layouts are the same
}

namespace {

bool ignorable_extra(const std::string& name, const ModelSpec& spec) {
  // Tied checkpoints sometimes still carry lm_head; old ones carry RoPE buffers.
  if (spec.tie_word_embeddings && name == "lm_head.weight") return true;
  const std::string buf = "rotary_emb.inv_freq";
  return name.size() >= buf.size() && name.compare(name.size() - buf.size(), buf.size(), buf) == 0;
}

// N for "model.layers.N....", else -1.
int64_t layer_of(const std::string& name) {
  const std::string pre = "model.layers.";
  if (name.rfind(pre, 0) != 0) return -1;
  const size_t dot = name.find('.', pre.size());
  if (dot == std::string::npos || dot == pre.size()) return -1;
  int64_t v = 0;
  for (size_t i = pre.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (int64_t{1} << 40)) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace

namespace {

// The checkpoint's tensors that no parameter used: skipped with one message where Transformers
// ignores them too (multi-token prediction, a vision tower), an error otherwise.
void check_leftover_tensors(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                            const Architecture& arch, const std::set<std::string>& used) {
  std::vector<std::string> extra;
  std::set<int64_t> mtp_layers;
  int64_t mtp_tensors = 0;
  int64_t mtp_module_tensors = 0;  // an `mtp.*` module (Transformers ignores it on load)
  int64_t skipped_tensors = 0;     // the architecture's skipped prefixes (a vision tower)
  for (const auto& name : ckpt.names()) {
    if (used.count(name) || ignorable_extra(name, spec)) continue;
    bool skip = false;
    for (const std::string& pre : arch.skipped_prefixes) skip = skip || name.rfind(pre, 0) == 0;
    if (skip) {
      ++skipped_tensors;
      continue;
    }
    if (spec.mtp_module && name.rfind("mtp.", 0) == 0) {
      ++mtp_module_tensors;
      continue;
    }
    const int64_t layer = layer_of(name);
    if (layer >= spec.num_layers && layer < spec.num_layers + spec.num_mtp_layers) {
      mtp_layers.insert(layer);
      ++mtp_tensors;
      continue;
    }
    extra.push_back(name);
  }
  if (!mtp_layers.empty()) {
    std::string list;
    for (int64_t l : mtp_layers) list += (list.empty() ? "" : ", ") + std::to_string(l);
    log_info(ckpt.dir(), ": skipping ", mtp_tensors, " tensor(s) of multi-token-prediction layer(s) ",
             list, " (num_nextn_predict_layers after the ", spec.num_layers,
             " decoder layers; not used for training, as in Transformers, and not written on save)");
  }
  if (skipped_tensors > 0) {
    std::string list;
    for (const std::string& pre : arch.skipped_prefixes) list += (list.empty() ? "" : ", ") + pre + "*";
    log_info(ckpt.dir(), ": skipping ", skipped_tensors, " tensor(s) the causal LM does not use (", list,
             ": the vision tower; AutoMoE runs the language model, as Transformers' ", arch.hf_class,
             " does, and saves it alone)");
  }
  if (mtp_module_tensors > 0) {
    log_info(ckpt.dir(), ": skipping ", mtp_module_tensors,
             " tensor(s) of the multi-token-prediction module (mtp.*; not used for training, as in "
             "Transformers, and not written on save)");
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 5; ++i) list += (i ? ", " : "") + extra[i];
    fail(ckpt.dir(), ": ", extra.size(), " tensor(s) that a ", spec.model_type,
         " model with this config.json does not have: ", list, extra.size() > 5 ? ", ..." : "");
  }
}

// One MoE layer's experts [first, first + count) of a per-expert checkpoint bitsandbytes
// quantised one linear layer at a time: each expert's parts joined along the rows (gate then up),
// the experts stacked. Every tensor read is added to *used.
ops::QuantizedWeight read_bnb_experts(const SafetensorsCheckpoint& ckpt, const WeightRule& rule,
                                      const std::string& prefix, int64_t count, int64_t first,
                                      const std::function<std::string(const std::string&)>& on_disk,
                                      std::optional<c10::ScalarType> dtype, std::set<std::string>* used) {
  AUTOMOE_CHECK(!rule.transpose && !rule.interleave && (rule.parts.size() == 1 || rule.concat_dim == 1),
                ckpt.dir(), ": ", prefix, rule.memory_suffix, ": this architecture's experts are "
                "stored transposed or interleaved; their bitsandbytes-quantised form is not supported");
  std::vector<ops::QuantizedWeight> experts;
  for (int64_t e = first; e < first + count; ++e) {
    std::vector<ops::QuantizedWeight> parts;
    for (const auto& part : rule.parts) {
      const std::string name = on_disk(disk_name(prefix, part, e));
      AUTOMOE_CHECK(bnb_format(ckpt, name), ckpt.dir(), ": tensor ", name,
                    " is not bitsandbytes-quantised, as the layer's other experts are");
      parts.push_back(read_bnb(ckpt, name, dtype));
      used->insert(name);
      for (const std::string& c : bnb_companions(ckpt, name)) used->insert(c);
    }
    experts.push_back(join_rows(parts, ckpt.dir() + ": expert " + std::to_string(e) + " of " + prefix));
  }
  return stack_experts(experts, ckpt.dir() + ": " + prefix + rule.memory_suffix);
}

// The experts read from a bnb checkpoint against config.json's shape and the recipe's
// model.quantize (which must name the stored format, or be left out).
void check_bnb_experts(const SafetensorsCheckpoint& ckpt, const ParamDecl& decl,
                       const ops::QuantizedWeight& q, const QuantizeOptions* quantize) {
  AUTOMOE_CHECK(at::IntArrayRef({q.experts, q.out_features, q.in_features}) == at::IntArrayRef(decl.shape),
                ckpt.dir(), ": tensor ", decl.name, ": expected shape ", at::IntArrayRef(decl.shape),
                " from config.json, found quantised experts [", q.experts, ", ", q.out_features, ", ",
                q.in_features, "]");
  auto name = [](ops::QuantType t, int64_t blocksize) {
    return std::string(ops::to_string(t)) +
           (t == ops::QuantType::kInt8 ? "" : " in blocks of " + std::to_string(blocksize));
  };
  AUTOMOE_CHECK(!quantize || (quantize->type == q.type &&
                              (q.type == ops::QuantType::kInt8 || quantize->blocksize == q.blocksize)),
                ckpt.dir(), ": the experts are stored ", name(q.type, q.blocksize),
                "; model.quantize asks for ", name(quantize->type, quantize->blocksize),
                " (requantising would lose precision twice): remove model.quantize or match it");
}

}  // namespace

NamedTensors read_parameters(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                             const Architecture& arch, std::optional<c10::ScalarType> dtype,
                             ExpertsLayout* layout_out, const QuantizeOptions* quantize,
                             std::vector<std::pair<std::string, ops::QuantizedWeight>>* quantized) {
  AUTOMOE_CHECK(!quantize || (quantized && !spec.moe.gpt_oss), ckpt.dir(), ": ",
                spec.model_type, "'s experts cannot be held quantised (GPT-OSS's experts are stored "
                "transposed with biases); load it unquantised");
  const ExpertsLayout layout = detect_layout(ckpt, spec, arch);
  if (layout_out) *layout_out = layout;
  std::set<std::string> used;
  // The original (per-expert) format renames tensors (Mixtral's block_sparse_moe); the fused
  // one, like Transformers v5's save_original_format=False, keeps the in-memory names.
  const std::vector<RenameRule> no_renames;
  const std::vector<RenameRule>& renames =
      layout == ExpertsLayout::kPerExpert ? arch.renames : no_renames;
  const bool contained = is_contained(ckpt, arch);
  auto on_disk = [&](const std::string& memory_name) {
    return in_container(to_disk_name(renames, memory_name), contained, arch);
  };
  // A bitsandbytes-quantised tensor other than a routed expert's is dequantised here (to the
  // dtype asked for, else its quant state's).
  int64_t bnb_dequantised = 0;
  auto mark_bnb = [&](const std::string& name) {
    for (const std::string& c : bnb_companions(ckpt, name)) used.insert(c);
  };
  std::vector<std::string> read_now;  // the current parameter's tensors
  auto get = [&](const std::string& memory_name) {
    const std::string name = on_disk(memory_name);
    AUTOMOE_CHECK(ckpt.contains(name), ckpt.dir(), ": missing tensor ", name, " (",
                  to_string(layout), " layout)");
    used.insert(name);
    read_now.push_back(name);
    if (!spec.bnb_quantized.empty() && bnb_format(ckpt, name)) {
      mark_bnb(name);
      ++bnb_dequantised;
      const ops::QuantizedWeight q =
          read_bnb(ckpt, name, dtype ? dtype : std::optional<c10::ScalarType>(spec.dtype));
      return ops::dequantize(q, 0, 1, q.dtype)[0];
    }
    return ckpt.get(name);
  };
  // Expert parallelism: this process's experts only, as byte ranges of the files.
  const MoESpec& moe = spec.moe;
  const bool sharded = moe.sharded();
  auto get_experts = [&](const std::string& memory_name) {
    const std::string name = on_disk(memory_name);
    AUTOMOE_CHECK(ckpt.contains(name), ckpt.dir(), ": missing tensor ", name, " (",
                  to_string(layout), " layout)");
    used.insert(name);
    read_now.push_back(name);
    return ckpt.get_rows(name, moe.expert_begin, moe.expert_begin + moe.expert_count);
  };
  // MXFP4 experts dequantise to the dtype asked for, else to the dtype the checkpoint's other
  // tensors are stored in (their biases'), so that the model stays in one dtype.
  auto dequant_dtype_for = [&](const std::string& name) -> c10::ScalarType {
    if (dtype) return *dtype;
    if (ckpt.contains(name + "_bias")) return ckpt.info(name + "_bias").dtype;
    return at::isFloatingType(spec.dtype) ? spec.dtype : at::kBFloat16;
  };
  // Buffers Transformers keeps in float32 (the correction bias) stay float32.
  auto want_of = [&](const ParamDecl& decl) {
    return decl.keep_float32 ? std::optional<c10::ScalarType>(at::kFloat) : dtype;
  };
  std::optional<c10::ScalarType> dequant_dtype;
  int64_t dequantised = 0;
  NamedTensors out;
  for (const auto& decl : parameter_layout(spec)) {
    read_now.clear();
    std::string prefix;
    const WeightRule* rule = find_rule(arch.per_expert_rules, decl.name, &prefix);
    at::Tensor t;
    if (spec.mxfp4_experts && decl.shape.size() == 3 && !ckpt.contains(decl.name) &&
        ckpt.contains(decl.name + "_blocks")) {
      // Stored [E, O, G, 16] + [E, O, G] for the transposed in-memory [E, K, O]: as Transformers.
      dequant_dtype = dequant_dtype_for(decl.name);
      auto part = [&](const std::string& n) { return sharded ? get_experts(n) : get(n); };
      t = dequantize_mxfp4(part(decl.name + "_blocks"), part(decl.name + "_scales"), *dequant_dtype,
                           ckpt.dir() + ": tensor " + decl.name)
              .transpose(1, 2)
              .contiguous();
      ++dequantised;
    } else {
      if (rule && layout == ExpertsLayout::kPerExpert) {
        const int64_t first = sharded ? moe.expert_begin : 0;
        for (int64_t e = 0; sharded && e < moe.num_experts; ++e) {  // other ranks' experts
          if (e >= moe.expert_begin && e < moe.expert_begin + moe.expert_count) continue;
          for (const auto& part : rule->parts) {
            used.insert(on_disk(disk_name(prefix, part, e)));
            mark_bnb(on_disk(disk_name(prefix, part, e)));
          }
        }
        if (!spec.bnb_quantized.empty() && decl.shape.size() == 3 &&
            bnb_format(ckpt, on_disk(disk_name(prefix, rule->parts.front(), first)))) {
          // Experts bitsandbytes quantised, one linear layer each: they stay quantised.
          AUTOMOE_CHECK(quantized, ckpt.dir(), ": the routed experts are stored bitsandbytes-"
                        "quantised (", spec.bnb_quantized, "); they load only as the frozen base of "
                        "LoRA (automoe train with a peft: section, or the drop-in)");
          ops::QuantizedWeight q = read_bnb_experts(
              ckpt, *rule, prefix, moe.local_experts(), first, on_disk,
              want_of(decl).value_or(at::isFloatingType(spec.dtype) ? spec.dtype : at::kBFloat16), &used);
          check_bnb_experts(ckpt, decl, q, quantize);
          out.emplace_back(decl.name, at::empty(decl.shape, at::TensorOptions().dtype(q.dtype).device(at::kMeta)));
          quantized->emplace_back(decl.name, std::move(q));
          continue;
        }
        t = gather_experts(*rule, prefix, moe.local_experts(), get, first);
      } else {
        t = sharded && decl.routed_expert ? get_experts(decl.name) : get(decl.name);
      }
    }
    AUTOMOE_CHECK(t.sizes() == at::IntArrayRef(decl.shape), ckpt.dir(), ": tensor ", decl.name,
                  ": expected shape ", at::IntArrayRef(decl.shape), " from config.json, found ",
                  t.sizes());
    AUTOMOE_CHECK(at::isFloatingType(t.scalar_type()), ckpt.dir(), ": tensor ", decl.name,
                  ": expected a floating-point dtype, found ", t.scalar_type());
    // Parameters own their memory: a tensor still aliasing the file mapping is copied, so that
    // another program rewriting the checkpoint in place can neither change nor (by truncating it)
    // crash a loaded model.
    const bool aliases_file = !(rule && layout == ExpertsLayout::kPerExpert);
    const std::optional<c10::ScalarType> want = want_of(decl);
    if (quantize && decl.routed_expert && decl.shape.size() == 3) {
      const c10::ScalarType dt = want.value_or(t.scalar_type());
      quantized->emplace_back(decl.name, ops::quantize(t, quantize->type, quantize->blocksize, dt,
                                                       ckpt.dir() + ": tensor " + decl.name));
      // The file's pages of the dense experts leave memory as they are quantised: the load's
      // peak stays near the quantised model's.
      t = at::Tensor();
      for (const std::string& name : read_now) ckpt.release(name);
      out.emplace_back(decl.name, at::empty(decl.shape, at::TensorOptions().dtype(dt).device(at::kMeta)));
      continue;
    }
    if (want && t.scalar_type() != *want) {
      t = t.to(*want);
    } else if (aliases_file) {
      t = t.clone(at::MemoryFormat::Contiguous);
    }
    out.emplace_back(decl.name, std::move(t));
  }
  if (dequantised > 0) {
    log_info(ckpt.dir(), ": dequantised ", dequantised, " MXFP4 expert tensors to ",
             dtype_to_name(*dequant_dtype), " (saves write them in that dtype)");
  }
  if (bnb_dequantised > 0) {
    log_info(ckpt.dir(), ": dequantised ", bnb_dequantised, " bitsandbytes-quantised (",
             spec.bnb_quantized, ") tensor(s) outside the routed experts (attention, dense MLPs: "
             "small beside the experts, which stay quantised)");
  }
  check_leftover_tensors(ckpt, spec, arch, used);
  return out;
}

NamedTensors to_disk_tensors(const NamedTensors& params, const ModelSpec& spec,
                             const Architecture& arch, ExpertsLayout layout) {
  NamedTensors out;
  for (const auto& [name, t] : params) {
    std::string prefix;
    const WeightRule* rule = find_rule(arch.per_expert_rules, name, &prefix);
    at::Tensor data = t.detach();
    if (layout != ExpertsLayout::kPerExpert) {
      out.emplace_back(name, data);  // the fused format keeps the in-memory names
    } else if (rule) {
      for (auto& [part, t] : scatter_experts(*rule, prefix, data, spec.moe.expert_begin)) {
        out.emplace_back(to_disk_name(arch.renames, part), std::move(t));
      }
    } else {
      out.emplace_back(to_disk_name(arch.renames, name), data);
    }
  }
  return out;
}

NamedTensors to_memory_tensors(const NamedTensors& tensors, const ModelSpec& spec,
                               const Architecture& arch) {
  // Names as in memory (on-disk renames undone), in the given order.
  NamedTensors renamed;
  for (const auto& [name, t] : tensors) {
    const bool contained = !arch.container_prefix.empty() && name.rfind(arch.container_prefix, 0) == 0;
    const std::string uncontained = contained ? "model." + name.substr(arch.container_prefix.size()) : name;
    renamed.emplace_back(to_memory_name(arch.renames, uncontained), t);
  }
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : renamed) by_name[name] = t;
  std::set<std::string> consumed;
  std::map<std::string, at::Tensor> gathered;  // first consumed disk name -> in-memory tensor
  std::map<std::string, std::string> gathered_name;
  for (const auto& decl : parameter_layout(spec)) {
    std::string prefix;
    const WeightRule* rule = find_rule(arch.per_expert_rules, decl.name, &prefix);
    if (!rule || by_name.count(decl.name)) continue;
    const std::string first = disk_name(prefix, rule->parts.front(), 0);
    if (!by_name.count(first)) continue;
    at::Tensor t = gather_experts(*rule, prefix, spec.moe.num_experts, [&](const std::string& n) {
      AUTOMOE_CHECK(by_name.count(n), "state dict: tensor ", n, " is missing (", decl.name,
                    " in the per-expert layout needs every expert)");
      consumed.insert(n);
      return by_name.at(n);
    });
    gathered[first] = std::move(t);
    gathered_name[first] = decl.name;
  }
  NamedTensors out;
  for (const auto& [name, t] : renamed) {
    if (gathered.count(name)) {
      out.emplace_back(gathered_name.at(name), gathered.at(name));
    } else if (!consumed.count(name)) {
      out.emplace_back(name, t);
    }
  }
  return out;
}

PretrainedModel load_pretrained(const std::string& dir, std::optional<c10::ScalarType> dtype,
                                const BackendConfig& backend,
                                const std::optional<std::string>& config_json,
                                ExpertShard experts, const std::optional<QuantizeOptions>& quantize) {
  PretrainedModel m;
  m.config = config_json ? parse_config(*config_json, (fs::path(dir) / "config.json").string())
                         : load_config(dir);
  if (experts.count > 0 && experts.count < m.config.spec.moe.num_experts) {
    m.config.spec.moe.expert_begin = experts.begin;
    m.config.spec.moe.expert_count = experts.count;
  }
  m.source_dir = dir;
  const Architecture& arch = find_architecture(m.config.spec.model_type, m.config.path);
  SafetensorsCheckpoint ckpt(dir);
  std::vector<std::pair<std::string, ops::QuantizedWeight>> quantized;
  NamedTensors params = read_parameters(ckpt, m.config.spec, arch, dtype, &m.layout,
                                        quantize ? &*quantize : nullptr, &quantized);
  m.decoder = std::make_unique<Decoder>(m.config.spec, backend, std::move(params));
  for (auto& [name, q] : quantized) m.decoder->set_quantized(name, std::move(q));
  return m;
}

PretrainedModel init_pretrained(const std::string& config_json, const std::string& origin,
                                c10::ScalarType dtype, const BackendConfig& backend,
                                uint64_t seed) {
  PretrainedModel m;
  m.config = parse_config(config_json, origin);
  // A new model is written as Transformers v5 writes one by default (its original format).
  m.layout = find_architecture(m.config.spec.model_type, origin).per_expert_rules.empty()
                 ? ExpertsLayout::kFused
                 : ExpertsLayout::kPerExpert;
  const double std = m.config.json->value("initializer_range", 0.02);
  AUTOMOE_CHECK(std >= 0, origin, ": key \"initializer_range\": expected >= 0, got ", std);
  m.decoder = std::make_unique<Decoder>(
      m.config.spec, backend,
      init_parameters(m.config.spec, dtype, c10::Device(c10::kCPU), seed, std));
  return m;
}

namespace {

// The tensors to save in parameter_layout order: the model's own, or `given` after checking that
// it holds exactly those names and shapes (a tied LM head may be listed; it is the embedding).
NamedTensors tensors_to_save(const PretrainedModel& model,
                             const std::optional<NamedTensors>& given, bool gathered = false) {
  const NamedTensors& params = model.decoder->named_parameters();
  if (!given && !model.decoder->has_quantized()) return params;
  if (!given) {  // quantised experts are written dequantised (a plain checkpoint)
    NamedTensors out;
    for (size_t i = 0; i < params.size(); ++i) {
      out.emplace_back(params[i].first, model.decoder->dense(static_cast<int64_t>(i)));
    }
    return out;
  }
  const ModelSpec& spec = model.decoder->spec();
  std::set<std::string> routed;
  if (gathered) {
    for (const auto& d : parameter_layout(spec)) {
      if (d.routed_expert) routed.insert(d.name);
    }
  }
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : *given) {
    AUTOMOE_CHECK(by_name.emplace(name, t).second, "state_dict: ", name, " is listed twice");
  }
  NamedTensors out;
  for (const auto& [name, own] : params) {
    auto it = by_name.find(name);
    AUTOMOE_CHECK(it != by_name.end(), "state_dict: missing ", name,
                  " (save_pretrained writes a whole checkpoint; every parameter is needed)");
    std::vector<int64_t> shape = own.sizes().vec();
    if (routed.count(name)) shape[0] = spec.moe.num_experts;  // every expert, gathered
    AUTOMOE_CHECK(it->second.sizes() == at::IntArrayRef(shape), "state_dict: ", name,
                  ": expected shape ", at::IntArrayRef(shape), ", got ", it->second.sizes());
    AUTOMOE_CHECK(at::isFloatingType(it->second.scalar_type()), "state_dict: ", name,
                  ": expected a floating-point tensor, got ", it->second.scalar_type());
    out.emplace_back(name, it->second.detach());  // the writer moves each to the CPU in turn
    by_name.erase(it);
  }
  if (spec.tie_word_embeddings) by_name.erase("lm_head.weight");
  if (!by_name.empty()) {
    fail("state_dict: ", by_name.size(), " tensor(s) that this ", spec.model_type,
         " model does not have, e.g. ", by_name.begin()->first);
  }
  return out;
}

}  // namespace

namespace {

// The slots of a collective save: every disk tensor of the full model, in the one-process
// save's order, with the rows this rank writes.
std::vector<TensorSlot> collective_slots(const ModelSpec& spec, const Architecture& arch,
                                         const NamedTensors& params, ExpertsLayout layout,
                                         const parallel::World& world) {
  ModelSpec full = spec;
  full.moe.expert_begin = full.moe.expert_count = 0;
  const std::vector<ParamDecl> decls = parameter_layout(spec);
  AUTOMOE_CHECK(decls.size() == params.size(), "save: ", params.size(), " tensors for ",
                decls.size(), " parameters");
  const bool lead = world.rank == 0, writes_experts = world.dp_rank() == 0;
  std::vector<TensorSlot> slots;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, t] = params[i];
    AUTOMOE_CHECK(name == decls[i].name, "save: tensor ", i, " is ", name, ", expected ",
                  decls[i].name);
    const bool expert = decls[i].routed_expert && spec.moe.sharded();
    std::vector<int64_t> shape = t.sizes().vec();
    if (expert) shape[0] = spec.moe.num_experts;
    const at::Tensor meta =
        at::empty(shape, at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
    const NamedTensors disk = to_disk_tensors({{name, meta}}, expert ? full : spec, arch, layout);
    std::map<std::string, at::Tensor> mine;
    if (expert ? writes_experts : lead) {
      for (auto& [n, d] : to_disk_tensors({{name, t}}, spec, arch, layout)) mine.emplace(n, d);
    }
    for (const auto& [n, m] : disk) {
      TensorSlot slot{n, m.scalar_type(), m.sizes().vec(), {}, 0};
      const auto it = mine.find(n);
      if (it != mine.end()) {
        slot.rows = it->second;
        // The fused layout keeps [E, ...]: this rank's experts are rows of it.
        if (expert && it->second.dim() > 0 && it->second.size(0) != m.size(0)) {
          slot.row_begin = spec.moe.expert_begin;
        }
      }
      slots.push_back(std::move(slot));
    }
  }
  return slots;
}

}  // namespace

static void write_config_and_files(const LoadedConfig& loaded, const std::string& source_dir,
                                   const ModelSpec& spec, const NamedTensors& params,
                                   const std::string& dir, const SaveOptions& options);

void write_pretrained(const LoadedConfig& loaded, ExpertsLayout layout,
                      const std::string& source_dir, const ModelSpec& spec,
                      const NamedTensors& params, const std::string& dir,
                      const SaveOptions& options, const parallel::World* world) {
  const bool collective = world && world->distributed();
  const bool lead = !collective || world->rank == 0;
  const Architecture& arch = find_architecture(spec.model_type, loaded.path);
  if (collective) {
    const WriteGroup group{lead, [world](const std::string& mine, const char* what) {
                             return parallel::all_gather_strings(world->world, mine, world->device,
                                                                 what);
                           }};
    std::vector<TensorSlot> slots;
    std::string error;
    try {
      slots = collective_slots(spec, arch, params, layout, *world);
    } catch (const std::exception& e) {
      error = e.what();
    }
    parallel::agree(world->world, error, world->device, "save (planning the files)");
    save_sharded(dir, slots, options.max_shard_bytes, &group);
  } else {
    save_sharded(dir, to_disk_tensors(params, spec, arch, layout), options.max_shard_bytes);
  }
  // Rank 0 writes the rest; the other ranks return once it has (or with its error).
  std::exception_ptr failed;
  if (lead) {
    try {
      write_config_and_files(loaded, source_dir, spec, params, dir, options);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (collective) {
    std::string error;
    if (failed) {
      try {
        std::rethrow_exception(failed);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    const auto all =
        parallel::all_gather_strings(world->world, error, world->device, "save (done)");
    if (!lead && !all.front().empty()) fail("saving ", dir, ": rank 0: ", all.front());
  }
  if (failed) std::rethrow_exception(failed);
}

static void write_config_and_files(const LoadedConfig& loaded, const std::string& source_dir,
                                   const ModelSpec& spec, const NamedTensors& params,
                                   const std::string& dir, const SaveOptions& options) {
  std::error_code ec;
  std::string config_text;
  if (options.config_json) {
    config_text = *options.config_json;
  } else {
    nlohmann::json config = *loaded.json;
    config["dtype"] = dtype_to_name(params.front().second.scalar_type());
    config.erase("torch_dtype");
    // Dequantised on load, written dequantised: the checkpoint is no longer MXFP4.
    if (spec.mxfp4_experts || !spec.bnb_quantized.empty()) config.erase("quantization_config");
    config_text = config.dump(2) + "\n";
  }
  write_file_atomic((fs::path(dir) / "config.json").string(), config_text);
  for (const auto& [name, text] : options.extra_files) {
    AUTOMOE_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "config.json",
                  "save_pretrained: bad extra file name \"", name, "\"");
    write_file_atomic((fs::path(dir) / name).string(), text);
  }

  // Tokenizer, chat template, generation config: everything that is not weights or config.
  if (source_dir.empty() || !fs::is_directory(source_dir)) return;
  if (fs::equivalent(source_dir, dir, ec)) return;
  for (const auto& entry : fs::directory_iterator(source_dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    const std::string ext = entry.path().extension().string();
    if (name == "config.json" || options.extra_files.count(name) || name.rfind('.', 0) == 0 ||
        name.rfind("model", 0) == 0 || ext == ".safetensors" || ext == ".bin" || ext == ".pt" ||
        ext == ".pth") {
      continue;
    }
    std::ifstream in(entry.path(), std::ios::binary);
    AUTOMOE_CHECK(in.good(), "copying ", entry.path().string(), " to ", dir, ": cannot read it");
    std::ostringstream bytes;
    bytes << in.rdbuf();
    write_file_atomic((fs::path(dir) / name).string(), bytes.str());
  }
}

void save_pretrained(const PretrainedModel& model, const std::string& dir,
                     const SaveOptions& options) {
  const parallel::World* world = model.world.get();
  NamedTensors params;
  if (options.gathered) {  // every expert given: written here alone, as by one process
    AUTOMOE_CHECK(options.tensors, "save_pretrained(gathered): the gathered tensors are missing");
    ModelSpec whole = model.decoder->spec();
    whole.moe.expert_begin = 0;
    whole.moe.expert_count = 0;
    write_pretrained(model.config, options.layout.value_or(model.layout), model.source_dir, whole,
                     tensors_to_save(model, options.tensors, true), dir, options, nullptr);
    return;
  }
  if (world && world->distributed()) {  // a rank's bad state_dict fails the save on every rank
    std::string error;
    try {
      params = tensors_to_save(model, options.tensors);
    } catch (const std::exception& e) {
      error = e.what();
    }
    parallel::agree(world->world, error, world->device, "save_pretrained");
  } else {
    params = tensors_to_save(model, options.tensors);
  }
  write_pretrained(model.config, options.layout.value_or(model.layout), model.source_dir,
                   model.decoder->spec(), params, dir, options, world);
}

}  // namespace automoe
