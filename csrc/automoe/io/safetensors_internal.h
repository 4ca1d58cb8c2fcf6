// What the safetensors reader (safetensors_read.cpp), the one-file writer (safetensors_write.cpp)
// and the sharded writer (safetensors_sharded.cpp) share; not part of the API (safetensors.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace automoe::safetensors_internal {

inline constexpr const char* kMetadataKey = "__metadata__";
inline constexpr const char* kSingleFile = "model.safetensors";
inline constexpr const char* kIndexFile = "model.safetensors.index.json";

inline std::string errno_text(int err) { return std::strerror(err); }

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

// The whole file as bytes; an unreadable file is an automoe::Error naming it.
std::string read_text_file(const std::string& path);

// ---- writing (safetensors_write.cpp) ----

[[noreturn]] void fail_write(const std::string& path, const char* what, int err);
void write_all(int fd, const std::string& path, const void* data, size_t n);
// fsync of the directory holding `path`, so that a rename into it is durable.
void fsync_dir(const std::string& path);

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
                               std::vector<uint64_t>* offsets);

at::Tensor contiguous_cpu(const std::string& path, const std::string& name, const at::Tensor& t);

}  // namespace automoe::safetensors_internal
