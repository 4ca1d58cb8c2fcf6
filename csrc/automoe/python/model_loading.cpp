// automoe._C.load_pretrained / init_model: an engine model from a checkpoint directory (optionally
// this rank's experts only, under expert parallelism) or with fresh parameters from a config.
#include <nlohmann/json.hpp>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/config.h"
#include "automoe/moe/dispatcher.h"
#include "automoe/parallel/world.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {
namespace {

std::optional<c10::ScalarType> parse_dtype(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  return dtype_from_name(*name, "dtype");
}

}  // namespace

void bind_model_loading(py::module_& m) {
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
        // The drop-in holds dense weights: experts a bitsandbytes checkpoint stores quantised are
        // for automoe train's frozen LoRA base (their meta parameters must not reach Python).
        auto dense_only = [&](PretrainedModel m) {
          AUTOMOE_CHECK(!m.decoder->has_quantized(), dir, ": the routed experts are stored "
                        "bitsandbytes-quantised (", m.config.spec.bnb_quantized, "); the drop-in "
                        "holds dense weights: train LoRA on them with automoe train (a peft: "
                        "section), or write them dequantised with automoe convert");
          return m;
        };
        if (!parallel) return dense_only(load_pretrained(dir, dt, cfg, config_json));
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
        return dense_only(std::move(m));
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
}

}  // namespace automoe::bindings
