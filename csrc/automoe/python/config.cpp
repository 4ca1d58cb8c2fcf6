// automoe._C: the model types the engine implements, and config.json checked as the engine reads
// it.
#include "automoe/model/config.h"

#include "automoe/model/arch/registry.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {

void bind_config(py::module_& m) {
  m.def("supported_model_types", &supported_model_types);
  m.def(
      "check_config", [](const std::string& dir) { return load_config(dir).spec.model_type; },
      py::arg("dir"),
      "Parses DIR/config.json as the engine does (an AutoMoEError names the file and key); returns "
      "its model_type.");
}

}  // namespace automoe::bindings
