#include "automoe/moe/dispatcher.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <chrono>
#include <numeric>

#include "automoe/core/error.h"
#include "automoe/ops/ops.h"

namespace automoe::moe {

namespace {

using Clock = std::chrono::steady_clock;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// One variable-size all-to-all of rows over a group: rows [sum(send[:j]), sum(send[:j+1])) of the
// input go to peer j; the output holds recv[i] rows from each peer i, peer-major.
struct Exchange : torch::CustomClassHolder {
  parallel::Group group;
  std::vector<int64_t> send, recv;
  std::shared_ptr<DispatchStats> stats;
  const char* what = "expert dispatch";
  bool backward = false;                    // counts its waiting as the backward's
  c10::intrusive_ptr<c10d::Work> pending;  // an exchange started but not yet waited for
  std::vector<int64_t> out_shape;           // of the last output (a missing gradient's zeros)
  at::TensorOptions out_options;

  void count(const at::Tensor& x, const std::vector<int64_t>& out_rows,
             const std::vector<int64_t>& in_rows) const {
    const int64_t self = group->getRank();
    int64_t row = 1;  // elements per row (also for an empty input)
    for (int64_t d = 1; d < x.dim(); ++d) row *= x.size(d);
    const int64_t bytes = row * static_cast<int64_t>(x.element_size());
    stats->bytes_sent += (sum(out_rows) - out_rows[self]) * bytes;
    stats->bytes_received += (sum(in_rows) - in_rows[self]) * bytes;
  }

