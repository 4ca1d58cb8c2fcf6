#include "automoe/ops/grouped_gemm/gemm_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/grouped_gemm/gemm_cpu_cache.h"
#include "automoe/ops/grouped_gemm/gemm_cpu_units.h"

namespace automoe::ops::cpu {
namespace {

using gemm_engine::adopt;
using gemm_engine::adopt_pinned_decisions;
using gemm_engine::brgemm_runs;
using gemm_engine::kMU;
using gemm_engine::kNC;
using gemm_engine::remember_decision;
using gemm_engine::run_unit_brgemm;
using gemm_engine::run_unit_brgemm_transposed;
using gemm_engine::run_unit_generic;
using gemm_engine::runs_transposed;
using gemm_engine::Unit;
using gemm_engine::Workspace;
#if defined(__x86_64__)
using gemm_engine::run_unit_avx2;
using gemm_engine::run_unit_avx512;
#endif

// float64: a plain triple loop (tests only).
void run_problem_f64(const GemmProblem& P) {
  const auto* A = static_cast<const double*>(P.A.data);
  const auto* B = static_cast<const double*>(P.B.data);
  auto* C = static_cast<double*>(P.C);
  at::parallel_for(0, P.M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < P.N; ++j) {
        double s = 0;
        for (int64_t p = 0; p < P.K; ++p) {
          s += A[i * P.A.row_stride + p * P.A.col_stride] * B[p * P.B.row_stride + j * P.B.col_stride];
        }
        double& c = C[i * P.ldc + j];
        c = P.accumulate ? c + s : s;
      }
    }
  });
}

bool is_f32_or_bf16(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16;
}

std::atomic<int> g_forced{-1};  // a GemmPath forced by force_gemm_path, or -1

const char* const kPathNames[] = {"generic", "avx2", "avx512", "brgemm"};

bool available(GemmPath p) {
  switch (p) {
    case GemmPath::kGeneric:
      return true;
    case GemmPath::kAvx2:
      return active_isa() >= Isa::kAvx2;
    case GemmPath::kAvx512:
      return active_isa() >= Isa::kAvx512;
    case GemmPath::kBrgemm:
      return active_isa() >= Isa::kAvx512 && brgemm_runs();
  }
  return false;
}

// The micro-kernel path the instruction set gives float32 problems (no forcing, no measurement).
GemmPath best_float_path() {
  if (available(GemmPath::kAvx512)) return GemmPath::kAvx512;
  if (available(GemmPath::kAvx2)) return GemmPath::kAvx2;
  return GemmPath::kGeneric;
}

// gemm_batch on a given path (gemm_batch itself takes gemm_path's).
void run_batch(const std::vector<GemmProblem>& problems, std::optional<GemmPath> path);

// ---- engine choices the instruction set does not settle: measured once per process ----------
//
// Two choices depend on more than cpuid: on an AVX-512-BF16 CPU without AMX, whether the native
// bf16 dot products (brgemm) beat the float32 FMA micro-kernel (AMD Zen 4/5 run vdpbf16ps at the
// FMA rate or better, so brgemm doubles the throughput; some Xeons issue it at half the FMA rate,
// so it loses), and for float32 whether ATen's BLAS (MKL, which runs slower code paths on
// non-Intel CPUs) beats our engine. Each is timed once per process and instruction-set level on
// a small problem per thread (best of 3, the two sides alternating); the new choice needs a 1.15x
// margin over the old default, so a noisy machine keeps the default unless the gap is large.

using Clock = std::chrono::steady_clock;

template <typename Fn>
double seconds(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Best-of-3 seconds of a and of b, run in turn (after one warm-up each), so that a busy moment
// hits both alike.
template <typename A, typename B>
std::pair<double, double> best_alternating(A&& a, B&& b) {
  a();
  b();
  double ta = 1e30, tb = 1e30;
  for (int r = 0; r < 3; ++r) {
    ta = std::min(ta, seconds(a));
    tb = std::min(tb, seconds(b));
  }
  return {ta, tb};
}

struct Probe {
  std::mutex mu;
  int decided[5] = {-1, -1, -1, -1, -1};  // per Isa level: -1 not measured, 0 / 1
  std::string summary[5];
};

Probe& brgemm_probe() {
  static Probe p;
  return p;
}
Probe& aten_fp32_probe() {
  static Probe p;
  return p;
}

}  // namespace

