// Mamba-2's ops (ops/mamba), in float64: the grouped SSD scan against the reference (output, final
// state, every input's gradient), and the semantics the model relies on: with document ids the
// scan and the conv equal running each document alone; a scan's final state continued by the
// recurrent step equals scanning one token more; a scan from an initial state equals the scan of
// the concatenated sequence.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "automoe/ops/mamba/mamba.h"

namespace automoe::ops {
namespace {

const auto f64 = at::TensorOptions().dtype(at::kDouble);

struct Inputs {
  at::Tensor x, dt, A, B, C, D;
};

// B rows of S positions, H heads of P, G groups of N; dt positive (as after softplus).
Inputs random_inputs(int64_t Bn, int64_t S, int64_t H, int64_t P, int64_t G, int64_t N) {
  Inputs in;
  in.x = at::randn({Bn, S, H, P}, f64);
  in.dt = at::rand({Bn, S, H}, f64) * 0.5 + 0.05;
  in.A = -at::rand({H}, f64) * 2 - 0.1;
  in.B = at::randn({Bn, S, G, N}, f64);
  in.C = at::randn({Bn, S, G, N}, f64);
  in.D = at::randn({H}, f64);
  return in;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

TEST(SsdScan, GroupedFormMatchesTheReferenceForwardStateAndGradients) {
  at::manual_seed(1);
  for (const int64_t chunk : {1, 3, 4, 16}) {  // 3 does not divide 10; 16 is longer than it
    for (const bool docs : {false, true}) {
      Inputs in = random_inputs(2, 10, 6, 3, 2, 5);  // 3 heads per group
      const at::Tensor init = at::randn({2, 6, 3, 5}, f64);
      std::optional<at::Tensor> doc;
      if (docs) {
        doc = at::tensor({0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 5, 5, 5, 5, 5, 5, 7, 7, 7, -1}, at::kLong).view({2, 10});
      }
      std::vector<at::Tensor> leaves{in.x, in.dt, in.A, in.B, in.C, in.D};
      for (auto& t : leaves) t.requires_grad_(true);
      const std::optional<at::Tensor> initial = docs ? std::nullopt : std::optional<at::Tensor>(init);
      const SsdScan want = ssd_scan_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                              leaves[5], chunk, initial, doc, true);
      const SsdScan got = ssd_scan(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5],
                                   chunk, initial, doc, true);
      EXPECT_LT(max_rel(got.y_BSHP, want.y_BSHP), 1e-12) << chunk << docs;
      if (!docs) EXPECT_LT(max_rel(got.final_BHPN, want.final_BHPN), 1e-12) << chunk;
      const at::Tensor w = at::randn(want.y_BSHP.sizes(), f64);
      const auto gw = torch::autograd::grad({(want.y_BSHP * w).sum()}, leaves);
      const auto gg = torch::autograd::grad({(got.y_BSHP * w).sum()}, leaves);
      for (size_t i = 0; i < leaves.size(); ++i) {
        EXPECT_LT(max_rel(gg[i], gw[i]), 1e-10) << "input " << i << " chunk " << chunk << " docs " << docs;
      }
    }
  }
}

TEST(SsdScan, GroupedFormsHandDerivedBackwardEqualsTheReferencesGradients) {
  // ssd_scan_aten_backward (what CUDA runs with AUTOMOE_CUDA_KERNELS=ssd_scan): every input's
  // gradient, from y's and the final state's, with and without documents and an initial state.
  at::manual_seed(7);
  for (const int64_t chunk : {1, 3, 4, 16}) {
    for (const bool docs : {false, true}) {
      Inputs in = random_inputs(2, 10, 6, 3, 2, 5);
      std::optional<at::Tensor> doc, initial;
      if (docs) {
        doc = at::tensor({0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 5, 5, 5, 5, 5, 5, 7, 7, 7, -1}, at::kLong).view({2, 10});
      } else {
        initial = at::randn({2, 6, 3, 5}, f64).requires_grad_(true);
      }
      std::vector<at::Tensor> leaves{in.x, in.dt, in.A, in.B, in.C, in.D};
      for (auto& t : leaves) t.requires_grad_(true);
      const SsdScan want = ssd_scan_reference(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                              leaves[5], chunk, initial, doc, true);
      const at::Tensor dy = at::randn(want.y_BSHP.sizes(), f64), dfin = at::randn(want.final_BHPN.sizes(), f64);
      std::vector<at::Tensor> inputs = leaves;
      if (initial) inputs.push_back(*initial);
      const auto gw = torch::autograd::grad({want.y_BSHP, want.final_BHPN}, inputs, {dy, dfin}, true);
      at::NoGradGuard no_grad;
      const SsdGroupedGrads got = ssd_scan_aten_backward(in.x, in.dt, in.A, in.B, in.C, in.D, chunk, initial,
                                                         doc, dy, dfin);
      const std::vector<at::Tensor> mine{got.dx, got.ddt, got.dA, got.dB, got.dC, got.dD, got.dinitial};
      for (size_t i = 0; i < gw.size(); ++i) {
        EXPECT_LT(max_rel(mine[i], gw[i]), 1e-10) << "input " << i << " chunk " << chunk << " docs " << docs;
      }
      // With no upstream gradient for the final state (undefined), only y's part.
      const auto gy = torch::autograd::grad({want.y_BSHP}, inputs, {dy}, /*retain_graph=*/true, false, true);
      const SsdGroupedGrads only_y = ssd_scan_aten_backward(in.x, in.dt, in.A, in.B, in.C, in.D, chunk, initial,
                                                            doc, dy, at::Tensor());
      EXPECT_LT(max_rel(only_y.dx, gy[0]), 1e-10) << chunk << docs;
      EXPECT_LT(max_rel(only_y.ddt, gy[1]), 1e-10) << chunk << docs;
    }
  }
}

TEST(SsdScan, GroupedAutogradFunctionGivesTheReferencesGradientsInEachDtype) {
  // ssd_scan_grouped (the autograd function around it) on the CPU: float64 exact, float32 and bf16
  // inputs within their precision, each gradient in its input's dtype.
  at::manual_seed(8);
  const Inputs base = random_inputs(1, 9, 4, 8, 2, 4);
  const at::Tensor doc = at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1}, at::kLong).view({1, 9});
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    std::vector<at::Tensor> ref{base.x, base.dt, base.A, base.B, base.C, base.D}, mine;
    for (auto& t : ref) {
      t = t.to(dtype).to(at::kDouble).requires_grad_(true);  // the same values in both
      mine.push_back(t.detach().to(t.dim() == 1 ? at::kFloat : dtype).requires_grad_(true));
    }
    if (dtype == at::kDouble) {  // (A and D float32 beside reduced-precision x, as the model has them)
      mine[2] = ref[2].detach().clone().requires_grad_(true);
      mine[5] = ref[5].detach().clone().requires_grad_(true);
    }
    const SsdScan want = ssd_scan_reference(ref[0], ref[1], ref[2], ref[3], ref[4], ref[5], 4, std::nullopt, doc, true);
    const SsdScan got = ssd_scan_grouped(mine[0], mine[1], mine[2], mine[3], mine[4], mine[5], 4, std::nullopt, doc, true);
    const double tol = dtype == at::kDouble ? 1e-10 : dtype == at::kFloat ? 1e-4 : 2e-2;
    EXPECT_LT(max_rel(got.y_BSHP.to(at::kDouble), want.y_BSHP), tol) << dtype;
    const at::Tensor w = at::randn(want.y_BSHP.sizes(), f64);
    const auto gw = torch::autograd::grad({(want.y_BSHP * w).sum()}, ref);
    const auto gg = torch::autograd::grad({(got.y_BSHP * w.to(got.y_BSHP.scalar_type())).sum()}, mine);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_EQ(gg[i].scalar_type(), mine[i].scalar_type()) << "input " << i;
      EXPECT_LT(max_rel(gg[i].to(at::kDouble), gw[i]), tol) << "input " << i << " " << dtype;
    }
  }
}

