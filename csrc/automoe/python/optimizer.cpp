// automoe._C's optimizer hooks for tests: the trainer's AdamW step on given tensors, the 8-bit
// moments' map and (de)quantisation, and the bf16 + remainder split of float32 masters.
#include "automoe/train/optimizer.h"

#include "automoe/core/error.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/python/bindings.h"

namespace automoe::bindings {
namespace {

void adamw_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
                std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                std::vector<at::Tensor> remainders, int64_t step, double lr, double beta1,
                double beta2, double eps, double weight_decay, double grad_scale,
                std::vector<at::Tensor> exp_avg_scales, std::vector<at::Tensor> exp_avg_sq_scales,
                bool aten) {
  // The trainer's AdamW update for bf16 training (optimizer.master_weights / state_dtype),
  // one step on the given tensors in place, every tensor in the decay group: for tests
  // against torch.optim.AdamW. 8-bit moments: uint8 codes with their block scales. `aten`:
  // the update other devices run (ATen ops), here on CPU tensors.
  const size_t n = params.size();
  const bool q8 = !exp_avg_scales.empty();
  AUTOMOE_CHECK(!q8 || (exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n),
                "_adamw_step: 8-bit moments need both scales for every parameter");
  AUTOMOE_CHECK(n > 0 && grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                    (remainders.empty() || remainders.size() == n),
                "_adamw_step: one gradient, moment pair (and remainder) per parameter");
  NamedTensors named;
  for (size_t i = 0; i < n; ++i) named.emplace_back("p" + std::to_string(i), params[i]);
  using Masters = train::AdamW::Masters;
  const Masters kind = !remainders.empty()                     ? Masters::kRemainders
                       : params[0].scalar_type() == at::kFloat ? Masters::kFloat32
                                                               : Masters::kNone;
  py::gil_scoped_release no_gil;
  train::AdamW opt;
  opt.init(named, std::vector<bool>(n, false), /*own_grads=*/true, /*full_state=*/true, kind,
           q8 ? at::kByte : exp_avgs[0].scalar_type(), remainders);
  opt.decay.assign(n, true);
  opt.aten_update = aten;
  for (size_t i = 0; i < n; ++i) {
    opt.exp_avg[i] = exp_avgs[i];
    opt.exp_avg_sq[i] = exp_avg_sqs[i];
    if (q8 && !opt.quantized(i)) {  // (1-D: float32 moments)
      AUTOMOE_CHECK(exp_avgs[i].scalar_type() == at::kFloat, "_adamw_step: parameter ", i,
                    ": float32 moments expected (", params[i].numel(), " elements)");
    } else if (q8) {
      AUTOMOE_CHECK(exp_avgs[i].scalar_type() == at::kByte &&
                        exp_avg_sqs[i].scalar_type() == at::kByte &&
                        exp_avgs[i].sizes() == params[i].sizes() &&
                        exp_avg_sqs[i].sizes() == params[i].sizes() &&
                        exp_avg_scales[i].scalar_type() == at::kFloat &&
                        exp_avg_sq_scales[i].scalar_type() == at::kFloat &&
                        exp_avg_scales[i].sizes() == opt.exp_avg_scale[i].sizes() &&
                        exp_avg_sq_scales[i].sizes() == opt.exp_avg_scale[i].sizes(),
                    "_adamw_step: parameter ", i, ": uint8 codes and scales of shape ",
                    opt.exp_avg_scale[i].sizes(), " expected");
      opt.exp_avg_scale[i] = exp_avg_scales[i];
      opt.exp_avg_sq_scale[i] = exp_avg_sq_scales[i];
    }
    opt.step[i].fill_(static_cast<double>(step - 1));
    opt.accumulate(i, grads[i]);
  }
  if (grad_scale != 1.0) opt.scale_grads(grad_scale);
  train::OptimizerSection o;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.weight_decay = weight_decay;
  opt.update(o, lr);
}

}  // namespace

void bind_optimizer(py::module_& m) {
  m.def("_adamw_step", &adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("remainders"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale") = 1.0, py::arg("exp_avg_scales") = std::vector<at::Tensor>{},
        py::arg("exp_avg_sq_scales") = std::vector<at::Tensor>{}, py::arg("aten") = false);
  m.def(
      "_qmap8",
      [](bool is_signed) {
        // The 8-bit moments' map (optimizer.state_dtype: 8bit): its 256 values and 255 midpoints.
        const at::Tensor v =
            at::from_blob(const_cast<float*>(ops::cpu::vec::qmap8(is_signed)), {256}, at::kFloat)
                .clone();
        const at::Tensor m =
            at::from_blob(const_cast<float*>(ops::cpu::vec::qmid8(is_signed)), {255}, at::kFloat)
                .clone();
        return py::make_tuple(v, m);
      },
      py::arg("is_signed"));
  m.def(
      "_code8",
      [](const at::Tensor& x, bool is_signed, bool row) {
        // The 8-bit code of each float32 of x: ops::cpu::vec::quantize8 (the table), or with
        // `row` quantize8_row (what the CPU kernel runs: vectorised on AVX2).
        AUTOMOE_CHECK(x.scalar_type() == at::kFloat, "_code8: float32 values expected");
        const at::Tensor xc = x.contiguous();
        at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kByte));
        const float* src = xc.data_ptr<float>();
        uint8_t* dst = out.data_ptr<uint8_t>();
        if (row) {
          ops::cpu::vec::quantize8_row(src, 1.f, is_signed, dst, xc.numel());
        } else {
          for (int64_t i = 0; i < xc.numel(); ++i)
            dst[i] = ops::cpu::vec::quantize8(src[i], is_signed);
        }
        return out;
      },
      py::arg("x"), py::arg("is_signed"), py::arg("row") = false);
  m.def(
      "_quantize8",
      [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
        // AdamW::quantize8 (the ATen composition the non-CPU step uses), into codes and scale.
        train::AdamW::quantize8(x, codes, scale, is_signed);
      },
      py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("is_signed"));
  m.def(
      "_dequantize8",
      [](const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
        return train::AdamW::dequantize8(codes, scale, is_signed);
      },
      py::arg("codes"), py::arg("scale"), py::arg("is_signed"));
  m.def(
      "_split_master",
      [](const at::Tensor& f32) {
        at::Tensor hi, lo;
        train::AdamW::split_master(f32, hi, lo);
        return py::make_tuple(hi, lo);
      },
      py::arg("master"));
  m.def("_join_master", &train::AdamW::join_master, py::arg("bf16"), py::arg("remainder"));
}

}  // namespace automoe::bindings
