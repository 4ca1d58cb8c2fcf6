// Fault injection for the crash-safety tests: every step of a save that changes what is on disk
// (a file written, fsynced, renamed or removed) calls fault_point() first. With
// AUTOMOE_FAULT_KILL_AT=N in the environment the process SIGKILLs itself at the N-th point (1-based),
// as a power cut or an OOM kill would; with AUTOMOE_FAULT_TRACE=path each point appends
// "N what path\n" to that file, so a test can count the points and kill at each of them.
// Without either variable a point costs one relaxed atomic increment.
#pragma once

#include <string>

namespace automoe {

void fault_point(const char* what, const std::string& path);

}  // namespace automoe
