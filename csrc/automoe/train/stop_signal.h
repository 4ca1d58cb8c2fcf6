// Graceful stop of a training run. While a StopSignals lives, the first SIGTERM, SIGINT or SIGHUP
// (Slurm preemption, `docker stop`, Kubernetes eviction, Ctrl-C, a closed SSH session) only asks
// the training loop to stop: it finishes its step, writes a checkpoint and exits with status
// kExitStopped. A second signal ends the process at once (that signal's default action).
#pragma once

namespace automoe::train {

inline constexpr int kExitStopped = 4;

class StopSignals {
 public:
  StopSignals();   // installs the handlers (one StopSignals at a time)
  ~StopSignals();  // restores the previous ones
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal that asked for a stop, or 0.
  int requested() const;
  static const char* name(int signum);  // "SIGTERM", ...
};

}  // namespace automoe::train
