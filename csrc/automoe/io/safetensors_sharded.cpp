// Sharded checkpoint writing (save_sharded): the shard plan, the pending files, each process's rows
// of them (one process, or several that write one checkpoint together), the index and the switch.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <utility>

#include "automoe/core/error.h"
#include "automoe/core/fault.h"
#include "automoe/core/log.h"
#include "automoe/io/safetensors.h"
#include "automoe/io/safetensors_internal.h"

namespace automoe {

using namespace safetensors_internal;
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// Shard i of n: model-0000i-of-0000n.safetensors, or (`alt`) model-0000i-of-0000n.alt.safetensors,
// the names an in-place save uses when the standard ones hold the checkpoint it replaces.
std::string format_shard_name(size_t i, size_t n, bool alt) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu%s.safetensors", i, n, alt ? ".alt" : "");
  return buf;
}

// What a Hugging Face save owns in a directory: model.safetensors, model-00001-of-00003.safetensors
// (.alt) and the index (not, say, a user's model_ema.safetensors).
bool is_checkpoint_file(const std::string& name) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}(\.alt)?\.safetensors)");
  return name == kIndexFile || name == kSingleFile || std::regex_match(name, kShard);
}

void pwrite_all(int fd, const std::string& path, const void* data, size_t n, uint64_t offset) {
  fault_point("write", path);
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_write(path, "write", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// The weight files the index in `dir` names (empty without a readable index).
std::set<std::string> indexed_files(const std::string& dir) {
  std::set<std::string> out;
  try {
    const Json index = Json::parse(read_text_file((fs::path(dir) / kIndexFile).string()));
    for (const auto& [name, file] : index.at("weight_map").items()) {
      out.insert(file.get<std::string>());
    }
  } catch (const std::exception&) {
  }
  return out;
}

void check_slot_names(const std::string& dir, const std::vector<TensorSlot>& slots) {
  std::set<std::string> seen;
  for (const TensorSlot& s : slots) {
    AUTOMOE_CHECK(s.name != kMetadataKey, "cannot write \"", dir, "\": \"", kMetadataKey,
                  "\" is reserved and cannot name a tensor");
    AUTOMOE_CHECK(seen.insert(s.name).second, "cannot write \"", dir,
                  "\": duplicate tensor name \"", s.name, "\"");
  }
}

// The shards (each the indices of its slots, in file order) and the bytes of all the slots.
struct ShardPlan {
  std::vector<std::vector<size_t>> shards;
  uint64_t total_bytes = 0;
};

// Greedy in the given order: a tensor opens a new shard when it would push the current one past
// the limit, so a tensor bigger than the limit always ends up alone. Every process computes the
// same plan from the slots' full shapes.
ShardPlan plan_shards(const std::vector<TensorSlot>& slots, uint64_t max_shard_bytes) {
  ShardPlan plan;
  std::vector<std::vector<size_t>>& shards = plan.shards;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const uint64_t nbytes = TensorMeta{slots[i].name, slots[i].dtype, slots[i].shape}.nbytes();
    if (shards.empty() || (!shards.back().empty() && shard_bytes + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    plan.total_bytes += nbytes;
  }
  if (shards.empty()) shards.emplace_back();
  return plan;
}

// Whether the index in `dir` names any of the standard names of `n` shards (the checkpoint being
// replaced holds them).
bool holds_standard_names(const std::string& dir, size_t n) {
  const std::set<std::string> held = indexed_files(dir);
  bool alt = false;
  for (size_t i = 0; i < n && !alt; ++i) {
    alt = held.count(format_shard_name(i + 1, n, false)) > 0;
  }
  return alt;
}

// FNV-1a of the plan (names, dtypes, shapes, shard size): equal on every process that plans the
// same files.
uint64_t plan_digest(const std::vector<TensorSlot>& slots, uint64_t max_shard_bytes) {
  uint64_t digest = 1469598103934665603ull;  // FNV-1a
  auto mix = [&](const std::string& text) {
    for (const char c : text) digest = (digest ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  };
  mix(std::to_string(max_shard_bytes));
  for (const TensorSlot& sl : slots) {
    mix(sl.name + "|" + std::to_string(static_cast<int>(sl.dtype)));
    for (int64_t d : sl.shape) mix("," + std::to_string(d));
  }
  return digest;
}

// What `f` threw, as text (empty: nothing), for the processes to agree on.
std::string attempt(const std::function<void()>& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

// One save_sharded on this process: the files it writes (under "<file>.pending-<lead pid>" until
// the switch) and the phases every process goes through together; each phase's errors are
// agreed on (agree) before the next begins.
class ShardedSave {
 public:
  ShardedSave(const std::string& dir, const std::vector<TensorSlot>& slots, const ShardPlan& plan,
              const WriteGroup& g, bool collective)
      : dir_(dir),
        slots_(slots),
        shards_(plan.shards),
        total_bytes_(plan.total_bytes),
        g_(g),
        collective_(collective),
        offsets_(plan.shards.size()),
        data_begin_(plan.shards.size()) {}
  // However the save ends (an error here, or a collective that failed because another process
  // died), the lead leaves no pending file behind (after the renames there is none to remove).
  ~ShardedSave() { remove_pending(); }
  ShardedSave(const ShardedSave&) = delete;
  ShardedSave& operator=(const ShardedSave&) = delete;

  const std::vector<std::string>& files() const { return files_; }

  // The processes must plan the same files: the lead's pid names the pending files, the lead's
  // `alt` chooses the names, and every process's `digest` of the plan must equal the lead's.
  void agree_on_files(bool alt, uint64_t digest) {
    const std::vector<std::string> starts = g_.gather(
        std::to_string(::getpid()) + ":" + (alt ? "1" : "0") + " " + std::to_string(digest),
        "save (start)");
    const std::string lead_pid = starts.front().substr(0, starts.front().find(':'));
    alt = starts.front().substr(starts.front().find(':') + 1, 1) == "1";  // the lead's choice
    std::vector<std::string> files;
    for (size_t i = 0; i < shards_.size(); ++i) {
      files.push_back(shards_.size() == 1 ? kSingleFile
                                          : format_shard_name(i + 1, shards_.size(), alt));
    }
    for (size_t r = 0; r < starts.size(); ++r) {
      AUTOMOE_CHECK(
          starts[r].substr(starts[r].find(' ')) == starts.front().substr(starts.front().find(' ')),
          "saving \"", dir_, "\": process ", r,
          " plans other files than process 0 (other tensor names, dtypes, shapes, layout or "
          "shard size)");
    }
    files_ = std::move(files);
    pending_ = ".pending-" + lead_pid;
  }

  // Every process's error (empty: none) in rank order; the first one fails the save everywhere.
  void agree(const std::string& error, const char* phase) {
    const std::vector<std::string> all = g_.gather(error, phase);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      remove_pending();
      if (collective_) fail("saving \"", dir_, "\" (", phase, "): process ", r, ": ", all[r]);
      throw Error(all[r]);
    }
  }

  // Every process lays out each shard's header (its tensors' offsets); the lead creates the
  // pending files with that header and their full length.
  void create_files() {
    std::error_code ec;
    if (g_.lead) {
      fs::create_directories(dir_, ec);
      AUTOMOE_CHECK(!ec, "cannot create directory \"", dir_, "\": ", ec.message());
      remove_dead_temporaries(dir_);
    }
    for (size_t i = 0; i < shards_.size(); ++i) {
      std::vector<TensorMeta> metas;
      for (size_t k : shards_[i]) {
        metas.push_back({slots_[k].name, slots_[k].dtype, slots_[k].shape});
      }
      const std::string path = pending_path(i);
      const std::string prefix = safetensors_prefix(path, metas, {{"format", "pt"}}, &offsets_[i]);
      data_begin_[i] = prefix.size();
      if (!g_.lead) continue;
      uint64_t size = prefix.size();
      for (const TensorMeta& m : metas) size += m.nbytes();
      Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (fd.get() < 0) fail_write(path, "create", errno);
      write_all(fd.get(), path, prefix.data(), prefix.size());
      // Reserve the blocks now: a full disk fails here, not as a hole that reads back as zeros.
      if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(size)); err != 0) {
        if (err != EOPNOTSUPP && err != EINVAL) fail_write(path, "allocate", err);
        if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
          fail_write(path, "ftruncate", errno);
        }
      }
      fault_point("fsync", path);
      if (::fsync(fd.get()) != 0) fail_write(path, "fsync", errno);
      if (::close(fd.release()) != 0) fail_write(path, "close", errno);
    }
  }

  // Writes the rows this process holds into the pending files. Returns what it wrote:
  // "slot:first row:rows;" for each slot.
  std::string write_rows() {
    std::string mine;
    for (size_t i = 0; i < shards_.size(); ++i) {
      const std::string path = pending_path(i);
      Fd fd;
      for (size_t j = 0; j < shards_[i].size(); ++j) {
        const TensorSlot& s = slots_[shards_[i][j]];
        if (!s.rows.defined()) continue;
        AUTOMOE_CHECK(s.rows.scalar_type() == s.dtype, "cannot write \"", path, "\": tensor \"",
                      s.name, "\" is ", s.rows.scalar_type(), ", its slot ", s.dtype);
        const at::Tensor c = contiguous_cpu(path, s.name, s.rows);
        uint64_t offset = 0;
        if (s.shape.empty()) {
          AUTOMOE_CHECK(c.dim() == 0 && s.row_begin == 0, "cannot write \"", path, "\": tensor \"",
                        s.name, "\": a scalar is written whole");
        } else {
          std::vector<int64_t> tail(s.shape.begin() + 1, s.shape.end());
          AUTOMOE_CHECK(c.dim() == static_cast<int64_t>(s.shape.size()) &&
                            c.sizes().slice(1).vec() == tail && s.row_begin >= 0 &&
                            s.row_begin + c.size(0) <= s.shape[0],
                        "cannot write \"", path, "\": tensor \"", s.name, "\": rows [", s.row_begin,
                        ", ", s.row_begin + (c.dim() ? c.size(0) : 0), ") of shape ", c.sizes(),
                        " do not fit its shape ", s.shape);
          offset = static_cast<uint64_t>(s.row_begin) * (c.numel() ? c.nbytes() / c.size(0) : 0);
        }
        if (fd.get() < 0) {
          fd = Fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
          if (fd.get() < 0) fail_write(path, "open", errno);
        }
        pwrite_all(fd.get(), path, c.data_ptr(), c.nbytes(),
                   data_begin_[i] + offsets_[i][j] + offset);
        mine += std::to_string(shards_[i][j]) + ":" + std::to_string(s.row_begin) + ":" +
                std::to_string(s.shape.empty() ? 1 : c.size(0)) + ";";
      }
      if (fd.get() >= 0) {
        fault_point("fsync", path);
        if (::fsync(fd.get()) != 0) fail_write(path, "fsync", errno);
        if (::close(fd.release()) != 0) fail_write(path, "close", errno);
      }
    }
    return mine;
  }

  // Together the processes must have written every row exactly once. Every process checks the
  // same gathered lists (`written`, write_rows() of each), so all of them agree on the outcome.
  void check_rows(const std::vector<std::string>& written) {
    std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(slots_.size());
    for (const std::string& list : written) {
      std::istringstream in(list);
      std::string item;
      while (std::getline(in, item, ';')) {
        size_t slot = 0;
        int64_t first = 0, count = 0;
        std::sscanf(item.c_str(), "%zu:%ld:%ld", &slot, &first, &count);
        rows.at(slot).emplace_back(first, count);
      }
    }
    for (size_t k = 0; k < slots_.size(); ++k) {
      const int64_t n = slots_[k].shape.empty() ? 1 : slots_[k].shape[0];
      auto& v = rows[k];
      std::sort(v.begin(), v.end());
      int64_t next = 0;
      for (const auto& [first, count] : v) {
        if (first != next) {
          remove_pending();
          fail("saving \"", dir_, "\": tensor \"", slots_[k].name, "\": rows [",
               std::min(first, next), ", ", std::max(first, next), ") are written by ",
               first > next ? "no" : "more than one",
               " process (each tensor's rows must be written by exactly one process)");
        }
        next = first + count;
      }
      if (next != n && !(n == 0 && v.empty())) {
        remove_pending();
        fail("saving \"", dir_, "\": tensor \"", slots_[k].name, "\": rows [", next, ", ", n,
             ") are written by no process (each tensor's rows must be written by exactly one "
             "process)");
      }
    }
  }

  // The switch, so that the directory loads as the old checkpoint or the new one at every instant
  // (a kill anywhere leaves one of them whole; loaders prefer model.safetensors over the index, as
  // Transformers does): the new shards are renamed in under names the old checkpoint does not use,
  // then the index is replaced in one rename (the switch), then an old model.safetensors (which
  // would win over the index) and the old shards are removed. A single-file save is one rename.
  void switch_into_place() {
    if (!g_.lead) return;
    std::error_code ec;
    const fs::path d(dir_);
    for (size_t i = 0; i < files_.size(); ++i) {
      const fs::path from = pending_path(i), to = d / files_[i];
      fault_point("rename", to.string());
      AUTOMOE_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename \"", from.string(),
                    "\" to \"", to.string(), "\": ", errno_text(errno));
    }
    fsync_dir((d / files_.front()).string());
    std::set<std::string> keep(files_.begin(), files_.end());
    if (shards_.size() > 1) {
      Json weight_map = Json::object();  // std::map-backed: keys come out sorted
      for (size_t i = 0; i < shards_.size(); ++i) {
        for (size_t k : shards_[i]) weight_map[slots_[k].name] = files_[i];
      }
      Json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
      write_file_atomic((d / kIndexFile).string(), index.dump(2) + "\n");
      keep.insert(kIndexFile);
      if (fs::exists(d / kSingleFile, ec)) {
        fault_point("remove", (d / kSingleFile).string());
        fs::remove(d / kSingleFile, ec);
        AUTOMOE_CHECK(!ec, "cannot remove the replaced \"", (d / kSingleFile).string(),
                      "\": ", ec.message());
      }
    } else if (fs::exists(d / kIndexFile, ec)) {  // the old index first: then its shards
      fault_point("remove", (d / kIndexFile).string());
      fs::remove(d / kIndexFile, ec);
      AUTOMOE_CHECK(!ec, "cannot remove the replaced \"", (d / kIndexFile).string(),
                    "\": ", ec.message());
    }
    fsync_dir((d / files_.front()).string());
    // Only now that the new checkpoint is the one the directory holds: drop what an earlier save
    // left behind (the replaced shards, a shard count that changed).
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      const std::string name = entry.path().filename().string();
      if (!is_checkpoint_file(name) || keep.count(name) || entry.is_directory(ec)) continue;
      fault_point("remove", entry.path().string());
      std::error_code rm;
      fs::remove(entry.path(), rm);  // the save is complete: a leftover is only disk space
      if (rm) {
        log_info("warning: saved \"", dir_, "\", but could not remove the replaced \"",
                 entry.path().string(), "\": ", rm.message());
      }
    }
  }

 private:
  std::string pending_path(size_t i) const {
    return (fs::path(dir_) / (files_[i] + pending_)).string();
  }
  void remove_pending() {
    if (!g_.lead) return;
    for (size_t i = 0; i < files_.size(); ++i) ::unlink(pending_path(i).c_str());
  }

  const std::string& dir_;
  const std::vector<TensorSlot>& slots_;
  const std::vector<std::vector<size_t>>& shards_;
  const uint64_t total_bytes_;
  const WriteGroup& g_;
  const bool collective_;           // a group of processes (errors name the process)
  std::vector<std::string> files_;  // the final names, shard i's at i
  std::string pending_;             // ".pending-<lead pid>": the files' names until the switch
  std::vector<std::vector<uint64_t>> offsets_;  // each shard's tensors' offsets in its data area
  std::vector<uint64_t> data_begin_;            // each shard's data area: its first byte
};

}  // namespace