  // Starts sending `x` by `out_rows` and receiving `in_rows`; returns the output buffer, valid
  // once finish() has returned.
  at::Tensor start(const at::Tensor& x, std::vector<int64_t> out_rows,
                   std::vector<int64_t> in_rows) {
    TORCH_INTERNAL_ASSERT(!pending, "an exchange is already in flight");
    at::Tensor in = x.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] = sum(in_rows);
    at::Tensor out = at::empty(shape, in.options());
    out_shape = shape;
    out_options = in.options();
    count(in, out_rows, in_rows);
    pending = group->alltoall_base(out, in, in_rows, out_rows);
    return out;
  }
  void finish() {
    if (!pending) return;
    const auto t0 = Clock::now();
    parallel::wait(pending, what);
    pending.reset();
    (backward ? stats->backward_wait_s : stats->wait_s) +=
        std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

// The exchange as an autograd function: the backward sends the gradient back the way the rows
// came (the reverse exchange), synchronously. The forward only starts the exchange; the caller
// calls Exchange::finish before reading the result (so that compute can run meanwhile).
class ExchangeRows : public torch::autograd::Function<ExchangeRows> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::intrusive_ptr<Exchange>& ex) {
    ctx->saved_data["exchange"] = c10::IValue::make_capsule(ex);
    ctx->saved_data["rows"] = x.size(0);
    return ex->start(x, ex->send, ex->recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    AUTOMOE_CHECK(!c10::GradMode::is_enabled(),
                  "expert parallelism: no double backward (create_graph=True) through the "
                  "experts' exchange");
    auto ex = c10::static_intrusive_pointer_cast<Exchange>(ctx->saved_data["exchange"].toCapsule());
    at::Tensor g = grads[0];
    if (!g.defined()) g = at::zeros(ex->out_shape, ex->out_options);  // the peers still exchange
    auto back = c10::make_intrusive<Exchange>();
    back->group = ex->group;
    back->stats = ex->stats;
    back->what = "expert dispatch (backward)";
    back->backward = true;
    at::Tensor out = back->start(g, ex->recv, ex->send);
    back->finish();
    return {out, at::Tensor()};
  }
};

// Starts moving x's rows: send[j] rows to peer j, recv[i] rows from peer i. Differentiable.
at::Tensor exchange(const at::Tensor& x, const c10::intrusive_ptr<Exchange>& ex) {
  return ExchangeRows::apply(x, ex);
}

c10::intrusive_ptr<Exchange> make_exchange(const parallel::Group& g,
                                           const std::shared_ptr<DispatchStats>& stats,
                                           std::vector<int64_t> send, std::vector<int64_t> recv,
                                           const char* what) {
  auto ex = c10::make_intrusive<Exchange>();
  ex->group = g;
  ex->stats = stats;
  ex->send = std::move(send);
  ex->recv = std::move(recv);
  ex->what = what;
  return ex;
}

// The routed rows of this rank's tokens, grouped by global expert (so by destination rank), and
// the plan that combines them back.
struct Permuted {
  ops::PermutePlan plan;
  at::Tensor x_NH;
  std::vector<int64_t> counts_E;  // rows per global expert, on the host
};

Permuted permute_rows(const at::Tensor& x_TH, const at::Tensor& idx_TK, int64_t E, bool fused) {
  Permuted p;
  p.plan = ops::permute_plan(idx_TK, E);
  p.x_NH = fused ? ops::permute(x_TH, p.plan) : ops::permute_reference(x_TH, p.plan);
  const at::Tensor off = p.plan.offsets.cpu();
  const int64_t* o = off.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) p.counts_E.push_back(o[e + 1] - o[e]);
  return p;
}

at::Tensor unpermute_rows(const at::Tensor& y_NH, const Permuted& p, const at::Tensor& w_TK,
                          bool fused) {
  return fused ? ops::unpermute(y_NH, p.plan, w_TK) : ops::unpermute_reference(y_NH, p.plan, w_TK);
}

// Exchanges per-expert row counts: this rank sends counts_E[j*L : (j+1)*L] to peer j and gets
// back, from each peer i, how many rows it routes to each of this rank's L experts: [P * L],
// peer-major. One small all-to-all for `parts` independent count vectors at once ([parts][E]).
std::vector<int64_t> exchange_counts(const parallel::Group& g, const std::vector<int64_t>& counts,
                                     int64_t parts, c10::Device device, DispatchStats& stats) {
  const int64_t P = g->getSize(), E = static_cast<int64_t>(counts.size()) / parts, L = E / P;
  // [parts][P][L] -> [P][parts][L]: what goes to peer j is contiguous.
  at::Tensor in = at::tensor(counts, at::kLong).view({parts, P, L}).transpose(0, 1).contiguous();
  in = in.view({-1}).to(device);
  at::Tensor out = at::empty_like(in);
  std::vector<int64_t> split(P, parts * L);
  const auto t0 = Clock::now();
  parallel::wait(g->alltoall_base(out, in, split, split), "expert dispatch (counts)");
  stats.wait_s += std::chrono::duration<double>(Clock::now() - t0).count();
  stats.bytes_sent += (P - 1) * parts * L * 8;
  stats.bytes_received += (P - 1) * parts * L * 8;
  out = out.cpu().view({P, parts, L}).transpose(0, 1).contiguous();  // [parts][P][L]
  return {out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel()};
}

// Rows received peer-major (from peer i, grouped by local expert) reordered expert-major, and
// back. recv_PL: [P][L] row counts.
struct Regroup {
  at::Tensor order, inverse;  // received row of each grouped row; and its inverse
  at::Tensor offsets_L1;
};

Regroup regroup(const std::vector<int64_t>& recv_PL, int64_t P, int64_t L, c10::Device device) {
  std::vector<int64_t> base(P + 1, 0);  // first received row from each peer
  for (int64_t i = 0; i < P; ++i) {
    base[i + 1] = base[i];
    for (int64_t l = 0; l < L; ++l) base[i + 1] += recv_PL[i * L + l];
  }
  std::vector<int64_t> order, offsets{0};
  order.reserve(base[P]);
  std::vector<int64_t> cursor(base.begin(), base.end() - 1);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < P; ++i) {
      for (int64_t n = 0; n < recv_PL[i * L + l]; ++n) order.push_back(cursor[i]++);
    }
    offsets.push_back(static_cast<int64_t>(order.size()));
  }
  Regroup r;
  r.order = at::tensor(order, at::kLong).to(device);
  r.inverse = at::empty_like(r.order);
  if (!order.empty()) r.inverse.index_copy_(0, r.order, at::arange(r.order.numel(), r.order.options()));
  r.offsets_L1 = at::tensor(offsets, at::kLong).to(device);
  return r;
}

std::vector<int64_t> per_peer(const std::vector<int64_t>& counts_PL, int64_t P, int64_t L) {
  std::vector<int64_t> rows(P, 0);
  for (int64_t i = 0; i < P; ++i) {
    for (int64_t l = 0; l < L; ++l) rows[i] += counts_PL[i * L + l];
  }
  return rows;
}

// ---- alltoall and alltoall_overlap --------------------------------------------------------------

