// automoe._C.KVCache: the engine's per-layer key/value buffers (what automoe.EngineCache wraps).
#include "automoe/model/kv_cache.h"

#include "automoe/python/bindings.h"

namespace automoe::bindings {

void bind_kv_cache(py::module_& m) {
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
}

}  // namespace automoe::bindings
