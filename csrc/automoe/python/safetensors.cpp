// automoe._C safetensors: the engine's reader and (sharded) writer, for tests and interop.
#include "automoe/io/safetensors.h"

#include "automoe/model/checkpoint.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {

void bind_safetensors(py::module_& m) {
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

}  // namespace automoe::bindings
