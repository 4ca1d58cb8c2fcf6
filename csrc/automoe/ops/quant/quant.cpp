// Block-wise quantisation in bitsandbytes' formats, the dequantising grouped GEMM and its autograd.
#include "automoe/ops/quant/quant.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/common.h"
#include "automoe/ops/ops.h"

namespace automoe::ops {
namespace {

// bitsandbytes' 4-bit code books (functional.get_4bit_type), float32.
constexpr float kNF4[16] = {-1.0f,
                            -0.6961928009986877f,
                            -0.5250730514526367f,
                            -0.39491748809814453f,
                            -0.28444138169288635f,
                            -0.18477343022823334f,
                            -0.09105003625154495f,
                            0.0f,
                            0.07958029955625534f,
                            0.16093020141124725f,
                            0.24611230194568634f,
                            0.33791524171829224f,
                            0.44070982933044434f,
                            0.5626170039176941f,
                            0.7229568362236023f,
                            1.0f};
constexpr float kFP4[16] = {0.0f,
                            0.0052083334885537624f,
                            0.6666666865348816f,
                            1.0f,
                            0.3333333432674408f,
                            0.5f,
                            0.1666666716337204f,
                            0.25f,
                            0.0f,
                            -0.0052083334885537624f,
                            -0.6666666865348816f,
                            -1.0f,
                            -0.3333333432674408f,
                            -0.5f,
                            -0.1666666716337204f,
                            -0.25f};
// The codes in ascending value (bitsandbytes' argsort; FP4's two zeros: +0 at 0 first).
constexpr uint8_t kFP4Order[16] = {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3};
// int8's dequantisation factor, 1/127 as bitsandbytes writes it.
constexpr float kInv127 = static_cast<float>(7.874015718698502e-3);

}  // namespace
const float* code_book(QuantType t);
namespace {

// Midpoints between consecutive sorted codes, in float32 as bitsandbytes computes them.
struct Bounds {
  float mid[15];
  uint8_t code_of[16];  // sorted position -> code
  explicit Bounds(QuantType t) {
    const float* c = code_book(t);
    for (int i = 0; i < 16; ++i) code_of[i] = t == QuantType::kNF4 ? i : kFP4Order[i];
    for (int i = 0; i < 15; ++i) mid[i] = (c[code_of[i]] + c[code_of[i + 1]]) / 2.0f;
  }
  // torch.bucketize(x, mid) (right=False): the number of midpoints strictly below x.
  uint8_t code(float x) const {
    int n = 0;
    while (n < 15 && mid[n] < x) ++n;
    return code_of[n];
  }
};

int64_t packed_bytes(int64_t n) { return (n + 1) / 2; }
int64_t blocks_of(int64_t n, int64_t bs) { return (n + bs - 1) / bs; }

void quantize_4bit_one(const float* w, int64_t n, int64_t bs, const Bounds& b, uint8_t* codes,
                       float* absmax) {
  const int64_t nb = blocks_of(n, bs), full = n / bs;
  std::vector<uint8_t> q(static_cast<size_t>(nb * bs), b.code(0.0f));
  at::parallel_for(0, nb, 16, [&](int64_t b0, int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t lo = blk * bs, len = std::min(bs, n - lo);
    float am = 0.0f;
    for (int64_t i = 0; i < len; ++i) am = std::max(am, std::fabs(w[lo + i]));
    if (blk < full) {  // bitsandbytes: x * (1 / max(absmax, 1e-38)), absmax stored unclamped
      absmax[blk] = am;
      const float inv = 1.0f / std::max(am, 1e-38f);
      for (int64_t i = 0; i < len; ++i) {
        q[lo + i] = b.code(std::clamp(w[lo + i] * inv, -1.0f, 1.0f));
      }
    } else {  // the last, partial block: x / max(absmax, 1e-38), that value stored
      am = std::max(am, 1e-38f);
      absmax[blk] = am;
      for (int64_t i = 0; i < len; ++i) q[lo + i] = b.code(std::clamp(w[lo + i] / am, -1.0f, 1.0f));
    }
  }
  });
  for (int64_t j = 0; j < packed_bytes(n); ++j) {
    codes[j] = static_cast<uint8_t>((q[2 * j] << 4) | q[2 * j + 1]);
  }
}

void quantize_int8_one(const float* w, int64_t O, int64_t K, int8_t* codes, float* scb) {
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* row = w + o * K;
    float am = 0.0f;
    for (int64_t k = 0; k < K; ++k) am = std::max(am, std::fabs(row[k]));
    scb[o] = am;
    // bitsandbytes' `127.0 / row_stats` is torch's reciprocal times 127: two roundings. (An
    // all-zero row: codes 0, where the product would be NaN.)
    const float r = (1.0f / am) * 127.0f;
    for (int64_t k = 0; k < K; ++k) {
      codes[o * K + k] = am == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(row[k] * r));
    }
  }
  });
}

