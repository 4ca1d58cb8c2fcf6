// automoe._C: the engine as seen from Python. Thin: argument conversion only, no tensor math.
#include <torch/extension.h>
#include <pybind11/functional.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/config.h"
#include "automoe/model/arch/registry.h"
#include "automoe/model/kv_cache.h"
#include "automoe/moe/dispatcher.h"
#include "automoe/moe/experts.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/parallel/world.h"
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include "automoe/train/optimizer.h"
#include "automoe/train/recipe.h"
#include "automoe/train/trainer.h"

namespace py = pybind11;
using namespace automoe;

namespace {

std::optional<c10::ScalarType> parse_dtype(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return dtype_from_name(*name, "dtype");
}

py::dict forward(const PretrainedModel& m, std::optional<at::Tensor> input_ids,
                 std::optional<at::Tensor> attention_mask, std::optional<at::Tensor> position_ids,
                 std::optional<at::Tensor> labels, std::optional<bool> output_router_logits,
                 std::optional<double> num_items_in_batch, bool split_packed_documents,
                 bool activation_checkpointing, std::optional<at::Tensor> inputs_embeds,
                 std::shared_ptr<KVCache> cache, bool lm_head, int64_t logits_to_keep,
                 std::optional<at::Tensor> logits_indices, bool output_hidden_states,
                 std::optional<double> router_aux_loss_coef, bool training) {
  ForwardArgs args;
  if (input_ids) args.input_ids = *input_ids;
  args.attention_mask = std::move(attention_mask);
  args.position_ids = std::move(position_ids);
  args.labels = std::move(labels);
  args.output_router_logits = output_router_logits;
  args.num_items_in_batch = num_items_in_batch;
  args.split_packed_documents = split_packed_documents;
  args.activation_checkpointing = activation_checkpointing;
  args.inputs_embeds = std::move(inputs_embeds);
  args.cache = cache.get();
  args.lm_head = lm_head;
  args.logits_to_keep = logits_to_keep;
  args.logits_indices = std::move(logits_indices);
  args.output_hidden_states = output_hidden_states;
  args.router_aux_loss_coef = router_aux_loss_coef;
  args.training = training;
  ForwardResult r;
  {
    py::gil_scoped_release no_gil;
    r = m.decoder->forward(args);
  }
  auto tensor_or_none = [](const at::Tensor& t) -> py::object {
    return t.defined() ? py::cast(t) : py::none();
  };
  auto tuple_of = [](const std::vector<at::Tensor>& ts) {
    py::tuple out(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) out[i] = ts[i];
    return out;
  };
  py::dict out;
  // Undefined when the fused linear cross-entropy computed the loss without logits, or when only
  // the backbone ran.
  out["logits"] = tensor_or_none(r.logits);
  out["last_hidden_state"] = tensor_or_none(r.last_hidden_state);
  out["loss"] = r.loss ? py::cast(*r.loss) : py::none();
  out["aux_loss"] = r.aux_loss ? py::cast(*r.aux_loss) : py::none();
  out["router_logits"] =
      args.output_router_logits.value_or(m.decoder->spec().moe.output_router_logits)
          ? py::object(tuple_of(r.router_logits))
          : py::object(py::none());
  out["hidden_states"] =
      output_hidden_states ? py::object(tuple_of(r.hidden_states)) : py::object(py::none());
  return out;
}

py::dict spec_dict(const ModelSpec& s) {
  py::dict d;
  d["model_type"] = s.model_type;
  d["vocab_size"] = s.vocab_size;
  d["hidden_size"] = s.hidden_size;
  d["num_layers"] = s.num_layers;
  d["attention"] = s.attn.kind == AttentionKind::kMLA ? "mla" : "gqa";
  d["num_heads"] = s.attn.num_heads;
  d["num_kv_heads"] = s.attn.num_kv_heads;
  d["head_dim"] = s.attn.head_dim;
  d["num_experts"] = s.moe.num_experts;
  d["top_k"] = s.moe.top_k;
  d["moe_intermediate_size"] = s.moe.intermediate_size;
  d["norm_topk_prob"] = s.moe.norm_topk_prob;
  d["router_aux_loss_coef"] = s.moe.router_aux_loss_coef;
  d["output_router_logits"] = s.moe.output_router_logits;
  std::vector<bool> is_moe;
  for (int64_t l = 0; l < s.num_layers; ++l) is_moe.push_back(s.is_moe(l));
  d["layer_is_moe"] = is_moe;
  d["aux_loss"] = s.moe.aux_loss;
  d["mxfp4_experts"] = s.mxfp4_experts;
  d["tie_word_embeddings"] = s.tie_word_embeddings;
  d["dtype"] = dtype_to_name(s.dtype);
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "AutoMoE engine (C++ on LibTorch)";
  py::register_exception<Error>(m, "AutoMoEError", PyExc_ValueError);

  m.def("supported_model_types", &supported_model_types);
  m.def(
      "check_config",
      [](const std::string& dir) { return load_config(dir).spec.model_type; },
      py::arg("dir"),
      "Parses DIR/config.json as the engine does (an AutoMoEError names the file and key); returns "
      "its model_type.");
  m.def(
      "resolve_recipe",
      [](const std::string& json_text, const std::string& origin) {
        return train::Recipe::parse(json_text, origin).to_json();
      },
      py::arg("json_text"), py::arg("origin"),
      "Validates a training recipe (JSON text) and returns it with every default filled in.");

  py::class_<PretrainedModel>(m, "Model")
      .def_property_readonly("layout",
                             [](const PretrainedModel& self) { return to_string(self.layout); })
      .def_property_readonly("config_json",
                             [](const PretrainedModel& self) { return self.config.json->dump(); })
      .def_property_readonly(
          "spec", [](const PretrainedModel& self) { return spec_dict(self.decoder->spec()); })
      .def_property_readonly("source_dir",
                             [](const PretrainedModel& self) { return self.source_dir; })
      .def_property_readonly("routed_expert_names",
                             [](const PretrainedModel& self) {
                               std::vector<std::string> out;
                               for (const auto& d : parameter_layout(self.decoder->spec())) {
                                 if (d.routed_expert) out.push_back(d.name);
                               }
                               return out;
                             })
      .def_property_readonly("parallel",
                             [](const PretrainedModel& self) -> py::object {
                               if (!self.world) return py::none();
                               const auto& w = *self.world;
                               const ModelSpec& spec = self.decoder->spec();
                               py::dict d;
                               d["rank"] = w.rank;
                               d["world_size"] = w.mesh.world;
                               d["ep"] = w.mesh.ep;
                               d["dp"] = w.mesh.dp;
                               d["ep_rank"] = w.ep_rank();
                               d["dp_rank"] = w.dp_rank();
                               d["expert_begin"] = spec.moe.expert_begin;
                               d["expert_count"] = spec.moe.local_experts();
                               d["device"] = w.device.str();
                               return d;
                             })
      .def("named_parameters",
           [](const PretrainedModel& self) { return self.decoder->named_parameters(); })
      .def("set_parameter", [](PretrainedModel& self, const std::string& name,
                               const at::Tensor& t) { self.decoder->set_parameter(name, t); })
      .def("set_adapters",
           [](PretrainedModel& self,
              const std::vector<std::tuple<std::string, at::Tensor, at::Tensor, double, double>>& in) {
             // (base weight name, A, B, scaling, dropout): linear A [r, K], B [O, r]; routed
             // experts A [E, r, K], B [E, O, r]. Replaces the adapters set before.
             const NamedTensors& params = self.decoder->named_parameters();
             std::vector<LoraSite> sites;
             for (const auto& [name, a, b, scaling, dropout] : in) {
               LoraSite s;
               for (size_t i = 0; i < params.size(); ++i) {
                 if (params[i].first == name) s.slot = static_cast<int64_t>(i);
               }
               AUTOMOE_CHECK(s.slot >= 0, "LoRA: the model has no weight named ", name);
               const size_t dot = name.rfind('.');
               s.module = name.substr(0, dot);
               s.param = name.substr(dot + 1);
               s.experts = params[s.slot].second.dim() == 3;
               AUTOMOE_CHECK(a.dim() == (s.experts ? 3 : 2), "LoRA: the adapter of ", name,
                             " has A ", a.sizes());
               s.r = a.size(-2);
               s.a = a;
               s.b = b;
               s.scaling = scaling;
               s.dropout = dropout;
               sites.push_back(std::move(s));
             }
             self.decoder->set_adapters(std::move(sites));
           })
      .def("backend", [](const PretrainedModel& self) { return self.decoder->backend().to_map(); })
      .def("set_backend",
           [](PretrainedModel& self, const std::map<std::string, std::string>& fields) {
             self.decoder->set_backend(BackendConfig::from_map(fields, "backend"));
           })
      .def("forward", &forward, py::arg("input_ids") = py::none(),
           py::arg("attention_mask") = py::none(), py::arg("position_ids") = py::none(),
           py::arg("labels") = py::none(), py::arg("output_router_logits") = py::none(),
           py::arg("num_items_in_batch") = py::none(), py::arg("split_packed_documents") = true,
           py::arg("activation_checkpointing") = false, py::arg("inputs_embeds") = py::none(),
           py::arg("cache") = nullptr, py::arg("lm_head") = true, py::arg("logits_to_keep") = 0,
           py::arg("logits_indices") = py::none(), py::arg("output_hidden_states") = false,
           py::arg("router_aux_loss_coef") = py::none(), py::arg("training") = false)
      .def("rebind",
           [](PretrainedModel& self, const std::vector<std::optional<at::Tensor>>& tensors) {
             self.decoder->rebind(tensors);
           })
      .def(
          "resize_vocab",
          [](PretrainedModel& self, const at::Tensor& embed,
             const std::optional<at::Tensor>& lm_head) {
            self.decoder->resize_vocab(embed, lm_head);
          },
          py::arg("embed"), py::arg("lm_head") = py::none())
      .def("__deepcopy__",
           [](const PretrainedModel& self, py::dict /*memo*/) {
             // The copy shares the parameter tensors until its owner re-binds its own copies.
             PretrainedModel copy;
             copy.config = self.config;
             copy.layout = self.layout;
             copy.source_dir = self.source_dir;
             copy.decoder = std::make_unique<Decoder>(*self.decoder);
             copy.world = self.world;
             return copy;
           })
      .def("to_memory_tensors",
           [](const PretrainedModel& self, const NamedTensors& tensors) {
             const ModelSpec& spec = self.decoder->spec();
             return to_memory_tensors(tensors, spec,
                                      find_architecture(spec.model_type, "to_memory_tensors"));
           })
      .def(
          "save_pretrained",
          [](const PretrainedModel& self, const std::string& dir,
             const std::optional<std::string>& layout, uint64_t max_shard_bytes,
             const std::optional<std::string>& config_json,
             const std::map<std::string, std::string>& extra_files,
             const std::optional<NamedTensors>& tensors) {
            SaveOptions o;
            if (layout) o.layout = layout_from_string(*layout, "layout");
            o.max_shard_bytes = max_shard_bytes;
            o.config_json = config_json;
            o.extra_files = extra_files;
            o.tensors = tensors;
            py::gil_scoped_release no_gil;
            save_pretrained(self, dir, o);
          },
          py::arg("dir"), py::arg("layout") = py::none(), py::arg("max_shard_bytes") = 5ull << 30,
          py::arg("config_json") = py::none(),
          py::arg("extra_files") = std::map<std::string, std::string>{},
          py::arg("tensors") = py::none());

  py::class_<KVCache, std::shared_ptr<KVCache>>(m, "KVCache")
      .def(py::init<int64_t>(), py::arg("num_layers"))
      .def_property_readonly("num_layers", &KVCache::num_layers)
      .def_property_readonly("batch_size", &KVCache::batch_size)
      .def("length", &KVCache::length, py::arg("layer") = 0)
      .def("keys",
           [](const KVCache& c, int64_t layer) -> py::object {
             const at::Tensor t = c.keys(layer);
             return t.defined() ? py::cast(t) : py::none();
           })
      .def("values",
           [](const KVCache& c, int64_t layer) -> py::object {
             const at::Tensor t = c.values(layer);
             return t.defined() ? py::cast(t) : py::none();
           })
      .def("append", [](KVCache& c, int64_t layer, const at::Tensor& k,
                        const at::Tensor& v) { return c.append(layer, k, v); })
      .def("index_batch", &KVCache::index_batch)
      .def("repeat_interleave_batch", &KVCache::repeat_interleave_batch)
      .def("remove_last", &KVCache::remove_last)
      .def("reset", &KVCache::reset)
      .def("clone", &KVCache::clone);

  m.def(
      "load_pretrained",
      [](const std::string& dir, const std::optional<std::string>& dtype,
         const std::map<std::string, std::string>& backend,
         const std::optional<std::string>& config_json,
         const std::optional<std::map<std::string, std::string>>& parallel) {
        const BackendConfig cfg = BackendConfig::from_map(backend, "backend");
        // "auto" (Transformers v5's default): the dtype config.json names, else the stored one.
        std::optional<c10::ScalarType> dt;
        if (dtype && *dtype == "auto") {
          const LoadedConfig cfg =
              config_json ? parse_config(*config_json, dir + "/config.json") : load_config(dir);
          // A key that is absent or null (Transformers writes "dtype": null): each tensor's own.
          auto present = [&](const char* key) {
            const auto it = cfg.json->find(key);
            return it != cfg.json->end() && !it->is_null();
          };
          if (present("dtype") || present("torch_dtype")) dt = cfg.spec.dtype;
        } else {
          dt = parse_dtype(dtype);
        }
        py::gil_scoped_release no_gil;
        if (!parallel) return load_pretrained(dir, dt, cfg, config_json);
        // Expert parallelism (from_pretrained(ep_size=N) under torch.distributed): this rank's
        // experts only, exchanged with the other ranks of its EP group by the dispatcher.
        const auto& p = *parallel;
        const std::string origin = "from_pretrained(ep_size=" + p.at("ep") + ")";
        const LoadedConfig loaded =
            config_json ? parse_config(*config_json, dir + "/config.json") : load_config(dir);
        const int64_t experts = loaded.spec.moe.num_experts;
        AUTOMOE_CHECK(experts > 0, origin, ": ", loaded.spec.model_type, " has no routed experts");
        const parallel::Mesh mesh = parallel::make_mesh(std::stoll(p.at("world_size")),
                                                        std::stoll(p.at("ep")), 0, experts, origin);
        auto world = std::make_shared<parallel::World>(
            parallel::world_from_group_names(p.at("world_group"), p.at("ep_group"),
                                             p.at("dp_group"), mesh, c10::Device(p.at("device"))));
        AUTOMOE_CHECK(
            cfg.dispatcher != "local", origin,
            ": backend dispatcher 'local' runs every "
            "expert in this process; use 'auto', 'alltoall', 'alltoall_overlap' or 'allgather'");
        const parallel::ExpertRange own = parallel::experts_of(world->ep_rank(), mesh.ep, experts);
        PretrainedModel m = load_pretrained(dir, dt, cfg, config_json, {own.begin, own.count});
        m.decoder->set_dispatcher(moe::make_dispatcher(
            cfg.dispatcher == "auto" ? "alltoall" : cfg.dispatcher, world->ep, experts));
        m.world = std::move(world);
        return m;
      },
      py::arg("dir"), py::arg("dtype") = py::none(),
      py::arg("backend") = std::map<std::string, std::string>{},
      py::arg("config_json") = py::none(), py::arg("parallel") = py::none());
  m.def(
      "init_model",
      [](const std::string& config_json, const std::string& dtype,
         const std::map<std::string, std::string>& backend, uint64_t seed) {
        const BackendConfig cfg = BackendConfig::from_map(backend, "backend");
        const c10::ScalarType dt = dtype_from_name(dtype, "dtype");
        py::gil_scoped_release no_gil;
        return init_pretrained(config_json, "from_config", dt, cfg, seed);
      },
      py::arg("config_json"), py::arg("dtype"),
      py::arg("backend") = std::map<std::string, std::string>{}, py::arg("seed") = 0,
      "A model with fresh parameters (Transformers' initialisation) for a config (JSON text).");

  m.def(
      "_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask, bool is_causal, double scale,
         const std::string& attn, const std::optional<at::Tensor>& sinks) {
        // The attention component a backend resolves to (sdpa / eager), for tests: [B, N, S, D]
        // queries, [B, N_kv, S, D] keys and values, GPT-OSS's per-head sinks [N] (eager);
        // autograd flows through it.
        const ComponentOps ops = resolve(BackendConfig::from_map({{"attn", attn}}, "backend"));
        return ops.attention(q, k, v, mask, is_causal, scale, sinks);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(),
      py::arg("is_causal") = false, py::arg("scale") = 1.0, py::arg("attn") = "sdpa",
      py::arg("sinks") = py::none());
  m.def(
      "save_safetensors",
      [](const std::string& path, const NamedTensors& tensors,
         std::map<std::string, std::string> metadata) {
        py::gil_scoped_release no_gil;
        save_safetensors(path, tensors, std::move(metadata));
      },
      py::arg("path"), py::arg("tensors"),
      py::arg("metadata") = std::map<std::string, std::string>{});
  m.def(
      "load_safetensors",
      [](const std::string& path) {
        SafetensorsFile f(path);
        NamedTensors out;
        for (const auto& name : f.names()) out.emplace_back(name, f.get(name));
        return py::make_tuple(out, f.metadata());
      },
      py::arg("path"));
  m.def(
      "save_sharded",
      [](const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes) {
        py::gil_scoped_release no_gil;
        return save_sharded(dir, tensors, max_shard_bytes);
      },
      py::arg("dir"), py::arg("tensors"), py::arg("max_shard_bytes"));

  m.def(
      "_adamw_step",
      [](std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
         std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
         std::vector<at::Tensor> remainders, int64_t step, double lr, double beta1, double beta2,
         double eps, double weight_decay, double grad_scale, std::vector<at::Tensor> exp_avg_scales,
         std::vector<at::Tensor> exp_avg_sq_scales, bool aten) {
        // The trainer's AdamW update for bf16 training (optimizer.master_weights / state_dtype),
        // one step on the given tensors in place, every tensor in the decay group: for tests
        // against torch.optim.AdamW. 8-bit moments: uint8 codes with their block scales. `aten`:
        // the update other devices run (ATen ops), here on CPU tensors.
        const size_t n = params.size();
        const bool q8 = !exp_avg_scales.empty();
        AUTOMOE_CHECK(!q8 || (exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n),
                      "_adamw_step: 8-bit moments need both scales for every parameter");
        AUTOMOE_CHECK(n > 0 && grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                          (remainders.empty() || remainders.size() == n),
                      "_adamw_step: one gradient, moment pair (and remainder) per parameter");
        NamedTensors named;
        for (size_t i = 0; i < n; ++i) named.emplace_back("p" + std::to_string(i), params[i]);
        using Masters = train::AdamW::Masters;
        const Masters kind = !remainders.empty()                   ? Masters::kRemainders
                             : params[0].scalar_type() == at::kFloat ? Masters::kFloat32
                                                                     : Masters::kNone;
        py::gil_scoped_release no_gil;
        train::AdamW opt;
        opt.init(named, std::vector<bool>(n, false), /*own_grads=*/true, /*full_state=*/true, kind,
                 q8 ? at::kByte : exp_avgs[0].scalar_type(), remainders);
        opt.decay.assign(n, true);
        opt.aten_update = aten;
        for (size_t i = 0; i < n; ++i) {
          opt.exp_avg[i] = exp_avgs[i];
          opt.exp_avg_sq[i] = exp_avg_sqs[i];
          if (q8 && !opt.quantized(i)) {  // (1-D: float32 moments)
            AUTOMOE_CHECK(exp_avgs[i].scalar_type() == at::kFloat, "_adamw_step: parameter ", i,
                          ": float32 moments expected (", params[i].numel(), " elements)");
          } else if (q8) {
            AUTOMOE_CHECK(exp_avgs[i].scalar_type() == at::kByte &&
                              exp_avg_sqs[i].scalar_type() == at::kByte &&
                              exp_avgs[i].sizes() == params[i].sizes() &&
                              exp_avg_sqs[i].sizes() == params[i].sizes() &&
                              exp_avg_scales[i].scalar_type() == at::kFloat &&
                              exp_avg_sq_scales[i].scalar_type() == at::kFloat &&
                              exp_avg_scales[i].sizes() == opt.exp_avg_scale[i].sizes() &&
                              exp_avg_sq_scales[i].sizes() == opt.exp_avg_scale[i].sizes(),
                          "_adamw_step: parameter ", i, ": uint8 codes and scales of shape ",
                          opt.exp_avg_scale[i].sizes(), " expected");
            opt.exp_avg_scale[i] = exp_avg_scales[i];
            opt.exp_avg_sq_scale[i] = exp_avg_sq_scales[i];
          }
          opt.step[i].fill_(static_cast<double>(step - 1));
          opt.accumulate(i, grads[i]);
        }
        if (grad_scale != 1.0) opt.scale_grads(grad_scale);
        train::OptimizerSection o;
        o.beta1 = beta1;
        o.beta2 = beta2;
        o.eps = eps;
        o.weight_decay = weight_decay;
        opt.update(o, lr);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("remainders"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale") = 1.0,
      py::arg("exp_avg_scales") = std::vector<at::Tensor>{},
      py::arg("exp_avg_sq_scales") = std::vector<at::Tensor>{}, py::arg("aten") = false);
  m.def(
      "_qmap8",
      [](bool is_signed) {
        // The 8-bit moments' map (optimizer.state_dtype: 8bit): its 256 values and 255 midpoints.
        const at::Tensor v = at::from_blob(const_cast<float*>(ops::cpu::vec::qmap8(is_signed)),
                                           {256}, at::kFloat).clone();
        const at::Tensor m = at::from_blob(const_cast<float*>(ops::cpu::vec::qmid8(is_signed)),
                                           {255}, at::kFloat).clone();
        return py::make_tuple(v, m);
      },
      py::arg("is_signed"));
  m.def(
      "_code8",
      [](const at::Tensor& x, bool is_signed, bool row) {
        // The 8-bit code of each float32 of x: ops::cpu::vec::quantize8 (the table), or with
        // `row` quantize8_row (what the CPU kernel runs: vectorised on AVX2).
        AUTOMOE_CHECK(x.scalar_type() == at::kFloat, "_code8: float32 values expected");
        const at::Tensor xc = x.contiguous();
        at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kByte));
        const float* src = xc.data_ptr<float>();
        uint8_t* dst = out.data_ptr<uint8_t>();
        if (row) {
          ops::cpu::vec::quantize8_row(src, 1.f, is_signed, dst, xc.numel());
        } else {
          for (int64_t i = 0; i < xc.numel(); ++i) dst[i] = ops::cpu::vec::quantize8(src[i], is_signed);
        }
        return out;
      },
      py::arg("x"), py::arg("is_signed"), py::arg("row") = false);
  m.def(
      "_quantize8",
      [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
        // AdamW::quantize8 (the ATen composition the non-CPU step uses), into codes and scale.
        train::AdamW::quantize8(x, codes, scale, is_signed);
      },
      py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("is_signed"));
  m.def(
      "_dequantize8",
      [](const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
        return train::AdamW::dequantize8(codes, scale, is_signed);
      },
      py::arg("codes"), py::arg("scale"), py::arg("is_signed"));
  m.def(
      "_split_master",
      [](const at::Tensor& f32) {
        at::Tensor hi, lo;
        train::AdamW::split_master(f32, hi, lo);
        return py::make_tuple(hi, lo);
      },
      py::arg("master"));
  m.def("_join_master", &train::AdamW::join_master, py::arg("bf16"), py::arg("remainder"));

  // ---- distributed ----
  m.def(
      "train",
      [](const std::string& recipe_text, const std::string& origin, const std::string& train_data,
         const std::string& validation_data, const std::string& train_key,
         const std::string& world_group, const std::string& ep_group, const std::string& dp_group,
         int64_t world_size, int64_t ep, const std::string& collective_device,
         std::function<int64_t()> peak_memory_bytes, std::function<void()> reset_peak_memory) {
        // The device's own memory measurements (torch.cuda's, on a GPU); the process's peak RSS
        // otherwise. (pybind's function wrappers take the GIL when the engine calls them.)
        train::TrainerHooks hooks;
        hooks.peak_memory_bytes = std::move(peak_memory_bytes);
        hooks.reset_peak_memory = std::move(reset_peak_memory);
        py::gil_scoped_release no_gil;
        const train::Recipe rc = train::Recipe::parse(recipe_text, origin);
        parallel::World w;
        if (world_size > 1) {
          AUTOMOE_CHECK(ep >= 1 && world_size % ep == 0, "parallel.ep = ", ep,
                        " does not divide the ", world_size, " processes");
          parallel::Mesh mesh;
          mesh.world = world_size;
          mesh.ep = ep;
          mesh.dp = world_size / ep;
          w = parallel::world_from_group_names(world_group, ep_group, dp_group, mesh,
                                               c10::Device(collective_device));
        }
        return train::run_training(rc, {train_data, validation_data, train_key}, hooks, w);
      },
      py::arg("recipe_text"), py::arg("origin"), py::arg("train_data"),
      py::arg("validation_data"), py::arg("train_key"), py::arg("world_group"),
      py::arg("ep_group"), py::arg("dp_group"), py::arg("world_size"), py::arg("ep"),
      py::arg("collective_device"), py::arg("peak_memory_bytes") = nullptr,
      py::arg("reset_peak_memory") = nullptr,
      "Runs `automoe train` in this process as one rank of a torch.distributed run (the groups "
      "by their registered names). Returns the trainer's exit status.");
  m.def(
      "dispatch_experts",
      [](const std::string& kind, const std::string& ep_group, int64_t num_experts,
         const at::Tensor& x_TH, const at::Tensor& idx_TK, const at::Tensor& weights_TK,
         const at::Tensor& w_gate_up, const at::Tensor& w_down, const std::string& experts,
         int64_t chunks) {
        auto d = moe::make_dispatcher(kind, c10d::resolve_process_group(ep_group), num_experts,
                                      chunks);
        auto local = [&](const at::Tensor& x_NH, const at::Tensor& offsets) {
          return moe::experts_on_rows(experts, x_NH, offsets, w_gate_up, w_down, true);
        };
        at::Tensor out = d->run(x_TH, idx_TK, weights_TK, local, experts == "grouped");
        const moe::DispatchStats st = d->take_stats();
        py::dict stats;
        stats["bytes_sent"] = st.bytes_sent;
        stats["bytes_received"] = st.bytes_received;
        stats["rows_computed"] = st.rows_computed;
        stats["wait_s"] = st.wait_s;
        stats["backward_wait_s"] = st.backward_wait_s;
        return py::make_tuple(out, stats);
      },
      py::arg("kind"), py::arg("ep_group"), py::arg("num_experts"), py::arg("x"), py::arg("idx"),
      py::arg("weights"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("experts") = "grouped",
      py::arg("chunks") = 4,
      "The routed experts through an expert-parallel dispatcher (this rank holds w_gate_up / "
      "w_down, its share of the experts): the exchange the engine's MoE layers run, for tests "
      "and benchmarks. The statistics count only this call's forward.");
}