// Decisions as gemm_decisions() writes them, for the active level: whether they applied.
namespace gemm_engine {
bool adopt(const std::string& decisions, const std::string& source) {
  const int level = static_cast<int>(active_isa());
  const std::string isa = isa_name(active_isa());
  if (decisions.size() != isa.size() + 4 || decisions.compare(0, isa.size(), isa) != 0) return false;
  Probe* probes[] = {&brgemm_probe(), &aten_fp32_probe()};
  for (int i = 0; i < 2; ++i) {
    const char c = decisions[isa.size() + 1 + 2 * i];
    if (decisions[isa.size() + 2 * i] != ':' || (c != '0' && c != '1' && c != '-')) return false;
  }
  for (int i = 0; i < 2; ++i) {
    const char c = decisions[isa.size() + 1 + 2 * i];
    if (c == '-') continue;
    std::lock_guard<std::mutex> lock(probes[i]->mu);
    probes[i]->decided[level] = c == '1';
    probes[i]->summary[level] = "adopted from " + source;
  }
  return true;
}
}  // namespace gemm_engine

namespace {

// One thread: a [192 x 512] x [512 x 256] bf16 problem shaped as the experts' forward (B
// transposed), brgemm against the AVX-512 micro-kernel.
bool brgemm_measured_faster() {
#if !defined(__x86_64__)
  return false;
#else
  adopt_pinned_decisions();
  Probe& pr = brgemm_probe();
  const int level = static_cast<int>(active_isa());
  std::lock_guard<std::mutex> lock(pr.mu);
  if (pr.decided[level] >= 0) return pr.decided[level] == 1;
  constexpr int64_t M = 192, N = 256, K = 512;
  std::vector<c10::BFloat16> a(M * K), b(N * K), c(M * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = c10::BFloat16(static_cast<float>(i % 7) - 3.f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = c10::BFloat16(static_cast<float>(i % 5) - 2.f);
  const GemmProblem P{M,
                      N,
                      K,
                      {a.data(), c10::ScalarType::BFloat16, K, 1},
                      {b.data(), c10::ScalarType::BFloat16, 1, K},
                      c.data(),
                      c10::ScalarType::BFloat16,
                      N,
                      false};
  Workspace ws;
  auto run_brgemm = [&] {
    ws.a16_problem = nullptr;
    run_unit_brgemm(P, Unit{0, 0, 0}, ws);
  };
  auto run_avx512 = [&] { run_unit_avx512(P, Unit{0, 0, 0}, ws); };
  const auto [t_br, t_512] = best_alternating(run_brgemm, run_avx512);
  at::native::cpublas::brgemm_release(true);
  const double gf = 2.0 * M * N * K * 1e-9;
  pr.decided[level] = t_512 > 1.15 * t_br ? 1 : 0;
  pr.summary[level] = "brgemm " + std::to_string(static_cast<int>(gf / t_br)) + " vs avx512 " +
                      std::to_string(static_cast<int>(gf / t_512)) + " GFLOP/s (one thread)";
  remember_decision(0, pr.decided[level] == 1);
  return pr.decided[level] == 1;
#endif
}

}  // namespace

bool engine_preferred(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) {  // ATen's native bf16 GEMM is oneDNN's
    // (below AVX2 the engine is a plain loop: ATen's, whatever it runs, is the better bet —
    // and on other architectures ATen may have native bf16 the ISA table does not know)
    const Isa isa = active_isa();
    return isa >= Isa::kAvx2 && (isa < Isa::kAvx512Bf16 || !at::hasMKLDNN() ||
                                 !at::globalContext().userEnabledMkldnn());
  }
  return dtype == at::kFloat && !aten_faster_fp32();
}

bool aten_faster_fp32() {
  const Isa isa = active_isa();
  if (isa < Isa::kAvx2) return true;  // the generic loop never beats a BLAS
  adopt_pinned_decisions();
  Probe& pr = aten_fp32_probe();
  const int level = static_cast<int>(isa);
  std::lock_guard<std::mutex> lock(pr.mu);
  if (pr.decided[level] >= 0) return pr.decided[level] == 1;
  // Every thread one [192 x 512] x [512 x 256] problem, as the grouped GEMM runs its groups:
  // at::mm inside a parallel loop (single-threaded BLAS per task) against one gemm_batch.
  const int64_t T = std::max(1, at::get_num_threads()), M = 192, N = 256, K = 512;
  // Fixed small integers, not at::randn: the probe must not move the global generator (a run's
  // random stream would then depend on whether its first GEMM was float32).
  const at::Tensor a = at::arange(T * M * K, at::kFloat).remainder_(7).sub_(3).view({T, M, K});
  const at::Tensor b = at::arange(T * K * N, at::kFloat).remainder_(5).sub_(2).view({T, K, N});
  at::Tensor c = at::empty({T, M, N});
  std::vector<GemmProblem> problems;
  for (int64_t t = 0; t < T; ++t) {
    problems.push_back({M,
                        N,
                        K,
                        {a[t].const_data_ptr(), c10::ScalarType::Float, K, 1},
                        {b[t].const_data_ptr(), c10::ScalarType::Float, N, 1},
                        c[t].data_ptr(),
                        c10::ScalarType::Float,
                        N,
                        false});
  }
  auto run_aten = [&] {
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        at::Tensor ct = c[t];
        at::mm_out(ct, a[t], b[t]);
      }
    });
  };
  // Our engine on the path the instruction set gives it, whatever a test has forced meanwhile:
  // the choice is cached per level.
  const GemmPath engine = best_float_path();
  auto run_engine = [&] { run_batch(problems, engine); };
  const auto [t_aten, t_eng] = best_alternating(run_aten, run_engine);
  const double gf = 2.0 * M * N * K * T * 1e-9;
  pr.decided[level] = t_aten > 1.15 * t_eng ? 0 : 1;
  pr.summary[level] = "aten " + std::to_string(static_cast<int>(gf / t_aten)) + " vs " +
                      gemm_path_name(engine) + " " + std::to_string(static_cast<int>(gf / t_eng)) +
                      " GFLOP/s";
  remember_decision(1, pr.decided[level] == 1);
  return pr.decided[level] == 1;
}