template <class T>
void dequantize_4bit_cpu(const uint8_t* codes, const float* absmax, int64_t n, int64_t bs,
                         const float* book, T* out) {
  at::parallel_for(0, blocks_of(n, bs), 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float am = absmax[blk];
      const int64_t lo = blk * bs, hi = std::min(n, lo + bs);
      for (int64_t i = lo; i < hi; ++i) {
        const uint8_t byte = codes[i >> 1];
        const uint8_t c = (i & 1) ? (byte & 0xF) : (byte >> 4);
        out[i] = static_cast<T>(book[c] * am);
      }
    }
  });
}

template <class T>
void dequantize_int8_cpu(const int8_t* codes, const float* scb, int64_t O, int64_t K, T* out) {
  at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      const float s = scb[o];
      for (int64_t k = 0; k < K; ++k) {
        out[o * K + k] = static_cast<T>(static_cast<float>(codes[o * K + k]) * s * kInv127);
      }
    }
  });
}

// The experts with rows among [0, E), in runs whose dequantised weights fit `budget` bytes.
struct Chunk {
  std::vector<int64_t> experts;
  int64_t row_begin = 0, row_end = 0;
};
std::vector<Chunk> chunks_of(const QuantizedWeight& q, const int64_t* off, c10::ScalarType dt) {
  const int64_t per = q.out_features * q.in_features * static_cast<int64_t>(c10::elementSize(dt));
  const int64_t budget = std::max<int64_t>(1, (int64_t{64} << 20) / std::max<int64_t>(per, 1));
  std::vector<Chunk> out;
  for (int64_t e = 0; e < q.experts; ++e) {
    if (off[e + 1] == off[e]) continue;
    if (out.empty() || static_cast<int64_t>(out.back().experts.size()) >= budget) {
      out.push_back({{}, off[e], off[e]});
    }
    out.back().experts.push_back(e);
    out.back().row_end = off[e + 1];
  }
  return out;
}

// The chunk's experts dequantised, [g, O, K], and their row offsets relative to the chunk.
std::pair<at::Tensor, at::Tensor> chunk_weights(const QuantizedWeight& q, const Chunk& c,
                                                const int64_t* off, c10::ScalarType dt,
                                                const c10::Device& dev) {
  std::vector<at::Tensor> ws;
  std::vector<int64_t> rel{0};
  for (int64_t e : c.experts) {
    ws.push_back(dequantize(q, e, 1, dt));
    rel.push_back(rel.back() + off[e + 1] - off[e]);
  }
  at::Tensor w = ws.size() == 1 ? ws.front() : at::cat(ws, 0);
  return {w, at::tensor(rel, at::kLong).to(dev)};
}

at::Tensor gemm_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& off) {
  if (x.is_cpu()) return cpu::grouped_gemm_fwd(x, w, off);
  return grouped_gemm_reference(x, w, off);
}
at::Tensor gemm_dx(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& off) {
  if (dy.is_cpu()) return cpu::grouped_gemm_dx(dy, w, off);
  return grouped_gemm_reference(dy, w.transpose(1, 2), off);
}

