// A tokenised dataset file (.amds) written in the documented layout, as automoe.data writes it,
// for the C++ tests of the dataset reader, the batcher and the trainer's step plan.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace automoe::testing {

// Writes a dataset file in the documented layout (what automoe.data writes).
inline std::string write_amds(const std::vector<std::vector<int32_t>>& docs,
                              const std::vector<std::vector<uint8_t>>& masks) {
  static int n = 0;
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("automoe_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".amds");
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  for (size_t d = 0; d < docs.size(); ++d) {
    tokens.insert(tokens.end(), docs[d].begin(), docs[d].end());
    mask.insert(mask.end(), masks[d].begin(), masks[d].end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  const uint64_t off_at = 1024, tok_at = off_at + 8 * offsets.size();
  const uint64_t mask_at = tok_at + 4 * tokens.size();
  const std::string header = nlohmann::json{
      {"n_docs", docs.size()},
      {"n_tokens", tokens.size()},
      {"offsets_at", off_at},
      {"tokens_at", tok_at},
      {"mask_at", mask_at}}.dump();
  std::string bytes(mask_at + mask.size(), '\0');
  std::memcpy(bytes.data(), "AMDS0001", 8);
  const uint64_t hlen = header.size();
  std::memcpy(bytes.data() + 8, &hlen, 8);
  std::memcpy(bytes.data() + 16, header.data(), hlen);
  std::memcpy(bytes.data() + off_at, offsets.data(), 8 * offsets.size());
  std::memcpy(bytes.data() + tok_at, tokens.data(), 4 * tokens.size());
  std::memcpy(bytes.data() + mask_at, mask.data(), mask.size());
  std::ofstream(path, std::ios::binary) << bytes;
  return path.string();
}

}  // namespace automoe::testing
