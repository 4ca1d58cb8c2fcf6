// The CPU GEMM engine behind grouped_gemm and the fused cross-entropy: many independent problems
// C_p = A_p · B_p (+ C_p) with arbitrary strides, run as one parallel loop over (problem, row
// tile, column tile) work units so that small problems (experts with few tokens) do not leave
// threads idle. Inside a unit, BLIS-style: operands are packed into float32 micro-panels (bf16 is
// widened while packing), and a 6x16 AVX2/FMA micro-kernel accumulates in float32; the result is
// rounded once to C's dtype. float64 problems (finite-difference tests) use a plain loop.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
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

// Runs every problem (K = 0 writes zeros, or leaves C when accumulating). Thread-parallel with
// at::parallel_for; deterministic (each C element is reduced by one thread in a fixed order).
void gemm_batch(const std::vector<GemmProblem>& problems);

}  // namespace automoe::ops::cpu
