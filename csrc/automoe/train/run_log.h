// What a training run records as it goes: metrics.jsonl (one JSON object per line, appended
// across resumes) and, when asked, TensorBoard scalars. Every write is checked: a record that
// cannot be written whole (a full disk, a removed directory) stops the run with the path and the
// system's reason, never a silently dropped or half line. An append starts on a fresh line, so a
// line cut by a killed run stays a single bad line that readers can skip.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "automoe/train/tensorboard.h"

namespace automoe::train {

class RunLog {
 public:
  // `jsonl`: the metrics file (created with its directory); `tensorboard`: "" or a directory.
  RunLog(const std::string& jsonl, const std::string& tensorboard);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  // Appends `rec` to the JSONL file and its scalars ("train", "eval" records) to TensorBoard.
  void emit(const nlohmann::json& rec);

 private:
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<TensorBoardWriter> tb_;
};

}  // namespace automoe::train
