#include "automoe/core/dtype.h"

#include <array>
#include <utility>

#include "automoe/core/error.h"

namespace automoe {
namespace {

using Entry = std::pair<const char*, c10::ScalarType>;
constexpr std::array<Entry, 15> kSafetensorsDtypes = {{
    {"F64", c10::kDouble},
    {"F32", c10::kFloat},
    {"F16", c10::kHalf},
    {"BF16", c10::kBFloat16},
    {"I64", c10::kLong},
    {"I32", c10::kInt},
    {"I16", c10::kShort},
    {"I8", c10::kChar},
    {"U8", c10::kByte},
    {"U16", c10::kUInt16},
    {"U32", c10::kUInt32},
    {"U64", c10::kUInt64},
    {"BOOL", c10::kBool},
    {"F8_E4M3", c10::kFloat8_e4m3fn},
    {"F8_E5M2", c10::kFloat8_e5m2},
}};

}  // namespace

std::optional<c10::ScalarType> dtype_from_safetensors(const std::string& name) {
  for (const auto& [n, t] : kSafetensorsDtypes) {
    if (name == n) return t;
  }
  return std::nullopt;
}

std::string dtype_to_safetensors(c10::ScalarType t) {
  for (const auto& [n, s] : kSafetensorsDtypes) {
    if (s == t) return n;
  }
  fail("safetensors cannot store dtype ", c10::toString(t));
}

c10::ScalarType dtype_from_name(const std::string& raw, const std::string& what) {
  std::string name = raw.rfind("torch.", 0) == 0 ? raw.substr(6) : raw;
  if (name == "float32" || name == "float") return c10::kFloat;
  if (name == "bfloat16") return c10::kBFloat16;
  if (name == "float16" || name == "half") return c10::kHalf;
  if (name == "float64" || name == "double") return c10::kDouble;
  fail(what, ": unsupported dtype \"", raw,
       "\" (expected one of float32, bfloat16, float16, float64)");
}

std::string dtype_to_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "float32";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kHalf:
      return "float16";
    case c10::kDouble:
      return "float64";
    default:
      fail("no Hugging Face dtype name for ", c10::toString(t));
  }
}

}  // namespace automoe
