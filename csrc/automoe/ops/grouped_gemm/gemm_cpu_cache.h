// The CPU GEMM engine's measured choices kept beyond one process (gemm_cpu_cache.cpp): the
// machine's cache file and the AUTOMOE_CPU_GEMM_DECISIONS pin, for the probes of gemm_cpu.cpp.
#pragma once

#include <string>

namespace automoe::ops::cpu::gemm_engine {

// Decisions as gemm_decisions() writes them, for the active level: whether they applied
// (gemm_cpu.cpp).
bool adopt(const std::string& decisions, const std::string& source);

// After a measurement: the file's line for this machine gets the new decision (probe 0: brgemm,
// 1: ATen for float32), written to a temporary file and renamed over the old one.
void remember_decision(int probe, bool decision);

// AUTOMOE_CPU_GEMM_DECISIONS (what gemm_decisions() printed in an earlier run): adopted instead
// of measuring, once, before the first probe. A value that cannot apply is an error naming it.
// Without it, the choices remembered for this machine, if any.
void adopt_pinned_decisions();

}  // namespace automoe::ops::cpu::gemm_engine