// y (or dx) over every chunk: `fn(rows, weights, offsets)` on each chunk's rows.
template <class Fn>
at::Tensor over_chunks(const at::Tensor& in_N, int64_t out_cols, const QuantizedWeight& q,
                       const at::Tensor& offsets, Fn&& fn) {
  const at::Tensor off_cpu = offsets.cpu().contiguous();
  const int64_t* off = off_cpu.const_data_ptr<int64_t>();
  at::Tensor out = at::zeros({in_N.size(0), out_cols}, in_N.options());
  for (const Chunk& c : chunks_of(q, off, in_N.scalar_type())) {
    auto [w, rel] = chunk_weights(q, c, off, in_N.scalar_type(), in_N.device());
    const int64_t n = c.row_end - c.row_begin;
    out.narrow(0, c.row_begin, n).copy_(fn(in_N.narrow(0, c.row_begin, n).contiguous(), w, rel));
  }
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct QuantizedGemmFn : torch::autograd::Function<QuantizedGemmFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& offsets,
                            const QuantizedWeight& q) {
    ctx->save_for_backward({offsets, q.codes, q.absmax});
    ctx->saved_data["type"] = static_cast<int64_t>(q.type);
    ctx->saved_data["blocksize"] = q.blocksize;
    ctx->saved_data["shape"] = std::vector<int64_t>{q.experts, q.out_features, q.in_features};
    return over_chunks(x, q.out_features, q, offsets, gemm_fwd);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("grouped_gemm_quantized");
    const auto s = ctx->get_saved_variables();
    QuantizedWeight q;
    q.type = static_cast<QuantType>(ctx->saved_data["type"].toInt());
    q.blocksize = ctx->saved_data["blocksize"].toInt();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    q.experts = shape[0];
    q.out_features = shape[1];
    q.in_features = shape[2];
    q.codes = s[1];
    q.absmax = s[2];
    const at::Tensor dy = grads[0].contiguous();
    q.dtype = dy.scalar_type();
    return {over_chunks(dy, q.in_features, q, s[0], gemm_dx), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

const float* code_book(QuantType t) { return t == QuantType::kNF4 ? kNF4 : kFP4; }

QuantType quant_type_from_name(const std::string& name, const std::string& what) {
  if (name == "nf4") return QuantType::kNF4;
  if (name == "fp4") return QuantType::kFP4;
  if (name == "int8") return QuantType::kInt8;
  fail(what, ": unknown quantisation \"", name, "\" (nf4, fp4 or int8, bitsandbytes' formats)");
}

const char* to_string(QuantType type) {
  switch (type) {
    case QuantType::kNF4: return "nf4";
    case QuantType::kFP4: return "fp4";
    case QuantType::kInt8: return "int8";
  }
  return "?";
}

int64_t QuantizedWeight::bytes() const {
  return codes.numel() * codes.element_size() + absmax.numel() * absmax.element_size();
}

QuantizedWeight QuantizedWeight::to(const c10::Device& device, c10::ScalarType dt) const {
  QuantizedWeight q = *this;
  q.codes = codes.to(device);
  q.absmax = absmax.to(device);
  q.dtype = dt;
  return q;
}

QuantizedWeight quantize(const at::Tensor& w_EOK, QuantType type, int64_t blocksize,
                         c10::ScalarType dtype, const std::string& what) {
  AUTOMOE_CHECK(w_EOK.dim() == 3 && at::isFloatingType(w_EOK.scalar_type()), what,
                ": quantisation takes a floating [experts, out, in] weight, found ",
                w_EOK.scalar_type(), " ", w_EOK.sizes());
  AUTOMOE_CHECK(type == QuantType::kInt8 || (blocksize >= 2 && blocksize % 2 == 0), what,
                ": 4-bit block size must be even and at least 2, found ", blocksize);
  QuantizedWeight q;
  q.type = type;
  q.blocksize = type == QuantType::kInt8 ? 0 : blocksize;
  q.experts = w_EOK.size(0);
  q.out_features = w_EOK.size(1);
  q.in_features = w_EOK.size(2);
  q.dtype = dtype;
  const int64_t E = q.experts, O = q.out_features, K = q.in_features, n = O * K;
  const bool int8 = type == QuantType::kInt8;
  const Bounds bounds(int8 ? QuantType::kNF4 : type);
  const int64_t pb = packed_bytes(n), nb = blocks_of(n, blocksize);
  q.codes = int8 ? at::empty({E, O, K}, at::kChar) : at::empty({E, pb}, at::kByte);
  q.absmax = int8 ? at::empty({E, O}, at::kFloat) : at::empty({E, nb}, at::kFloat);
  // One expert at a time in float32 (a float32 copy of one expert, not of the tensor), each
  // expert's blocks or rows in parallel. int8 quantises the float16 values, as Linear8bitLt does.
  for (int64_t e = 0; e < E; ++e) {
    {
      const at::Tensor w = (int8 ? w_EOK[e].detach().to(at::kCPU, at::kHalf) : w_EOK[e].detach())
                               .to(at::kCPU, at::kFloat)
                               .contiguous();
      AUTOMOE_CHECK(at::isfinite(w).all().item<bool>(), what, ": expert ", e,
                    " holds non-finite values (NaN or infinity); it cannot be quantised");
      const float* src = w.const_data_ptr<float>();
      if (int8) {
        quantize_int8_one(src, O, K, q.codes.data_ptr<int8_t>() + e * n,
                          q.absmax.data_ptr<float>() + e * O);
      } else {
        quantize_4bit_one(src, n, blocksize, bounds, q.codes.data_ptr<uint8_t>() + e * pb,
                          q.absmax.data_ptr<float>() + e * nb);
      }
    }
  }
  return q;
}

at::Tensor dequantize_reference(const QuantizedWeight& q, int64_t begin, int64_t count,
                                c10::ScalarType dtype) {
  const int64_t O = q.out_features, K = q.in_features, n = O * K;
  const at::Tensor codes = q.codes.narrow(0, begin, count);
  const at::Tensor absmax = q.absmax.narrow(0, begin, count);
  if (q.type == QuantType::kInt8) {
    return ((codes.to(at::kFloat) * absmax.unsqueeze(-1)) * kInv127).to(dtype);
  }
  const at::Tensor book =
      at::from_blob(const_cast<float*>(code_book(q.type)), {16}, at::kFloat).to(codes.device());
  const at::Tensor bytes = codes.to(at::kLong);
  const at::Tensor idx = at::stack({bytes.bitwise_right_shift(4), bytes.bitwise_and(15)}, -1)
                             .reshape({count, -1})
                             .narrow(1, 0, n);
  const at::Tensor per_elem = absmax.repeat_interleave(q.blocksize, 1).narrow(1, 0, n);
  return (book.index({idx}) * per_elem).to(dtype).reshape({count, O, K});
}

at::Tensor dequantize(const QuantizedWeight& q, int64_t begin, int64_t count, c10::ScalarType dtype) {
  AUTOMOE_CHECK(begin >= 0 && count >= 0 && begin + count <= q.experts,
                "dequantize: experts [", begin, ", ", begin + count, ") of ", q.experts);
  if (!q.codes.is_cpu() || (dtype != at::kFloat && dtype != at::kBFloat16)) {
    return dequantize_reference(q, begin, count, dtype);
  }
  const int64_t O = q.out_features, K = q.in_features, n = O * K;
  at::Tensor out = at::empty({count, O, K}, at::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t e = begin; e < begin + count; ++e) {
      scalar_t* dst = o + (e - begin) * n;
      if (q.type == QuantType::kInt8) {
        dequantize_int8_cpu(q.codes[e].const_data_ptr<int8_t>(), q.absmax[e].const_data_ptr<float>(),
                            O, K, dst);
      } else {
        dequantize_4bit_cpu(q.codes[e].const_data_ptr<uint8_t>(), q.absmax[e].const_data_ptr<float>(),
                            n, q.blocksize, code_book(q.type), dst);
      }
    }
  });
  return out;
}

