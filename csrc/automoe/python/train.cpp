// automoe._C.resolve_recipe / train: a training recipe validated, and the trainer run in this
// process as one rank of a torch.distributed run.
#include <pybind11/functional.h>

#include "automoe/core/error.h"
#include "automoe/parallel/world.h"
#include "automoe/python/bindings.h"
#include "automoe/train/recipe.h"
#include "automoe/train/trainer.h"

namespace automoe::bindings {

void bind_train(py::module_& m) {
  m.def(
      "resolve_recipe",
      [](const std::string& json_text, const std::string& origin) {
        return train::Recipe::parse(json_text, origin).to_json();
      },
      py::arg("json_text"), py::arg("origin"),
      "Validates a training recipe (JSON text) and returns it with every default filled in.");
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
      py::arg("recipe_text"), py::arg("origin"), py::arg("train_data"), py::arg("validation_data"),
      py::arg("train_key"), py::arg("world_group"), py::arg("ep_group"), py::arg("dp_group"),
      py::arg("world_size"), py::arg("ep"), py::arg("collective_device"),
      py::arg("peak_memory_bytes") = nullptr, py::arg("reset_peak_memory") = nullptr,
      "Runs `automoe train` in this process as one rank of a torch.distributed run (the groups "
      "by their registered names). Returns the trainer's exit status.");
}

}  // namespace automoe::bindings
