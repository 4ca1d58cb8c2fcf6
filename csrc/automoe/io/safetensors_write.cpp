// safetensors writing, one file at a time: atomic writes (temporary file, fsync, rename, directory
// fsync), the header every writer puts first, and the clean-up of what a killed save left behind.
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/fault.h"
#include "automoe/core/log.h"
#include "automoe/io/safetensors.h"
#include "automoe/io/safetensors_internal.h"

namespace automoe {

using namespace safetensors_internal;
namespace fs = std::filesystem;

namespace {

void append_u64_le(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
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

}  // namespace

[[noreturn]] void safetensors_internal::fail_write(const std::string& path, const char* what,
                                                   int err) {
  fail("cannot write \"", path, "\": ", what, ": ", errno_text(err));
}

void safetensors_internal::write_all(int fd, const std::string& path, const void* data, size_t n) {
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

void safetensors_internal::fsync_dir(const std::string& path) {
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail_write(path, "open directory for fsync", errno);
  if (::fsync(fd.get()) != 0) fail_write(path, "fsync directory", errno);
}

std::string safetensors_internal::safetensors_prefix(
    const std::string& path, const std::vector<TensorMeta>& tensors,
    const std::map<std::string, std::string>& metadata, std::vector<uint64_t>* offsets) {
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

at::Tensor safetensors_internal::contiguous_cpu(const std::string& path, const std::string& name,
                                                const at::Tensor& t) {
  try {
    return t.contiguous().cpu();
  } catch (const c10::Error& e) {  // e.g. a meta tensor, which has no bytes to write
    fail("cannot write \"", path, "\": tensor \"", name, "\": ", e.what_without_backtrace());
  }
}

void write_file_atomic(const std::string& path, const std::string& text) {
  write_atomic(path, [&](int fd) { write_all(fd, path, text.data(), text.size()); });
}

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

}  // namespace automoe
