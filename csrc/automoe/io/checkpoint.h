// Hugging Face checkpoint directories <-> a Decoder: config.json, safetensors (single or sharded),
// experts in either on-disk layout through the architecture's weight rules, tokenizer and
// generation files copied through on save.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "automoe/io/hf_config.h"
#include "automoe/io/safetensors.h"
#include "automoe/io/weight_rules.h"
#include "automoe/model/arch/registry.h"
#include "automoe/model/decoder.h"

namespace automoe {

struct PretrainedModel {
  LoadedConfig config;
  ExpertsLayout layout = ExpertsLayout::kPerExpert;  // the layout found on disk
  std::string source_dir;
  std::unique_ptr<Decoder> decoder;
};

// Which experts layout `ckpt` stores (checks the first MoE layer); errors when it holds neither.
ExpertsLayout detect_layout(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                            const Architecture& arch);

// Reads every parameter of `spec` from `ckpt`, applying the architecture's rules for the layout
// found there (returned in *layout). `dtype`: cast every tensor to it; nullopt keeps each tensor's
// stored dtype. Missing, misshapen and unexpected tensors are errors naming the tensor and file.
NamedTensors read_parameters(const SafetensorsCheckpoint& ckpt, const ModelSpec& spec,
                             const Architecture& arch, std::optional<c10::ScalarType> dtype,
                             ExpertsLayout* layout);

// The tensors to write for `params` in `layout` (views of `params`; nothing is copied).
NamedTensors to_disk_tensors(const NamedTensors& params, const ModelSpec& spec,
                             const Architecture& arch, ExpertsLayout layout);

PretrainedModel load_pretrained(const std::string& dir, std::optional<c10::ScalarType> dtype,
                                const BackendConfig& backend = {});

// Writes config.json (the loaded config, "dtype" updated), the weights in `layout` (default: the
// layout that was loaded), sharded at `max_shard_bytes`, and copies tokenizer/generation files
// from the source directory. Every file is written atomically.
void save_pretrained(const PretrainedModel& model, const std::string& dir,
                     std::optional<ExpertsLayout> layout = std::nullopt,
                     uint64_t max_shard_bytes = 5ull << 30);

}  // namespace automoe
