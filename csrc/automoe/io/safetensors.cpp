#include "automoe/io/safetensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/fault.h"
#include "automoe/core/log.h"

namespace automoe {

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

constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string errno_text(int err) { return std::strerror(err); }

// Closes a file descriptor on scope exit unless released.
class Fd {
 public:
  Fd() : fd_(-1) {}
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

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

void append_u64_le(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
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
        fail_tensor(name, "shape ", shape_str(shape), ": the product of its non-zero dims "
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

// ---- writing ----

[[noreturn]] void fail_write(const std::string& path, const char* what, int err) {
  fail("cannot write \"", path, "\": ", what, ": ", errno_text(err));
}

void write_all(int fd, const std::string& path, const void* data, size_t n) {
  fault_point("write", path);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_write(path, "write", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_dir(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail_write(path, "open directory for fsync", errno);
  if (::fsync(fd.get()) != 0) fail_write(path, "fsync directory", errno);
}

// Writes `path` atomically: `body` writes the contents to a temporary file next to it, which is
// fsync'ed and renamed over `path`; the directory is then fsync'ed so the rename is durable.
// Readers (and existing mappings of the old file) never see a partial file.
void write_atomic(const std::string& path, const std::function<void(int fd)>& body) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail_write(path, "create temporary file", errno);
  try {
    body(fd.get());
    fault_point("fsync", tmp);
    if (::fsync(fd.get()) != 0) fail_write(path, "fsync", errno);
    if (::close(fd.release()) != 0) fail_write(path, "close", errno);
    fault_point("rename", path);
    if (::rename(tmp.c_str(), path.c_str()) != 0) fail_write(path, "rename", errno);
  } catch (...) {
    if (fd.get() >= 0) ::close(fd.release());
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(path);
}

// Shard i of n: model-0000i-of-0000n.safetensors, or (`alt`) model-0000i-of-0000n.alt.safetensors,
// the names an in-place save uses when the standard ones hold the checkpoint it replaces.
std::string format_shard_name(size_t i, size_t n, bool alt) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu%s.safetensors", i, n, alt ? ".alt" : "");
  return buf;
}

// What a Hugging Face save owns in a directory: model.safetensors, model-00001-of-00003.safetensors
// (.alt) and the index (not, say, a user's model_ema.safetensors).
bool is_checkpoint_file(const std::string& name) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}(\.alt)?\.safetensors)");
  return name == kIndexFile || name == kSingleFile || std::regex_match(name, kShard);
}


void check_unique_names(const std::string& where,
                        const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::set<std::string> seen;
  for (const auto& [name, _] : tensors) {
    AUTOMOE_CHECK(name != kMetadataKey, "cannot write \"", where, "\": \"", kMetadataKey,
                  "\" is reserved and cannot name a tensor");
    AUTOMOE_CHECK(seen.insert(name).second, "cannot write \"", where,
                  "\": duplicate tensor name \"", name, "\"");
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  AUTOMOE_CHECK(in, "cannot read \"", path, "\": ", errno_text(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

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

// ---- writing ----

void write_file_atomic(const std::string& path, const std::string& text) {
  write_atomic(path, [&](int fd) { write_all(fd, path, text.data(), text.size()); });
}

namespace {

struct TensorMeta {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes() const {
    uint64_t n = c10::elementSize(dtype);
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};

// The 8-byte length, the JSON header (__metadata__, then the tensors in the given order, packed
// back to back) padded with spaces so that the data area starts at a multiple of 8 bytes (as the
// python package does: every tensor then maps aligned, without a copy).
std::string safetensors_prefix(const std::string& path, const std::vector<TensorMeta>& tensors,
                               const std::map<std::string, std::string>& metadata,
                               std::vector<uint64_t>* offsets) {
  nlohmann::ordered_json header;
  header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const TensorMeta& t : tensors) {
    std::string dtype;
    try {
      dtype = dtype_to_safetensors(t.dtype);
    } catch (const Error& e) {
      fail("cannot write \"", path, "\": tensor \"", t.name, "\": ", e.what());
    }
    if (offsets) offsets->push_back(offset);
    header[t.name] = {
        {"dtype", dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string json = header.dump();
  json.append((8 - (8 + json.size()) % 8) % 8, ' ');
  std::string prefix;
  append_u64_le(prefix, json.size());
  prefix += json;
  return prefix;
}

at::Tensor contiguous_cpu(const std::string& path, const std::string& name, const at::Tensor& t) {
  try {
    return t.contiguous().cpu();
  } catch (const c10::Error& e) {  // e.g. a meta tensor, which has no bytes to write
    fail("cannot write \"", path, "\": tensor \"", name, "\": ", e.what_without_backtrace());
  }
}

void pwrite_all(int fd, const std::string& path, const void* data, size_t n, uint64_t offset) {
  fault_point("write", path);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_write(path, "write", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// The weight files the index in `dir` names (empty without a readable index).
std::set<std::string> indexed_files(const std::string& dir) {
  std::set<std::string> out;
  try {
    const Json index = Json::parse(read_text_file((fs::path(dir) / kIndexFile).string()));
    for (const auto& [name, file] : index.at("weight_map").items()) out.insert(file.get<std::string>());
  } catch (const std::exception&) {
  }
  return out;
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      std::map<std::string, std::string> metadata) {
  check_unique_names(path, tensors);
  metadata.emplace("format", "pt");  // no-op when a format is already named
  std::vector<TensorMeta> metas;
  for (const auto& [name, t] : tensors) {
    AUTOMOE_CHECK(t.defined(), "cannot write \"", path, "\": tensor \"", name, "\" is undefined");
    AUTOMOE_CHECK(t.layout() == at::kStrided, "cannot write \"", path, "\": tensor \"", name,
                  "\" is not a dense (strided) tensor");
    metas.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  const std::string prefix = safetensors_prefix(path, metas, metadata, nullptr);
  // Tensors are made contiguous / moved to the CPU one at a time, bounding the extra memory.
  write_atomic(path, [&](int fd) {
    write_all(fd, path, prefix.data(), prefix.size());
    for (const auto& [name, t] : tensors) {
      const at::Tensor c = contiguous_cpu(path, name, t);
      write_all(fd, path, c.data_ptr(), c.nbytes());
    }
  });
}

bool process_alive(int64_t pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

std::vector<std::string> remove_dead_temporaries(const std::string& dir) {
  static const std::regex kTemp(R"(.+\.(tmp\.|pending-)(\d{1,9}))");
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, kTemp) || !entry.is_regular_file(ec)) continue;
    if (process_alive(std::stoll(m[2].str()))) continue;
    std::error_code rm;
    fs::remove(entry.path(), rm);
    if (rm) {
      log_info("warning: could not remove \"", entry.path().string(),
               "\", left by a killed save: ", rm.message());
    } else {
      removed.push_back(entry.path().string());
    }
  }
  return removed;
}

std::vector<std::string> save_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    uint64_t max_shard_bytes) {
  std::vector<TensorSlot> slots;
  slots.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    AUTOMOE_CHECK(t.defined(), "cannot write \"", dir, "\": tensor \"", name, "\" is undefined");
    slots.push_back({name, t.scalar_type(), t.sizes().vec(), t, 0});
  }
  return save_sharded(dir, slots, max_shard_bytes, nullptr);
}

std::vector<std::string> save_sharded(const std::string& dir, const std::vector<TensorSlot>& slots,
                                      uint64_t max_shard_bytes, const WriteGroup* group) {
  {
    std::set<std::string> seen;
    for (const TensorSlot& s : slots) {
      AUTOMOE_CHECK(s.name != kMetadataKey, "cannot write \"", dir, "\": \"", kMetadataKey,
                    "\" is reserved and cannot name a tensor");
      AUTOMOE_CHECK(seen.insert(s.name).second, "cannot write \"", dir,
                    "\": duplicate tensor name \"", s.name, "\"");
    }
  }
  const WriteGroup alone{
      true, [](const std::string& mine, const char*) { return std::vector<std::string>{mine}; }};
  const WriteGroup& g = group ? *group : alone;
  std::error_code ec;

  // Greedy in the given order: a tensor opens a new shard when it would push the current one past
  // the limit, so a tensor bigger than the limit always ends up alone. Every process computes the
  // same plan from the slots' full shapes.
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const uint64_t nbytes = TensorMeta{slots[i].name, slots[i].dtype, slots[i].shape}.nbytes();
    if (shards.empty() || (!shards.back().empty() && shard_bytes + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  if (shards.empty()) shards.emplace_back();
  // The standard shard names, unless the checkpoint being replaced (a save into the directory it
  // was loaded from) holds them: then the .alt names, so that it stays whole until the switch.
  bool alt = false;
  if (g.lead && shards.size() > 1) {
    const std::set<std::string> held = indexed_files(dir);
    for (size_t i = 0; i < shards.size() && !alt; ++i) {
      alt = held.count(format_shard_name(i + 1, shards.size(), false)) > 0;
    }
  }

  // Shards are written under temporary names first (the lead creates each with its header and
  // full length, every process writes its rows into it); the old index is removed before any
  // shard is renamed into place and the new index is written last. A save interrupted at any
  // point leaves either the previous checkpoint intact or no index (an error on load) — never an
  // index that matches a mix of old and new shards.
  // The processes must plan the same files: the lead's pid names the pending files, and every
  // process's digest of the plan (names, dtypes, shapes, shard size) must equal the lead's.
  uint64_t digest = 1469598103934665603ull;  // FNV-1a
  auto mix = [&](const std::string& text) {
    for (const char c : text) digest = (digest ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  };
  mix(std::to_string(max_shard_bytes));
  for (const TensorSlot& sl : slots) {
    mix(sl.name + "|" + std::to_string(static_cast<int>(sl.dtype)));
    for (int64_t d : sl.shape) mix("," + std::to_string(d));
  }
  const std::vector<std::string> starts = g.gather(
      std::to_string(::getpid()) + ":" + (alt ? "1" : "0") + " " + std::to_string(digest),
      "save (start)");
  const std::string lead_pid = starts.front().substr(0, starts.front().find(':'));
  alt = starts.front().substr(starts.front().find(':') + 1, 1) == "1";  // the lead's choice
  std::vector<std::string> files;
  for (size_t i = 0; i < shards.size(); ++i) {
    files.push_back(shards.size() == 1 ? kSingleFile : format_shard_name(i + 1, shards.size(), alt));
  }
  for (size_t r = 0; r < starts.size(); ++r) {
    AUTOMOE_CHECK(
        starts[r].substr(starts[r].find(' ')) == starts.front().substr(starts.front().find(' ')),
        "saving \"", dir, "\": process ", r,
        " plans other files than process 0 (other tensor names, dtypes, shapes, layout or "
        "shard size)");
  }
  const std::string pending = ".pending-" + lead_pid;
  auto pending_path = [&](size_t i) { return (fs::path(dir) / (files[i] + pending)).string(); };
  auto remove_pending = [&] {
    if (!g.lead) return;
    for (size_t i = 0; i < files.size(); ++i) ::unlink(pending_path(i).c_str());
  };
  // However the save ends (an error here, or a collective that failed because another process
  // died), the lead leaves no pending file behind (after the renames there is none to remove).
  struct Cleanup {
    std::function<void()> f;
    ~Cleanup() { f(); }
  } cleanup{remove_pending};
  // Every process's error (empty: none) in rank order; the first one fails the save everywhere.
  auto agree = [&](const std::string& error, const char* phase) {
    const std::vector<std::string> all = g.gather(error, phase);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      remove_pending();
      if (group) fail("saving \"", dir, "\" (", phase, "): process ", r, ": ", all[r]);
      throw Error(all[r]);
    }
  };
  auto attempt = [](const std::function<void()>& f) -> std::string {
    try {
      f();
      return {};
    } catch (const std::exception& e) {
      return e.what();
    }
  };

  std::vector<std::vector<uint64_t>> offsets(shards.size());
  std::vector<uint64_t> data_begin(shards.size());
  std::string error = attempt([&] {
    if (g.lead) {
      fs::create_directories(dir, ec);
      AUTOMOE_CHECK(!ec, "cannot create directory \"", dir, "\": ", ec.message());
      remove_dead_temporaries(dir);
    }
    for (size_t i = 0; i < shards.size(); ++i) {
      std::vector<TensorMeta> metas;
      for (size_t k : shards[i]) metas.push_back({slots[k].name, slots[k].dtype, slots[k].shape});
      const std::string path = pending_path(i);
      const std::string prefix = safetensors_prefix(path, metas, {{"format", "pt"}}, &offsets[i]);
      data_begin[i] = prefix.size();
      if (!g.lead) continue;
      uint64_t size = prefix.size();
      for (const TensorMeta& m : metas) size += m.nbytes();
      Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (fd.get() < 0) fail_write(path, "create", errno);
      write_all(fd.get(), path, prefix.data(), prefix.size());
      // Reserve the blocks now: a full disk fails here, not as a hole that reads back as zeros.
      if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size)); err != 0) {
        if (err != EOPNOTSUPP && err != EINVAL) fail_write(path, "allocate", err);
        if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) fail_write(path, "ftruncate", errno);
      }
      fault_point("fsync", path);
      if (::fsync(fd.get()) != 0) fail_write(path, "fsync", errno);
      if (::close(fd.release()) != 0) fail_write(path, "close", errno);
    }
  });
  agree(error, "creating the files");

  // Each process writes the rows it holds; together they must cover every row exactly once.
  std::string mine;  // "slot:first row:rows;" for each slot this process writes
  error = attempt([&] {
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string path = pending_path(i);
      Fd fd;
      for (size_t j = 0; j < shards[i].size(); ++j) {
        const TensorSlot& s = slots[shards[i][j]];
        if (!s.rows.defined()) continue;
        AUTOMOE_CHECK(s.rows.scalar_type() == s.dtype, "cannot write \"", path, "\": tensor \"",
                      s.name, "\" is ", s.rows.scalar_type(), ", its slot ", s.dtype);
        const at::Tensor c = contiguous_cpu(path, s.name, s.rows);
        uint64_t offset = 0;
        if (s.shape.empty()) {
          AUTOMOE_CHECK(c.dim() == 0 && s.row_begin == 0, "cannot write \"", path, "\": tensor \"",
                        s.name, "\": a scalar is written whole");
        } else {
          std::vector<int64_t> tail(s.shape.begin() + 1, s.shape.end());
          AUTOMOE_CHECK(c.dim() == static_cast<int64_t>(s.shape.size()) &&
                            c.sizes().slice(1).vec() == tail && s.row_begin >= 0 &&
                            s.row_begin + c.size(0) <= s.shape[0],
                        "cannot write \"", path, "\": tensor \"", s.name, "\": rows [", s.row_begin,
                        ", ", s.row_begin + (c.dim() ? c.size(0) : 0), ") of shape ", c.sizes(),
                        " do not fit its shape ", s.shape);
          offset = static_cast<uint64_t>(s.row_begin) * (c.numel() ? c.nbytes() / c.size(0) : 0);
        }
        if (fd.get() < 0) {
          fd = Fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
          if (fd.get() < 0) fail_write(path, "open", errno);
        }
        pwrite_all(fd.get(), path, c.data_ptr(), c.nbytes(),
                   data_begin[i] + offsets[i][j] + offset);
        mine += std::to_string(shards[i][j]) + ":" + std::to_string(s.row_begin) + ":" +
                std::to_string(s.shape.empty() ? 1 : c.size(0)) + ";";
      }
      if (fd.get() >= 0) {
        fault_point("fsync", path);
        if (::fsync(fd.get()) != 0) fail_write(path, "fsync", errno);
        if (::close(fd.release()) != 0) fail_write(path, "close", errno);
      }
    }
  });
  agree(error, "writing the tensors");
  {
    // Every process checks the same gathered lists, so all of them agree on the outcome.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(slots.size());
    for (const std::string& list : g.gather(mine, "save (rows written)")) {
      std::istringstream in(list);
      std::string item;
      while (std::getline(in, item, ';')) {
        size_t slot = 0;
        int64_t first = 0, count = 0;
        std::sscanf(item.c_str(), "%zu:%ld:%ld", &slot, &first, &count);
        rows.at(slot).emplace_back(first, count);
      }
    }
    for (size_t k = 0; k < slots.size(); ++k) {
      const int64_t n = slots[k].shape.empty() ? 1 : slots[k].shape[0];
      auto& v = rows[k];
      std::sort(v.begin(), v.end());
      int64_t next = 0;
      for (const auto& [first, count] : v) {
        if (first != next) {
          remove_pending();
          fail("saving \"", dir, "\": tensor \"", slots[k].name, "\": rows [",
               std::min(first, next), ", ", std::max(first, next), ") are written by ",
               first > next ? "no" : "more than one",
               " process (each tensor's rows must be written by exactly one process)");
        }
        next = first + count;
      }
      if (next != n && !(n == 0 && v.empty())) {
        remove_pending();
        fail("saving \"", dir, "\": tensor \"", slots[k].name, "\": rows [", next, ", ", n,
             ") are written by no process (each tensor's rows must be written by exactly one "
             "process)");
      }
    }
  }

  // The switch, so that the directory loads as the old checkpoint or the new one at every instant
  // (a kill anywhere leaves one of them whole; loaders prefer model.safetensors over the index, as
  // Transformers does): the new shards are renamed in under names the old checkpoint does not use,
  // then the index is replaced in one rename (the switch), then an old model.safetensors (which
  // would win over the index) and the old shards are removed. A single-file save is one rename.
  error = attempt([&] {
    if (!g.lead) return;
    const fs::path d(dir);
    for (size_t i = 0; i < files.size(); ++i) {
      const fs::path from = pending_path(i), to = d / files[i];
      fault_point("rename", to.string());
      AUTOMOE_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename \"", from.string(),
                    "\" to \"", to.string(), "\": ", errno_text(errno));
    }
    fsync_dir((d / files.front()).string());
    std::set<std::string> keep(files.begin(), files.end());
    if (shards.size() > 1) {
      Json weight_map = Json::object();  // std::map-backed: keys come out sorted
      for (size_t i = 0; i < shards.size(); ++i) {
        for (size_t k : shards[i]) weight_map[slots[k].name] = files[i];
      }
      Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      write_file_atomic((d / kIndexFile).string(), index.dump(2) + "\n");
      keep.insert(kIndexFile);
      if (fs::exists(d / kSingleFile, ec)) {
        fault_point("remove", (d / kSingleFile).string());
        fs::remove(d / kSingleFile, ec);
        AUTOMOE_CHECK(!ec, "cannot remove the replaced \"", (d / kSingleFile).string(), "\": ",
                      ec.message());
      }
    } else if (fs::exists(d / kIndexFile, ec)) {  // the old index first: then its shards
      fault_point("remove", (d / kIndexFile).string());
      fs::remove(d / kIndexFile, ec);
      AUTOMOE_CHECK(!ec, "cannot remove the replaced \"", (d / kIndexFile).string(), "\": ",
                    ec.message());
    }
    fsync_dir((d / files.front()).string());
    // Only now that the new checkpoint is the one the directory holds: drop what an earlier save
    // left behind (the replaced shards, a shard count that changed).
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (!is_checkpoint_file(name) || keep.count(name) || entry.is_directory(ec)) continue;
      fault_point("remove", entry.path().string());
      std::error_code rm;
      fs::remove(entry.path(), rm);  // the save is complete: a leftover is only disk space
      if (rm) log_info("warning: saved \"", dir, "\", but could not remove the replaced \"",
                       entry.path().string(), "\": ", rm.message());
    }
  });
  agree(error, "renaming the files into place");
  return files;
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
    log_info("warning: \"", dir, "\" holds both ", kSingleFile, " and ", kIndexFile,
             "; loading ", kSingleFile, " as Transformers does (the index and the shards it names "
             "are ignored; remove the one you do not mean)");
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

}  // namespace automoe
