#include "automoe/model/kv_cache.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "automoe/core/error.h"

namespace automoe {

KVCache::KVCache(int64_t num_layers) {
  AUTOMOE_CHECK(num_layers >= 0, "KVCache: expected a non-negative layer count, got ", num_layers);
  layers_.resize(num_layers);
}

KVCache::Layer& KVCache::at_layer(int64_t layer) {
  AUTOMOE_CHECK(layer >= 0 && layer < num_layers(), "KVCache: layer ", layer, " out of range [0, ",
                num_layers(), ")");
  return layers_[layer];
}

const KVCache::Layer& KVCache::at_layer(int64_t layer) const {
  return const_cast<KVCache*>(this)->at_layer(layer);
}

int64_t KVCache::length(int64_t layer) const {
  return layers_.empty() ? 0 : at_layer(layer).length;
}

int64_t KVCache::batch_size() const {
  for (const Layer& l : layers_) {
    if (l.k.defined()) return l.k.size(0);
    if (l.state.conv.defined()) return l.state.conv.size(0);
  }
  return 0;
}

KVCache::Recurrent& KVCache::recurrent(int64_t layer) { return at_layer(layer).state; }

void KVCache::advance(int64_t layer, int64_t n) {
  Layer& L = at_layer(layer);
  AUTOMOE_CHECK(!L.k.defined() && n >= 0, "KVCache.advance: layer ", layer, " holds keys");
  L.length += n;
}

std::pair<at::Tensor, at::Tensor> KVCache::append(int64_t layer, const at::Tensor& k,
                                                  const at::Tensor& v) {
  Layer& L = at_layer(layer);
  // Keys and values may differ in their last dim (DeepSeek's latent cache: the compressed kv
  // [B, 1, S, R] as "keys", the rotary key [B, 1, S, Dr] as "values").
  AUTOMOE_CHECK(k.dim() == 4 && v.dim() == 4 && v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
                "KVCache.append: expected keys [B, N_kv, S, Dk] and values [B, N_kv, S, Dv], got ",
                k.sizes(), " and ", v.sizes());
  const int64_t S = k.size(2), needed = L.length + S;
  if (L.k.defined()) {
    AUTOMOE_CHECK(
        k.size(0) == L.k.size(0) && k.size(1) == L.k.size(1) && k.size(3) == L.k.size(3) &&
            v.size(3) == L.v.size(3) && k.scalar_type() == L.k.scalar_type() &&
            v.scalar_type() == L.v.scalar_type() &&
            k.device() == L.k.device(),
        "KVCache layer ", layer, ": cached keys are ", L.k.sizes(), " ", L.k.scalar_type(), " on ",
        L.k.device(), "; cannot append ", k.sizes(), " ", k.scalar_type(), " on ", k.device(),
        " (batch size, heads, head dim, dtype and device must stay the same)");
  }
  const at::Tensor past_k = keys(layer), past_v = values(layer);
  {
    at::NoGradGuard no_grad;
    if (L.length == 0) {
      L.k = k.detach();
      L.v = v.detach();
      L.length = S;
      L.borrowed = true;
    } else {
      const int64_t capacity = L.k.size(2);
      if (needed > capacity || L.borrowed) {
        // Growth is geometric, so that decoding copies each position a bounded number of times.
        const int64_t grown = std::max(needed, capacity + std::max<int64_t>(capacity / 4, 128));
        auto resize = [&](const at::Tensor& old, const at::Tensor& like) {
          at::Tensor buf =
              at::empty({like.size(0), like.size(1), grown, like.size(3)}, like.options());
          buf.narrow(2, 0, L.length).copy_(old.narrow(2, 0, L.length));
          return buf;
        };
        L.k = resize(L.k, k);
        L.v = resize(L.v, v);
        L.borrowed = false;
      }
      L.k.narrow(2, L.length, S).copy_(k);
      L.v.narrow(2, L.length, S).copy_(v);
      L.length = needed;
    }
  }
  if (at::GradMode::is_enabled() && (k.requires_grad() || v.requires_grad())) {
    if (!past_k.defined()) return {k, v};
    return {at::cat({past_k, k}, 2), at::cat({past_v, v}, 2)};
  }
  return {keys(layer), values(layer)};
}

at::Tensor KVCache::keys(int64_t layer) const {
  const Layer& L = at_layer(layer);
  return L.length == 0 || !L.k.defined() ? at::Tensor() : L.k.narrow(2, 0, L.length);
}

at::Tensor KVCache::values(int64_t layer) const {
  const Layer& L = at_layer(layer);
  return L.length == 0 || !L.v.defined() ? at::Tensor() : L.v.narrow(2, 0, L.length);
}

void KVCache::index_batch(const at::Tensor& batch_idx) {
  AUTOMOE_CHECK(batch_idx.dim() == 1 && !at::isFloatingType(batch_idx.scalar_type()),
                "KVCache: expected a 1-D integer batch index, got ", batch_idx.sizes(), " ",
                batch_idx.scalar_type());
  at::NoGradGuard no_grad;
  for (Layer& L : layers_) {
    const at::Tensor& first = L.k.defined() ? L.k : L.state.conv;
    if (!first.defined()) continue;
    const at::Tensor idx = batch_idx.to(first.device(), at::kLong);
    if (idx.numel() > 0) {
      const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
      AUTOMOE_CHECK(lo >= 0 && hi < first.size(0), "KVCache: batch index out of range [0, ",
                    first.size(0), "): found values in [", lo, ", ", hi, "]");
    }
    if (L.k.defined()) {
      L.k = L.k.index_select(0, idx);
      L.v = L.v.index_select(0, idx);
    }
    if (L.state.conv.defined()) {
      L.state.conv = L.state.conv.index_select(0, idx);
      L.state.ssm = L.state.ssm.index_select(0, idx);
    }
    L.borrowed = false;
  }
}

void KVCache::repeat_interleave_batch(int64_t repeats) {
  AUTOMOE_CHECK(repeats >= 1, "KVCache: repeats must be >= 1, got ", repeats);
  at::NoGradGuard no_grad;
  for (Layer& L : layers_) {
    if (L.state.conv.defined()) {
      L.state.conv = L.state.conv.repeat_interleave(repeats, 0);
      L.state.ssm = L.state.ssm.repeat_interleave(repeats, 0);
    }
    if (!L.k.defined()) continue;
    L.k = L.k.repeat_interleave(repeats, 0);
    L.v = L.v.repeat_interleave(repeats, 0);
    L.borrowed = false;
  }
}

void KVCache::remove_last(int64_t n) {
  AUTOMOE_CHECK(n >= 0, "KVCache: cannot remove a negative number (", n, ") of positions");
  if (n == 0) return;
  for (const Layer& L : layers_) {
    AUTOMOE_CHECK(!L.state.ssm.defined(),
                  "KVCache: cannot remove positions from a recurrent layer's state (Mamba-2, gated DeltaNet: a "
                  "hybrid model's cache cannot be cropped, as in Transformers)");
  }
  for (Layer& L : layers_) L.length = std::max<int64_t>(L.length - n, 0);
}

void KVCache::reset() {
  for (Layer& L : layers_) L = Layer{};
}

KVCache KVCache::clone() const {
  KVCache out(num_layers());
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].length == 0) continue;
    if (layers_[i].k.defined()) {
      out.layers_[i].k = keys(i).clone();
      out.layers_[i].v = values(i).clone();
    }
    if (layers_[i].state.conv.defined()) {
      out.layers_[i].state.conv = layers_[i].state.conv.clone();
      out.layers_[i].state.ssm = layers_[i].state.ssm.clone();
    }
    out.layers_[i].length = layers_[i].length;
  }
  return out;
}

}  // namespace automoe
