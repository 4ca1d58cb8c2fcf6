// Dtype names: safetensors' ("BF16"), Hugging Face config's ("bfloat16") and ATen's ScalarType.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace automoe {

// "F32" -> kFloat ... ; nullopt for a name safetensors does not define or ATen cannot hold.
std::optional<c10::ScalarType> dtype_from_safetensors(const std::string& name);
// kFloat -> "F32"; throws automoe::Error for a dtype safetensors cannot store.
std::string dtype_to_safetensors(c10::ScalarType t);

// "float32"/"float"/"torch.float32" -> kFloat, "bfloat16", "float16"/"half", "float64";
// throws automoe::Error naming `what` (e.g. the config key) for anything else.
c10::ScalarType dtype_from_name(const std::string& name, const std::string& what);
// kBFloat16 -> "bfloat16" (the spelling Transformers writes into config.json).
std::string dtype_to_name(c10::ScalarType t);

}  // namespace automoe
