// safetensors reading: the file mapped (copy-on-write), its header fully validated, tensors and
// row ranges handed out zero-copy; and a checkpoint directory's files (single file or index).
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/log.h"
#include "automoe/io/safetensors.h"
#include "automoe/io/safetensors_internal.h"

namespace automoe {

using namespace safetensors_internal;
namespace fs = std::filesystem;
using Json = nlohmann::json;

// The whole file, mapped private and writable: a write through a tensor that aliases the mapping
// gets a private copy of the page (copy-on-write) and never reaches the file. MAP_NORESERVE keeps
// the kernel from charging the full file size as committed memory (which would refuse to map a
// checkpoint larger than RAM + swap); only pages actually written get private copies.
class MappedFile {
 public:
  MappedFile(char* data, size_t size) : data_(data), size_(size) {}
  ~MappedFile() { ::munmap(data_, size_); }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_;
  size_t size_;
};

namespace {

std::shared_ptr<MappedFile> map_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail("safetensors file \"", path, "\": cannot open: ", errno_text(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    fail("safetensors file \"", path, "\": cannot stat: ", errno_text(errno));
  }
  AUTOMOE_CHECK(S_ISREG(st.st_mode), "safetensors file \"", path, "\": not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  AUTOMOE_CHECK(size >= 8, "safetensors file \"", path, "\": file too short: ", size,
                " bytes, expected at least 8 (the u64 header length)");
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd.get(), 0);
  if (p == MAP_FAILED) fail("safetensors file \"", path, "\": cannot mmap: ", errno_text(errno));
  return std::make_shared<MappedFile>(static_cast<char*>(p), size);
}

uint64_t read_u64_le(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// Parses and checks one safetensors header. Every message starts with the file path; messages
// about one entry also name the tensor.
class HeaderParser {
 public:
  HeaderParser(const std::string& path, uint64_t data_size) : path_(path), data_size_(data_size) {}

  void parse(const char* begin, const char* end, std::map<std::string, TensorInfo>& tensors,
             std::map<std::string, std::string>& metadata) {
    Json header = parse_json(begin, end);
    if (!header.is_object())
      fail_file("header is not a JSON object (found ", header.type_name(), ")");
    for (const auto& [key, value] : header.items()) {
      if (key == kMetadataKey) {
        metadata = parse_metadata(value);
      } else {
        tensors.emplace(key, parse_entry(key, value));
      }
    }
    check_tiling(tensors);
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail_file(Args&&... args) const {
    fail("safetensors file \"", path_, "\": ", std::forward<Args>(args)...);
  }
  template <typename... Args>
  [[noreturn]] void fail_tensor(const std::string& name, Args&&... args) const {
    fail("safetensors file \"", path_, "\": tensor \"", name, "\": ", std::forward<Args>(args)...);
  }

  // nlohmann keeps the last of duplicate keys silently; the callback sees every top-level key
  // (depth 1) so a repeated tensor name is reported instead.
  Json parse_json(const char* begin, const char* end) const {
    std::set<std::string> seen;
    std::string duplicate;
    auto on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
      if (event == Json::parse_event_t::key && depth == 1 && duplicate.empty() &&
          !seen.insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    Json header;
    try {
      header = Json::parse(begin, end, on_event);
    } catch (const Json::exception& e) {
      fail_file("header is not valid JSON: ", e.what());
    }
    if (!duplicate.empty()) fail_file("header names \"", duplicate, "\" more than once");
    return header;
  }

  std::map<std::string, std::string> parse_metadata(const Json& value) const {
    if (!value.is_object()) {
      fail_file("__metadata__ must be an object of string to string (found ", value.type_name(),
                ")");
    }
    std::map<std::string, std::string> out;
    for (const auto& [k, v] : value.items()) {
      if (!v.is_string()) {
        fail_file("__metadata__ value of \"", k, "\" must be a string (found ", v.type_name(), ")");
      }
      out.emplace(k, v.get<std::string>());
    }
    return out;
  }

  const Json& field(const std::string& name, const Json& entry, const char* key) const {
    auto it = entry.find(key);
    if (it == entry.end()) fail_tensor(name, "missing \"", key, "\"");
    return *it;
  }

  // A JSON integer that fits in [0, max]; nullopt for anything else (float, negative, too big).
  static std::optional<uint64_t> as_uint(const Json& v, uint64_t max) {
    if (v.is_number_unsigned()) {
      auto u = v.get<uint64_t>();
      if (u <= max) return u;
    } else if (v.is_number_integer()) {
      auto i = v.get<int64_t>();
      if (i >= 0 && static_cast<uint64_t>(i) <= max) return static_cast<uint64_t>(i);
    }
    return std::nullopt;
  }

  c10::ScalarType parse_dtype(const std::string& name, const Json& entry) const {
    const Json& v = field(name, entry, "dtype");
    if (!v.is_string()) fail_tensor(name, "\"dtype\" must be a string (found ", v.type_name(), ")");
    auto dtype = dtype_from_safetensors(v.get<std::string>());
    if (!dtype) fail_tensor(name, "unknown dtype \"", v.get<std::string>(), "\"");
    return *dtype;
  }

  std::vector<int64_t> parse_shape(const std::string& name, const Json& entry) const {
    const Json& v = field(name, entry, "shape");
    if (!v.is_array()) fail_tensor(name, "\"shape\" must be an array (found ", v.type_name(), ")");
    std::vector<int64_t> shape;
    for (size_t i = 0; i < v.size(); ++i) {
      const Json& d = v[i];
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0) {
        fail_tensor(name, "negative shape dim ", d.get<int64_t>(), " at index ", i);
      }
      auto u = as_uint(d, std::numeric_limits<int64_t>::max());
      if (!u)
        fail_tensor(name, "shape dim ", i, " must be a non-negative integer (found ", d.dump(),
                    ")");
      shape.push_back(static_cast<int64_t>(*u));
    }
    return shape;
  }

  std::pair<uint64_t, uint64_t> parse_offsets(const std::string& name, const Json& entry) const {
    const Json& v = field(name, entry, "data_offsets");
    const uint64_t max = std::numeric_limits<uint64_t>::max();
    std::optional<uint64_t> b, e;
    if (v.is_array() && v.size() == 2) b = as_uint(v[0], max), e = as_uint(v[1], max);
    if (!b || !e || *b > *e) {
      fail_tensor(name,
                  "\"data_offsets\" must be [begin, end] with integers 0 <= begin <= end (found ",
                  v.dump(), ")");
    }
    return {*b, *e};
  }

  // Bytes the shape needs, or a failure when the product does not fit in 64 bits. The strides
  // must fit too: a zero-size dim makes [0, 2^62, 4] hold no bytes, yet no tensor has that shape
  // (PyTorch computes its strides, the product of the other dims, in int64).
  uint64_t shape_bytes(const std::string& name, const std::vector<int64_t>& shape,
                       c10::ScalarType dtype) const {
    uint64_t bytes = c10::elementSize(dtype);
    int64_t span = static_cast<int64_t>(bytes);
    for (int64_t d : shape) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
        fail_tensor(name, "shape ", shape_str(shape), " overflows 64-bit byte count");
      }
      if (__builtin_mul_overflow(span, std::max<int64_t>(d, 1), &span)) {
        fail_tensor(name, "shape ", shape_str(shape),
                    ": the product of its non-zero dims "
                    "overflows 64 bits (no tensor can have this shape, even with no elements)");
      }
    }
    return bytes;
  }

  TensorInfo parse_entry(const std::string& name, const Json& entry) const {
    if (!entry.is_object())
      fail_tensor(name, "entry is not a JSON object (found ", entry.type_name(), ")");
    TensorInfo t;
    t.name = name;
    t.dtype = parse_dtype(name, entry);
    t.shape = parse_shape(name, entry);
    std::tie(t.begin, t.end) = parse_offsets(name, entry);
    const uint64_t need = shape_bytes(name, t.shape, t.dtype);
    if (need != t.end - t.begin) {
      fail_tensor(name, "shape/size mismatch: shape ", shape_str(t.shape), " of ",
                  dtype_to_safetensors(t.dtype), " needs ", need, " bytes, data_offsets [", t.begin,
                  ", ", t.end, "] span ", t.end - t.begin);
    }
    if (t.end > data_size_) {
      fail_tensor(name, "data_offsets [", t.begin, ", ", t.end, "] out of range: the data area is ",
                  data_size_, " bytes");
    }
    return t;
  }

  // The ranges, sorted by (begin, end), must tile [0, data_size) exactly: each begins where the
  // previous one ended. (Zero-byte tensors are empty ranges and may sit at any boundary.)
  void check_tiling(const std::map<std::string, TensorInfo>& tensors) const {
    std::vector<const TensorInfo*> order;
    for (const auto& [_, t] : tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
      return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
    });
    const TensorInfo* prev = nullptr;
    uint64_t cursor = 0;
    for (const TensorInfo* t : order) {
      if (t->begin < cursor) {
        fail_file("tensors \"", prev->name, "\" [", prev->begin, ", ", prev->end, ") and \"",
                  t->name, "\" [", t->begin, ", ", t->end, ") overlap");
      }
      if (t->begin > cursor) {
        if (prev == nullptr) {
          fail_file("gap of ", t->begin, " bytes at the start of the data area, before tensor \"",
                    t->name, "\" (begins at ", t->begin, ")");
        }
        fail_file("gap of ", t->begin - cursor, " bytes between tensors \"", prev->name,
                  "\" (ends at ", cursor, ") and \"", t->name, "\" (begins at ", t->begin, ")");
      }
      cursor = t->end;
      prev = t;
    }
    if (cursor != data_size_) {
      fail_file("data area not fully covered: tensors end at byte ", cursor, " of a ", data_size_,
                "-byte data area (", data_size_ - cursor, " trailing bytes)");
    }
  }

