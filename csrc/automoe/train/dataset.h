// Tokenised datasets and the batches the trainer feeds the model.
//
// A dataset file (".amds", written by automoe.data after tokenising a JSONL file once) holds
// documents as token ids plus a per-token loss flag:
//   bytes 0..7   "AMDS0001"
//   bytes 8..15  little-endian uint64: length of the JSON header that follows
//   JSON header  {"n_docs", "n_tokens", "offsets_at", "tokens_at", "mask_at", ...}
//   offsets      int64[n_docs + 1] at offsets_at (document d is tokens [offsets[d], offsets[d+1]))
//   tokens       int32[n_tokens] at tokens_at
//   loss mask    uint8[n_tokens] at mask_at (1 = the token is a training target)
// The file is memory-mapped; every field is validated on open.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace automoe::train {

class TokenDataset {
 public:
  explicit TokenDataset(const std::string& path);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t num_docs() const { return n_docs_; }
  int64_t num_tokens() const { return n_tokens_; }
  int64_t doc_length(int64_t d) const { return offsets_[d + 1] - offsets_[d]; }
  const int32_t* doc_tokens(int64_t d) const { return tokens_ + offsets_[d]; }
  const uint8_t* doc_mask(int64_t d) const { return mask_ + offsets_[d]; }
  int64_t max_token() const;  // largest token id (for the vocabulary check)
  const std::string& path() const { return path_; }
  const std::string& header() const { return header_; }

 private:
  std::string path_, header_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  int64_t n_docs_ = 0, n_tokens_ = 0;
  const int64_t* offsets_ = nullptr;
  const int32_t* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;
};

// Where the data stream stands: epoch and position in that epoch's document order.
struct DataPosition {
  int64_t epoch = 0;
  int64_t cursor = 0;
  bool operator==(const DataPosition&) const = default;
};

// One micro-batch, ready for Decoder::forward (CPU tensors).
struct MicroBatch {
  at::Tensor input_ids;     // [R, L] int64
  at::Tensor position_ids;  // [R, L] int64, restarting at 0 for each document
  at::Tensor document_ids;  // [R, L] int64, -1 on padding
  at::Tensor labels;        // [R, L] int64, -100 where there is no loss
  int64_t loss_tokens = 0;  // labels != -100
  int64_t real_tokens = 0;  // non-padding tokens
  int64_t documents = 0;
  int64_t truncated = 0;    // documents cut at seq_len
  int64_t truncated_tokens = 0;  // the tokens cut off them
  int64_t rows = 0, length = 0;  // R and L (also without tensors)
};

// What cutting every document at seq_len does to a dataset (one pass over its documents).
struct Truncation {
  int64_t documents = 0, tokens = 0;  // documents cut, and the tokens cut off them
  int64_t documents_without_loss = 0; // documents with no loss token left within seq_len
  int64_t documents_cut_to_no_loss = 0;  // ... of which had loss tokens past seq_len
};
Truncation truncation_at(const TokenDataset& data, int64_t seq_len);

// Packs or pads documents into micro-batches of `rows` x (up to) `seq_len`, in an order fixed by
// (seed, epoch): the same position always yields the same batch, which is what makes resuming
// exact. Packing fills each row greedily with whole documents (position ids restart per document,
// no attention across documents); a document longer than seq_len is truncated. Without packing,
// each row holds one document, right-padded to the longest row of the batch.
// The first token of every document carries no loss (nothing before it in its document predicts
// it), so a packed row and the same documents one per row give the same loss.
class Batcher {
 public:
  Batcher(const TokenDataset& data, int64_t rows, int64_t seq_len, bool packing, bool shuffle,
          uint64_t seed, int64_t pad_token_id);

  // The micro-batch at `pos`, moving `pos` past it; `tensors` false: its counts only (cheap).
  MicroBatch next(DataPosition& pos, bool tensors = true) const;
  // How many next() calls from `pos` until the stream has consumed `epochs` epochs (a fraction
  // counts documents); depends on each epoch's order when packing.
  int64_t count_until(DataPosition pos, double epochs) const;
  // The whole validation pass: every document once, in file order.
  std::vector<MicroBatch> all_in_order() const;

 private:
  const std::vector<int64_t>& order(int64_t epoch) const;
  // Moves `pos` past one micro-batch's documents, collecting them per row when asked.
  void advance(DataPosition& pos, std::vector<std::vector<int64_t>>* rows_docs) const;
  MicroBatch build(const std::vector<std::vector<int64_t>>& rows_docs, bool tensors = true) const;

  const TokenDataset& data_;
  int64_t rows_, seq_len_;
  bool packing_, shuffle_;
  uint64_t seed_;
  int64_t pad_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

}  // namespace automoe::train
