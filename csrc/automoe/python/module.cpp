// automoe._C: the engine as seen from Python. Thin: argument conversion only, no tensor math.
// Each area registers in its own file (bindings.h); the order below is the registration order.
#include "automoe/core/error.h"
#include "automoe/python/bindings.h"

using namespace automoe;
using namespace automoe::bindings;

PYBIND11_MODULE(_C, m) {
  m.doc() = "AutoMoE engine (C++ on LibTorch)";
  py::register_exception<Error>(m, "AutoMoEError", PyExc_ValueError);

  bind_config(m);
  bind_train(m);
  // Model before KVCache: Model.forward's signature names the cache as the C++ type, as before.
  bind_model(m);
  bind_kv_cache(m);
  bind_model_loading(m);
  bind_components(m);
  bind_safetensors(m);
  bind_optimizer(m);
}
