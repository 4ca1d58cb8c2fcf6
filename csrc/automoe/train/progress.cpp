#include "automoe/train/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace automoe::train {

std::string human_count(double v) {
  char buf[32];
  if (v >= 1e12)
    std::snprintf(buf, sizeof buf, "%.2fT", v / 1e12);
  else if (v >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fB", v / 1e9);
  else if (v >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

Progress::Progress(const std::string& mode, int64_t total_steps) : total_(total_steps) {
  const bool tty = ::isatty(STDERR_FILENO);
  bar_ = mode == "bar" || (mode == "auto" && tty);
  lines_ = mode == "lines" || (mode == "auto" && !tty);
}

void Progress::update(int64_t step, double loss, double tok_s, double eta_s) {
  if (!bar_) return;
  const int width = 24;
  const int filled = total_ ? static_cast<int>(width * step / total_) : width;
  std::string bar(filled, '#');
  bar.resize(width, '.');
  std::fprintf(stderr, "\r  step %ld/%ld [%s] loss %.4f | %s tok/s | ETA %s   ", step, total_,
               bar.c_str(), loss, human_count(tok_s).c_str(), human_time(eta_s).c_str());
  std::fflush(stderr);
  dirty_ = true;
}

void Progress::line(const std::string& text) {
  if (!bar_ && !lines_) return;
  if (dirty_) std::fputs("\n", stderr);
  dirty_ = false;
  std::fprintf(stderr, "%s\n", text.c_str());
}

void Progress::log(const nlohmann::json& rec) {
  if (!lines_) return;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "step %ld/%ld  loss %.4f  aux %.4f  grad_norm %.3f  lr %.3g  %s tok/s  "
                "%.3g TFLOP/s",
                rec["step"].get<int64_t>(), total_, rec["loss"].get<double>(),
                rec["aux_loss"].get<double>(), rec["grad_norm"].get<double>(),
                rec["lr"].get<double>(), human_count(rec["tokens_per_s"].get<double>()).c_str(),
                rec["tflops"].get<double>());
  line(buf);
}

void Progress::done() {
  if (dirty_) std::fputs("\n", stderr);
  dirty_ = false;
}

}  // namespace automoe::train
