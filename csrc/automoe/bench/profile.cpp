#include "automoe/bench/profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>
#include <vector>

#include "automoe/core/error.h"

namespace automoe::bench {
namespace {

namespace kineto = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

const impl::ProfilerConfig& config() {
  static const impl::ProfilerConfig c(impl::ProfilerState::KINETO);
  return c;
}
const std::set<impl::ActivityType>& activities() {
  static const std::set<impl::ActivityType> a{impl::ActivityType::CPU};
  return a;
}

// "torch::autograd::CppNode<automoe::ops::(anonymous namespace)::RouterFn>" -> "backward: RouterFn"
std::string short_name(std::string n) {
  const std::string node = "torch::autograd::CppNode<";
  if (n.rfind(node, 0) == 0 && n.back() == '>') {
    n = n.substr(node.size(), n.size() - node.size() - 1);
    const auto colons = n.rfind("::");
    return "backward: " + (colons == std::string::npos ? n : n.substr(colons + 2));
  }
  return n;
}

struct Totals {
  int64_t calls = 0;
  uint64_t self_ns = 0, total_ns = 0;
};

}  // namespace

void OpProfile::start() {
  AUTOMOE_CHECK(!running_, "automoe bench --profile: the profiler is already running");
  // Kineto logs "gpuGetDeviceCount failed" as an ERROR on every machine without a GPU; quiet
  // unless the user asked for its logs (it reads the variable when it starts, here).
  setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  kineto::prepareProfiler(config(), activities());
  kineto::enableProfiler(config(), activities());
  running_ = true;
}

nlohmann::json OpProfile::stop(int64_t steps) {
  AUTOMOE_CHECK(running_, "automoe bench --profile: the profiler was not started");
  running_ = false;
  const std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  // Per thread, by start (the enclosing event first on equal starts); a stack of open events
  // gives each one its parent, whose self time loses the child's duration.
  struct Ev {
    uint64_t start, end;
    std::string name;
    uint64_t child_ns = 0;
  };
  std::unordered_map<uint64_t, std::vector<Ev>> by_thread;
  for (const auto& e : result->events()) {
    if (e.endNs() < e.startNs()) continue;
    by_thread[e.startThreadId()].push_back({e.startNs(), e.endNs(), e.name()});
  }
  std::map<std::string, Totals> totals;
  for (auto& [tid, evs] : by_thread) {
    std::sort(evs.begin(), evs.end(), [](const Ev& a, const Ev& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
    std::vector<size_t> open;
    for (size_t i = 0; i < evs.size(); ++i) {
      while (!open.empty() && evs[open.back()].end <= evs[i].start) open.pop_back();
      if (!open.empty()) evs[open.back()].child_ns += evs[i].end - evs[i].start;
      open.push_back(i);
    }
    for (const Ev& e : evs) {
      Totals& t = totals[short_name(e.name)];
      const uint64_t dur = e.end - e.start;
      t.calls += 1;
      t.total_ns += dur;
      t.self_ns += dur - std::min(dur, e.child_ns);
    }
  }
  std::vector<std::pair<std::string, Totals>> rows(totals.begin(), totals.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.self_ns > b.second.self_ns; });
  const double n_steps = static_cast<double>(std::max<int64_t>(steps, 1)), per = 1e-6 / n_steps;
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [name, t] : rows) {
    out.push_back({{"name", name},
                   {"calls", static_cast<double>(t.calls) / n_steps},
                   {"self_ms", static_cast<double>(t.self_ns) * per},
                   {"total_ms", static_cast<double>(t.total_ns) * per}});
  }
  return out;
}

std::string profile_table(const nlohmann::json& rows, double step_ms, size_t top) {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line, "%-52s %8s %10s %7s %10s\n", "op (per step, by self time)",
                "calls", "self ms", "% step", "total ms");
  s += line;
  double shown = 0;
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& r = rows[i];
    const double self = r["self_ms"].get<double>();
    shown += self;
    std::string name = r["name"].get<std::string>();
    if (name.size() > 52) name = name.substr(0, 49) + "...";
    std::snprintf(line, sizeof line, "%-52s %8.1f %10.1f %6.1f%% %10.1f\n", name.c_str(),
                  r["calls"].get<double>(), self, step_ms > 0 ? 100.0 * self / step_ms : 0.0,
                  r["total_ms"].get<double>());
    s += line;
  }
  double all = 0;
  for (const auto& r : rows) all += r["self_ms"].get<double>();
  std::snprintf(line, sizeof line,
                "(%zu of %zu ops shown: %.1f ms; all recorded ops %.1f ms of the %.1f ms step; the "
                "rest ran outside any recorded op)\n",
                std::min(top, rows.size()), rows.size(), shown, all, step_ms);
  s += line;
  return s;
}

}  // namespace automoe::bench