TEST(SsdScan, DocumentsRestartTheStateAsIfEachRanAlone) {
  at::manual_seed(2);
  const Inputs in = random_inputs(1, 11, 4, 3, 2, 5);
  const std::vector<int64_t> starts{0, 4, 5, 11};  // documents of 4, 1 and 6 positions
  const at::Tensor doc = at::tensor({0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2}, at::kLong).view({1, 11});
  for (const int64_t chunk : {3, 4}) {
    for (auto scan : {&ssd_scan_reference, &ssd_scan}) {
      const at::Tensor packed = scan(in.x, in.dt, in.A, in.B, in.C, in.D, chunk, std::nullopt, doc, false).y_BSHP;
      for (size_t d = 0; d + 1 < starts.size(); ++d) {
        const int64_t a = starts[d], n = starts[d + 1] - a;
        const at::Tensor alone = scan(in.x.narrow(1, a, n), in.dt.narrow(1, a, n), in.A, in.B.narrow(1, a, n),
                                      in.C.narrow(1, a, n), in.D, chunk, std::nullopt, std::nullopt, false)
                                     .y_BSHP;
        EXPECT_LT(max_rel(packed.narrow(1, a, n), alone), 1e-12) << "document " << d << " chunk " << chunk;
      }
    }
  }
}

