// libFuzzer target: a tokenised dataset file (.amds: magic, u64 header length, JSON header,
// offsets / tokens / loss-mask sections) as TokenDataset opens it. An accepted file is read through
// every document's tokens and mask, and one packed and one padded batch are built from it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "automoe/train/dataset.h"
#include "fuzz_util.h"

namespace {

void read_all(const automoe::train::TokenDataset& ds) {
  int64_t total = 0;
  uint64_t sum = 0;
  for (int64_t d = 0; d < ds.num_docs(); ++d) {
    const int64_t len = ds.doc_length(d);
    if (len <= 0) automoe::fuzz::finding("document " + std::to_string(d) + " has length <= 0");
    const int32_t* tok = ds.doc_tokens(d);
    const uint8_t* mask = ds.doc_mask(d);
    for (int64_t i = 0; i < len; ++i) sum += static_cast<uint32_t>(tok[i]) + mask[i];
    total += len;
  }
  automoe::fuzz::keep(sum);
  if (total != ds.num_tokens()) automoe::fuzz::finding("documents do not add up to n_tokens");
  ds.max_token();  // throws automoe::Error on a negative token id
  if (ds.num_docs() == 0) return;
  for (const bool packing : {true, false}) {
    automoe::train::Batcher b(ds, /*rows=*/2, /*seq_len=*/8, packing, /*shuffle=*/true,
                              /*seed=*/7, /*pad_token_id=*/-1);
    automoe::train::DataPosition pos;
    b.next(pos);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static automoe::fuzz::InputFile file;
  const std::string& path = file.write(data, size);
  automoe::fuzz::accepts([&] {
    automoe::train::TokenDataset ds(path);
    read_all(ds);
  });
  automoe::fuzz::check_unmapped("TokenDataset");
  return 0;
}

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned seed) {
  return automoe::fuzz::mutate_framed_json(data, size, max_size, seed, &LLVMFuzzerMutate,
                                           /*length_at=*/8);
}
