// The CPU GEMM engine's work unit, shared by its files: the tiling, a unit (problem, rows, column
// tile), the per-thread workspace, and what runs a unit on each path (gemm_cpu.h lists the paths).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "automoe/ops/grouped_gemm/gemm_cpu.h"

namespace automoe::ops::cpu::gemm_engine {

constexpr int64_t kMR = 6;    // micro-tile rows
constexpr int64_t kMC = 96;   // rows per packed A block (16 micro-panels)
constexpr int64_t kMU = 384;  // rows per work unit: each packed B panel serves kMU / kMC A blocks
constexpr int64_t kNC = 256;  // columns per work unit
constexpr int64_t kKC = 512;  // depth per packed panel
// Micro-tile columns: NR = 16 (two 8-float AVX2 registers, or the generic loop) or 32 (two
// 16-float AVX-512 registers). Per micro-tile the kernel streams an A micro-panel (kKC x kMR
// floats, 12 KB) and a B micro-panel (kKC x NR, 32 or 64 KB) from L1/L2; the whole packed B panel
// (kKC x kNC, 512 KB) sits in L2. kKC = 512 measured best of 256/512 for the AVX-512 kernel
// (fewer accumulator round-trips); see docs/ops.md.

struct Unit {
  int64_t problem, m0, n0;
};

template <typename T>
struct AlignedDelete {
  void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
template <typename T>
using Aligned = std::unique_ptr<T[], AlignedDelete<T>>;

template <typename T>
Aligned<T> aligned(size_t n) {
  return Aligned<T>(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t(64))));
}

// Per thread. brgemm's operands are bf16: A [kMU, kKC] and B in VNNI pairs [kKC/2, kNC, 2].
struct Workspace {
  Aligned<float> a = aligned<float>(kMC * kKC), b = aligned<float>(kKC * kNC),
                 acc = aligned<float>(kMU * kNC);
  Aligned<c10::BFloat16> a16, b16;
  // What a16 holds (brgemm): the A panel of (problem, first row, depth); consecutive units of one
  // thread that share it (the same rows, the next column tile) skip re-packing it.
  const GemmProblem* a16_problem = nullptr;
  int64_t a16_m0 = -1, a16_k0 = -1;
  // run_unit_brgemm_transposed: Aᵀ in VNNI pairs for (problem, first row), and the Cᵀ tile
  std::vector<uint16_t> nt_b;
  std::vector<float> nt_c;
  const GemmProblem* nt_problem = nullptr;
  int64_t nt_m0 = -1;
};

// Writes (or adds) the float32 tile acc [mc, nc] (row stride kNC) into C
// (gemm_cpu_microkernel.cpp).
void store_tile(const GemmProblem& P, int64_t m0, int64_t mc, int64_t n0, int64_t nc,
                const float* acc);

// One unit on the packed float32 paths (gemm_cpu_microkernel.cpp): the generic loop, and the
// AVX2 and AVX-512 micro-kernels.
void run_unit_generic(const GemmProblem& P, const Unit& u, Workspace& ws);
#if defined(__x86_64__)
void run_unit_avx2(const GemmProblem& P, const Unit& u, Workspace& ws);
void run_unit_avx512(const GemmProblem& P, const Unit& u, Workspace& ws);
#endif

// The brgemm path (gemm_cpu_brgemm.cpp): one unit, packed; whether a problem runs transposed
// instead (then as one unit of rows per column tile); whether ATen's bf16 brgemm runs here.
void run_unit_brgemm(const GemmProblem& P, const Unit& u, Workspace& ws);
bool runs_transposed(const GemmProblem& P);
void run_unit_brgemm_transposed(const GemmProblem& P, const Unit& u, Workspace& ws);
bool brgemm_runs();

}  // namespace automoe::ops::cpu::gemm_engine
