// The CPU GEMM engine behind grouped_gemm and the fused cross-entropy: many independent problems
// C_p = A_p · B_p (+ C_p) with arbitrary strides, run as one parallel loop over (problem, row
// tile, column tile) work units so that small problems (experts with few tokens) do not leave
// threads idle. Inside a unit, by the path the CPU allows (ops/cpu/isa.h):
//   brgemm   bf16 operands on AMX CPUs, and on AVX-512-BF16 CPUs where it measures faster than
//            avx512 (gemm_cpu.cpp): A packed to bf16 rows, B to VNNI pairs (AVX-512 packing and
//            transposes), and ATen's batch-reduce GEMM (oneDNN's ukernel: AMX tiles, or
//            vdpbf16ps) accumulates in float32; below AMX, 17-128 rows run transposed
//            (Cᵀ = W · Aᵀ: the weights read in place, Aᵀ packed once);
//   avx512   BLIS-style: operands packed into float32 micro-panels (bf16 widened while packing)
//            and a 6x32 AVX-512 FMA micro-kernel;
//   avx2     the same with a 6x16 AVX2/FMA micro-kernel;
//   generic  the same with a plain loop.
// The result is rounded once to C's dtype. float64 problems (finite-difference tests) use a plain
// loop.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace automoe::ops::cpu {

struct GemmOperand {
  const void* data = nullptr;
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t row_stride = 0;  // element (i, j) is at data[i * row_stride + j * col_stride]
  int64_t col_stride = 0;
};

struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
  GemmOperand A;  // [M, K]
  GemmOperand B;  // [K, N]
  void* C = nullptr;  // [M, N], row stride ldc, unit column stride
  c10::ScalarType c_dtype = c10::ScalarType::Float;
  int64_t ldc = 0;
  bool accumulate = false;  // C += A·B instead of C = A·B (C must then be float32 or float64)
};

enum class GemmPath { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kBrgemm = 3 };
const char* gemm_path_name(GemmPath path);
// The path gemm_batch takes for a batch (`bf16_operands`: every A and B is bf16) at the active
// instruction-set level, or the one forced by force_gemm_path.
GemmPath gemm_path(bool bf16_operands);
// The paths that run on this CPU at the active level (the op tests run each).
std::vector<GemmPath> gemm_paths_available();
// Forces a path by name for every batch it can run ("" restores the choice by instruction set);
// a path this CPU cannot run is an automoe::Error. brgemm applies to all-bf16 batches only.
void force_gemm_path(const std::string& name);

// float32: whether ATen's BLAS (at::mm, one task per thread) beats gemm_batch on this CPU —
// measured once per process and instruction-set level (gemm_cpu.cpp). The grouped GEMM and the
// fused cross-entropy run float32 on the faster one.
bool aten_faster_fp32();
// Whether a CPU GEMM of this dtype runs faster on gemm_batch than on at::mm here: bf16 on an
// AVX2 or AVX-512 CPU whose ATen bf16 GEMM is not native (no AVX512_BF16 / AMX, or no oneDNN:
// ATen's fallback measured 0.3-21 GFLOP/s on an AVX2 EPYC, against ~130 for the engine; below
// AVX2 the engine is a plain loop and ATen keeps it), float32 by aten_faster_fp32();
// other dtypes never. The fused cross-entropy and the dense linear (ops::linear) choose by it.
bool engine_preferred(c10::ScalarType dtype);
// What the measured choices found, e.g. "brgemm 610 vs avx512 300 GFLOP/s (one thread); aten
// 170 vs avx512 320 GFLOP/s" (for `automoe bench` and the op benchmark).
std::string gemm_choices();
// The measured choices at the active instruction-set level, as "<isa>:<brgemm>:<aten_fp32>"
// (each 1, 0, or - when not measured), and their adoption: a resumed training run adopts the
// choices of the run it continues, so that it computes exactly as that run would have (a fresh
// measurement near the margin could pick the other path, whose sums round differently).
// Choices recorded at another level are ignored; adopting returns whether they applied. The ranks
// of a distributed CPU run adopt rank 0's, so that every rank computes the same way. `source`
// says where they came from in gemm_choices(). AUTOMOE_CPU_GEMM_DECISIONS=<gemm_decisions()>
// pins them for a process (adopted instead of measured: fresh runs that compute alike, at full
// speed); a value for another level, or malformed, is an error naming the variable. Without a
// pin, a choice measured on this machine is remembered ($AUTOMOE_CACHE/cpu_gemm, else
// ~/.cache/automoe/cpu_gemm, one line per CPU, level, thread count and torch version) and the
// next process adopts it instead of measuring, so that runs from scratch compute alike too.
// Order: an adoption (a resumed run's, rank 0's) over the pin, the pin over the cache.
std::string gemm_decisions();
bool adopt_gemm_decisions(const std::string& decisions,
                          const std::string& source = "the resumed run");

// Runs every problem (K = 0 writes zeros, or leaves C when accumulating). Thread-parallel with
// at::parallel_for; deterministic (each C element is reduced by one thread in a fixed order).
void gemm_batch(const std::vector<GemmProblem>& problems);

}  // namespace automoe::ops::cpu
