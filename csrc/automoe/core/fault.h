// Fault injection for the crash-safety tests: every step of a save that changes what is on disk
// (a file written, fsynced, renamed or removed) calls fault_point() first. With
// AUTOMOE_FAULT_KILL_AT=N in the environment the process SIGKILLs itself at the N-th point (1-based),
// as a power cut or an OOM kill would; with AUTOMOE_FAULT_TRACE=path each point appends
// "N what path\n" to that file, so a test can count the points and kill at each of them.
// AUTOMOE_FAULT_RANK=r and AUTOMOE_FAULT_ATTEMPT=a limit both to the process whose RANK is r and
// whose TORCHELASTIC_RESTART_COUNT is a (unset: 0), for the torchrun restart tests.
// Without either variable a point costs one relaxed atomic increment.
#pragma once

#include <string>

namespace automoe {

void fault_point(const char* what, const std::string& path);

}  // namespace automoe
