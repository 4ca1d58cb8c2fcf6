#include "automoe/io/bnb.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"

namespace automoe {
namespace {

std::string module_of(const std::string& weight_name) {
  const std::string suffix = ".weight";
  if (weight_name.size() > suffix.size() &&
      weight_name.compare(weight_name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return weight_name.substr(0, weight_name.size() - suffix.size());
  }
  return weight_name;
}

const char* kStateNF4 = ".quant_state.bitsandbytes__nf4";
const char* kStateFP4 = ".quant_state.bitsandbytes__fp4";

at::Tensor get_checked(const SafetensorsCheckpoint& ckpt, const std::string& name,
                       c10::ScalarType dtype, int64_t numel, const std::string& of) {
  AUTOMOE_CHECK(ckpt.contains(name), ckpt.dir(), ": ", of, " is bitsandbytes-quantised but ", name,
                " is missing");
  const at::Tensor t = ckpt.get(name);
  AUTOMOE_CHECK(t.scalar_type() == dtype && (numel < 0 || t.numel() == numel), ckpt.dir(), ": tensor ",
                name, ": expected ", dtype, numel >= 0 ? " with " + std::to_string(numel) + " elements" : "",
                " (bitsandbytes' format), found ", t.scalar_type(), " ", t.sizes());
  return t;
}

}  // namespace

std::optional<ops::QuantType> bnb_format(const SafetensorsCheckpoint& ckpt, const std::string& w) {
  if (ckpt.contains(w + kStateNF4)) return ops::QuantType::kNF4;
  if (ckpt.contains(w + kStateFP4)) return ops::QuantType::kFP4;
  if (ckpt.contains(module_of(w) + ".SCB")) return ops::QuantType::kInt8;
  return std::nullopt;
}

std::vector<std::string> bnb_companions(const SafetensorsCheckpoint& ckpt, const std::string& w) {
  std::vector<std::string> out;
  for (const std::string& s : {w + ".absmax", w + ".quant_map", w + ".nested_absmax",
                               w + ".nested_quant_map", w + kStateNF4, w + kStateFP4,
                               module_of(w) + ".SCB", module_of(w) + ".weight_format"}) {
    if (ckpt.contains(s)) out.push_back(s);
  }
  return out;
}

ops::QuantizedWeight read_bnb(const SafetensorsCheckpoint& ckpt, const std::string& w,
                              std::optional<c10::ScalarType> dtype) {
  const std::optional<ops::QuantType> type = bnb_format(ckpt, w);
  AUTOMOE_CHECK(type, ckpt.dir(), ": tensor ", w, " is not bitsandbytes-quantised");
  ops::QuantizedWeight q;
  q.type = *type;
  q.experts = 1;
  AUTOMOE_CHECK(ckpt.contains(w), ckpt.dir(), ": missing tensor ", w);
  if (q.type == ops::QuantType::kInt8) {
    const at::Tensor codes = get_checked(ckpt, w, at::kChar, -1, w);
    AUTOMOE_CHECK(codes.dim() == 2, ckpt.dir(), ": tensor ", w, ": int8 weight must be [out, in], found ",
                  codes.sizes());
    q.out_features = codes.size(0);
    q.in_features = codes.size(1);
    q.blocksize = 0;
    q.codes = codes.unsqueeze(0).clone();
    q.absmax = get_checked(ckpt, module_of(w) + ".SCB", at::kFloat, q.out_features, w)
                   .reshape({1, q.out_features})
                   .clone();
    const std::string format = module_of(w) + ".weight_format";
    if (ckpt.contains(format)) {  // bitsandbytes < 0.43 could save GPU-tiled layouts (1, 2, 3)
      const at::Tensor f = ckpt.get(format);
      AUTOMOE_CHECK(f.numel() == 1 && f.to(at::kLong).item<int64_t>() == 0, ckpt.dir(), ": tensor ",
                    format, ": ", f.numel() == 1 ? std::to_string(f.to(at::kLong).item<int64_t>()) : "not a scalar",
                    ", expected 0 (row-major; the tiled formats of older bitsandbytes are not supported)");
    }
    q.dtype = dtype.value_or(at::kBFloat16);
    return q;
  }
  const std::string state_name = w + (q.type == ops::QuantType::kNF4 ? kStateNF4 : kStateFP4);
  const at::Tensor state_bytes = get_checked(ckpt, state_name, at::kByte, -1, w);
  nlohmann::json st;
  try {
    st = nlohmann::json::parse(std::string(static_cast<const char*>(state_bytes.const_data_ptr()),
                                           static_cast<size_t>(state_bytes.numel())));
  } catch (const nlohmann::json::exception& e) {
    fail(ckpt.dir(), ": tensor ", state_name, ": not a bitsandbytes quant state (", e.what(), ")");
  }
  try {
    const std::string qt = st.at("quant_type").get<std::string>();
    AUTOMOE_CHECK(qt == ops::to_string(q.type), ckpt.dir(), ": tensor ", state_name,
                  ": quant_type \"", qt, "\" under a ", ops::to_string(q.type), " name");
    q.blocksize = st.at("blocksize").get<int64_t>();
    const auto shape = st.at("shape").get<std::vector<int64_t>>();
    AUTOMOE_CHECK(shape.size() == 2 && shape[0] > 0 && shape[1] > 0 && q.blocksize >= 2 &&
                      q.blocksize % 2 == 0,
                  ckpt.dir(), ": tensor ", state_name, ": expected a 2-D shape and an even block size, "
                  "found shape ", at::IntArrayRef(shape), ", blocksize ", q.blocksize);
    q.out_features = shape[0];
    q.in_features = shape[1];
    q.dtype = dtype ? *dtype : dtype_from_name(st.at("dtype").get<std::string>(), ckpt.dir() + ": " + state_name);
    const int64_t n = q.out_features * q.in_features, blocks = (n + q.blocksize - 1) / q.blocksize;
    q.codes = get_checked(ckpt, w, at::kByte, (n + 1) / 2, w).reshape({1, (n + 1) / 2}).clone();
    const at::Tensor map = get_checked(ckpt, w + ".quant_map", at::kFloat, 16, w).contiguous();
    AUTOMOE_CHECK(std::memcmp(map.const_data_ptr<float>(), ops::code_book(q.type), 16 * sizeof(float)) == 0,
                  ckpt.dir(), ": tensor ", w, ".quant_map: not bitsandbytes' ", ops::to_string(q.type),
                  " code book (a custom code book is not supported)");
    const at::Tensor absmax = ckpt.get(w + ".absmax");
    if (absmax.scalar_type() == at::kFloat) {
      q.absmax = get_checked(ckpt, w + ".absmax", at::kFloat, blocks, w).reshape({1, blocks}).clone();
      return q;
    }
    // Double quantisation: bitsandbytes' dequantize_blockwise (code[u8] · absmax per nested
    // block, float32), then + offset.
    const int64_t nbs = st.at("nested_blocksize").get<int64_t>();
    const float offset = st.at("nested_offset").get<float>();
    AUTOMOE_CHECK(nbs > 0, ckpt.dir(), ": tensor ", state_name, ": nested_blocksize ", nbs);
    const at::Tensor a8 = get_checked(ckpt, w + ".absmax", at::kByte, blocks, w).contiguous();
    const at::Tensor nested = get_checked(ckpt, w + ".nested_absmax", at::kFloat, (blocks + nbs - 1) / nbs, w).contiguous();
    const at::Tensor nmap = get_checked(ckpt, w + ".nested_quant_map", at::kFloat, 256, w).contiguous();
    q.absmax = at::empty({1, blocks}, at::kFloat);
    const uint8_t* a = a8.const_data_ptr<uint8_t>();
    const float* na = nested.const_data_ptr<float>();
    const float* nm = nmap.const_data_ptr<float>();
    float* out = q.absmax.data_ptr<float>();
    for (int64_t i = 0; i < blocks; ++i) {
      const float v = nm[a[i]] * na[i / nbs];
      out[i] = v + offset;
    }
    return q;
  } catch (const nlohmann::json::exception& e) {
    fail(ckpt.dir(), ": tensor ", state_name, ": ", e.what());
  }
}

ops::QuantizedWeight join_rows(const std::vector<ops::QuantizedWeight>& parts, const std::string& what) {
  AUTOMOE_CHECK(!parts.empty(), what, ": nothing to join");
  if (parts.size() == 1) return parts.front();
  ops::QuantizedWeight q = parts.front();
  std::vector<at::Tensor> codes, absmax;
  q.out_features = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const ops::QuantizedWeight& p = parts[i];
    AUTOMOE_CHECK(p.type == q.type && p.blocksize == q.blocksize && p.in_features == q.in_features &&
                      p.experts == 1,
                  what, ": its parts are stored in different formats (", ops::to_string(p.type), "/",
                  p.blocksize, " vs ", ops::to_string(q.type), "/", q.blocksize, ") or widths");
    const int64_t n = p.out_features * p.in_features;
    AUTOMOE_CHECK(i + 1 == parts.size() || q.type == ops::QuantType::kInt8 || n % q.blocksize == 0,
                  what, ": part ", i, " has ", n, " elements, not whole blocks of ", q.blocksize,
                  ": its quantised parts cannot be joined without requantising");
    codes.push_back(p.codes.reshape({1, -1}));
    absmax.push_back(p.absmax.reshape({1, -1}));
    q.out_features += p.out_features;
  }
  q.codes = at::cat(codes, 1);
  q.absmax = at::cat(absmax, 1);
  if (q.type == ops::QuantType::kInt8) q.codes = q.codes.reshape({1, q.out_features, q.in_features});
  return q;
}

ops::QuantizedWeight stack_experts(const std::vector<ops::QuantizedWeight>& experts, const std::string& what) {
  AUTOMOE_CHECK(!experts.empty(), what, ": no experts");
  ops::QuantizedWeight q = experts.front();
  std::vector<at::Tensor> codes, absmax;
  for (const auto& e : experts) {
    AUTOMOE_CHECK(e.type == q.type && e.blocksize == q.blocksize && e.out_features == q.out_features &&
                      e.in_features == q.in_features,
                  what, ": experts stored in different formats or shapes");
    codes.push_back(e.codes);
    absmax.push_back(e.absmax);
  }
  q.experts = static_cast<int64_t>(experts.size());
  q.codes = at::cat(codes, 0);
  q.absmax = at::cat(absmax, 0);
  return q;
}

}  // namespace automoe
