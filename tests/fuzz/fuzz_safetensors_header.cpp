// libFuzzer target: a safetensors file as SafetensorsFile opens it (u64 header length, JSON
// header, dtype / shape / data_offsets validation, tiling of the data area), then every tensor
// read whole and by rows. Accepted files must keep the reader's promises: each tensor's bytes lie
// inside the file and match its shape and dtype.
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "automoe/io/safetensors.h"
#include "fuzz_util.h"

namespace {

// Reads every byte (a tensor past the mapping faults here, under ASan's eyes).
uint64_t touch(const at::Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.data_ptr());
  uint64_t sum = 0;
  for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
  return sum;
}

void read_all(const automoe::SafetensorsFile& f) {
  for (const std::string& name : f.names()) {
    const automoe::TensorInfo& info = f.info(name);
    const at::Tensor t = f.get(name);
    if (t.scalar_type() != info.dtype || t.sizes().vec() != info.shape ||
        t.nbytes() != info.end - info.begin) {
      automoe::fuzz::finding("tensor \"" + name + "\" does not match its header entry");
    }
    automoe::fuzz::keep(touch(t));
    if (info.shape.empty()) continue;
    const int64_t rows = info.shape[0];
    const at::Tensor tail = f.get_rows(name, rows / 2, rows);
    if (tail.size(0) != rows - rows / 2) automoe::fuzz::finding("get_rows returned wrong rows");
    automoe::fuzz::keep(touch(tail));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static automoe::fuzz::InputFile file;
  const std::string& path = file.write(data, size);
  automoe::fuzz::accepts([&] {
    automoe::SafetensorsFile f(path);
    read_all(f);
  });
  automoe::fuzz::check_unmapped("SafetensorsFile");
  return 0;
}

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned seed) {
  return automoe::fuzz::mutate_framed_json(data, size, max_size, seed, &LLVMFuzzerMutate,
                                           /*length_at=*/0);
}
