#include "automoe/train/dataset.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>

#include "automoe/core/error.h"

namespace automoe::train {

TokenDataset::TokenDataset(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  AUTOMOE_CHECK(fd >= 0, path, ": cannot open dataset: ", std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, ": cannot stat dataset: ", std::strerror(errno));
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ < 16) {
    ::close(fd);
    fail(path, ": not an AutoMoE dataset (", map_size_, " bytes)");
  }
  map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  AUTOMOE_CHECK(map_ != MAP_FAILED, path, ": mmap failed: ", std::strerror(errno));
  // A failed check below throws out of the constructor, so the destructor never runs: unmap here.
  struct Unmap {
    TokenDataset* self;
    ~Unmap() {
      if (self) ::munmap(self->map_, self->map_size_);
    }
  } unmap_on_error{this};
  const auto* base = static_cast<const char*>(map_);
  AUTOMOE_CHECK(std::memcmp(base, "AMDS0001", 8) == 0, path,
                ": not an AutoMoE dataset (bad magic; delete it to re-tokenise)");
  uint64_t hlen = 0;
  std::memcpy(&hlen, base + 8, 8);
  AUTOMOE_CHECK(hlen <= map_size_ - 16, path, ": header length ", hlen, " exceeds the file");
  header_.assign(base + 16, hlen);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(header_);
    // get<>() would convert a float (undefined behaviour when out of range): integers only.
    auto integer = [&](const char* key) {
      const nlohmann::json& v = h.at(key);
      AUTOMOE_CHECK(
          v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX), path,
          ": header field \"", key, "\" must be an integer, found ", v.dump());
      return v.get<int64_t>();
    };
    n_docs_ = integer("n_docs");
    n_tokens_ = integer("n_tokens");
    const auto off_at = static_cast<uint64_t>(integer("offsets_at"));  // negative: out of range
    const auto tok_at = static_cast<uint64_t>(integer("tokens_at"));
    const auto mask_at = static_cast<uint64_t>(integer("mask_at"));
    AUTOMOE_CHECK(n_docs_ >= 0 && n_tokens_ >= 0, path, ": negative sizes in header");
    // Counts, not byte products, are compared: a crafted header cannot overflow the check.
    auto fits = [&](uint64_t at, uint64_t count, uint64_t elem) {
      return at % elem == 0 && at >= 16 + hlen && at <= map_size_ &&
             count <= (map_size_ - at) / elem;
    };
    AUTOMOE_CHECK(fits(off_at, static_cast<uint64_t>(n_docs_) + 1, 8) &&
                      fits(tok_at, static_cast<uint64_t>(n_tokens_), 4) &&
                      fits(mask_at, static_cast<uint64_t>(n_tokens_), 1),
                  path, ": truncated or inconsistent dataset (delete it to re-tokenise)");
    offsets_ = reinterpret_cast<const int64_t*>(base + off_at);
    tokens_ = reinterpret_cast<const int32_t*>(base + tok_at);
    mask_ = reinterpret_cast<const uint8_t*>(base + mask_at);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": bad dataset header: ", e.what());
  }
  AUTOMOE_CHECK(offsets_[0] == 0 && offsets_[n_docs_] == n_tokens_, path,
                ": document offsets do not cover the tokens");
  for (int64_t d = 0; d < n_docs_; ++d) {
    AUTOMOE_CHECK(offsets_[d + 1] > offsets_[d], path, ": document ", d, " is empty or misordered");
  }
  unmap_on_error.self = nullptr;
}

TokenDataset::~TokenDataset() {
  if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_size_);
}

int64_t TokenDataset::max_token() const {
  int64_t hi = -1;
  for (int64_t i = 0; i < n_tokens_; ++i) {
    AUTOMOE_CHECK(tokens_[i] >= 0, path_, ": negative token id at position ", i);
    hi = std::max<int64_t>(hi, tokens_[i]);
  }
  return hi;
}

Batcher::Batcher(const TokenDataset& data, int64_t rows, int64_t seq_len, bool packing,
                 bool shuffle, uint64_t seed, int64_t pad_token_id)
    : data_(data),
      rows_(rows),
      seq_len_(seq_len),
      packing_(packing),
      shuffle_(shuffle),
      seed_(seed),
      pad_(pad_token_id < 0 ? 0 : pad_token_id) {
  AUTOMOE_CHECK(data.num_docs() > 0, data.path(), ": the dataset has no documents");
}

