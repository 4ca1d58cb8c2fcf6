// The CPU's instruction sets, detected once, and the path each CPU kernel family takes from them:
// the one place where CPU kernels choose by hardware. Kernels ask at every call (an atomic load),
// so tests can run each path in turn.
//
//   AUTOMOE_CPU_ISA=baseline|avx2|avx512|avx512_bf16|amx   caps the level (for testing a lower
//   path on a bigger CPU); a level above what the CPU has, or an unknown name, is an error.
#pragma once

#include <map>
#include <string>

namespace automoe::ops::cpu {

// Ordered: each level includes the ones below it.
enum class Isa : int {
  kBaseline = 0,    // x86-64 (or another architecture): scalar code the compiler vectorises
  kAvx2 = 1,        // AVX2 + FMA
  kAvx512 = 2,      // AVX-512 F/BW/VL/DQ
  kAvx512Bf16 = 3,  // + AVX512_BF16 (native bf16 dot products)
  kAmx = 4,         // + AMX-TILE / AMX-BF16
};

const char* isa_name(Isa isa);
// "avx512_bf16" -> Isa::kAvx512Bf16; an unknown name is an automoe::Error listing the names.
Isa parse_isa(const std::string& name);

// What this CPU has (cpuinfo through ATen, checked once).
Isa detected_isa();
// The level kernels use now: detected_isa(), capped by AUTOMOE_CPU_ISA or set_isa().
Isa active_isa();
// Caps the level (tests, benchmarks); above detected_isa() is an automoe::Error.
void set_isa(Isa isa);

// The path each kernel family runs at the active level, e.g. {"isa": "avx512_bf16",
// "gemm_bf16": "brgemm", "gemm_fp32": "avx512", "lm_head_bf16": "brgemm", "elementwise":
// "avx512", "gemm_measured": "brgemm 610 vs avx512 300 GFLOP/s ..."}: what `automoe bench` and
// the op benchmark print. (Asking runs the once-per-process measurements it reports.)
std::map<std::string, std::string> kernel_paths();

}  // namespace automoe::ops::cpu