at::Tensor grouped_gemm_quantized(const at::Tensor& x_NK, const QuantizedWeight& q,
                                  const at::Tensor& offsets_E1) {
  RECORD_FUNCTION("automoe::grouped_gemm_quantized", c10::ArrayRef<const c10::IValue>{});
  AUTOMOE_CHECK(q.defined(), "grouped_gemm_quantized: no quantised weight");
  detail::check_float("grouped_gemm_quantized", "x", x_NK);
  detail::check_dim("grouped_gemm_quantized", "x", x_NK, 2);
  AUTOMOE_CHECK(x_NK.size(1) == q.in_features, "grouped_gemm_quantized: x has ", x_NK.size(1),
                " features, the weight takes ", q.in_features);
  AUTOMOE_CHECK(offsets_E1.dim() == 1 && offsets_E1.size(0) == q.experts + 1 &&
                    offsets_E1.scalar_type() == at::kLong,
                "grouped_gemm_quantized: offsets must be int64 [", q.experts + 1, "], found ",
                offsets_E1.scalar_type(), " ", offsets_E1.sizes());
  AUTOMOE_CHECK(x_NK.device() == q.codes.device(), "grouped_gemm_quantized: x on ", x_NK.device(),
                ", the quantised weight on ", q.codes.device());
  const at::Tensor off = offsets_E1.cpu().contiguous();
  const int64_t* o = off.const_data_ptr<int64_t>();
  AUTOMOE_CHECK(o[0] >= 0, "grouped_gemm_quantized: offsets[0] = ", o[0], " < 0");
  for (int64_t e = 0; e < q.experts; ++e) {
    AUTOMOE_CHECK(o[e + 1] >= o[e], "grouped_gemm_quantized: offsets must be non-decreasing (offsets[",
                  e + 1, "] = ", o[e + 1], " < offsets[", e, "] = ", o[e], ")");
  }
  AUTOMOE_CHECK(o[q.experts] <= x_NK.size(0), "grouped_gemm_quantized: offsets[", q.experts, "] = ",
                o[q.experts], " is past x's ", x_NK.size(0), " rows");
  return QuantizedGemmFn::apply(x_NK, offsets_E1, q);
}

}  // namespace automoe::ops
