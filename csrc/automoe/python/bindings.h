// automoe._C's registration functions, one per area; module.cpp calls them in a fixed order (a
// class must be registered before a function whose signature names it).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace automoe::bindings {

namespace py = pybind11;

void bind_config(py::module_& m);         // supported_model_types, check_config (config.cpp)
void bind_model(py::module_& m);          // Model (model.cpp)
void bind_kv_cache(py::module_& m);       // KVCache (kv_cache.cpp)
void bind_model_loading(py::module_& m);  // load_pretrained, init_model (model_loading.cpp)
void bind_components(py::module_& m);     // _attention, dispatch_experts (components.cpp)
void bind_safetensors(py::module_& m);    // save/load_safetensors, save_sharded (safetensors.cpp)
void bind_optimizer(py::module_& m);  // _adamw_step and the 8-bit / master helpers (optimizer.cpp)
void bind_train(py::module_& m);      // resolve_recipe, train (train.cpp)

}  // namespace automoe::bindings
