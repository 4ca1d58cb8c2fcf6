// What `automoe train` prints on the console: a progress bar on a terminal (step, loss, tokens/s,
// ETA), or one line per logged step when stderr is not a terminal; notices go between them.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace automoe::train {

// 1234567 -> "1.23M", 4321 -> "4.3k", 12 -> "12".
std::string human_count(double v);
// Seconds as "m:ss" or "h:mm:ss"; "?" for a negative or non-finite time.
std::string human_time(double s);

class Progress {
 public:
  // `mode`: bar | lines | auto (a bar on a terminal, lines elsewhere) | off.
  Progress(const std::string& mode, int64_t total_steps);
  // Redraws the bar (bar mode only).
  void update(int64_t step, double loss, double tok_s, double eta_s);
  // A notice on a line of its own (any mode but off).
  void line(const std::string& text);
  // A "train" record of metrics.jsonl as one console line (lines mode only).
  void log(const nlohmann::json& rec);
  // Ends the bar's line.
  void done();

 private:
  int64_t total_;
  bool bar_ = false, lines_ = false, dirty_ = false;
};

}  // namespace automoe::train
