// TensorBoard scalars without TensorFlow or protobuf: an events file is a sequence of TFRecords
// (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload), each payload
// a serialized tensorflow.Event. We write the three message shapes scalars need by hand:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace automoe::train {

uint32_t crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new events.out.tfevents.<time>.<host>.automoe file in it.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalar(const std::string& tag, int64_t step, double value);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace automoe::train
