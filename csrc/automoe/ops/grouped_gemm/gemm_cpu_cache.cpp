// The CPU GEMM engine's measured choices remembered between processes ($AUTOMOE_CACHE/cpu_gemm, one
// line per machine), and the AUTOMOE_CPU_GEMM_DECISIONS pin that stands in for measuring.
#include "automoe/ops/grouped_gemm/gemm_cpu_cache.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/isa.h"

namespace automoe::ops::cpu::gemm_engine {
namespace {

// ---- the machine's measured choices, remembered between processes ---------------------------
//
// Measured in each process, a choice whose two sides time within noise of the margin comes out
// either way (on an AVX2 EPYC, ATen and our float32 kernel tie and the probe picked ours in ~2
// of 12 processes): two runs of the same recipe would then sum in different orders. So the first
// measurement on a machine is remembered in a small file, one line per (CPU, level, threads,
// torch) — $AUTOMOE_CACHE/cpu_gemm, else ~/.cache/automoe/cpu_gemm (the directory the tokenised
// datasets use too) — and later processes adopt it instead of measuring.
// AUTOMOE_CPU_GEMM_CACHE=off turns it off; deleting the file measures again. Beyond a bad value of
// that variable nothing here is an error: an unreadable or unwritable cache is no cache.

bool g_cache_writes = true;  // false while AUTOMOE_CPU_GEMM_DECISIONS pins the choices

std::string cache_file() {
  if (const char* sw = std::getenv("AUTOMOE_CPU_GEMM_CACHE"); sw != nullptr && *sw != '\0') {
    const std::string v = sw;
    AUTOMOE_CHECK(v == "on" || v == "off", "AUTOMOE_CPU_GEMM_CACHE=", v, ": expected on or off");
    if (v == "off") return "";
  }
  std::string d;
  if (const char* dir = std::getenv("AUTOMOE_CACHE"); dir != nullptr && *dir != '\0') {
    d = dir;
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    d = std::string(home) + "/.cache/automoe";
  } else {
    return "";
  }
  return d + "/cpu_gemm";
}

// What the choices depend on: the CPU (vendor, name, family, model), the level the kernels run
// at, the thread count (the float32 probe runs one problem per thread) and ATen's version.
std::string machine_key() {
  static const std::string cpu = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string line, out;
    for (const char* field : {"vendor_id", "model name", "cpu family", "model"}) {
      in.clear();
      in.seekg(0);
      while (std::getline(in, line)) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::string k = line.substr(0, colon);
        k.erase(k.find_last_not_of(" \t") + 1);
        if (k != field) continue;
        std::string v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(' '));
        out += (out.empty() ? "" : " ") + v;
        break;
      }
    }
    return out.empty() ? std::string("unknown CPU") : out;
  }();
  static const std::string torch = [] {
    const std::string cfg = at::show_config();
    const auto at = cfg.find("TORCH_VERSION=");
    return at == std::string::npos
               ? std::string("?")
               : cfg.substr(at + 14, cfg.find_first_of(", \n", at + 14) - at - 14);
  }();
  std::string key = cpu + " | " + isa_name(active_isa()) + " | " +
                    std::to_string(std::max(1, at::get_num_threads())) + " threads | torch " +
                    torch;
  for (char& c : key) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return key;
}

// The file's lines as (key, decisions).
std::vector<std::pair<std::string, std::string>> read_cache(const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    if (tab != std::string::npos) out.emplace_back(line.substr(0, tab), line.substr(tab + 1));
  }
  return out;
}

std::mutex g_cache_mu;

}  // namespace

void remember_decision(int probe, bool decision) {
  if (!g_cache_writes) return;
  const std::string path = cache_file();
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(g_cache_mu);
  try {
    auto lines = read_cache(path);
    const std::string key = machine_key(), isa = isa_name(active_isa());
    std::string* value = nullptr;
    for (auto& [k, v] : lines) {
      if (k == key) value = &v;
    }
    if (value == nullptr) value = &lines.emplace_back(key, "").second;
    if (value->size() != isa.size() + 4 || value->compare(0, isa.size(), isa) != 0) {
      *value = isa + ":-:-";
    }
    (*value)[isa.size() + 1 + 2 * probe] = decision ? '1' : '0';
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      for (const auto& [k, v] : lines) out << k << '\t' << v << '\n';
      if (!out.good()) {
        std::filesystem::remove(tmp, ec);
        return;
      }
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) std::filesystem::remove(tmp, ec);
  } catch (const std::exception&) {
  }
}

// AUTOMOE_CPU_GEMM_DECISIONS (what gemm_decisions() printed in an earlier run): adopted instead
// of measuring, once, before the first probe. A value that cannot apply is an error naming it.
// Without it, the choices remembered for this machine (above), if any.
void adopt_pinned_decisions() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("AUTOMOE_CPU_GEMM_DECISIONS");
    if (env == nullptr || *env == '\0') {
      const std::string path = cache_file();
      if (path.empty()) return;
      const std::string key = machine_key();
      for (const auto& [k, v] : read_cache(path)) {
        if (k == key) adopt(v, "the cache " + path);
      }
      return;
    }
    g_cache_writes = false;
    const std::string v = env, isa = isa_name(active_isa());
    AUTOMOE_CHECK(v.rfind(isa + ":", 0) == 0, "AUTOMOE_CPU_GEMM_DECISIONS=", v,
                  ": the kernels run at ", isa,
                  " here, so choices recorded at another level "
                  "cannot apply (pin the level too with AUTOMOE_CPU_ISA, or take this machine's "
                  "cpu_kernels.gemm_decisions from `automoe bench`)");
    AUTOMOE_CHECK(adopt(v, "AUTOMOE_CPU_GEMM_DECISIONS"), "AUTOMOE_CPU_GEMM_DECISIONS=", v,
                  ": expected ", isa,
                  ":B:F (B: brgemm for bf16, F: ATen for float32; each 1, 0 or -), as "
                  "`automoe bench` prints it in cpu_kernels.gemm_decisions");
  });
}

}  // namespace automoe::ops::cpu::gemm_engine
