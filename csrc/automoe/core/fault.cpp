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
    if (const char* s = std::getenv("AUTOMOE_FAULT_KILL_AT")) kill_at = std::atol(s);
    trace = std::getenv("AUTOMOE_FAULT_TRACE");
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
