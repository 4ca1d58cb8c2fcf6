#include "automoe/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "automoe/core/error.h"

namespace automoe::train {
namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // Castagnoli
      t[i] = c;
    }
    return t;
  }();
  return table;
}

uint32_t masked_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void bytes_field(std::string& out, uint32_t field, const std::string& payload) {
  varint(out, (field << 3) | 2);
  varint(out, payload.size());
  out += payload;
}

template <typename T>
void fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts (x86-64, aarch64)
  out.append(b, sizeof(T));
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  path_ = (std::filesystem::path(dir) /
           ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) + "." +
            host + "." + std::to_string(::getpid()) + ".automoe"))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  AUTOMOE_CHECK(file_, "log.tensorboard: cannot create ", path_, ": ", std::strerror(errno));
  std::string event;
  varint(event, (1 << 3) | 1);
  fixed(event, now_seconds());
  bytes_field(event, 3, "brain.Event:2");
  record(event);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string val;
  bytes_field(val, 1, tag);
  varint(val, (2 << 3) | 5);
  fixed(val, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, val);
  std::string event;
  varint(event, (1 << 3) | 1);
  fixed(event, now_seconds());
  varint(event, 2 << 3);
  varint(event, static_cast<uint64_t>(step));
  bytes_field(event, 5, summary);
  record(event);
}

void TensorBoardWriter::record(const std::string& event) {
  std::string rec;
  const uint64_t len = event.size();
  fixed(rec, len);
  fixed(rec, masked_crc(rec.data(), 8));
  rec += event;
  fixed(rec, masked_crc(event.data(), event.size()));
  AUTOMOE_CHECK(std::fwrite(rec.data(), 1, rec.size(), file_) == rec.size(), "log.tensorboard: ",
                "write to ", path_, " failed: ", std::strerror(errno));
}

void TensorBoardWriter::flush() {
  AUTOMOE_CHECK(std::fflush(file_) == 0, "log.tensorboard: write to ", path_, " failed: ",
                std::strerror(errno));
}

}  // namespace automoe::train
