#include "automoe/io/mxfp4.h"

#include <ATen/ATen.h>

#include "automoe/core/error.h"

namespace automoe {

at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            c10::ScalarType dtype, const std::string& what) {
  AUTOMOE_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, what,
                ": MXFP4 blocks and scales must be uint8, found ", blocks.scalar_type(), " and ",
                scales.scalar_type());
  AUTOMOE_CHECK(blocks.dim() >= 2 && blocks.size(-1) == 16 &&
                    blocks.sizes().slice(0, blocks.dim() - 1) == scales.sizes(),
                what, ": MXFP4 blocks [..., G, 16] and scales [..., G] expected, found ",
                blocks.sizes(), " and ", scales.sizes());
  static const float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor lut = at::tensor(at::ArrayRef<float>(kFp4, 16), at::kFloat);
  const at::Tensor b = blocks.to(at::kLong);
  const at::Tensor lo = lut.index_select(0, b.bitwise_and(0x0F).reshape({-1}));
  const at::Tensor hi = lut.index_select(0, b.bitwise_right_shift(4).reshape({-1}));
  // Interleave: byte j gives elements 2j (low nibble) and 2j + 1 (high nibble).
  std::vector<int64_t> out_shape = scales.sizes().vec();
  out_shape.push_back(32);
  at::Tensor values = at::stack({lo, hi}, -1).reshape(out_shape);  // [..., G, 16 bytes x 2]
  // Exact: FP4 values times a power of two (ldexp), in float32, then cast.
  const at::Tensor exponent = scales.to(at::kInt) - 127;
  values = at::ldexp(values, exponent.unsqueeze(-1));
  std::vector<int64_t> flat = scales.sizes().vec();
  flat.back() *= 32;
  return values.reshape(flat).to(dtype);
}

}  // namespace automoe
