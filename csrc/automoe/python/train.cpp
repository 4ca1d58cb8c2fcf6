// automoe._C.resolve_recipe / train: a training recipe validated, and the trainer run in this
// process as one rank of a torch.distributed run.
#include <pybind11/functional.h>

#include "automoe/core/error.h"
#include "automoe/parallel/world.h"
#include "automoe/python/bindings.h"
#include "automoe/model/config.h"
#include "automoe/train/peak.h"
#include "automoe/train/plan.h"
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
      "plan",
      [](const std::string& recipe_text, const std::string& origin, int64_t nproc_per_node,
         int64_t nnodes, const std::string& device, double rank_memory_gib, double peak_tflops,
         double mfu) {
        py::gil_scoped_release no_gil;
        const train::Recipe rc = train::Recipe::parse(recipe_text, origin);
        const LoadedConfig config = load_config(rc.model.path);
        train::PlanTarget t;
        t.nproc_per_node = nproc_per_node;
        t.nnodes = nnodes;
        t.device = device;
        t.rank_memory_bytes = rank_memory_gib * (1 << 30);
        t.mfu = mfu;
        t.peak_tflops = peak_tflops;
        if (t.peak_tflops <= 0 && device == "cpu") {
          // This machine's matmul peak in the compute dtype (a small product: a fraction of a
          // second even where bf16 has no native instructions).
          const auto dtype = rc.model.dtype == "bfloat16" ? c10::kBFloat16 : c10::kFloat;
          t.peak_tflops = measure_matmul_peak(c10::kCPU, dtype, 384, 3).tflops;
          t.peak_source = "measured here";
        }
        const train::Plan plan = train::make_plan(config.spec, rc, t);
        return std::make_pair(plan.to_json(), plan.to_text());
      },
      py::arg("recipe_text"), py::arg("origin"), py::arg("nproc_per_node") = 1,
      py::arg("nnodes") = 1, py::arg("device") = "cpu", py::arg("rank_memory_gib") = 0.0,
      py::arg("peak_tflops") = 0.0, py::arg("mfu") = 0.0,
      "The memory and time plan of a recipe (train/plan.h): (JSON text, the table as text).");
  m.def(
      "plan_weights",
      [](const std::string& config_json, int64_t ep, double bytes) {
        const LoadedConfig config = parse_config(config_json, "config.json");
        return py::make_tuple(train::weight_bytes(config.spec, ep, bytes),
                              train::available_cpu_memory(), config.spec.moe.num_experts);
      },
      py::arg("config_json"), py::arg("ep"), py::arg("bytes"),
      "(one rank's weight bytes under expert parallelism ep, the CPU memory available to this "
      "process, the routed experts) for the drop-in's pre-flight check.");
  m.def(
      "train",
      [](const std::string& recipe_text, const std::string& origin, const std::string& train_data,
         const std::string& validation_data, const std::string& train_key,
         const std::string& world_group, const std::string& ep_group, const std::string& dp_group,
         int64_t world_size, int64_t ep, const std::string& collective_device,
         std::function<int64_t()> peak_memory_bytes, std::function<void()> reset_peak_memory,
         std::function<int64_t()> available_memory_bytes) {
        // The device's own memory measurements (torch.cuda's, on a GPU); the process's peak RSS
        // otherwise. (pybind's function wrappers take the GIL when the engine calls them.)
        train::TrainerHooks hooks;
        hooks.peak_memory_bytes = std::move(peak_memory_bytes);
        hooks.reset_peak_memory = std::move(reset_peak_memory);
        hooks.available_memory_bytes = std::move(available_memory_bytes);
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
      py::arg("available_memory_bytes") = nullptr,
      "Runs `automoe train` in this process as one rank of a torch.distributed run (the groups "
      "by their registered names). Returns the trainer's exit status.");
}

}  // namespace automoe::bindings
