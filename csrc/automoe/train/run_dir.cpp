#include "automoe/train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "automoe/core/error.h"
#include "automoe/core/fault.h"
#include "automoe/core/log.h"
#include "automoe/io/safetensors.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;

bool is_complete_checkpoint(const fs::path& dir) {
  std::error_code ec;
  for (const char* f : {"trainer_state.json", "model.safetensors", "optimizer.safetensors"}) {
    if (!fs::is_regular_file(dir / f, ec)) return false;
  }
  return true;
}

}  // namespace

void claim_run_dir(const fs::path& run) {
  std::error_code ec;
  fs::create_directories(run, ec);
  AUTOMOE_CHECK(!ec, "checkpoint.dir ", run.string(), ": cannot create the directory: ",
                ec.message());
  AUTOMOE_CHECK(fs::is_directory(run, ec), "checkpoint.dir ", run.string(),
                " exists and is not a directory");
  const bool marked = fs::exists(run / kRunMarker, ec);
  if (!marked) {
    // An earlier AutoMoE wrote no marker, but always its lock and recipe record at the start.
    const bool earlier_run = fs::exists(run / ".lock", ec) && fs::exists(run / "recipe.json", ec);
    std::vector<std::string> foreign;
    for (const auto& e : fs::directory_iterator(run, ec)) {
      if (foreign.size() < 3) foreign.push_back(e.path().filename().string());
    }
    AUTOMOE_CHECK(!ec, "checkpoint.dir ", run.string(), ": cannot list the directory: ",
                  ec.message());
    std::string names;
    for (const auto& n : foreign) names += (names.empty() ? "" : ", ") + n;
    AUTOMOE_CHECK(foreign.empty() || earlier_run, "checkpoint.dir ", run.string(),
                  " is not empty (", names, foreign.size() == 3 ? ", ..." : "",
                  ") and was not created by automoe train: the trainer deletes old checkpoints "
                  "and temporary files in its run directory, so it only uses a new or empty one; "
                  "choose another checkpoint.dir");
  }
  // One trainer per run directory at a time (the lock goes with the process, however it ends).
  const std::string lock = (run / ".lock").string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  AUTOMOE_CHECK(fd >= 0, "checkpoint.dir ", run.string(), " is not writable: cannot create ", lock,
                ": ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    AUTOMOE_CHECK(err != EWOULDBLOCK, "checkpoint.dir ", run.string(),
                  " is in use by another automoe train process (it holds ", lock, ")");
    fail("checkpoint.dir ", run.string(), ": cannot lock ", lock, ": ", std::strerror(err),
         " (a file system without file locks?)");
  }
  if (!marked) {
    char when[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    write_file_atomic((run / kRunMarker).string(),
                      std::string("{\"automoe_run\": 1, \"claimed\": \"") + when + "\"}\n");
  }
  // Under the lock no other process of ours uses the directory: what a killed save left here
  // (a half-written step directory, temporary files) is garbage.
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-step-", 0) != 0) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (rm) log_info("warning: could not remove ", e.path().string(), ": ", rm.message());
  }
  remove_dead_temporaries(run.string());
}

void prune_checkpoints(const fs::path& run, int64_t keep_last, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const auto s = step_of(e.path().filename().string());
    if (s && e.is_directory(ec) && fs::exists(e.path() / "trainer_state.json", ec)) {
      steps.emplace_back(*s, e.path());
    }
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < steps.size(); ++i) {
    if (steps[i].first == keep) continue;
    fault_point("remove", steps[i].second.string());
    std::error_code rm;
    fs::remove_all(steps[i].second, rm);
    if (rm) {
      log_info("warning: checkpoint.keep_last: could not remove the old checkpoint ",
               steps[i].second.string(), ": ", rm.message(), " (the new one is saved; training "
               "goes on)");
    }
  }
}

std::vector<std::string> complete_checkpoints(const fs::path& run, int64_t below) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run, ec)) {
    const std::string name = e.path().filename().string();
    const auto s = step_of(name);
    if (s && *s < below && is_complete_checkpoint(e.path())) found.emplace_back(*s, name);
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& [s, name] : found) out.push_back(std::move(name));
  return out;
}

}  // namespace automoe::train