// Only the routed rows travel: per-expert counts first (one small all-to-all), then the rows
// (grouped by destination), the local grouped GEMMs, and the rows back. `chunks` > 1 cuts the
// tokens into pieces whose exchanges are in flight while the experts compute another piece.
class AllToAllDispatcher : public Dispatcher {
 public:
  AllToAllDispatcher(parallel::Group g, int64_t E, int64_t chunks)
      : g_(std::move(g)), E_(E), chunks_(chunks) {}
  std::string kind() const override { return chunks_ > 1 ? "alltoall_overlap" : "alltoall"; }

  at::Tensor run(const at::Tensor& x_TH, const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                 const LocalExperts& experts, bool fused) override {
    const int64_t P = g_->getSize(), L = E_ / P, T = x_TH.size(0);
    // Every rank cuts its tokens into the same number of pieces (some may be empty).
    const int64_t C = chunks_;
    std::vector<int64_t> bounds{0};
    for (int64_t c = 1; c <= C; ++c) bounds.push_back(T * c / C);
    std::vector<Permuted> parts;
    std::vector<int64_t> all_counts;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t n = bounds[c + 1] - bounds[c];
      parts.push_back(permute_rows(x_TH.narrow(0, bounds[c], n), idx_TK.narrow(0, bounds[c], n),
                                   E_, fused));
      all_counts.insert(all_counts.end(), parts.back().counts_E.begin(), parts.back().counts_E.end());
    }
    const std::vector<int64_t> recv = exchange_counts(g_, all_counts, C, x_TH.device(), *stats_);
    std::vector<c10::intrusive_ptr<Exchange>> there(C), back(C);
    // An error mid-way (in the experts, say) leaves no exchange in flight behind it.
    struct Drain {
      std::vector<c10::intrusive_ptr<Exchange>>* lists[2];
      ~Drain() {
        for (auto* list : lists) {
          for (auto& ex : *list) {
            if (!ex || !ex->pending) continue;
            try {
              ex->finish();
            } catch (...) {  // already failing: the first error is the one reported
            }
          }
        }
      }
    } drain{{&there, &back}};
    std::vector<at::Tensor> arrived(C), returned(C);
    std::vector<Regroup> groups(C);
    auto start_dispatch = [&](int64_t c) {
      const std::vector<int64_t> recv_PL(recv.begin() + c * P * L, recv.begin() + (c + 1) * P * L);
      there[c] = make_exchange(g_, stats_, per_peer(parts[c].counts_E, P, L),
                               per_peer(recv_PL, P, L), "expert dispatch");
      groups[c] = regroup(recv_PL, P, L, x_TH.device());
      arrived[c] = exchange(parts[c].x_NH, there[c]);
    };
    start_dispatch(0);
    for (int64_t c = 0; c < C; ++c) {
      if (c + 1 < C) start_dispatch(c + 1);  // in flight while chunk c computes
      there[c]->finish();
      const at::Tensor x_grouped = arrived[c].index_select(0, groups[c].order);
      stats_->rows_computed += x_grouped.size(0);
      const at::Tensor y_grouped = experts(x_grouped, groups[c].offsets_L1);
      const at::Tensor y_arrived = y_grouped.index_select(0, groups[c].inverse);
      back[c] = make_exchange(g_, stats_, there[c]->recv, there[c]->send, "expert combine");
      returned[c] = exchange(y_arrived, back[c]);  // in flight while the next chunk computes
    }
    std::vector<at::Tensor> outs;
    for (int64_t c = 0; c < C; ++c) {
      back[c]->finish();
      const int64_t n = bounds[c + 1] - bounds[c];
      outs.push_back(unpermute_rows(returned[c], parts[c], weights_TK.narrow(0, bounds[c], n), fused));
    }
    return C == 1 ? outs.front() : at::cat(outs, 0);
  }

 private:
  parallel::Group g_;
  int64_t E_, chunks_;
};

// ---- allgather -----------------------------------------------------------------------------------

// Every rank gathers every rank's tokens and routing, runs its own experts on the rows routed to
// them, and sends each rank the partial sums for its tokens (a reduce-scatter). The gather and the
// reduce-scatter are all-to-alls here (token counts may differ between ranks): the same bytes on
// the wire as the collectives of those names, with one code path for Gloo and NCCL.
class AllGatherDispatcher : public Dispatcher {
 public:
  AllGatherDispatcher(parallel::Group g, int64_t E) : g_(std::move(g)), E_(E) {}
  std::string kind() const override { return "allgather"; }