TEST(SsdScan, ContinuingFromAStateEqualsScanningTheWholeSequence) {
  at::manual_seed(3);
  const Inputs in = random_inputs(2, 9, 4, 3, 2, 5);
  const SsdScan whole =
      ssd_scan_reference(in.x, in.dt, in.A, in.B, in.C, in.D, 4, std::nullopt, std::nullopt, true);
  auto part = [&](int64_t a, int64_t n, const std::optional<at::Tensor>& init) {
    return ssd_scan_reference(in.x.narrow(1, a, n), in.dt.narrow(1, a, n), in.A, in.B.narrow(1, a, n),
                    in.C.narrow(1, a, n), in.D, 4, init, std::nullopt, true);
  };
  const SsdScan first = part(0, 5, std::nullopt);
  const SsdScan rest = part(5, 4, first.final_BHPN);
  EXPECT_LT(max_rel(at::cat({first.y_BSHP, rest.y_BSHP}, 1), whole.y_BSHP), 1e-12);
  EXPECT_LT(max_rel(rest.final_BHPN, whole.final_BHPN), 1e-12);
}

TEST(SsdStep, OneRecurrentStepContinuesTheScan) {
  at::manual_seed(4);
  Inputs in = random_inputs(2, 7, 4, 3, 2, 5);
  const at::Tensor raw_dt = at::randn({2, 7, 4}, f64), dt_bias = at::randn({4}, f64);
  const at::Tensor dt = at::softplus(raw_dt + dt_bias);
  const SsdScan whole = ssd_scan_reference(in.x, dt, in.A, in.B, in.C, in.D, 3, std::nullopt, std::nullopt, true);
  const SsdScan first = ssd_scan_reference(in.x.narrow(1, 0, 6), dt.narrow(1, 0, 6), in.A, in.B.narrow(1, 0, 6),
                                           in.C.narrow(1, 0, 6), in.D, 3, std::nullopt, std::nullopt, true);
  at::Tensor state = first.final_BHPN.clone();
  const at::Tensor y = ssd_step_reference(state, in.x.select(1, 6), raw_dt.select(1, 6), dt_bias, in.A,
                                          in.B.select(1, 6), in.C.select(1, 6), in.D);
  EXPECT_LT(max_rel(y, whole.y_BSHP.select(1, 6)), 1e-12);
  EXPECT_LT(max_rel(state, whole.final_BHPN), 1e-12);
}

TEST(CausalConv1d, DocumentsSeeOnlyTheirOwnTaps) {
  at::manual_seed(5);
  const at::Tensor x = at::randn({1, 9, 6}, f64), w = at::randn({6, 4}, f64), bias = at::randn({6}, f64);
  const at::Tensor doc = at::tensor({3, 3, 3, 3, 3, 8, 8, 9, 9}, at::kLong).view({1, 9});
  const std::vector<int64_t> starts{0, 5, 7, 9};
  for (const bool silu : {false, true}) {
    const at::Tensor packed = causal_conv1d_reference(x, w, bias, doc, silu);
    // The fused kernel (float32) packs the same way.
    const at::Tensor fused = causal_conv1d(x.to(at::kFloat), w.to(at::kFloat), bias.to(at::kFloat),
                                           doc, silu);
    EXPECT_LT(max_rel(fused.to(at::kDouble), packed), 1e-6);
    for (size_t d = 0; d + 1 < starts.size(); ++d) {
      const int64_t a = starts[d], n = starts[d + 1] - a;
      const at::Tensor alone = causal_conv1d_reference(x.narrow(1, a, n), w, bias, std::nullopt, silu);
      EXPECT_LT(max_rel(packed.narrow(1, a, n), alone), 1e-12) << "document " << d;
    }
  }
  // One document: the same as the plain conv.
  const at::Tensor one = causal_conv1d_reference(x, w, bias, at::zeros({1, 9}, at::kLong), false);
  EXPECT_LT(max_rel(one, causal_conv1d_reference(x, w, bias, std::nullopt, false)), 1e-12);
}

TEST(GatedRmsNorm, NormalisesEachGroupOfTheGatedValues) {
  at::manual_seed(6);
  const at::Tensor y = at::randn({2, 3, 8}, f64), z = at::randn({2, 3, 8}, f64), w = at::randn({8}, f64);
  const at::Tensor got = gated_rms_norm_reference(y, z, w, 4, 1e-5);
  const at::Tensor h = (y * at::silu(z)).view({2, 3, 2, 4});
  const at::Tensor want = w * (h / at::sqrt(h.pow(2).mean(-1, true) + 1e-5)).view({2, 3, 8});
  EXPECT_LT(max_rel(got, want), 1e-12);
}

}  // namespace
}  // namespace automoe::ops
