// `automoe` — the command-line entry point: dispatches to one file per subcommand.
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <cstdio>
#include <iostream>

#include "automoe/cli/commands.h"
#include "automoe/core/error.h"
#include "automoe/ops/cpu/isa.h"

namespace {

constexpr const char* kUsage = R"(usage: automoe <command> [args]

commands:
  train RECIPE.yaml [key=value ...]
                              fine-tune a Hugging Face MoE checkpoint on JSONL data and export a
                              Hugging Face checkpoint (see docs/recipes.md)
  plan RECIPE.yaml [--nproc-per-node N --nnodes M --device cpu|cuda --gpu-memory GiB --json]
                              per-rank peak memory and step time of a recipe's run, and the
                              configurations that fit (see docs/recipes.md)
  report RUN_DIR              loss curve and expert-load heat map of a training run (PNG files)
  (train, plan and report start in the Python `automoe` command: `pip install .`, or .venv/bin/automoe
   after `make setup`)
  inspect DIR                 architecture, parameter counts, experts layout and dtype of a
                              Hugging Face checkpoint directory
  convert IN OUT --layout per-expert|fused [--dtype float32|bfloat16|float16]
                 [--max-shard-size SIZE]
                              rewrite a checkpoint with the other experts layout (bit-exact)
  export ADAPTER OUT --merge [--base DIR] [--dtype NAME] [--layout per-expert|fused]
                              merge a PEFT LoRA adapter into its base model: a full Hugging Face
                              checkpoint (see docs/lora.md)
  bench [--preset NAME | --config FILE] [--batch B --seq S --steps N ...]
                              time training steps of a random Qwen3-MoE (see bench --help and
                              bench/compare_hf.py for the side-by-side with Transformers)
  --version                   this build: AutoMoE's version, the LibTorch it runs on, the CPU
                              kernels' instruction-set level
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  if (cmd == "--version") {
    std::cout << "automoe " << AUTOMOE_VERSION << " (LibTorch " << TORCH_VERSION << ", CPU kernels "
              << automoe::ops::cpu::kernel_paths()["isa"] << ")\n";
    return 0;
  }
  automoe::cli::Args args(argv + 2, argv + argc);
  try {
    if (cmd == "inspect") return automoe::cli::inspect(args);
    if (cmd == "convert") return automoe::cli::convert(args);
    if (cmd == "bench") return automoe::cli::bench(args);
    if (cmd == "train") return automoe::cli::train(args);
    if (cmd == "export") return automoe::cli::export_adapter(args);
    if (cmd == "report" || cmd == "plan") {
      std::cerr << "automoe " << cmd << ": run it through the Python `automoe` command (it "
                << (cmd == "plan" ? "reads the YAML recipe" : "draws with matplotlib") << ")\n";
      return 2;
    }
    std::cerr << "automoe: unknown command \"" << cmd << "\"\n\n" << kUsage;
    return 2;
  } catch (const automoe::Error& e) {
    std::cerr << "automoe " << cmd << ": error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "automoe " << cmd << ": error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "automoe " << cmd << ": error: " << e.what() << "\n";
    return 1;
  }
}
