#include "automoe/train/state.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "automoe/core/error.h"
#include "automoe/core/fault.h"
#include "automoe/io/safetensors.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  AUTOMOE_CHECK(in.good(), p.string(), ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// How the optimizer keeps its state (trainer_state.json's optimizer_precision).
json precision_json(const AdamW& opt) {
  json j = {{"master_weights", AdamW::masters_name(opt.masters)},
            {"state_dtype", AdamW::state_dtype_name(opt.state_dtype)}};
  // 8-bit codes mean something only with their map and blocks: a later format is told apart.
  if (opt.state_dtype == at::kByte) {
    j["state_format"] = "dynamic map v1, blocks of 256 along the last dim";
  }
  return j;
}

std::string experts_file(int64_t ep_rank, int64_t ep) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "experts-%05ld-of-%05ld.safetensors", ep_rank, ep);
  return buf;
}

void barrier(const parallel::World& w, const char* what) {
  if (!w.distributed()) return;
  parallel::all_reduce_sum(w.world, at::zeros({1}, at::TensorOptions(at::kFloat).device(w.device)),
                           what);
}

// trainer_state.json of checkpoint `dir` into `st`, every field checked, and the optimizer
// precision it was written with checked against `opt`'s. Returns the whole document.
json read_trainer_state(const fs::path& dir, const AdamW& opt, TrainerState& st) {
  const std::string state_path = (dir / "trainer_state.json").string();
  json j;
  try {
    j = json::parse(read_text(dir / "trainer_state.json"));
    auto integer = [&](const json& v, const char* key) {
      AUTOMOE_CHECK(
          v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= INT64_MAX),
          state_path, ": ", key, " must be an integer, found ", v.dump());
      return v.get<int64_t>();
    };
    st.step = integer(j.at("step"), "step");
    st.pos.epoch = integer(j.at("data_position").at("epoch"), "data_position.epoch");
    st.pos.cursor = integer(j.at("data_position").at("cursor"), "data_position.cursor");
    st.tokens_seen = integer(j.at("tokens_seen"), "tokens_seen");
    st.skipped_steps = integer(j.at("skipped_steps"), "skipped_steps");
    st.consecutive_nonfinite = integer(j.at("consecutive_nonfinite"), "consecutive_nonfinite");
  } catch (const json::exception& e) {
    fail(state_path, ": ", e.what());
  }
  // Every field of the resumable state in its range (a damaged or hand-edited file must not
  // resume with, say, a negative step and so a negative learning rate).
  const auto named = step_of(dir.filename().string());
  AUTOMOE_CHECK(st.step >= 1 && (!named || *named == st.step), state_path, ": step ", st.step,
                " does not match its directory ", dir.filename().string());
  AUTOMOE_CHECK(st.pos.epoch >= 0 && st.pos.cursor >= 0, state_path, ": data_position (epoch ",
                st.pos.epoch, ", cursor ", st.pos.cursor, ") must not be negative");
  AUTOMOE_CHECK(st.tokens_seen >= 0, state_path, ": tokens_seen ", st.tokens_seen,
                " must not be negative");
  AUTOMOE_CHECK(st.skipped_steps >= 0 && st.skipped_steps <= st.step, state_path,
                ": skipped_steps ", st.skipped_steps, " must be in [0, step ", st.step, "]");
  AUTOMOE_CHECK(st.consecutive_nonfinite >= 0 && st.consecutive_nonfinite <= st.skipped_steps,
                state_path, ": consecutive_nonfinite ", st.consecutive_nonfinite,
                " must be in [0, skipped_steps ", st.skipped_steps, "]");
  // The optimizer state is kept as optimizer.master_weights / state_dtype say: a checkpoint
  // written with other settings holds other tensors (checkpoints before them: float32).
  const json saved_precision = j.value(
      "optimizer_precision", json{{"master_weights", "float32"}, {"state_dtype", "float32"}});
  AUTOMOE_CHECK(saved_precision == precision_json(opt), state_path,
                ": the checkpoint's optimizer state was written with optimizer.master_weights: ",
                saved_precision.value("master_weights", "?"),
                ", state_dtype: ", saved_precision.value("state_dtype", "?"),
                "; this run has master_weights: ", AdamW::masters_name(opt.masters),
                ", state_dtype: ", precision_json(opt).at("state_dtype").get<std::string>(),
                ". Resume with the checkpoint's settings, or start a new checkpoint.dir");
  return j;
}

}  // namespace

