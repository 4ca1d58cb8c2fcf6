// automoe._C._attention / dispatch_experts / ExpertDispatcher: single components of the engine
// (the attention a backend resolves to, for tests; the routed experts behind a dispatcher, for
// tests and benchmarks; the dispatcher itself, for the drop-in's expert parallelism on
// Transformers' experts modules, whose local experts are a Python function).
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "automoe/model/backend.h"
#include "automoe/moe/dispatcher.h"
#include "automoe/moe/experts.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {

void bind_components(py::module_& m) {
  m.def(
      "_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::optional<at::Tensor>& mask, bool is_causal, double scale,
         const std::string& attn, const std::optional<at::Tensor>& sinks) {
        // The attention component a backend resolves to (sdpa / eager), for tests: [B, N, S, D]
        // queries, [B, N_kv, S, D] keys and values, GPT-OSS's per-head sinks [N] (eager);
        // autograd flows through it.
        const ComponentOps ops = resolve(BackendConfig::from_map({{"attn", attn}}, "backend"));
        return ops.attention(q, k, v, mask, is_causal, scale, sinks);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(),
      py::arg("is_causal") = false, py::arg("scale") = 1.0, py::arg("attn") = "sdpa",
      py::arg("sinks") = py::none());
  m.def(
      "dispatch_experts",
      [](const std::string& kind, const std::string& ep_group, int64_t num_experts,
         const at::Tensor& x_TH, const at::Tensor& idx_TK, const at::Tensor& weights_TK,
         const at::Tensor& w_gate_up, const at::Tensor& w_down, const std::string& experts,
         int64_t chunks) {
        auto d =
            moe::make_dispatcher(kind, c10d::resolve_process_group(ep_group), num_experts, chunks);
        auto local = [&](const at::Tensor& x_NH, const at::Tensor& offsets) {
          return moe::experts_on_rows(experts, x_NH, offsets, w_gate_up, w_down, true);
        };
        at::Tensor out = d->run(x_TH, idx_TK, weights_TK, local, experts == "grouped");
        const moe::DispatchStats st = d->take_stats();
        py::dict stats;
        stats["bytes_sent"] = st.bytes_sent;
        stats["bytes_received"] = st.bytes_received;
        stats["rows_computed"] = st.rows_computed;
        stats["wait_s"] = st.wait_s;
        stats["backward_wait_s"] = st.backward_wait_s;
        return py::make_tuple(out, stats);
      },
      py::arg("kind"), py::arg("ep_group"), py::arg("num_experts"), py::arg("x"), py::arg("idx"),
      py::arg("weights"), py::arg("w_gate_up"), py::arg("w_down"), py::arg("experts") = "grouped",
      py::arg("chunks") = 4,
      "The routed experts through an expert-parallel dispatcher (this rank holds w_gate_up / "
      "w_down, its share of the experts): the exchange the engine's MoE layers run, for tests "
      "and benchmarks. The statistics count only this call's forward.");

  py::class_<moe::Dispatcher, std::shared_ptr<moe::Dispatcher>>(m, "ExpertDispatcher")
      .def(py::init([](const std::string& kind, const std::string& ep_group, int64_t num_experts,
                       int64_t chunks) {
             return moe::make_dispatcher(kind, c10d::resolve_process_group(ep_group), num_experts,
                                         chunks);
           }),
           py::arg("kind"), py::arg("ep_group"), py::arg("num_experts"), py::arg("chunks") = 4)
      .def_property_readonly("kind", &moe::Dispatcher::kind)
      .def(
          "run",
          [](moe::Dispatcher& d, const at::Tensor& x_TH, const at::Tensor& idx_TK,
             const at::Tensor& weights_TK, const py::function& local, bool fused_permute) {
            // `local(x_NH, offsets_L1)` runs this rank's experts on the rows the exchange brought,
            // grouped by local expert; it is called during run() only (never from the backward).
            moe::LocalExperts experts = [&local](const at::Tensor& x_NH, const at::Tensor& off) {
              py::gil_scoped_acquire gil;
              return local(x_NH, off).cast<at::Tensor>();
            };
            py::gil_scoped_release no_gil;  // other Python threads run while this one waits
            return d.run(x_TH, idx_TK, weights_TK, experts, fused_permute);
          },
          py::arg("x"), py::arg("idx"), py::arg("weights"), py::arg("local"),
          py::arg("fused_permute") = true,
          "out[t] = sum_k weights[t, k] * expert_{idx[t, k]}(x[t]) over the EP group: this rank's "
          "tokens (idx: global expert ids) go to the ranks holding their experts and come back "
          "combined; autograd runs the reverse exchanges.")
      .def("take_stats", [](moe::Dispatcher& d) {
        const moe::DispatchStats st = d.take_stats();
        py::dict stats;
        stats["bytes_sent"] = st.bytes_sent;
        stats["bytes_received"] = st.bytes_received;
        stats["rows_computed"] = st.rows_computed;
        stats["wait_s"] = st.wait_s;
        stats["backward_wait_s"] = st.backward_wait_s;
        return stats;
      });
}

}  // namespace automoe::bindings
