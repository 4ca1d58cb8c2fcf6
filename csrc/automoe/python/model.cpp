// automoe._C.Model: an engine model (`PretrainedModel`) as the drop-in drives it: its spec and
// parameters, the tensors the Python side binds and adapts, the forward, deep copies, the save.
#include <nlohmann/json.hpp>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/arch/registry.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/kv_cache.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {
namespace {

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
  d["bnb_quantized"] = s.bnb_quantized;
  d["tie_word_embeddings"] = s.tie_word_embeddings;
  d["dtype"] = dtype_to_name(s.dtype);
  return d;
}

void set_adapters(
    PretrainedModel& self,
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
    AUTOMOE_CHECK(a.dim() == (s.experts ? 3 : 2), "LoRA: the adapter of ", name, " has A ",
                  a.sizes());
    s.r = a.size(-2);
    s.a = a;
    s.b = b;
    s.scaling = scaling;
    s.dropout = dropout;
    sites.push_back(std::move(s));
  }
  self.decoder->set_adapters(std::move(sites));
}

// Expert parallelism: this rank, the mesh and the experts it holds; None in one process.
py::object parallel_info(const PretrainedModel& self) {
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
}

}  // namespace

void bind_model(py::module_& m) {
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
      .def_property_readonly("parallel", &parallel_info)
      .def("named_parameters",
           [](const PretrainedModel& self) { return self.decoder->named_parameters(); })
      .def("set_parameter", [](PretrainedModel& self, const std::string& name,
                               const at::Tensor& t) { self.decoder->set_parameter(name, t); })
      .def("set_adapters", &set_adapters)
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
             const std::optional<NamedTensors>& tensors, bool gathered) {
            SaveOptions o;
            o.gathered = gathered;
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
          py::arg("tensors") = py::none(), py::arg("gathered") = false);
}

}  // namespace automoe::bindings