std::vector<std::string> save_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    uint64_t max_shard_bytes) {
  std::vector<TensorSlot> slots;
  slots.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    AUTOMOE_CHECK(t.defined(), "cannot write \"", dir, "\": tensor \"", name, "\" is undefined");
    slots.push_back({name, t.scalar_type(), t.sizes().vec(), t, 0});
  }
  return save_sharded(dir, slots, max_shard_bytes, nullptr);
}

std::vector<std::string> save_sharded(const std::string& dir, const std::vector<TensorSlot>& slots,
                                      uint64_t max_shard_bytes, const WriteGroup* group) {
  check_slot_names(dir, slots);
  const WriteGroup alone{
      true, [](const std::string& mine, const char*) { return std::vector<std::string>{mine}; }};
  const WriteGroup& g = group ? *group : alone;
  const ShardPlan plan = plan_shards(slots, max_shard_bytes);
  // The standard shard names, unless the checkpoint being replaced (a save into the directory it
  // was loaded from) holds them: then the .alt names, so that it stays whole until the switch.
  const bool alt =
      g.lead && plan.shards.size() > 1 && holds_standard_names(dir, plan.shards.size());

  // Shards are written under temporary names first (the lead creates each with its header and
  // full length, every process writes its rows into it); the old index is removed before any
  // shard is renamed into place and the new index is written last. A save interrupted at any
  // point leaves either the previous checkpoint intact or no index (an error on load) — never an
  // index that matches a mix of old and new shards.
  ShardedSave save(dir, slots, plan, g, group != nullptr);
  save.agree_on_files(alt, plan_digest(slots, max_shard_bytes));
  save.agree(attempt([&] { save.create_files(); }), "creating the files");
  // Each process writes the rows it holds; together they must cover every row exactly once.
  std::string mine;
  save.agree(attempt([&] { mine = save.write_rows(); }), "writing the tensors");
  save.check_rows(g.gather(mine, "save (rows written)"));
  save.agree(attempt([&] { save.switch_into_place(); }), "renaming the files into place");
  return save.files();
}

}  // namespace automoe
