#include "automoe/train/run_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "automoe/core/error.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;

void write_checked(int fd, const std::string& path, const std::string& text) {
  const char* p = text.data();
  size_t n = text.size();
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    AUTOMOE_CHECK(w > 0, "log.jsonl: cannot write ", path, ": ",
                  w < 0 ? std::strerror(errno) : "no progress", " (the run stops: its metrics "
                  "would be incomplete; free space and resume)");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

RunLog::RunLog(const std::string& jsonl, const std::string& tensorboard) : path_(jsonl) {
  const fs::path p(jsonl);
  if (p.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(p.parent_path(), ec);
    AUTOMOE_CHECK(!ec, "log.jsonl: cannot create the directory ", p.parent_path().string(), ": ",
                  ec.message());
  }
  fd_ = ::open(jsonl.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) fd_ = ::open(jsonl.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  AUTOMOE_CHECK(fd_ >= 0, "log.jsonl: cannot open ", jsonl, " for appending: ",
                std::strerror(errno));
  // A line cut short by a run that was killed or met a full disk: end it before appending.
  struct stat st {};
  char last = '\n';
  if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 &&
      ::pread(fd_, &last, 1, st.st_size - 1) == 1 && last != '\n') {
    write_checked(fd_, path_, "\n");
  }
  if (!tensorboard.empty()) tb_ = std::make_unique<TensorBoardWriter>(tensorboard);
}

RunLog::~RunLog() {
  if (fd_ >= 0) ::close(fd_);
}

void RunLog::emit(const nlohmann::json& rec) {
  write_checked(fd_, path_, rec.dump() + "\n");  // one write(2) per record: O_APPEND keeps it whole
  if (!tb_) return;
  const std::string type = rec.value("type", "");
  const int64_t step = rec.value("step", int64_t{0});
  auto put = [&](const std::string& tag, const char* key) {
    if (rec.contains(key) && rec[key].is_number()) tb_->scalar(tag, step, rec[key].get<double>());
  };
  if (type == "train") {
    put("train/loss", "loss");
    put("train/aux_loss", "aux_loss");
    put("train/grad_norm", "grad_norm");
    put("train/lr", "lr");
    put("perf/tokens_per_s", "tokens_per_s");
    put("perf/tflops", "tflops");
    put("perf/mfu", "mfu");
    put("perf/peak_memory_gib", "peak_memory_gib");
    for (const auto& layer : rec["expert_load"]) {
      const std::string l = std::to_string(layer["layer"].get<int64_t>());
      tb_->scalar("moe/layer" + l + "/load_cv", step, layer["cv"].get<double>());
      tb_->scalar("moe/layer" + l + "/empty_experts", step, layer["empty"].get<double>());
    }
  } else if (type == "eval") {
    put("eval/loss", "eval_loss");
  }
  tb_->flush();
}

}  // namespace automoe::train