  const std::string& path_;
  uint64_t data_size_;
};

std::vector<int64_t> row_shape(const TensorInfo& t, int64_t rows) {
  std::vector<int64_t> shape = t.shape;
  shape[0] = rows;
  return shape;
}

// A CPU tensor over `nbytes` bytes at `ptr` that keeps `map` alive. Bytes misaligned for the
// dtype (possible in files not written with 8-byte padding) are copied instead.
at::Tensor tensor_over(const std::shared_ptr<MappedFile>& map, char* ptr, uint64_t nbytes,
                       c10::ScalarType dtype, const std::vector<int64_t>& shape) {
  auto options = at::TensorOptions().dtype(dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % c10::elementSize(dtype) != 0) {
    at::Tensor copy = at::empty(shape, options);
    if (nbytes > 0) std::memcpy(copy.data_ptr(), ptr, nbytes);
    return copy;
  }
  return at::from_blob(
      ptr, shape, [keep = map](void*) {}, options);
}

}  // namespace

std::string safetensors_internal::read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  AUTOMOE_CHECK(in, "cannot read \"", path, "\": ", errno_text(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// ---- SafetensorsFile ----

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), map_(map_file(path)) {
  const char* base = map_->data();
  const uint64_t size = map_->size();
  const uint64_t n = read_u64_le(base);
  if (n > size - 8) {
    fail("safetensors file \"", path_, "\": header length past end of file: header length ", n,
         " needs ", n, " + 8 bytes, the file has ", size);
  }
  data_start_ = 8 + n;
  HeaderParser(path_, size - data_start_).parse(base + 8, base + data_start_, tensors_, metadata_);
}

SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<const TensorInfo*> order;
  for (const auto& [_, t] : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  std::vector<std::string> out;
  for (const TensorInfo* t : order) out.push_back(t->name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return tensors_.count(name) > 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    fail("safetensors file \"", path_, "\": no tensor named \"", name, "\"");
  return it->second;
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& t = info(name);
  return tensor_over(map_, map_->data() + data_start_ + t.begin, t.end - t.begin, t.dtype, t.shape);
}

at::Tensor SafetensorsFile::get_rows(const std::string& name, int64_t begin, int64_t end) const {
  const TensorInfo& t = info(name);
  AUTOMOE_CHECK(!t.shape.empty(), "safetensors file \"", path_, "\": tensor \"", name,
                "\": get_rows needs at least 1 dimension, the tensor is a scalar");
  AUTOMOE_CHECK(0 <= begin && begin <= end && end <= t.shape[0], "safetensors file \"", path_,
                "\": tensor \"", name, "\": row range [", begin, ", ", end,
                ") invalid, expected 0 <= begin <= end <= ", t.shape[0], " (shape ",
                shape_str(t.shape), ")");
  // Rows are contiguous runs of row_bytes; the size check at open guarantees
  // shape[0] * row_bytes == end - begin, so neither product below can overflow.
  const uint64_t row_bytes = t.shape[0] == 0 ? 0 : (t.end - t.begin) / t.shape[0];
  char* ptr = map_->data() + data_start_ + t.begin + static_cast<uint64_t>(begin) * row_bytes;
  return tensor_over(map_, ptr, static_cast<uint64_t>(end - begin) * row_bytes, t.dtype,
                     row_shape(t, end - begin));
}

void SafetensorsFile::release(const std::string& name) const {
  const TensorInfo& t = info(name);
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(map_->data() + data_start_ + t.begin) / page * page;
  const uintptr_t hi = reinterpret_cast<uintptr_t>(map_->data() + data_start_ + t.end);
  const uintptr_t map_lo = reinterpret_cast<uintptr_t>(map_->data());
  // (private, never written: the pages come back from the file if read again)
  if (hi > lo) ::madvise(reinterpret_cast<void*>(std::max(lo, map_lo / page * page)), hi - lo, MADV_DONTNEED);
}

// ---- SafetensorsCheckpoint ----

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  AUTOMOE_CHECK(fs::is_directory(dir, ec), "checkpoint directory \"", dir,
                "\" does not exist or is not a directory");
  const fs::path index_path = fs::path(dir) / kIndexFile;
  const fs::path single_path = fs::path(dir) / kSingleFile;

  // Which file the index says holds each tensor (empty without an index).
  std::map<std::string, std::string> claimed;
  std::vector<std::string> file_names;
  // model.safetensors wins over an index beside it, as in Transformers (which loads the single
  // file): the same directory must never be two different models to the two of us.
  const bool single = fs::exists(single_path, ec);
  if (single && fs::exists(index_path, ec)) {
    log_info("warning: \"", dir, "\" holds both ", kSingleFile, " and ", kIndexFile, "; loading ",
             kSingleFile,
             " as Transformers does (the index and the shards it names are ignored; remove the "
             "one you do not mean)");
  }
  if (!single && fs::exists(index_path, ec)) {
    const std::string where = "index \"" + index_path.string() + "\"";
    Json index;
    try {
      index = Json::parse(read_text_file(index_path.string()));
    } catch (const Json::exception& e) {
      fail(where, ": not valid JSON: ", e.what());
    }
    AUTOMOE_CHECK(
        index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), where,
        ": expected an object with a \"weight_map\" object");
    std::set<std::string> unique;
    for (const auto& [name, file] : index["weight_map"].items()) {
      AUTOMOE_CHECK(file.is_string(), where, ": weight_map value of \"", name,
                    "\" must be a file name string (found ", file.type_name(), ")");
      // A downloaded checkpoint must not make us open files outside its directory.
      const std::string f = file.get<std::string>();
      AUTOMOE_CHECK(!f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
                        f.find('\\') == std::string::npos && f.find('\0') == std::string::npos,
                    where, ": weight_map value of \"", name, "\" is \"", f,
                    "\", which is not a file name inside the checkpoint directory");
      claimed.emplace(name, file.get<std::string>());
      if (unique.insert(file.get<std::string>()).second)
        file_names.push_back(file.get<std::string>());
    }
    for (const auto& [name, file] : claimed) {
      AUTOMOE_CHECK(fs::is_regular_file(fs::path(dir) / file, ec), where, ": file \"", file,
                    "\" (holding tensor \"", name, "\") is missing from \"", dir, "\"");
    }
  } else {
    AUTOMOE_CHECK(fs::exists(single_path, ec), "checkpoint directory \"", dir, "\": neither ",
                  kIndexFile, " nor ", kSingleFile, " found");
    file_names.push_back(kSingleFile);
  }

  for (const std::string& file : file_names) {
    files_.emplace_back((fs::path(dir) / file).string());
    for (const std::string& name : files_.back().names()) {
      auto [it, fresh] = where_.emplace(name, files_.size() - 1);
      AUTOMOE_CHECK(fresh, "checkpoint directory \"", dir, "\": tensor \"", name,
                    "\" is in both \"", files_[it->second].path(), "\" and \"",
                    files_.back().path(), "\"");
    }
  }
  for (const auto& [name, file] : claimed) {
    auto it = where_.find(name);
    const std::string file_path = (fs::path(dir) / file).string();
    AUTOMOE_CHECK(it != where_.end() && files_[it->second].path() == file_path, "index \"",
                  index_path.string(), "\": tensor \"", name, "\" is absent from \"", file_path,
                  "\", the file the index names for it");
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail("checkpoint \"", dir_, "\": no tensor named \"", name, "\"");
  return files_[it->second];
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return file_of(name).info(name);
}

at::Tensor SafetensorsCheckpoint::get(const std::string& name) const {
  return file_of(name).get(name);
}

at::Tensor SafetensorsCheckpoint::get_rows(const std::string& name, int64_t begin,
                                           int64_t end) const {
  return file_of(name).get_rows(name, begin, end);
}

void SafetensorsCheckpoint::release(const std::string& name) const { file_of(name).release(name); }

}  // namespace automoe
