// `automoe train`: the engine half of the command. The Python front (automoe.cli) reads the YAML
// recipe, applies overrides, validates it through the same Recipe parser and tokenises the data
// into cached .amds files; it then runs this with the resolved recipe and the dataset paths.
#include <iostream>

#include "automoe/cli/commands.h"
#include "automoe/core/error.h"
#include "automoe/train/recipe.h"
#include "automoe/train/trainer.h"

#ifdef AUTOMOE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <dlfcn.h>
#endif

#include <fstream>
#include <sstream>

namespace automoe::cli {

namespace {
constexpr const char* kUsage = R"(usage: automoe train RECIPE.yaml [section.key=value ...]

Fine-tunes the recipe's Hugging Face checkpoint on its JSONL data; see docs/recipes.md.
(The `automoe` command tokenises the data, then runs the engine as:
  automoe train (--recipe-json FILE | --recipe-text JSON [--origin NAME])
                --train-data FILE.amds [--validation-data FILE.amds] [--train-key KEY])
)";
}  // namespace

int train(const Args& args) {
  std::string recipe_file, recipe_text, origin, train_data, val_data, train_key;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      AUTOMOE_CHECK(i + 1 < args.size(), a, ": expected a value");
      return args[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--recipe-json") {
      recipe_file = value();
    } else if (a == "--recipe-text") {
      recipe_text = value();
    } else if (a == "--origin") {
      origin = value();
    } else if (a == "--train-data") {
      train_data = value();
    } else if (a == "--validation-data") {
      val_data = value();
    } else if (a == "--train-key") {
      train_key = value();
    } else {
      std::cerr << "automoe train: unexpected argument \"" << a
                << "\" (run recipes through the `automoe` command, which tokenises the data)\n\n"
                << kUsage;
      return 2;
    }
  }
  if ((recipe_file.empty() == recipe_text.empty()) || train_data.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  if (!recipe_file.empty()) {
    std::ifstream in(recipe_file);
    AUTOMOE_CHECK(in.good(), recipe_file, ": cannot open");
    std::stringstream ss;
    ss << in.rdbuf();
    recipe_text = ss.str();
    if (origin.empty()) origin = recipe_file;
  }
  const train::Recipe recipe =
      train::Recipe::parse(recipe_text, origin.empty() ? "recipe" : origin);
  train::TrainerHooks hooks;
#ifdef AUTOMOE_TORCH_CUDA
  if (recipe.train.device != "cpu" && c10::cuda::device_count() > 0) {
    const c10::DeviceIndex index =
        recipe.train.device.rfind("cuda:", 0) == 0
            ? static_cast<c10::DeviceIndex>(std::stoi(recipe.train.device.substr(5)))
            : c10::cuda::current_device();
    hooks.peak_memory_bytes = [index] {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
      return static_cast<int64_t>(stats.allocated_bytes[0].peak);
    };
    hooks.reset_peak_memory = [index] { c10::cuda::CUDACachingAllocator::resetPeakStats(index); };
    // The pre-flight check's: what the GPU still has free (other processes' use included).
    // (cudaMemGetInfo from the CUDA runtime torch has loaded: no link-time dependency on it.)
    hooks.available_memory_bytes = [index]() -> int64_t {
      using MemGetInfo = int (*)(size_t*, size_t*);
      static const auto get = reinterpret_cast<MemGetInfo>(dlsym(RTLD_DEFAULT, "cudaMemGetInfo"));
      if (get == nullptr) return 0;  // unknown: the check is skipped
      const c10::cuda::CUDAGuard guard(index);
      size_t free = 0, total = 0;
      return get(&free, &total) == 0 ? static_cast<int64_t>(free) : 0;
    };
  }
#endif
  return train::run_training(recipe, {train_data, val_data, train_key}, hooks);
}

}  // namespace automoe::cli
