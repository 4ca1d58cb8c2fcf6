// automoe._C: the engine as seen from Python. Thin: argument conversion only, no tensor math.
#include <torch/extension.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/checkpoint.h"
#include "automoe/model/arch/registry.h"
#include "automoe/train/recipe.h"

namespace py = pybind11;
using namespace automoe;

namespace {

std::optional<c10::ScalarType> parse_dtype(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return dtype_from_name(*name, "dtype");
}

py::dict forward(const PretrainedModel& m, const at::Tensor& input_ids,
                 std::optional<at::Tensor> attention_mask, std::optional<at::Tensor> position_ids,
                 std::optional<at::Tensor> labels, std::optional<bool> output_router_logits,
                 std::optional<double> num_items_in_batch, bool split_packed_documents,
                 bool activation_checkpointing) {
  ForwardArgs args{input_ids,
                   std::move(attention_mask),
                   std::move(position_ids),
                   std::move(labels),
                   output_router_logits,
                   num_items_in_batch,
                   split_packed_documents};
  args.activation_checkpointing = activation_checkpointing;
  ForwardResult r;
  {
    py::gil_scoped_release no_gil;
    r = m.decoder->forward(args);
  }
  py::dict out;
  // Undefined when the fused linear cross-entropy computed the loss without logits.
  if (r.logits.defined()) {
    out["logits"] = r.logits;
  } else {
    out["logits"] = py::none();
  }
  out["loss"] = r.loss ? py::cast(*r.loss) : py::none();
  out["aux_loss"] = r.aux_loss ? py::cast(*r.aux_loss) : py::none();
  if (args.output_router_logits.value_or(m.decoder->spec().moe.output_router_logits)) {
    py::tuple logits(r.router_logits.size());
    for (size_t i = 0; i < r.router_logits.size(); ++i) logits[i] = r.router_logits[i];
    out["router_logits"] = logits;
  } else {
    out["router_logits"] = py::none();
  }
  return out;
}

py::dict spec_dict(const ModelSpec& s) {
  py::dict d;
  d["model_type"] = s.model_type;
  d["vocab_size"] = s.vocab_size;
  d["hidden_size"] = s.hidden_size;
  d["num_layers"] = s.num_layers;
  d["num_heads"] = s.num_heads;
  d["num_kv_heads"] = s.num_kv_heads;
  d["head_dim"] = s.head_dim;
  d["num_experts"] = s.moe.num_experts;
  d["top_k"] = s.moe.top_k;
  d["moe_intermediate_size"] = s.moe.intermediate_size;
  d["norm_topk_prob"] = s.moe.norm_topk_prob;
  d["router_aux_loss_coef"] = s.moe.router_aux_loss_coef;
  d["output_router_logits"] = s.moe.output_router_logits;
  d["layer_is_moe"] = s.layer_is_moe;
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
      .def("named_parameters",
           [](const PretrainedModel& self) { return self.decoder->named_parameters(); })
      .def("set_parameter", [](PretrainedModel& self, const std::string& name,
                               const at::Tensor& t) { self.decoder->set_parameter(name, t); })
      .def("backend", [](const PretrainedModel& self) { return self.decoder->backend().to_map(); })
      .def("set_backend",
           [](PretrainedModel& self, const std::map<std::string, std::string>& fields) {
             self.decoder->set_backend(BackendConfig::from_map(fields, "backend"));
           })
      .def("forward", &forward, py::arg("input_ids"), py::arg("attention_mask") = py::none(),
           py::arg("position_ids") = py::none(), py::arg("labels") = py::none(),
           py::arg("output_router_logits") = py::none(), py::arg("num_items_in_batch") = py::none(),
           py::arg("split_packed_documents") = true, py::arg("activation_checkpointing") = false)
      .def(
          "save_pretrained",
          [](const PretrainedModel& self, const std::string& dir,
             const std::optional<std::string>& layout, uint64_t max_shard_bytes) {
            std::optional<ExpertsLayout> l;
            if (layout) l = layout_from_string(*layout, "layout");
            py::gil_scoped_release no_gil;
            save_pretrained(self, dir, l, max_shard_bytes);
          },
          py::arg("dir"), py::arg("layout") = py::none(), py::arg("max_shard_bytes") = 5ull << 30);

  m.def(
      "load_pretrained",
      [](const std::string& dir, const std::optional<std::string>& dtype,
         const std::map<std::string, std::string>& backend) {
        const BackendConfig cfg = BackendConfig::from_map(backend, "backend");
        // "auto" (Transformers v5's default): the dtype config.json names, else the stored one.
        std::optional<c10::ScalarType> dt;
        if (dtype && *dtype == "auto") {
          const LoadedConfig cfg = load_config(dir);
          if (cfg.json->contains("dtype") || cfg.json->contains("torch_dtype")) dt = cfg.spec.dtype;
        } else {
          dt = parse_dtype(dtype);
        }
        py::gil_scoped_release no_gil;
        return load_pretrained(dir, dt, cfg);
      },
      py::arg("dir"), py::arg("dtype") = py::none(),
      py::arg("backend") = std::map<std::string, std::string>{});

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
}
