// libFuzzer target: model.safetensors.index.json as SafetensorsCheckpoint reads it (weight_map ->
// shard files, each checked to exist and to hold the tensors the index names for it). The input is
// the index of a fixed checkpoint directory made once per process:
//   <tmp>/ckpt/model-00001-of-00002.safetensors   a [2] F32, b [3] I8
//   <tmp>/ckpt/model-00002-of-00002.safetensors   c [1, 2] BF16
//   <tmp>/ckpt/other.safetensors                  s [1] U8
//   <tmp>/outside.safetensors                     x [1] F32  (not part of the checkpoint)
// (No model.safetensors: it would win over the index, which would then go unread.) An accepted
// index must name files inside the checkpoint directory only, and every tensor it yields must be
// readable.
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "automoe/io/safetensors.h"
#include "fuzz_util.h"

namespace fs = std::filesystem;

namespace {

// A safetensors file from (name, dtype, shape, byte count) entries, packed back to back.
void write_shard(
    const fs::path& path,
    const std::vector<std::tuple<std::string, std::string, std::vector<int>, int>>& ts) {
  nlohmann::ordered_json header;
  int offset = 0;
  for (const auto& [name, dtype, shape, bytes] : ts) {
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  const std::string json = header.dump();
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xff));
  out += json;
  for (int i = 0; i < offset; ++i) out.push_back(static_cast<char>(i * 37 + 1));
  std::ofstream(path, std::ios::binary) << out;
}

struct Fixture {
  fs::path root, ckpt, index;
  Fixture() {
    std::string tmpl = (fs::temp_directory_path() / "automoe-fuzz-index.XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) automoe::fuzz::finding("mkdtemp failed");
    root = tmpl;
    ckpt = root / "ckpt";
    index = ckpt / "model.safetensors.index.json";
    fs::create_directories(ckpt);
    write_shard(ckpt / "model-00001-of-00002.safetensors",
                {{"a", "F32", {2}, 8}, {"b", "I8", {3}, 3}});
    write_shard(ckpt / "model-00002-of-00002.safetensors", {{"c", "BF16", {1, 2}, 4}});
    write_shard(ckpt / "other.safetensors", {{"s", "U8", {1}, 1}});
    write_shard(root / "outside.safetensors", {{"x", "F32", {1}, 4}});
    ckpt = fs::canonical(ckpt);
  }
  ~Fixture() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

// Whether `file`, as the index names it, resolves to a path outside the checkpoint directory.
bool escapes(const fs::path& ckpt, const std::string& file) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(ckpt / file, ec);
  if (ec) return false;  // unresolvable: cannot have been opened
  const std::string dir = ckpt.string() + "/";
  return p.string().compare(0, dir.size(), dir) != 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fx;
  std::ofstream(fx.index, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  const bool accepted = automoe::fuzz::accepts([&] {
    const automoe::SafetensorsCheckpoint ck(fx.ckpt.string());
    for (const std::string& name : ck.names()) {
      const at::Tensor t = ck.get(name);
      if (t.nbytes() != ck.info(name).end - ck.info(name).begin) {
        automoe::fuzz::finding("tensor \"" + name + "\" does not match its header entry");
      }
    }
  });
  if (!accepted) return 0;
  const auto index = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    automoe::fuzz::finding("accepted an index without a weight_map object");
  }
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) automoe::fuzz::finding("accepted a weight_map value that is no string");
    if (escapes(fx.ckpt, file.get<std::string>())) {
      automoe::fuzz::finding("accepted an index whose weight_map names \"" +
                             file.get<std::string>() + "\" (for tensor \"" + name +
                             "\"), a file outside the checkpoint directory");
    }
  }
  return 0;
}

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned seed) {
  return automoe::fuzz::mutate_json(data, size, max_size, seed, &LLVMFuzzerMutate);
}
