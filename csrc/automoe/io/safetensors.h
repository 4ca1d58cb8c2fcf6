// safetensors reading (mmap, zero-copy, fully validated header) and writing (atomic, sharded,
// with model.safetensors.index.json), as the Hugging Face `safetensors` package defines the format:
//   [u64 little-endian N][N bytes JSON header][data area]
//   header: {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"key": "string value"}}
//   offsets are relative to the start of the data area; ranges tile it with no gap or overlap.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace automoe {

struct TensorInfo {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data area
  uint64_t end = 0;
};

class MappedFile;

// An open, validated safetensors file. Opening maps the file read-only (copy-on-write) and checks
// the whole header; every violation throws automoe::Error naming the file and the tensor.
// Tensors returned alias the mapping (zero-copy) and keep it alive; writing to them never
// changes the file (the mapping is private).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;

  const std::string& path() const { return path_; }
  // Tensor names in file order (ascending data offset).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The whole tensor, zero-copy (copied only when its bytes are misaligned for its dtype).
  at::Tensor get(const std::string& name) const;
  // Rows [begin, end) along dim 0 (e.g. a range of experts of an [E, ...] tensor), touching only
  // those bytes of the file.
  at::Tensor get_rows(const std::string& name, int64_t begin, int64_t end) const;
  // Drops the tensor's pages from this process's memory (madvise MADV_DONTNEED): a tensor that
  // was copied out of the mapping no longer counts towards the resident memory while the rest is
  // read. (A view still over it reads the same bytes again from the file.)
  void release(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<MappedFile> map_;
  uint64_t data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes one safetensors file atomically: a temporary file in the same directory, fsync, rename,
// fsync of the directory. Tensors are written in the given order; metadata gets {"format": "pt"}
// unless it already names a format. Any dtype of dtype_to_safetensors; non-contiguous tensors are
// made contiguous; CUDA tensors are copied to the CPU.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      std::map<std::string, std::string> metadata = {});

// Writes `tensors` into `dir` as Hugging Face does: a single `model.safetensors` when everything
// fits in `max_shard_bytes`, otherwise `model-0000i-of-0000n.safetensors` shards plus
// `model.safetensors.index.json` ({"metadata": {"total_size": ...}, "weight_map": {...}}).
// A tensor larger than the limit gets a shard of its own. Saving over a checkpoint (the directory
// it was loaded from) is crash-safe: the directory holds the old checkpoint or the new one, whole,
// at every instant (new shards take the .alt names where the old ones hold the standard names;
// the index is the switch); the replaced files are removed last. Returns the file names.
std::vector<std::string> save_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
    uint64_t max_shard_bytes = 5ull << 30);

// One tensor of a checkpoint that several processes write together (expert parallelism: each
// rank holds some experts' rows): its full name, dtype and shape, and the rows
// [row_begin, row_begin + rows.size(0)) of it that this process writes (`rows` undefined: none;
// a 0-dim tensor is written whole). Together the processes write every byte exactly once.
struct TensorSlot {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  at::Tensor rows;
  int64_t row_begin = 0;
};

// How the processes of a collective save agree: `gather` returns every process's `mine`, in
// rank order (a collective that every process joins; `what` names it in errors). The lead is the
// first process: it creates the files, renames them into place and writes the index; the others
// return once the checkpoint is complete. An error on any process fails the save on all of them.
struct WriteGroup {
  bool lead = true;
  std::function<std::vector<std::string>(const std::string& mine, const char* what)> gather;
};

// save_sharded for slots, written by one process (`group` null) or by a group of processes that
// all call it with the same slot names, dtypes, shapes and order, and the same directory (one
// that all of them see). The files are those the one-process save of the full tensors writes,
// byte for byte.
std::vector<std::string> save_sharded(const std::string& dir, const std::vector<TensorSlot>& slots,
                                      uint64_t max_shard_bytes, const WriteGroup* group);

// The tensors of a Hugging Face checkpoint directory: `model.safetensors` when present (as in
// Transformers; a warning when an index lies beside it), otherwise `model.safetensors.index.json`
// (checking that every file it names is a plain file name in the directory, exists and holds the
// tensors it claims). Maps each tensor name to its file.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& dir);
  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  at::Tensor get(const std::string& name) const;
  at::Tensor get_rows(const std::string& name, int64_t begin, int64_t end) const;
  void release(const std::string& name) const;  // SafetensorsFile::release
  size_t num_files() const { return files_.size(); }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
};

// Writes `text` to `path` atomically (temporary file, fsync, rename, directory fsync).
void write_file_atomic(const std::string& path, const std::string& text);

// Whether `pid` names a live process on this machine.
bool process_alive(int64_t pid);

// Removes what a killed save left in `dir`: "<file>.tmp.<pid>" (write_file_atomic,
// save_safetensors) and "<file>.pending-<pid>" (save_sharded) whose process is gone. Returns
// the paths removed; one that cannot be removed is reported and skipped.
std::vector<std::string> remove_dead_temporaries(const std::string& dir);

}  // namespace automoe
