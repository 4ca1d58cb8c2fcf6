// Token dispatchers: the exchange of routed tokens between the ranks of an expert-parallel group
// (DESIGN.md: "dispatch"; the local grouping of rows by expert is "permute"). Each rank routes
// its own tokens over all E experts; the experts [begin, begin + L) live on EP rank begin / L.
//
//   dispatch: this rank's routed rows -> the rows of every rank routed to this rank's experts,
//             grouped by local expert (offsets_L1 [L+1]);
//   local experts on those rows (grouped GEMMs);
//   combine:  their outputs back to the ranks that own the tokens, weighted and summed per token.
//
// dispatch and combine are each other's backward: every exchange is an autograd function whose
// backward runs the reverse exchange. Every rank joins every collective, whatever it received
// (zero rows included), in the same order: all ranks of a group run the same layers in order.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>

#include "automoe/parallel/world.h"

namespace automoe::moe {

// The local experts on rows grouped by local expert: rows [offsets[l], offsets[l+1]) go to local
// expert l; offsets_L1 is int64 on x's device.
using LocalExperts = std::function<at::Tensor(const at::Tensor& x_NH, const at::Tensor& offsets_L1)>;

// What the exchanges of one rank moved, accumulated until read (Dispatcher::take_stats).
struct DispatchStats {
  int64_t bytes_sent = 0, bytes_received = 0;  // to / from other ranks, rows and routing
  int64_t rows_computed = 0;                   // rows the local experts ran on (this rank's load)
  double wait_s = 0;           // time blocked in the forward's collectives
  double backward_wait_s = 0;  // ... and in the backward's (the reverse exchanges)
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  // out[t] = sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) for this rank's tokens, whichever rank
  // holds the expert. idx_TK holds global expert ids; weights_TK is float32 or x's dtype.
  // `fused_permute`: the local permute / unpermute run as ops::permute / ops::unpermute, else
  // as their references (the torch_mm and eager experts backends).
  virtual at::Tensor run(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const LocalExperts& experts,
                         bool fused_permute) = 0;
  virtual std::string kind() const = 0;
  // The statistics since the last call (they are shared with the pending backward passes).
  DispatchStats take_stats();

 protected:
  std::shared_ptr<DispatchStats> stats_ = std::make_shared<DispatchStats>();
};

// `allgather`, `alltoall` or `alltoall_overlap` over `ep_group`, for `num_experts` global experts
// split evenly over it (BackendConfig.dispatcher). `chunks`: how many pieces alltoall_overlap
// cuts the tokens into (the exchange of one hides behind the experts of another).
std::shared_ptr<Dispatcher> make_dispatcher(const std::string& kind, parallel::Group ep_group,
                                            int64_t num_experts, int64_t chunks = 4);

// The wire size of one token row and its routing (bytes) — what docs/parallelism.md's formulas
// count. Exposed for the tests that check the counted bytes.
int64_t row_bytes(int64_t hidden, c10::ScalarType dtype);

}  // namespace automoe::moe
