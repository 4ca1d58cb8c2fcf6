// The run directory of `automoe train` (checkpoint.dir): step-N/ checkpoints, `latest`, export/,
// metrics.jsonl, recipe.json, the lock `.lock` and the marker `.automoe-run`, written when the
// trainer creates (or claims an empty) directory. The trainer deletes only names it wrote, in a
// directory that carries its marker: a non-empty directory without one is refused, so that a
// mistyped checkpoint.dir can never cost the user their own files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace automoe::train {

inline constexpr const char* kRunMarker = ".automoe-run";

// step-N -> N; anything else -> nullopt.
inline std::optional<int64_t> step_of(const std::string& dirname) {
  if (dirname.rfind("step-", 0) != 0 || dirname.size() == 5 || dirname.size() > 5 + 18) {
    return std::nullopt;
  }
  for (size_t i = 5; i < dirname.size(); ++i) {
    if (dirname[i] < '0' || dirname[i] > '9') return std::nullopt;
  }
  return std::stoll(dirname.substr(5));
}

// Rank 0, once per run: creates `run` or claims it (an empty directory, or one an earlier AutoMoE
// trained in), takes its lock for the life of the process, and removes what a killed save of ours
// left in it. Throws automoe::Error naming the directory and the reason (in use, not writable,
// not ours).
void claim_run_dir(const std::filesystem::path& run);

// Deletes all but the newest `keep_last` checkpoints, never step-`keep`, and only step-N
// directories that hold a trainer_state.json (what save_checkpoint writes). A checkpoint that
// cannot be removed is reported on stderr: the new one is saved, the run goes on.
void prune_checkpoints(const std::filesystem::path& run, int64_t keep_last, int64_t keep);

// The checkpoints step-N of `run` with N < `below` whose files are all present, newest first.
std::vector<std::string> complete_checkpoints(const std::filesystem::path& run, int64_t below);

}  // namespace automoe::train
