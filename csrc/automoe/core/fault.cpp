#include "automoe/core/fault.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>

namespace automoe {
namespace {

struct FaultConfig {
  long kill_at = 0;           // 0: never
  const char* trace = nullptr;
  FaultConfig() {
    // Under torchrun every process has the same environment: the points count in one rank of
    // one attempt only (RANK, TORCHELASTIC_RESTART_COUNT), so a restarted group runs clean.
    if (!only_here("AUTOMOE_FAULT_RANK", "RANK") ||
        !only_here("AUTOMOE_FAULT_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"))
      return;
    if (const char* s = std::getenv("AUTOMOE_FAULT_KILL_AT")) kill_at = std::atol(s);
    trace = std::getenv("AUTOMOE_FAULT_TRACE");
  }
  static bool only_here(const char* want_var, const char* have_var) {
    const char* want = std::getenv(want_var);
    if (!want) return true;
    const char* have = std::getenv(have_var);
    return std::string(have ? have : "0") == want;
  }
};

}  // namespace

void fault_point(const char* what, const std::string& path) {
  static const FaultConfig config;  // read once: the environment of the process's start
  static std::atomic<long> count{0};
  if (config.kill_at <= 0 && !config.trace) return;
  const long n = ++count;
  if (config.trace) {
    const int fd = ::open(config.trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      char line[4096];
      const int len = std::snprintf(line, sizeof line, "%ld %s %s\n", n, what, path.c_str());
      if (len > 0) {
        const ssize_t w = ::write(fd, line, std::min<size_t>(len, sizeof line - 1));
        (void)w;  // a lost trace line only makes the test's count short: it then fails
      }
      ::close(fd);
    }
  }
  if (n == config.kill_at) ::kill(::getpid(), SIGKILL);
}

}  // namespace automoe
