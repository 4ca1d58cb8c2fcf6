#include "automoe/ops/cpu/isa.h"

#include <ATen/cpu/Utils.h>

#include <atomic>
#include <cstdlib>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"

namespace automoe::ops::cpu {
namespace {

constexpr const char* kNames[] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};

bool has(const std::unordered_map<std::string, c10::IValue>& caps, const char* key) {
  const auto it = caps.find(key);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

Isa detect() {
#if defined(__x86_64__)
  const auto caps = at::cpu::get_cpu_capabilities();
  if (!(has(caps, "avx2") && has(caps, "fma3"))) return Isa::kBaseline;
  if (!(has(caps, "avx512_f") && has(caps, "avx512_bw") && has(caps, "avx512_vl") &&
        has(caps, "avx512_dq"))) {
    return Isa::kAvx2;
  }
  if (!has(caps, "avx512_bf16")) return Isa::kAvx512;
  if (!(has(caps, "amx_tile") && has(caps, "amx_bf16"))) return Isa::kAvx512Bf16;
  return Isa::kAmx;
#else
  return Isa::kBaseline;
#endif
}

Isa initial() {
  const Isa cpu = detected_isa();
  const char* env = std::getenv("AUTOMOE_CPU_ISA");
  if (env == nullptr || *env == '\0') return cpu;
  const Isa want = parse_isa(env);
  AUTOMOE_CHECK(want <= cpu, "AUTOMOE_CPU_ISA=", env, ": this CPU only has ", isa_name(cpu),
                " (a path can be capped below what the CPU has, never raised above it)");
  return want;
}

std::atomic<int>& active() {
  static std::atomic<int> level{static_cast<int>(initial())};
  return level;
}

}  // namespace

const char* isa_name(Isa isa) { return kNames[static_cast<int>(isa)]; }

Isa parse_isa(const std::string& name) {
  for (int i = 0; i < 5; ++i) {
    if (name == kNames[i]) return static_cast<Isa>(i);
  }
  fail("unknown CPU instruction-set level \"", name,
       "\" (expected one of baseline, avx2, avx512, avx512_bf16, amx)");
}

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

void set_isa(Isa isa) {
  AUTOMOE_CHECK(isa <= detected_isa(), "cannot use the ", isa_name(isa),
                " kernels: this CPU only has ", isa_name(detected_isa()));
  active().store(static_cast<int>(isa), std::memory_order_relaxed);
}

std::map<std::string, std::string> kernel_paths() {
  const bool native_bf16 = active_isa() >= Isa::kAvx512Bf16;
  std::map<std::string, std::string> out{
      {"isa", isa_name(active_isa())},
      {"cpu_isa", isa_name(detected_isa())},
      {"gemm_bf16", gemm_path_name(gemm_path(true))},
      {"gemm_fp32", aten_faster_fp32() ? "aten" : gemm_path_name(gemm_path(false))},
      {"elementwise", vec::path_name()}};
  out["lm_head_bf16"] = native_bf16 ? "aten" : out["gemm_bf16"];  // fused cross-entropy GEMMs
  out["gemm_measured"] = gemm_choices();
  out["gemm_decisions"] = gemm_decisions();  // (what AUTOMOE_CPU_GEMM_DECISIONS pins)
  return out;
}

}  // namespace automoe::ops::cpu
