// The engine's key/value cache for incremental decoding (what `generate` keeps between steps).
// Per attention layer: keys and values after RoPE, [B, N_kv, capacity, D] buffers in the model's
// dtype, the first `length` positions filled. Per recurrent layer (Mamba-2, gated DeltaNet): its
// state instead (the conv's last inputs and the SSM / delta-rule state), and the count of positions it has consumed. Appending grows the buffers geometrically, so a decoding step
// copies only its new positions (no re-concatenation of the prefix).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace automoe {

class KVCache {
 public:
  explicit KVCache(int64_t num_layers);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t length(int64_t layer = 0) const;  // positions cached in `layer` (0 when empty)
  int64_t batch_size() const;               // 0 when empty

  // Appends keys/values [B, N_kv, S_new, D] to `layer` and returns what attention reads: every
  // cached position [B, N_kv, length + S_new, D]. The cache stores them detached. While gradients
  // are recorded the returned tensors are past ⊕ new (so the new positions stay differentiable);
  // otherwise they are views of the buffers (no copy of the prefix). The first append to an empty
  // layer keeps the given tensors themselves (no copy: a training forward with use_cache pays
  // nothing); any later write into them reallocates first, so they are never modified.
  std::pair<at::Tensor, at::Tensor> append(int64_t layer, const at::Tensor& k_BNSD,
                                           const at::Tensor& v_BNSD);

  // A recurrent layer's state: `conv` [B, conv_dim, kernel] (the last inputs of the causal conv, in
  // the model's dtype) and `ssm` float32 (Mamba-2: [B, heads, head_dim, state]; gated DeltaNet:
  // [B, value heads, head_k_dim, head_v_dim]); undefined before the layer's first forward. The mixer reads and replaces them, then calls `advance`.
  struct Recurrent {
    at::Tensor conv, ssm;
  };
  Recurrent& recurrent(int64_t layer);
  // Records that a layer without keys (a recurrent one) consumed `n` more positions.
  void advance(int64_t layer, int64_t n);

  // Views [B, N_kv, length, D] of what `layer` holds; undefined tensors when it is empty.
  at::Tensor keys(int64_t layer) const;
  at::Tensor values(int64_t layer) const;

  // Batch rearrangements used by generation (beam search reordering, expanding, selecting).
  void index_batch(const at::Tensor& batch_idx);  // rows := rows[batch_idx]
  void repeat_interleave_batch(int64_t repeats);
  // Drops the last `n` positions of every layer (assisted decoding's rollback; Transformers' crop);
  // refused once a recurrent layer holds a state (a recurrence cannot be rolled back).
  void remove_last(int64_t n);
  void reset();
  // An independent copy (what copy.deepcopy of Transformers' caches gives: prefix reuse).
  KVCache clone() const;

 private:
  struct Layer {
    at::Tensor k, v;  // [B, N_kv, capacity, D]
    int64_t length = 0;
    bool borrowed = false;  // k/v are the caller's tensors: reallocate before writing into them
    Recurrent state;        // Mamba-2 layers
  };
  Layer& at_layer(int64_t layer);
  const Layer& at_layer(int64_t layer) const;
  std::vector<Layer> layers_;
};

}  // namespace automoe
