// Checkpoints quantised by bitsandbytes (config.json quantization_config quant_method
// "bitsandbytes", as Transformers + bitsandbytes save them, or as the per-expert checkpoints of
// Transformers 4.x quantised each expert's linear layers). A quantised weight `<p>.weight` comes
// with companion tensors:
//   4-bit: `<p>.weight` uint8 [(O·K+1)/2, 1], `.absmax` (float32 [blocks], or uint8 with
//          `.nested_absmax` float32 and `.nested_quant_map` float32 [256]: double quantisation),
//          `.quant_map` float32 [16], `.quant_state.bitsandbytes__nf4|fp4` (uint8 JSON: quant_type,
//          blocksize, dtype, shape, nested_blocksize, nested_offset);
//   int8:  `<p>.weight` int8 [O, K], `<p>.SCB` float32 [O], `<p>.weight_format` (row-major).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "automoe/io/safetensors.h"
#include "automoe/ops/quant/quant.h"

namespace automoe {

// The format `weight_name` is stored in, when bitsandbytes quantised it; nullopt otherwise.
std::optional<ops::QuantType> bnb_format(const SafetensorsCheckpoint& ckpt, const std::string& weight_name);

// Every companion of a quantised `weight_name` present in ckpt (not the weight itself).
std::vector<std::string> bnb_companions(const SafetensorsCheckpoint& ckpt, const std::string& weight_name);

// The quantised weight as one expert ([1, O, K]): codes as stored, the absmax in float32
// (double quantisation undone as bitsandbytes undoes it: nested_code[u8] · nested_absmax + offset,
// in float32), dequantising to `dtype` (nullopt: the quant state's dtype, int8: bfloat16). Every
// inconsistency (shapes, code book, block size) is an error naming the tensor and file.
ops::QuantizedWeight read_bnb(const SafetensorsCheckpoint& ckpt, const std::string& weight_name,
                              std::optional<c10::ScalarType> dtype);

// Weights [1, O_i, K] of one format and block size joined along the rows, [1, ΣO_i, K]: the
// codes and scales concatenated, as one quantisation of the joined weight gives when every part
// but the last fills whole blocks (checked; `what` names it otherwise).
ops::QuantizedWeight join_rows(const std::vector<ops::QuantizedWeight>& parts, const std::string& what);
// Experts [1, O, K] stacked into [E, O, K].
ops::QuantizedWeight stack_experts(const std::vector<ops::QuantizedWeight>& experts, const std::string& what);

}  // namespace automoe
