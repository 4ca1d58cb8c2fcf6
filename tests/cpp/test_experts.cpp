// The `grouped` experts backend against the `eager` reference, in float64, on awkward routings:
// an expert with no tokens, every token on one expert, K = 1, a single token.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "automoe/moe/experts.h"
#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"

namespace automoe::moe {
namespace {

struct Case {
  const char* name;
  int64_t T, E, K;
  bool all_on_one;  // every slot routed to expert E-1 (K must be 1)
};

class ExpertsBackends : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertsBackends, GroupedMatchesEagerForwardAndGradients) {
  const Case c = GetParam();
  at::manual_seed(7);
  const int64_t H = 5, I = 3;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor idx;
  if (c.all_on_one) {
    idx = at::full({c.T, c.K}, c.E - 1, at::kLong);
  } else {
    // K distinct experts per token, never expert 0 (so one expert always has no tokens).
    idx = at::stack({at::randperm(c.E - 1, at::kLong).narrow(0, 0, c.K) + 1}, 0);
    for (int64_t t = 1; t < c.T; ++t) {
      idx = at::cat({idx, (at::randperm(c.E - 1, at::kLong).narrow(0, 0, c.K) + 1).view({1, -1})});
    }
  }
  auto leaf = [&](std::vector<int64_t> shape) { return at::randn(shape, f64).requires_grad_(); };
  at::Tensor x = leaf({c.T, H}), w = at::rand({c.T, c.K}, f64).requires_grad_();
  at::Tensor gu = leaf({c.E, 2 * I, H}), down = leaf({c.E, H, I});
  const at::Tensor probe = at::randn({c.T, H}, f64);

  auto run = [&](bool grouped) {
    for (auto* t : {&x, &w, &gu, &down}) t->mutable_grad() = at::Tensor();
    const at::Tensor y =
        grouped ? experts_grouped(x, idx, w, gu, down) : experts_eager(x, idx, w, gu, down);
    (y * probe).sum().backward();
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), gu.grad(), down.grad()};
  };
  const auto ref = run(false), got = run(true);
  const char* what[] = {"output", "dx", "dweights", "dgate_up", "ddown"};
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << what[i];
    EXPECT_TRUE(at::allclose(got[i], ref[i], 1e-12, 1e-12)) << what[i];
  }
  // the expert that received nothing gets a zero (not missing) weight gradient
  if (!c.all_on_one) {
    EXPECT_EQ(got[3][0].abs().max().item<double>(), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(AwkwardRoutings, ExpertsBackends,
                         ::testing::Values(Case{"Odd", 13, 7, 3, false},
                                           Case{"TopOne", 9, 5, 1, false},
                                           Case{"SingleToken", 1, 4, 2, false},
                                           Case{"AllOnOneExpert", 6, 4, 1, true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace automoe::moe

// A resumed run adopts the GEMM paths the run it continues measured (see gemm_cpu.h).
TEST(GemmDecisions, AdoptedDecisionsAreReportedBackAndForeignOnesRefused) {
  namespace cpu = automoe::ops::cpu;
  const std::string isa = cpu::isa_name(cpu::active_isa());
  EXPECT_FALSE(cpu::adopt_gemm_decisions("garbage"));
  EXPECT_FALSE(cpu::adopt_gemm_decisions(isa + ":2:0"));
  const std::string other = isa == "amx" ? "avx2" : "amx";
  EXPECT_FALSE(cpu::adopt_gemm_decisions(other + ":1:1"));
  ASSERT_TRUE(cpu::adopt_gemm_decisions(isa + ":0:1"));
  EXPECT_EQ(cpu::gemm_decisions(), isa + ":0:1");
  EXPECT_TRUE(cpu::aten_faster_fp32());  // adopted, not measured
  ASSERT_TRUE(cpu::adopt_gemm_decisions(isa + ":-:0"));
  EXPECT_EQ(cpu::gemm_decisions(), isa + ":0:0");  // "-" leaves a choice as it was
  if (cpu::active_isa() >= cpu::Isa::kAvx2) EXPECT_FALSE(cpu::aten_faster_fp32());
}

// Quantised experts (a LoRA base) against the dense backends on the dequantised weights, with
// adapters on both projections: outputs and the gradients of x, the routing weights and the
// adapters, for each backend and both expert MLPs.
namespace automoe::moe {
namespace {

class QuantizedExpertsBackends
    : public ::testing::TestWithParam<std::tuple<std::string, ExpertMlp, ops::QuantType>> {};

TEST_P(QuantizedExpertsBackends, EqualTheDenseBackendOnTheDequantisedWeights) {
  const auto [backend, mlp, type] = GetParam();
  at::manual_seed(11);
  const int64_t T = 11, E = 5, K = 2, H = 32, I = 16, r = 3;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t first = mlp == ExpertMlp::kSwiglu ? 2 * I : I;
  const ops::QuantizedWeight qgu =
      ops::quantize(at::randn({E, first, H}), type, 64, at::kDouble, "gate_up");
  const ops::QuantizedWeight qd = ops::quantize(at::randn({E, H, I}), type, 64, at::kDouble, "down");
  const at::Tensor gu = ops::dequantize(qgu, 0, E, at::kDouble), dn = ops::dequantize(qd, 0, E, at::kDouble);
  // Expert 0 gets no token.
  at::Tensor idx = at::randint(1, E, {T, K}, at::kLong);
  idx.select(1, 1).copy_((idx.select(1, 0) % (E - 1)) + 1);
  idx.select(1, 1).masked_fill_(idx.select(1, 1) == idx.select(1, 0), 1);
  auto leaf = [&](std::vector<int64_t> s) { return at::randn(s, f64).requires_grad_(); };
  at::Tensor x = leaf({T, H}), w = at::rand({T, K}, f64).requires_grad_();
  at::Tensor a1 = leaf({E, r, H}), b1 = leaf({E, first, r}), a2 = leaf({E, r, I}), b2 = leaf({E, H, r});
  const at::Tensor probe = at::randn({T, H}, f64);
  auto run = [&](bool quantized) {
    for (auto* t : {&x, &w, &a1, &b1, &a2, &b2}) t->mutable_grad() = at::Tensor();
    ExpertLora lora{{a1, b1, 0.5}, {a2, b2, 2.0}};
    const at::Tensor y = quantized
                             ? experts_quantized(backend, x, idx, w, {&qgu, &qd}, true, &lora, mlp)
                             : experts_by_name(backend, x, idx, w, gu, dn, &lora, mlp);
    (y * probe).sum().backward();
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), a1.grad(), b1.grad(), a2.grad(), b2.grad()};
  };
  const auto ref = run(false), got = run(true);
  const char* what[] = {"output", "dx", "dweights", "dA1", "dB1", "dA2", "dB2"};
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << what[i];
    EXPECT_TRUE(at::allclose(got[i], ref[i], 1e-10, 1e-10)) << what[i];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Backends, QuantizedExpertsBackends,
    ::testing::Combine(::testing::Values("grouped", "eager"),
                       ::testing::Values(ExpertMlp::kSwiglu, ExpertMlp::kRelu2),
                       ::testing::Values(ops::QuantType::kNF4, ops::QuantType::kInt8)),
    [](const auto& info) {
      return std::get<0>(info.param) +
             (std::get<1>(info.param) == ExpertMlp::kSwiglu ? "_swiglu_" : "_relu2_") +
             ops::to_string(std::get<2>(info.param));
    });

}  // namespace
}  // namespace automoe::moe
