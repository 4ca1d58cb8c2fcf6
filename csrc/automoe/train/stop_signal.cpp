#include "automoe/train/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>

#include "automoe/core/error.h"

namespace automoe::train {
namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGHUP};

// A signal handler can only reach process-wide state; this is the one place that holds some.
volatile sig_atomic_t g_requested = 0;
struct sigaction g_previous[3];
bool g_installed = false;

void on_signal(int signum) {
  if (g_requested != 0) {  // the second signal: stop now
    ::signal(signum, SIG_DFL);
    ::raise(signum);
    return;
  }
  g_requested = signum;
  const char* msg = signum == SIGINT
                        ? "\nautomoe train: SIGINT: finishing this step, then a checkpoint and "
                          "exit (press Ctrl-C again to stop at once)\n"
                        : "\nautomoe train: stop requested by signal: finishing this step, then a "
                          "checkpoint and exit (a second signal stops at once)\n";
  [[maybe_unused]] const ssize_t w = ::write(STDERR_FILENO, msg, std::strlen(msg));
}

}  // namespace

StopSignals::StopSignals() {
  AUTOMOE_CHECK(!g_installed, "internal: a second StopSignals while one is installed");
  g_requested = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // interrupted reads and writes resume: the step goes on
  for (int i = 0; i < 3; ++i) {
    AUTOMOE_CHECK(::sigaction(kSignals[i], &sa, &g_previous[i]) == 0,
                  "cannot install a handler for ", name(kSignals[i]), ": ", std::strerror(errno));
  }
  g_installed = true;
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  g_installed = false;
}

int StopSignals::requested() const { return g_requested; }

const char* StopSignals::name(int signum) {
  switch (signum) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

}  // namespace automoe::train