std::string gemm_choices() {
  std::string out;
  for (Probe* p : {&brgemm_probe(), &aten_fp32_probe()}) {
    std::lock_guard<std::mutex> lock(p->mu);
    const std::string& s = p->summary[static_cast<int>(active_isa())];
    if (!s.empty()) out += (out.empty() ? "" : "; ") + s;
  }
  return out.empty() ? "not measured (no choice needed at this level)" : out;
}

std::string gemm_decisions() {
  const int level = static_cast<int>(active_isa());
  std::string out = isa_name(active_isa());
  for (Probe* p : {&brgemm_probe(), &aten_fp32_probe()}) {
    std::lock_guard<std::mutex> lock(p->mu);
    out += p->decided[level] < 0 ? ":-" : p->decided[level] ? ":1" : ":0";
  }
  return out;
}

bool adopt_gemm_decisions(const std::string& decisions, const std::string& source) {
  // The pin and the cache are read first, so that they never override a later adoption (a
  // resumed run's: the choices of the run it continues).
  adopt_pinned_decisions();
  return adopt(decisions, source);
}

const char* gemm_path_name(GemmPath p) { return kPathNames[static_cast<int>(p)]; }

GemmPath gemm_path(bool bf16_operands) {
  const int forced = g_forced.load(std::memory_order_relaxed);
  if (forced >= 0) {
    const auto p = static_cast<GemmPath>(forced);
    // brgemm takes bf16 operands only; other problems run the best micro-kernel.
    if (p != GemmPath::kBrgemm || bf16_operands) return p;
  } else if (bf16_operands && active_isa() >= Isa::kAvx512Bf16 && available(GemmPath::kBrgemm) &&
             (active_isa() >= Isa::kAmx || brgemm_measured_faster())) {
    return GemmPath::kBrgemm;
  }
  return best_float_path();
}