  at::Tensor run(const at::Tensor& x_TH, const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                 const LocalExperts& experts, bool fused) override {
    const int64_t P = g_->getSize(), L = E_ / P, r = g_->getRank(), T = x_TH.size(0);
    const int64_t H = x_TH.size(1);
    const std::vector<int64_t> tokens =
        parallel::all_gather_ints(g_, {T}, x_TH.device(), "expert dispatch (token counts)");
    stats_->bytes_sent += (P - 1) * 8;
    stats_->bytes_received += (P - 1) * 8;
    const std::vector<int64_t> mine(P, T);
    auto gather = [&](const at::Tensor& t, const char* what) {  // [T, ...] -> [sum tokens, ...]
      std::vector<int64_t> reps(t.dim(), 1);
      reps[0] = P;
      auto ex = make_exchange(g_, stats_, mine, tokens, what);
      at::Tensor out = exchange(t.repeat(reps), ex);
      ex->finish();
      return out;
    };
    const at::Tensor x_all = gather(x_TH, "expert dispatch (allgather)");
    const at::Tensor idx_all = gather(idx_TK, "expert dispatch (allgather routing)");
    const at::Tensor w_all = gather(weights_TK, "expert dispatch (allgather weights)");
    // This rank's experts, with every other expert's slots dropped (index -1).
    const int64_t lo = r * L;
    const at::Tensor local = idx_all.ge(lo).logical_and(idx_all.lt(lo + L));
    const at::Tensor idx_local = at::where(local, idx_all - lo, at::full({}, -1, idx_all.options()));
    const ops::PermutePlan plan = ops::permute_plan(idx_local, L);
    const at::Tensor x_NH = fused ? ops::permute(x_all, plan) : ops::permute_reference(x_all, plan);
    const int64_t rows = plan.offsets.narrow(0, L, 1).item<int64_t>();
    stats_->rows_computed += rows;
    const at::Tensor y_rows = experts(x_NH.narrow(0, 0, rows), plan.offsets);
    // Dropped slots' rows (past offsets[L]) contribute nothing.
    const at::Tensor y_NH = at::cat({y_rows, at::zeros({x_NH.size(0) - rows, H}, y_rows.options())});
    const at::Tensor w = at::where(local, w_all, at::zeros({}, w_all.options()));
    const at::Tensor partial =
        fused ? ops::unpermute(y_NH, plan, w) : ops::unpermute_reference(y_NH, plan, w);
    // Reduce-scatter: rank j's tokens' partial sums go to rank j, which adds the P of them.
    auto ex = make_exchange(g_, stats_, tokens, mine, "expert combine (reduce-scatter)");
    at::Tensor parts = exchange(partial, ex);
    ex->finish();
    // The P partial sums in float32 at least (bf16 adds would round at every rank).
    const c10::ScalarType acc = at::promote_types(partial.scalar_type(), at::kFloat);
    return parts.view({P, T, H}).sum(0, /*keepdim=*/false, acc).to(partial.scalar_type());
  }

 private:
  parallel::Group g_;
  int64_t E_;
};

}  // namespace

DispatchStats Dispatcher::take_stats() {
  DispatchStats s = *stats_;
  *stats_ = DispatchStats{};
  return s;
}

int64_t row_bytes(int64_t hidden, c10::ScalarType dtype) {
  return hidden * static_cast<int64_t>(c10::elementSize(dtype));
}

std::shared_ptr<Dispatcher> make_dispatcher(const std::string& kind, parallel::Group ep_group,
                                            int64_t num_experts, int64_t chunks) {
  AUTOMOE_CHECK(ep_group && ep_group->getSize() > 1, "dispatcher \"", kind,
                "\" needs an expert-parallel group of 2 or more ranks");
  AUTOMOE_CHECK(num_experts % ep_group->getSize() == 0, "dispatcher: ", num_experts,
                " experts do not split evenly over ", ep_group->getSize(), " ranks");
  if (kind == "alltoall") return std::make_shared<AllToAllDispatcher>(ep_group, num_experts, 1);
  if (kind == "alltoall_overlap") {
    AUTOMOE_CHECK(chunks >= 2, "alltoall_overlap: expected at least 2 chunks, got ", chunks);
    return std::make_shared<AllToAllDispatcher>(ep_group, num_experts, chunks);
  }
  if (kind == "allgather") return std::make_shared<AllGatherDispatcher>(ep_group, num_experts);
  fail("dispatcher \"", kind, "\" is unknown with expert parallelism (allgather, alltoall, "
       "alltoall_overlap)");
}

}  // namespace automoe::moe
