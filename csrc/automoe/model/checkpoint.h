// Hugging Face checkpoint directories <-> a Decoder: config.json, safetensors (single or sharded),
// experts in either on-disk layout through the architecture's weight rules, tokenizer and
// generation files copied through on save.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "automoe/model/config.h"
#include "automoe/io/safetensors.h"
#include "automoe/io/weight_rules.h"
#include "automoe/model/arch/registry.h"
#include "automoe/model/decoder.h"

namespace automoe {
namespace parallel {
struct World;
}

struct PretrainedModel {
  LoadedConfig config;
  ExpertsLayout layout = ExpertsLayout::kPerExpert;  // the layout found on disk
  std::string source_dir;
  std::unique_ptr<Decoder> decoder;
  // Expert parallelism (null: one process): the ranks this model's experts are spread over;
  // save_pretrained is then collective.
  std::shared_ptr<const parallel::World> world;
};

// Which experts layout `ckpt` stores (checks the first MoE layer); errors when it holds neither.
ExpertsLayout detect_layout(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                            const Architecture& arch);

// Reads every parameter of `spec` from `ckpt`, applying the architecture's rules for the layout
// found there (returned in *layout). `dtype`: cast every tensor to it; nullopt keeps each tensor's
// stored dtype. Missing, misshapen and unexpected tensors are errors naming the tensor and file.
// `quantize`: the routed experts' weights are quantised as each is read (peak memory stays near
// the quantised model's plus one expert tensor) and appended to *quantized; their entries in the
// result are meta tensors (Decoder::set_quantized).
struct QuantizeOptions {
  ops::QuantType type = ops::QuantType::kNF4;
  int64_t blocksize = 64;
};
NamedTensors read_parameters(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                             const Architecture& arch, std::optional<c10::ScalarType> dtype,
                             ExpertsLayout* layout, const QuantizeOptions* quantize = nullptr,
                             std::vector<std::pair<std::string, ops::QuantizedWeight>>* quantized = nullptr);

// The tensors to write for `params` in `layout` (views of `params`; nothing is copied).
NamedTensors to_disk_tensors(const NamedTensors& params, const ModelSpec& spec,
                             const Architecture& arch, ExpertsLayout layout);

// The reverse for tensors named as in a checkpoint of either layout (a state dict read from
// safetensors): per-expert tensors are stacked into the in-memory parameter (a copy); every other
// entry, unknown names included, passes through unchanged and in order.
NamedTensors to_memory_tensors(const NamedTensors& tensors, const ModelSpec& spec,
                               const Architecture& arch);

// `config_json`: the config to build from instead of `dir`/config.json (a caller that changed it,
// e.g. the drop-in applying from_pretrained's config overrides); errors still name `dir`.
// `experts`: expert parallelism's [begin, begin + count) of every MoE layer, read as byte ranges
// (count 0: all experts).
struct ExpertShard {
  int64_t begin = 0, count = 0;
};
PretrainedModel load_pretrained(const std::string& dir, std::optional<c10::ScalarType> dtype,
                                const BackendConfig& backend = {},
                                const std::optional<std::string>& config_json = std::nullopt,
                                ExpertShard experts = {},
                                const std::optional<QuantizeOptions>& quantize = std::nullopt);

// A model with fresh parameters for a config (Transformers' from_config): see init_parameters.
PretrainedModel init_pretrained(const std::string& config_json, const std::string& origin,
                                c10::ScalarType dtype, const BackendConfig& backend, uint64_t seed);

struct SaveOptions {
  std::optional<ExpertsLayout> layout;  // default: the layout that was loaded
  uint64_t max_shard_bytes = 5ull << 30;
  // config.json to write instead of the loaded config with "dtype" updated.
  std::optional<std::string> config_json;
  // Further files to write (name -> contents), e.g. generation_config.json; they take precedence
  // over files of the same name copied from the source directory.
  std::map<std::string, std::string> extra_files;
  // Tensors to write instead of the model's parameters (Transformers'
  // save_pretrained(state_dict=)): exactly the parameters' in-memory names and shapes, in any
  // order.
  std::optional<NamedTensors> tensors;
  // Under expert parallelism: `tensors` hold every expert (this rank's with the rest of its EP
  // group's, gathered by the caller: the drop-in's save service) and this process writes the
  // whole checkpoint alone, as one process holding every expert would.
  bool gathered = false;
};

// Writes config.json, the weights in the chosen layout, sharded at `max_shard_bytes`, and copies
// tokenizer/generation files from the source directory. Every file is written atomically.
// A model with a `world` saves collectively: every rank of the world must call it (see
// write_pretrained).
void save_pretrained(const PretrainedModel& model, const std::string& dir,
                     const SaveOptions& options);

// What save_pretrained writes, for `params` in parameter_layout(spec) order (options.tensors is
// not read). `world` (null or one process: this process writes everything): every rank calls it
// with the same directory, each with its own experts' rows (spec.moe's expert range). Rank 0
// writes config.json, the other files and every dense tensor (other ranks may pass meta tensors
// for those: only their dtype and shape are read); the ranks of data-parallel replica 0 write
// their experts' rows into the same shard files; rank 0 renames them into place and writes the
// index once all have written. The files equal the one-process save's, byte for byte.
void write_pretrained(const LoadedConfig& config, ExpertsLayout layout,
                      const std::string& source_dir, const ModelSpec& spec,
                      const NamedTensors& params, const std::string& dir,
                      const SaveOptions& options, const parallel::World* world);
inline void save_pretrained(const PretrainedModel& model, const std::string& dir,
                            std::optional<ExpertsLayout> layout = std::nullopt,
                            uint64_t max_shard_bytes = 5ull << 30) {
  SaveOptions o;
  o.layout = layout;
  o.max_shard_bytes = max_shard_bytes;
  save_pretrained(model, dir, o);
}

}  // namespace automoe