namespace {
// splitmix64: a small, fully specified generator, so that a data order never depends on the
// version of a library.
uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

const std::vector<int64_t>& Batcher::order(int64_t epoch) const {
  if (epoch == cached_epoch_) return cached_order_;
  cached_order_.resize(data_.num_docs());
  std::iota(cached_order_.begin(), cached_order_.end(), 0);
  if (shuffle_) {
    uint64_t s = seed_ * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(epoch) + 1;
    for (int64_t i = data_.num_docs() - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(splitmix64(s) % static_cast<uint64_t>(i + 1));
      std::swap(cached_order_[i], cached_order_[j]);
    }
  }
  cached_epoch_ = epoch;
  return cached_order_;
}

void Batcher::advance(DataPosition& pos, std::vector<std::vector<int64_t>>* rows_docs) const {
  int64_t rows = 0, used = seq_len_;  // rows started, tokens in the current row
  while (true) {
    const int64_t doc = order(pos.epoch)[pos.cursor];
    const int64_t len = std::min(data_.doc_length(doc), seq_len_);
    const bool new_row = !packing_ || used + len > seq_len_;
    if (new_row && rows == rows_) return;
    if (new_row) {
      ++rows;
      used = 0;
      if (rows_docs) rows_docs->emplace_back();
    }
    if (rows_docs) rows_docs->back().push_back(doc);
    used += len;
    if (++pos.cursor == data_.num_docs()) {  // an epoch ends: the position is the next one's start
      pos.epoch += 1;
      pos.cursor = 0;
    }
  }
}

Truncation truncation_at(const TokenDataset& data, int64_t seq_len) {
  Truncation t;
  for (int64_t d = 0; d < data.num_docs(); ++d) {
    const int64_t full = data.doc_length(d), len = std::min(full, seq_len);
    t.documents += full > len;
    t.tokens += full - len;
    const uint8_t* m = data.doc_mask(d);
    // (the first token of a document never carries loss: see Batcher)
    const bool kept = std::find(m + std::min<int64_t>(1, len), m + len, 1) != m + len;
    if (kept) continue;
    t.documents_without_loss += 1;
    t.documents_cut_to_no_loss += std::find(m + len, m + full, 1) != m + full;
  }
  return t;
}

MicroBatch Batcher::next(DataPosition& pos, bool tensors) const {
  std::vector<std::vector<int64_t>> rows;
  advance(pos, &rows);
  return build(rows, tensors);
}

int64_t Batcher::count_until(DataPosition pos, double epochs) const {
  const auto n = static_cast<double>(data_.num_docs());
  int64_t count = 0;
  while (static_cast<double>(pos.epoch) + static_cast<double>(pos.cursor) / n < epochs) {
    advance(pos, nullptr);
    ++count;
  }
  return count;
}

std::vector<MicroBatch> Batcher::all_in_order() const {
  std::vector<MicroBatch> out;
  std::vector<std::vector<int64_t>> rows;
  int64_t used = seq_len_;
  for (int64_t doc = 0; doc < data_.num_docs(); ++doc) {
    const int64_t len = std::min(data_.doc_length(doc), seq_len_);
    const bool new_row = !packing_ || used + len > seq_len_;
    if (new_row && static_cast<int64_t>(rows.size()) == rows_) {
      out.push_back(build(rows));
      rows.clear();
    }
    if (new_row) {
      rows.emplace_back();
      used = 0;
    }
    rows.back().push_back(doc);
    used += len;
  }
  if (!rows.empty()) out.push_back(build(rows));
  return out;
}

MicroBatch Batcher::build(const std::vector<std::vector<int64_t>>& rows_docs, bool tensors) const {
  const auto R = static_cast<int64_t>(rows_docs.size());
  int64_t L = 1;
  for (const auto& row : rows_docs) {
    int64_t n = 0;
    for (int64_t d : row) n += std::min(data_.doc_length(d), seq_len_);
    L = std::max(L, n);
  }
  MicroBatch mb;
  mb.rows = R;
  mb.length = L;
  for (const auto& row : rows_docs) {  // the counts (all a step's plan needs)
    for (int64_t d : row) {
      const int64_t full = data_.doc_length(d), len = std::min(full, seq_len_);
      mb.truncated += full > len;
      mb.truncated_tokens += full - len;
      mb.documents += 1;
      mb.real_tokens += len;
      const uint8_t* m = data_.doc_mask(d);
      for (int64_t i = 1; i < len; ++i) mb.loss_tokens += m[i] != 0;
    }
  }
  if (!tensors) return mb;
  const auto opts = at::TensorOptions().dtype(at::kLong);
  mb.input_ids = at::full({R, L}, pad_, opts);
  mb.position_ids = at::zeros({R, L}, opts);
  mb.document_ids = at::full({R, L}, -1, opts);
  mb.labels = at::full({R, L}, -100, opts);
  auto ids = mb.input_ids.accessor<int64_t, 2>();
  auto pos = mb.position_ids.accessor<int64_t, 2>();
  auto doc_ids = mb.document_ids.accessor<int64_t, 2>();
  auto labels = mb.labels.accessor<int64_t, 2>();
  for (int64_t r = 0; r < R; ++r) {
    int64_t at_col = 0, local_doc = 0;
    for (int64_t d : rows_docs[r]) {
      const int64_t len = std::min(data_.doc_length(d), seq_len_);
      const int32_t* tok = data_.doc_tokens(d);
      const uint8_t* m = data_.doc_mask(d);
      for (int64_t i = 0; i < len; ++i) {
        ids[r][at_col + i] = tok[i];
        pos[r][at_col + i] = i;
        doc_ids[r][at_col + i] = local_doc;
        if (i > 0 && m[i]) labels[r][at_col + i] = tok[i];
      }
      at_col += len;
      local_doc += 1;
    }
    // Padding continues the positions of a document of its own (id -1), so that it attends only
    // to itself and never to real tokens.
    for (int64_t c = at_col; c < L; ++c) pos[r][c] = c - at_col;
  }
  return mb;
}

}  // namespace automoe::train