void save_checkpoint(const fs::path& run, const TrainerState& st, const AdamW& opt,
                     const NamedTensors& buffers, const json& extra, int64_t keep_last,
                     const parallel::World& world, int64_t expert_begin) {
  const bool lead = world.rank == 0;
  const std::string name = "step-" + std::to_string(st.step);
  const fs::path final_dir = run / name;
  // Rank 0 decides whether this step is already saved; the others follow its answer.
  int64_t skip = 0;
  if (lead && fs::exists(final_dir)) {
    std::string latest;
    if (fs::exists(run / "latest")) latest = read_text(run / "latest");
    if (latest.rfind(name + "\n", 0) == 0 || latest == name) {
      skip = 1;  // this state is what latest holds
    } else {
      // A killed run renamed this step into place but never pointed `latest` at it: replace it.
      fs::remove_all(final_dir);
    }
  }
  if (world.distributed()) {
    skip = parallel::all_gather_ints(world.world, {skip}, world.device, "checkpoint save").front();
  }
  if (skip) return;
  // One temporary directory for all ranks (named by rank 0's pid, which every rank learns).
  int64_t pid = ::getpid();
  if (world.distributed()) {
    pid = parallel::all_gather_ints(world.world, {pid}, world.device, "checkpoint save").front();
  }
  const fs::path tmp = run / (".tmp-" + name + "-" + std::to_string(pid));
  if (lead) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  barrier(world, "checkpoint save (directory)");
  NamedTensors weights, state, experts;
  for (size_t i = 0; i < opt.names.size(); ++i) {
    NamedTensors& w = opt.expert[i] && world.mesh.ep > 1 ? experts : weights;
    NamedTensors& s = opt.expert[i] && world.mesh.ep > 1 ? experts : state;
    w.emplace_back(opt.names[i], opt.master[i]);
    s.emplace_back("exp_avg." + opt.names[i], opt.exp_avg[i]);
    s.emplace_back("exp_avg_sq." + opt.names[i], opt.exp_avg_sq[i]);
    if (opt.quantized(i)) {  // 8-bit moments: the codes above, their block scales here
      s.emplace_back("exp_avg_scale." + opt.names[i], opt.exp_avg_scale[i]);
      s.emplace_back("exp_avg_sq_scale." + opt.names[i], opt.exp_avg_sq_scale[i]);
    }
    if (opt.masters == AdamW::Masters::kRemainders) {
      s.emplace_back("remainder." + opt.names[i], opt.remainder[i]);
    }
  }
  // A failed write on any rank (a full disk) fails the save on every rank, and the half-written
  // directory goes: the previous checkpoint stays the latest.
  std::string error;
  try {
    if (!experts.empty() && world.dp_rank() == 0) {  // each shard once, by the first replica
      save_safetensors((tmp / experts_file(world.ep_rank(), world.mesh.ep)).string(), experts,
                       {{"format", "pt"},
                        {"expert_begin", std::to_string(expert_begin)},
                        {"expert_count", std::to_string(experts.front().second.size(0))}});
    }
    if (lead) {
      for (const auto& [name, t] : buffers) weights.emplace_back(name, t);
      if (!opt.step.empty()) state.emplace_back("step", opt.step.front());
      save_safetensors((tmp / "model.safetensors").string(), weights, {{"format", "pt"}});
      save_safetensors((tmp / "optimizer.safetensors").string(), state, {{"format", "pt"}});
      json j = extra;
      j["step"] = st.step;
      j["data_position"] = {{"epoch", st.pos.epoch}, {"cursor", st.pos.cursor}};
      j["tokens_seen"] = st.tokens_seen;
      j["skipped_steps"] = st.skipped_steps;
      j["optimizer_precision"] = precision_json(opt);
      j["consecutive_nonfinite"] = st.consecutive_nonfinite;
      j["parallel"] = {{"world", world.mesh.world}, {"ep", world.mesh.ep}, {"dp", world.mesh.dp}};
      write_file_atomic((tmp / "trainer_state.json").string(), j.dump(2) + "\n");
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (world.distributed()) {
    try {
      parallel::agree(world.world, error, world.device, "checkpoint save");
    } catch (...) {
      std::error_code ec;
      if (lead) fs::remove_all(tmp, ec);
      throw;
    }
  } else if (!error.empty()) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw Error(error);
  }
  if (lead) {
    fsync_path(tmp);
    fault_point("rename", final_dir.string());
    std::error_code ec;
    fs::rename(tmp, final_dir, ec);
    AUTOMOE_CHECK(!ec, "cannot rename ", tmp.string(), " to ", final_dir.string(), ": ",
                  ec.message());
    fsync_path(run);
    write_file_atomic((run / "latest").string(), name + "\n");
    prune_checkpoints(run, keep_last, st.step);
  }
  barrier(world, "checkpoint save (latest)");
}

std::string latest_checkpoint(const fs::path& run) {
  std::string name = read_text(run / "latest");
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  AUTOMOE_CHECK(step_of(name), (run / "latest").string(), ": expected a step-N name, found \"",
                name, "\"");
  return name;
}

json load_checkpoint(const fs::path& run, const std::string& name, AdamW& opt,
                     NamedTensors& buffers, TrainerState& st, int64_t expert_begin,
                     const std::function<void(const json&)>& check) {
  bool refused = false;  // by `check`: the run cannot continue, whatever the checkpoint
  auto checked = [&](const json& j) {
    refused = true;
    if (check) check(j);
    refused = false;
  };
  try {
    return load_checkpoint_dir(run / name, opt, buffers, st, expert_begin, checked);
  } catch (const Error& e) {
    if (refused) throw;
    // A damaged checkpoint: say which older one is whole, and how to resume from it.
    const std::vector<std::string> older = complete_checkpoints(run, *step_of(name));
    if (older.empty()) throw;
    fail(e.what(), "\n  The older checkpoint ", (run / older.front()).string(),
         " is complete: resume from it with --resume-from ", older.front(),
         " (checkpoint.resume_from=", older.front(), "); the checkpoints after it are then set "
         "aside as step-N.aside, and training repeats the steps since.");
  }
}

json load_checkpoint_dir(const fs::path& dir, AdamW& opt, NamedTensors& buffers,
                         TrainerState& st, int64_t expert_begin,
                         const std::function<void(const json&)>& check) {
  AUTOMOE_CHECK(fs::is_directory(dir), "checkpoint ", dir.string(), " does not exist");
  json j = read_trainer_state(dir, opt, st);
  if (check) check(j);
  const SafetensorsFile model((dir / "model.safetensors").string());
  const SafetensorsFile state((dir / "optimizer.safetensors").string());
  auto load_into = [](const SafetensorsFile& f, const std::string& key, at::Tensor& dst) {
    AUTOMOE_CHECK(f.contains(key), f.path(), ": missing tensor ", key);
    const at::Tensor src = f.get(key);
    AUTOMOE_CHECK(src.sizes() == dst.sizes() && src.scalar_type() == dst.scalar_type(), f.path(),
                  ": tensor ", key, " is ", src.scalar_type(), src.sizes(), ", expected ",
                  dst.scalar_type(), dst.sizes());
    dst.copy_(src);
  };
  // Expert tensors: rows [expert_begin, expert_begin + n) from model/optimizer.safetensors (a
  // checkpoint written with ep = 1) or from the experts-*.safetensors files that cover them.
  std::vector<std::unique_ptr<SafetensorsFile>> shards;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("experts-", 0) == 0 && e.path().extension() == ".safetensors") {
      shards.push_back(std::make_unique<SafetensorsFile>(e.path().string()));
    }
  }
  auto load_rows = [&](const SafetensorsFile& whole, const std::string& key, at::Tensor& dst) {
    const int64_t n = dst.size(0);
    if (whole.contains(key)) {
      const int64_t saved = whole.info(key).shape.at(0);
      AUTOMOE_CHECK(expert_begin + n <= saved, whole.path(), ": tensor ", key, " holds ", saved,
                    " experts, this rank needs [", expert_begin, ", ", expert_begin + n, ")");
      const at::Tensor src = whole.get_rows(key, expert_begin, expert_begin + n);
      AUTOMOE_CHECK(src.sizes() == dst.sizes() && src.scalar_type() == dst.scalar_type(),
                    whole.path(), ": tensor ", key, " rows are ", src.scalar_type(), src.sizes(),
                    ", expected ", dst.scalar_type(), dst.sizes());
      dst.copy_(src);
      return;
    }
    int64_t covered = 0;
    for (const auto& f : shards) {
      const auto& md = f->metadata();
      AUTOMOE_CHECK(md.count("expert_begin") && md.count("expert_count"), f->path(),
                    ": missing expert_begin / expert_count metadata");
      int64_t b = 0, c = 0;
      try {
        b = std::stoll(md.at("expert_begin"));
        c = std::stoll(md.at("expert_count"));
      } catch (const std::exception&) {
        fail(f->path(), ": expert_begin / expert_count metadata are not integers (\"",
             md.at("expert_begin"), "\", \"", md.at("expert_count"), "\")");
      }
      AUTOMOE_CHECK(b >= 0 && c >= 0, f->path(), ": negative expert_begin / expert_count metadata");
      const int64_t lo = std::max(b, expert_begin), hi = std::min(b + c, expert_begin + n);
      if (lo >= hi) continue;
      AUTOMOE_CHECK(f->contains(key), f->path(), ": missing tensor ", key);
      const at::Tensor src = f->get_rows(key, lo - b, hi - b);
      at::Tensor part = dst.narrow(0, lo - expert_begin, hi - lo);
      AUTOMOE_CHECK(src.sizes() == part.sizes() && src.scalar_type() == dst.scalar_type(),
                    f->path(), ": tensor ", key, " rows are ", src.scalar_type(), src.sizes(),
                    ", expected ", dst.scalar_type(), part.sizes());
      part.copy_(src);
      covered += hi - lo;
    }
    AUTOMOE_CHECK(covered == n, dir.string(), ": the checkpoint holds ", covered, " of the ", n,
                  " experts [", expert_begin, ", ", expert_begin + n, ") of ", key,
                  " this rank needs");
  };
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < opt.names.size(); ++i) {
    if (opt.expert[i]) {
      load_rows(model, opt.names[i], opt.master[i]);
      load_rows(state, "exp_avg." + opt.names[i], opt.exp_avg[i]);
      load_rows(state, "exp_avg_sq." + opt.names[i], opt.exp_avg_sq[i]);
      if (opt.quantized(i)) {
        load_rows(state, "exp_avg_scale." + opt.names[i], opt.exp_avg_scale[i]);
        load_rows(state, "exp_avg_sq_scale." + opt.names[i], opt.exp_avg_sq_scale[i]);
      }
      if (!opt.remainder.empty()) load_rows(state, "remainder." + opt.names[i], opt.remainder[i]);
    } else {
      load_into(model, opt.names[i], opt.master[i]);
      load_into(state, "exp_avg." + opt.names[i], opt.exp_avg[i]);
      load_into(state, "exp_avg_sq." + opt.names[i], opt.exp_avg_sq[i]);
      if (opt.quantized(i)) {
        load_into(state, "exp_avg_scale." + opt.names[i], opt.exp_avg_scale[i]);
        load_into(state, "exp_avg_sq_scale." + opt.names[i], opt.exp_avg_sq_scale[i]);
      }
      if (!opt.remainder.empty()) load_into(state, "remainder." + opt.names[i], opt.remainder[i]);
    }
    if (state.contains("step")) load_into(state, "step", opt.step[i]);
  }
  for (auto& [name, t] : buffers) load_into(model, name, t);
  // (Checkpoints before 2026-12-03 also hold rng.cpu, the lead rank's generator; unused since
  // every step seeds its own draws: seed_step in step.h.)
  return j;
}


}  // namespace automoe::train
