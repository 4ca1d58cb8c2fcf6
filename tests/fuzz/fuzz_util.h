// Shared pieces of the libFuzzer targets under tests/fuzz/ (built by scripts/fuzz.sh): the
// contract every target checks, and the files the file-opening parsers read their input from.
// Contract: a parser either accepts its input or throws automoe::Error; any other exception,
// a crash, a leak or a sanitizer report is a finding.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "automoe/core/error.h"

namespace automoe::fuzz {

// Aborts (a libFuzzer finding, with the input saved) with `what` on stderr.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "automoe fuzz finding: %s\n", what.c_str());
  std::abort();
}

// Keeps a value computed from every byte read, so that reads are not optimised away.
inline void keep(uint64_t v) { asm volatile("" : : "r"(v) : "memory"); }

// Runs `parse`; automoe::Error is the expected rejection and is swallowed. Returns whether the
// input was accepted. Any other exception propagates and ends the run (std::terminate).
template <typename F>
bool accepts(F&& parse) {
  try {
    parse();
    return true;
  } catch (const automoe::Error&) {
    return false;
  }
}

// One anonymous in-memory file per process (memfd), rewritten for each input and opened by the
// parsers through its /proc path, so that a target needs neither disk nor a temporary name.
class InputFile {
 public:
  InputFile() : fd_(::memfd_create("automoe-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) finding("memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& write(const uint8_t* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0) finding("ftruncate failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) finding("pwrite failed");
      done += static_cast<size_t>(n);
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

// LeakSanitizer sees heap leaks only; a parser that maps its file and throws without unmapping it
// leaks address space. Call after the parser's objects are gone: any mapping of the input file
// left in /proc/self/maps is a finding on the input at hand.
inline void check_unmapped(const char* what) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:automoe-fuzz") != std::string::npos) {
      finding(std::string(what) + " left the input file mapped: " + line);
    }
  }
}

// Structure-aware mutation for the targets whose input is or holds a JSON document: one value of
// the document replaced by an edge case (0, -1, 2^31, 2^63 - 1, 2^64 - 1, 1e308, a fraction, null,
// a string, an empty container), nudged (a number halved, negated, doubled, off by one), or
// removed (an object key, an array element). Byte flips alone rarely turn a valid config's
// "head_dim": 8 into 9223372036854775807.
inline void mutate_json_value(nlohmann::json& doc, std::minstd_rand& rng) {
  using nlohmann::json;
  static const std::vector<json> kEdges = {0,
                                           -1,
                                           1,
                                           2,
                                           int64_t{1} << 31,
                                           (int64_t{1} << 31) - 1,
                                           int64_t{1} << 53,
                                           std::numeric_limits<int64_t>::max(),
                                           std::numeric_limits<int64_t>::min(),
                                           std::numeric_limits<uint64_t>::max(),
                                           1e308,
                                           -1e308,
                                           0.5,
                                           -0.0,
                                           4.0,
                                           nullptr,
                                           true,
                                           "",
                                           "x",
                                           json::array(),
                                           json::object()};
  std::vector<json*> nodes;
  std::vector<json*> stack{&doc};
  while (!stack.empty()) {
    json* n = stack.back();
    stack.pop_back();
    nodes.push_back(n);
    if (n->is_structured()) {
      for (auto& child : *n) stack.push_back(&child);
    }
  }
  json& target = *nodes[rng() % nodes.size()];
  const json& edge = kEdges[rng() % kEdges.size()];
  switch (rng() % 3) {
    case 0:
      target = edge;
      break;
    case 1:
      if (target.is_number_integer() && !target.is_number_unsigned()) {
        const int64_t v = target.get<int64_t>();
        const int64_t nudged[] = {v / 2, v == INT64_MIN ? v : -v, v < INT64_MAX ? v + 1 : v,
                                  v > INT64_MIN ? v - 1 : v,
                                  v <= INT64_MAX / 2 && v >= INT64_MIN / 2 ? v * 2 : v};
        target = nudged[rng() % 5];
      } else if (target.is_number()) {
        target = target.get<double>() * (rng() % 2 ? 2.0 : -0.5);
      } else {
        target = edge;
      }
      break;
    default:
      if (target.is_object() && !target.empty()) {
        auto it = target.begin();
        std::advance(it, rng() % target.size());
        target.erase(it);
      } else if (target.is_array() && !target.empty()) {
        target.erase(target.begin() + static_cast<std::ptrdiff_t>(rng() % target.size()));
      } else {
        target = edge;
      }
  }
}

using ByteMutator = size_t (*)(uint8_t* data, size_t size, size_t max_size);

// A LLVMFuzzerCustomMutator for a JSON document: half of the time libFuzzer's own byte-level
// mutation (with the target's dictionary), else mutate_json_value when the input parses.
inline size_t mutate_json(uint8_t* data, size_t size, size_t max_size, unsigned seed,
                          ByteMutator byte_mutate) {
  std::minstd_rand rng(seed);
  if (rng() % 2 == 0) return byte_mutate(data, size, max_size);
  auto doc = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return byte_mutate(data, size, max_size);
  mutate_json_value(doc, rng);
  const std::string out = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (out.size() > max_size) return byte_mutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}

// The same for a file that holds a JSON header after a little-endian u64 length at `length_at`
// (safetensors: 0; .amds: 8, after the magic), data following it. A mutated header no longer than
// the old one is padded with spaces to the old length, so that the data keeps its offsets.
inline size_t mutate_framed_json(uint8_t* data, size_t size, size_t max_size, unsigned seed,
                                 ByteMutator byte_mutate, size_t length_at) {
  std::minstd_rand rng(seed);
  if (rng() % 2 == 0 || size < length_at + 8) return byte_mutate(data, size, max_size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[length_at + i];
  const size_t json_at = length_at + 8;
  if (n > size - json_at) return byte_mutate(data, size, max_size);
  auto doc = nlohmann::json::parse(data + json_at, data + json_at + n, nullptr, false);
  if (doc.is_discarded()) return byte_mutate(data, size, max_size);
  mutate_json_value(doc, rng);
  std::string header = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (header.size() < n) header.append(n - header.size(), ' ');
  const std::string rest(reinterpret_cast<const char*>(data) + json_at + n, size - json_at - n);
  if (json_at + header.size() + rest.size() > max_size) return byte_mutate(data, size, max_size);
  for (size_t i = 0; i < 8; ++i) data[length_at + i] = (header.size() >> (8 * i)) & 0xff;
  std::memcpy(data + json_at, header.data(), header.size());
  std::memcpy(data + json_at + header.size(), rest.data(), rest.size());
  return json_at + header.size() + rest.size();
}

}  // namespace automoe::fuzz