std::vector<GemmPath> gemm_paths_available() {
  std::vector<GemmPath> out;
  for (int i = 0; i < 4; ++i) {
    if (available(static_cast<GemmPath>(i))) out.push_back(static_cast<GemmPath>(i));
  }
  return out;
}

void force_gemm_path(const std::string& name) {
  if (name.empty()) {
    g_forced.store(-1, std::memory_order_relaxed);
    return;
  }
  for (int i = 0; i < 4; ++i) {
    if (name != kPathNames[i]) continue;
    AUTOMOE_CHECK(available(static_cast<GemmPath>(i)), "the \"", name,
                  "\" GEMM path does not run on this CPU at the ", isa_name(active_isa()),
                  " level");
    g_forced.store(i, std::memory_order_relaxed);
    return;
  }
  fail("unknown GEMM path \"", name, "\" (expected generic, avx2, avx512 or brgemm)");
}

void gemm_batch(const std::vector<GemmProblem>& problems) { run_batch(problems, std::nullopt); }

namespace {

void run_batch(const std::vector<GemmProblem>& problems, std::optional<GemmPath> path_override) {
  std::vector<Unit> units;
  bool all_bf16 = true;
  for (int64_t p = 0; p < static_cast<int64_t>(problems.size()); ++p) {
    const GemmProblem& P = problems[p];
    if (P.M == 0 || P.N == 0) continue;
    if (P.A.dtype == c10::ScalarType::Double) {
      AUTOMOE_CHECK(P.B.dtype == c10::ScalarType::Double && P.c_dtype == c10::ScalarType::Double,
                    "gemm_batch: float64 problems need float64 A, B and C");
      run_problem_f64(P);
      continue;
    }
    AUTOMOE_CHECK(is_f32_or_bf16(P.A.dtype) && is_f32_or_bf16(P.B.dtype) &&
                      is_f32_or_bf16(P.c_dtype),
                  "gemm_batch: operands must be float32 or bfloat16");
    AUTOMOE_CHECK(!P.accumulate || P.c_dtype == c10::ScalarType::Float,
                  "gemm_batch: accumulation needs a float32 C");
    all_bf16 = all_bf16 && P.A.dtype == c10::ScalarType::BFloat16 &&
               P.B.dtype == c10::ScalarType::BFloat16;
    for (int64_t m0 = 0; m0 < P.M; m0 += kMU) {
      for (int64_t n0 = 0; n0 < P.N; n0 += kNC) units.push_back({p, m0, n0});
    }
  }
  if (units.empty()) return;
  const GemmPath path = path_override ? *path_override : gemm_path(all_bf16);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Workspace ws;
    ws.a16_problem = ws.nt_problem = nullptr;  // packed panels are only reused within a batch
    for (int64_t u = begin; u < end; ++u) {
      const GemmProblem& P = problems[units[u].problem];
      switch (path) {
        case GemmPath::kBrgemm:
          if (runs_transposed(P)) {
            run_unit_brgemm_transposed(P, units[u], ws);
          } else {
            run_unit_brgemm(P, units[u], ws);
          }
          break;
#if defined(__x86_64__)
        case GemmPath::kAvx512:
          run_unit_avx512(P, units[u], ws);
          break;
        case GemmPath::kAvx2:
          run_unit_avx2(P, units[u], ws);
          break;
#endif
        default:
          run_unit_generic(P, units[u], ws);
          break;
      }
    }
    if (path == GemmPath::kBrgemm) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace
}  // namespace automoe::ops::cpu
