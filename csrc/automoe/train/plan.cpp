#include "automoe/train/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/core/error.h"
#include "automoe/model/components.h"
#include "automoe/model/lora.h"
#include "automoe/train/flops.h"
#include "automoe/train/progress.h"
#include "automoe/train/setup.h"

namespace automoe::train {
namespace {

using nlohmann::json;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr int64_t kQuantBlock = 256;  // the 8-bit moments' block (ops/cpu/vec.h)

// Measured (docs/performance.md#memory-plan): what a training process holds above its memory
// before the model is loaded, whatever the model — the CPU kernels' thread pools and packed-weight
// caches, oneDNN's code; on CUDA the context and cuBLAS's workspaces.
constexpr double kRuntimeCpu = 40 * kMiB;
constexpr double kRuntimeCuda = 1024 * kMiB;
constexpr double kRuntimeDistributed = 48 * kMiB;
// The allocator's overhead over what the tensors hold at the peak: freed blocks kept for reuse
// (jemalloc's retained pages, the CUDA caching allocator's) and rounding to its size classes.
constexpr double kAllocatorCpu = 0.02;
// The share of the activations' freed memory the allocator gives to the gradients the backward
// makes meanwhile (the rest stays as freed blocks of the wrong sizes).
constexpr double kReuse = 0.5;
constexpr double kAllocatorCuda = 0.10;
// The training step's fraction of the matmul peak (MFU), per device. CPU: measured on the
// cpu-medium preset, bf16, 2 x 256 tokens, on an AVX-512-BF16 Xeon (2 cores): 0.63 of at::mm's
// bf16 peak (the engine's brgemm kernels outrun at::mm there; other CPUs differ: --mfu). CUDA: not
// measured yet (no GPU run): the reference system's published Nemotron 3 Nano rate on H100 is
// about a third of the datasheet.
constexpr double kMfuCpu = 0.6;
constexpr double kMfuCuda = 0.30;
// TFLOP/s: an H100 SXM's dense bf16 tensor-core peak, and its float32 (no TF32) peak.
constexpr double kH100Bf16 = 989.0, kH100Fp32 = 67.0;

// The parameters one rank holds, by class.
struct Counts {
  double dense = 0, experts = 0, buffers = 0;  // elements: trained dense, trained routed (local), buffers
  double dense_1d = 0, experts_1d = 0;         // of which 1-D (their moments stay float32)
  double dense_blocks = 0, experts_blocks = 0;  // 8-bit moments' scale blocks (>= 2-D tensors)
  double largest = 0;                           // the largest trained tensor
  double head = 0;                              // the LM head's (its gradient comes first)
  double trained() const { return dense + experts; }
};

Counts count(const ModelSpec& local) {
  Counts c;
  const std::vector<ParamDecl> decls = parameter_layout(local);
  for (size_t i = 0; i < decls.size(); ++i) {
    const ParamDecl& d = decls[i];
    double n = 1;
    for (int64_t x : d.shape) n *= static_cast<double>(x);
    if (!d.trainable) {
      c.buffers += n;
      continue;
    }
    const double cols = d.shape.empty() ? 1 : static_cast<double>(d.shape.back());
    const double blocks = d.shape.size() >= 2 ? n / cols * std::ceil(cols / kQuantBlock) : 0;
    (d.routed_expert ? c.experts : c.dense) += n;
    if (d.shape.size() < 2) (d.routed_expert ? c.experts_1d : c.dense_1d) += n;
    (d.routed_expert ? c.experts_blocks : c.dense_blocks) += blocks;
    c.largest = std::max(c.largest, n);
  }
  c.head = static_cast<double>(local.vocab_size) * static_cast<double>(local.hidden_size);
  return c;
}

// Moments per element (exp_avg + exp_avg_sq), 1-D tensors float32 under 8-bit.
double moment_bytes(const std::string& state, double n, double n_1d, double blocks) {
  if (state == "bfloat16") return 4 * n;
  if (state == "8bit") return 2 * (n - n_1d) + 8 * n_1d + 2 * 4 * blocks;
  return 8 * n;
}

// A configuration's speed for ranking: its predicted tokens/s, or (no peak known) tokens per FLOP.
double speed(const RankPlan& p) {
  return p.tokens_per_s > 0 ? p.tokens_per_s : p.tokens_per_step / (p.flops_per_step + 1);
}

int precision_loss(const std::string& masters, const std::string& state) {
  const int m = masters == "none" ? 3 : 0;
  const int s = state == "bfloat16" ? 1 : state == "8bit" ? 2 : 0;
  return m + s;
}

std::string gib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, b >= 100 * kGiB ? "%.0f" : "%.2f", b / kGiB);
  return buf;
}

struct Config {
  int64_t world = 1, ep = 1, zero = 0, micro_batch = 1, accumulation = 1;
  std::string masters, state;
  bool checkpointing = false;
};

// What the configurations of one search share, computed once per expert-parallel size or
// micro-batch: a 4096-layer model's parameter layout is thousands of declarations.
struct ModelFacts {
  const ModelSpec& full;
  const Recipe& rc;
  std::map<int64_t, ModelSpec> local;  // per ep
  std::map<int64_t, Counts> counts;    // per ep
  std::map<int64_t, double> adapters;  // per ep
  // per ep, bytes per token: the linear adapters' float32 input and x·A (4 (in + r)); the routed
  // experts' x·A in the compute dtype, top_k rows per token (the fused grouped LoRA op keeps the
  // base GEMM's input, no copy)
  std::map<int64_t, double> adapter_inputs;
  std::map<std::pair<int64_t, int64_t>, ActivationDecl> acts;  // per (ep, micro-batch)
  double flops_per_token = -1;  // a training step's, at the recipe's sequence length

  double training_flops() {
    if (flops_per_token < 0) flops_per_token = training_flops_per_token(full, rc.data.seq_len);
    return flops_per_token;
  }

  const ModelSpec& spec(int64_t ep) {
    auto it = local.find(ep);
    if (it != local.end()) return it->second;
    ModelSpec l = full;
    if (ep > 1) l.moe.expert_count = full.moe.num_experts / ep;
    return local.emplace(ep, std::move(l)).first->second;
  }
  const Counts& count_of(int64_t ep) {
    auto it = counts.find(ep);
    return it != counts.end() ? it->second : counts.emplace(ep, count(spec(ep))).first->second;
  }
  double adapters_of(int64_t ep) {
    auto it = adapters.find(ep);
    if (it != adapters.end()) return it->second;
    const LoraConfig lc = lora_config_of(rc.peft);
    double n = 0, inputs = 0;
    const double K = static_cast<double>(std::max<int64_t>(1, full.moe.top_k));
    const double compute_bytes = rc.model.dtype == "bfloat16" ? 2 : 4;
    for (const LoraSite& s : plan_lora(spec(ep), parameter_layout(spec(ep)), lc, /*strict=*/false)) {
      n += static_cast<double>(s.experts_count) * static_cast<double>(s.r) *
           static_cast<double>(s.in + s.out);
      inputs += s.experts ? K * compute_bytes * static_cast<double>(s.r)
                          : 4.0 * static_cast<double>(s.in + s.r);
    }
    adapter_inputs[ep] = inputs;
    return adapters.emplace(ep, n).first->second;
  }
  const ActivationDecl& acts_of(int64_t ep, int64_t micro_batch, int64_t compute_bytes) {
    const auto key = std::make_pair(ep, micro_batch);
    auto it = acts.find(key);
    if (it != acts.end()) return it->second;
    return acts.emplace(key, activation_bytes(spec(ep), micro_batch, rc.data.seq_len, compute_bytes))
        .first->second;
  }
};

// The quantised base's format ("nf4", "fp4", "int8"; "" when the experts are not quantised):
// model.quantize, or a checkpoint whose experts bitsandbytes quantised.
std::string quantised_base(const ModelFacts& f) {
  if (!f.rc.peft.enabled) return "";
  if (f.rc.model.quantize != "none") return f.rc.model.quantize;
  return f.full.bnb_quantized_experts ? f.full.bnb_quantized : "";
}

// Bytes per routed-expert parameter of a quantised base: codes + float32 scales (int8: per row,
// negligible).
double quantised_bytes_per_param(const ModelFacts& f, const std::string& quant) {
  const double blocksize = f.rc.model.quantize != "none" ? static_cast<double>(f.rc.model.quantize_blocksize) : 64;
  return quant == "int8" ? 1.0 : 0.5 + 4.0 / blocksize;
}

// Why a configuration cannot run at all (the engine refuses it), or "".
std::string refusal(const ModelSpec& full, const Recipe& rc, const Config& c, int64_t zero) {
  const bool lora = rc.peft.enabled;
  const bool lean = rc.model.dtype == "bfloat16" && !lora &&
                    (c.masters != "float32" || c.state != "float32");
  if (lean && zero > 0) return "lean optimizer precision needs parallel.zero: 0";
  if (c.world % c.ep != 0) return "parallel.ep does not divide the processes";
  if (c.ep > 1 && full.moe.num_experts == 0) return "parallel.ep > 1 on a model without experts";
  if (full.moe.num_experts > 0 && full.moe.num_experts % c.ep != 0) {
    return "parallel.ep does not divide the experts";
  }

  if (rc.optimizer.in_backward && (c.world > 1 || c.accumulation > 1 || lora)) {
    return "optimizer.in_backward needs one process and one micro-batch a step";
  }
  return "";
}

// The gradients' transients: held at the end of a step's backward; made first by the loss's
// backward, beside every activation; held while a step's later micro-batches run their forward.
struct Gradients {
  double end = 0, first = 0, held = 0;
};

// Adds what the run holds throughout — weights, masters, moments, ZeRO's gradient buffers — to
// `p`'s items and static bytes; returns the gradients' transients.
Gradients training_state(RankPlan& p, ModelFacts& facts, const Config& c) {
  const Recipe& rc = facts.rc;
  const Counts& n = facts.count_of(c.ep);
  const bool bf16 = rc.model.dtype == "bfloat16";
  const double cd = bf16 ? 2 : 4, P = n.trained();
  auto item = [&](const std::string& name, double bytes, const std::string& what) {
    if (bytes <= 0) return;
    p.memory.push_back({name, bytes, what});
    p.static_bytes += bytes;
  };
  item("buffers", 4 * n.buffers, "float32 (routers' correction biases)");
  Gradients g;
  if (rc.peft.enabled) {  // the base frozen in the compute dtype; the adapters train in float32
    // A quantised base (model.quantize, or a bitsandbytes checkpoint): the routed experts as
    // stored, codes + a float32 absmax per block (int8: per row), the rest in the compute dtype.
    const std::string quant = quantised_base(facts);
    if (!quant.empty()) {
      const double per = quantised_bytes_per_param(facts, quant);
      item("weights", cd * n.dense, std::string("frozen base outside the routed experts, ") +
                                        (bf16 ? "bfloat16" : "float32"));
      item("quantised experts", per * n.experts,
           "frozen, " + quant + (quant == "int8" ? " + float32 row scales" : " + float32 block scales"));
      // Each GEMM dequantises up to 64 MiB of experts at a time (at least one expert): the chunk,
      // its parts and the GEMM kernel's packed copy (three chunks: measured on cpu-medium).
      const ModelSpec& l = facts.spec(c.ep);
      const double I = static_cast<double>(l.moe.intermediate_size), H = static_cast<double>(l.hidden_size);
      const double expert = cd * (l.moe.gated ? 2 : 1) * I * H;
      const double chunk = std::max(expert, std::min(64 * kMiB, expert * static_cast<double>(l.moe.local_experts())));
      item("dequantisation scratch", 3 * chunk, "the experts being multiplied, dequantised");
    } else {
      item("weights", cd * P, std::string("frozen base, ") + (bf16 ? "bfloat16" : "float32"));
    }
    const double adapters = facts.adapters_of(c.ep);
    item("adapters", 4 * adapters, human_count(adapters) + " float32 adapter parameters");
    item("optimizer moments", 8 * adapters, "float32 exp_avg + exp_avg_sq of the adapters");
    item("gradients", 4 * adapters, "float32, the adapters'");
    return g;
  }
  if (p.zero > 0) {
    // Ranks sharing each class of tensors: dense over the world, experts over dp.
    const double dense_share = 1.0 / static_cast<double>(c.world);
    const double expert_share = 1.0 / static_cast<double>(p.dp);
    const double sharded = n.dense * dense_share + n.experts * expert_share;
    item("weights", cd * P, "what the forward reads, one flat buffer per bucket");
    item("master weights", 4 * sharded, "float32, this rank's ZeRO slices");
    item("optimizer moments", 8 * sharded, "float32, this rank's ZeRO slices");
    // The reduce-scatter's output is a slice of its own only for tensors other ranks hold too.
    const double slices = 4 * n.dense * dense_share + (p.dp > 1 ? 4 * n.experts * expert_share : 0);
    if (p.zero == 1) {
      item("gradients", 4 * P + slices, "float32 accumulators (full size) + reduced slices");
    } else {
      item("gradients", slices + (p.dp > 1 ? 0 : 4 * n.experts), "float32, reduced slices");
      // Each backward's full-size bucket accumulators are freed as their reductions complete, but
      // their blocks (each bucket's own size) stay with the allocator (measured): as much as
      // ZeRO-1's accumulators, held through the step.
      g.held = 4 * (n.dense + (p.dp > 1 ? n.experts : 0)) + 3 * rc.parallel.bucket_mb * kMiB;
    }
    g.first = cd * n.head;
    return g;
  }
  if (!bf16) {
    item("weights", 4 * P, "float32 (they are the masters)");
  } else {
    item("weights", 2 * P, "bfloat16, what the forward reads");
    const double m = c.masters == "float32" ? 4 : c.masters == "remainders" ? 2 : 0;
    item("master weights", m * P,
         c.masters == "float32" ? "float32 copy" : "int16 remainders of the float32 masters");
  }
  const std::string state = bf16 ? c.state : "float32";
  item("optimizer moments",
       moment_bytes(state, n.dense, n.dense_1d, n.dense_blocks) +
           moment_bytes(state, n.experts, n.experts_1d, n.experts_blocks),
       state + " exp_avg + exp_avg_sq");
  // The gradients live from the backward to the update (released after every step): float32 ones
  // accumulate in place over a step's micro-batches; bf16 ones as autograd made them, summed in
  // float32 from a step's second micro-batch on.
  if (rc.optimizer.in_backward) {
    g.end = cd * n.largest;
  } else if (!bf16) {
    g.end = 4 * P;
    g.held = c.accumulation > 1 ? 4 * P : 0;
    g.first = 4 * n.head;
  } else {
    g.end = 2 * P + (c.accumulation > 1 ? 4 * P : 0);
    g.held = c.accumulation > 2 ? 4 * P : c.accumulation > 1 ? 2 * P : 0;
    g.first = 2 * n.head;
  }
  // The all-reduce's float32 buckets (64 MiB, as sync_gradients cuts them), two at a time.
  if (c.world > 1) g.end += std::min(2 * 64 * kMiB, 4 * P);
  return g;
}

// The step's largest transient (and loading's, when larger) into `p`'s items and dynamic bytes.
void transients(RankPlan& p, ModelFacts& facts, const Config& c, const Gradients& g) {
  const Recipe& rc = facts.rc;
  const bool lora = rc.peft.enabled, bf16 = rc.model.dtype == "bfloat16";
  const double cd = bf16 ? 2 : 4;
  const int64_t seq = rc.data.seq_len;
  const double T = static_cast<double>(c.micro_batch) * static_cast<double>(seq);
  const ActivationDecl& act = facts.acts_of(c.ep, c.micro_batch, static_cast<int64_t>(cd));
  // LoRA: each adapted weight's float32 input and x·A, per token.
  double kept = act.head + (lora ? facts.adapter_inputs[c.ep] * T : 0), biggest_layer = 0;
  for (double l : act.layer) {
    kept += c.checkpointing ? act.layer_input : l;
    biggest_layer = std::max(biggest_layer, l);
  }
  // Checkpointing: the layer recomputed in the backward, and its weights' gradients, which
  // autograd::grad makes apart before they are added to the others.
  const Counts& n = facts.count_of(c.ep);
  const double layers = static_cast<double>(std::max<int64_t>(1, facts.full.num_layers));
  if (c.checkpointing) kept += biggest_layer + cd * (n.trained() - 2 * n.head) / layers;
  // Every activation with the loss's (or a layer's) backward and the gradients made first, or the
  // gradients at the end of the backward. The gradients take the activations' place as the
  // backward frees them, but only in part: the allocator cannot reuse blocks of other sizes
  // (kReuse, measured).
  // Under expert parallelism a layer's exchange adds its send and receive buffers (the routed rows,
  // top_k per token) to that layer's backward.
  const double K = static_cast<double>(facts.full.moe.top_k);
  const double dispatch =
      c.ep > 1 ? 2 * T * K * static_cast<double>(facts.full.hidden_size) * cd : 0;
  const double A = kept + std::max(act.loss, act.layer_backward + dispatch) + g.first;
  p.dynamic_bytes =
      std::max(A + g.held, g.end) + (1 - kReuse) * std::min(A, g.end) + act.scratch;
  char what[200];
  std::snprintf(what, sizeof what, "%lld x %lld tokens%s; the loss's logits %s GiB%s",
                static_cast<long long>(c.micro_batch), static_cast<long long>(seq),
                c.checkpointing ? ", layer inputs + one recomputed layer" : "",
                gib(act.loss).c_str(), dispatch > 0 ? (", dispatch " + gib(dispatch) + " GiB").c_str() : "");
  p.memory.push_back({"activations (one micro-batch)", kept + act.loss + act.scratch, what});
  if (g.end > 0) {
    p.memory.push_back({"gradients (end of backward)", g.end,
                        g.held > 0 ? "transient; " + gib(g.held) + " GiB of them held while the "
                                         "step's later micro-batches run"
                                   : "transient, freed by the update"});
  }
  // Loading: the checkpoint's tensors are held until the training state is built from them; under
  // ZeRO the full float32 masters (and bf16 compute copies) exist until they are sliced.
  const double stored = static_cast<double>(c10::elementSize(facts.full.dtype)), P = n.trained();
  double loading = p.static_bytes - 4 * n.buffers;
  const std::string quant = quantised_base(facts);
  if (lora && !quant.empty()) {
    // Quantised as each experts tensor is read, its file pages released: one held at a time. A
    // checkpoint stored quantised: its codes' pages stay mapped until the load ends.
    // (per-expert layout: the gathered copy beside its still-mapped pages)
    const double experts = rc.model.quantize != "none"
                               ? 2 * stored * n.largest
                               : quantised_bytes_per_param(facts, quant) * n.experts;
    loading += stored * (n.dense + n.buffers) + experts;
  } else if (lora) {
    loading += stored * (P + n.buffers);
  } else if (p.zero > 0) {
    loading += (bf16 ? 6 : 4) * P;
  } else {
    loading += stored * P;
  }
  if (loading > p.static_bytes + p.dynamic_bytes) {
    p.memory.push_back({"loading (transient)", loading - p.static_bytes,
                        "the checkpoint's tensors until the training state is built"});
    p.dynamic_bytes = loading - p.static_bytes;
  }
}

RankPlan plan_config(ModelFacts& facts, const Config& c, double memory, bool cuda) {
  const Recipe& rc = facts.rc;
  RankPlan p;
  p.world = c.world;
  p.ep = c.ep;
  p.dp = std::max<int64_t>(1, c.world / c.ep);
  p.checkpointing = c.checkpointing;
  p.micro_batch = c.micro_batch;
  p.accumulation = c.accumulation;
  p.available_bytes = memory;
  const bool lora = rc.peft.enabled, dist = c.world > 1;
  p.zero = dist && !lora ? c.zero : 0;
  if (rc.model.dtype == "bfloat16" && !lora) p.master_weights = c.masters, p.state_dtype = c.state;
  p.invalid = refusal(facts.full, rc, c, p.zero);

  transients(p, facts, c, training_state(p, facts, c));
  // Several processes: the collectives' buffers and threads (and, in a torchrun rank, the Python
  // process's allocator arenas).
  const double runtime = (cuda ? kRuntimeCuda : kRuntimeCpu) + (dist ? kRuntimeDistributed : 0);
  p.memory.push_back({"runtime", runtime, cuda ? "CUDA context, cuBLAS workspaces" : "CPU kernels' pools and code"});
  p.static_bytes += runtime;
  const double overhead =
      (cuda ? kAllocatorCuda : kAllocatorCpu) * (p.static_bytes - runtime + p.dynamic_bytes);
  p.memory.push_back({"allocator overhead", overhead,
                      cuda ? "assumed fraction of the tensors' bytes (not yet measured on a GPU)"
                           : "measured fraction of the tensors' bytes"});
  p.peak_bytes = p.static_bytes + p.dynamic_bytes + overhead;
  p.fits = p.invalid.empty() && (memory <= 0 || p.peak_bytes <= memory);

  // The step: every rank runs its micro-batches; each token costs the same FLOPs on any mesh.
  const double T = static_cast<double>(c.micro_batch) * static_cast<double>(rc.data.seq_len);
  const double per_token = facts.training_flops() * (c.checkpointing ? 4.0 / 3 : 1.0);
  p.flops_per_step = per_token * T * static_cast<double>(c.accumulation);
  p.tokens_per_step = T * static_cast<double>(c.accumulation) * static_cast<double>(c.world);
  return p;
}

void timing(RankPlan& p, double tflops, double mfu) {
  p.step_s = p.flops_per_step / (tflops * 1e12 * mfu);
  p.tokens_per_s = p.step_s > 0 ? p.tokens_per_step / p.step_s : 0;
}

double local_memory(const PlanTarget& t) {
  if (t.rank_memory_bytes > 0) return t.rank_memory_bytes;
  if (t.device == "cuda") return 80 * kGiB;
  return static_cast<double>(available_cpu_memory()) / static_cast<double>(t.nproc_per_node);
}

json memory_json(const RankPlan& p) {
  json items = json::array();
  for (const MemoryItem& m : p.memory) items.push_back({{"name", m.name}, {"bytes", m.bytes}, {"what", m.what}});
  json j = {{"world", p.world},
            {"ep", p.ep},
            {"dp", p.dp},
            {"zero", p.zero},
            {"activation_checkpointing", p.checkpointing},
            {"micro_batch_size", p.micro_batch},
            {"micro_batches_per_rank", p.accumulation},
            {"memory", items},
            {"peak_bytes", p.peak_bytes},
            {"available_bytes", p.available_bytes},
            {"fits", p.fits},
            {"flops_per_step_per_rank", p.flops_per_step},
            {"tokens_per_step", p.tokens_per_step},
            {"step_s", p.step_s},
            {"tokens_per_s", p.tokens_per_s},
            {"description", p.describe()}};
  if (!p.master_weights.empty()) {
    j["master_weights"] = p.master_weights;
    j["state_dtype"] = p.state_dtype;
  }
  if (!p.invalid.empty()) j["invalid"] = p.invalid;
  return j;
}

// A line of `automoe plan`'s table: "  name ........ 12.34 GiB  what".
std::string row(const std::string& name, double bytes, const std::string& what) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "    %-32s %9s GiB  %s\n", name.c_str(), gib(bytes).c_str(),
                what.c_str());
  return buf;
}

}  // namespace

std::string RankPlan::describe() const {
  std::ostringstream o;
  o << world << (world == 1 ? " process" : " processes");
  if (world > 1) o << " (ep " << ep << " x dp " << dp << (zero > 0 ? ", ZeRO-" + std::to_string(zero) : "") << ")";
  if (!master_weights.empty()) o << ", masters " << master_weights << ", moments " << state_dtype;
  o << ", " << accumulation << (accumulation == 1 ? " micro-batch" : " micro-batches") << " of "
    << micro_batch << (micro_batch == 1 ? " row" : " rows") << " per step";
  if (checkpointing) o << ", activation checkpointing";
  return o.str();
}

RankPlan plan_rank(const ModelSpec& spec, const Recipe& rc, int64_t world, int64_t rank_memory,
                   bool cuda) {
  Config c;
  c.world = world;
  c.ep = rc.parallel.ep;
  c.zero = rc.parallel.zero;
  c.micro_batch = rc.train.micro_batch_size;
  c.accumulation = std::max<int64_t>(1, rc.train.grad_accumulation_steps / world);
  const OptimizerSection o = resolve_precision(rc, world);
  c.masters = o.master_weights;
  c.state = o.state_dtype;
  c.checkpointing = rc.train.activation_checkpointing;
  ModelFacts facts{spec, rc};
  RankPlan p = plan_config(facts, c, static_cast<double>(rank_memory), cuda);
  if (p.invalid.empty() && rc.train.grad_accumulation_steps % world != 0) {
    p.invalid = "the step's " + std::to_string(rc.train.grad_accumulation_steps) +
                " micro-batches do not split evenly over " + std::to_string(world) + " processes";
    p.fits = false;
  }
  return p;
}

Plan make_plan(const ModelSpec& spec_in, const Recipe& rc, const PlanTarget& t,
               int64_t max_suggestions) {
  ModelSpec spec = spec_in;
  spec.moe.expert_begin = spec.moe.expert_count = 0;
  const bool cuda = t.device == "cuda";
  AUTOMOE_CHECK(t.device == "cpu" || cuda, "--device: expected cpu or cuda, got \"", t.device, "\"");
  AUTOMOE_CHECK(t.nproc_per_node >= 1 && t.nnodes >= 1, "--nproc-per-node / --nnodes: at least 1");
  Plan plan;
  const Counts all = count(spec);
  plan.parameters = all.trained() + all.buffers;
  plan.active_parameters = forward_flops_per_token(spec, 1) / 2;
  plan.model = spec.model_type + ", " + human_count(plan.parameters) + " parameters (" +
               human_count(plan.active_parameters) + " active per token)";
  const double memory = local_memory(t);
  const bool bf16 = rc.model.dtype == "bfloat16";
  plan.peak_tflops = t.peak_tflops;
  plan.peak_source = t.peak_source;
  if (plan.peak_tflops <= 0) {
    plan.peak_tflops = cuda ? (bf16 ? kH100Bf16 : kH100Fp32) : 0;
    plan.peak_source = cuda ? "H100 SXM datasheet, dense" : "not measured";
  }
  plan.mfu = t.mfu > 0 ? t.mfu : cuda ? kMfuCuda : kMfuCpu;
  plan.mfu_source = t.mfu > 0 ? "given" : cuda ? "assumed: not yet measured on a GPU by this project"
                                               : "measured on cpu-medium, AVX-512-BF16";
  plan.device = std::to_string(t.world()) + " x " + t.device + " (" + gib(memory) + " GiB each)";

  plan.chosen = plan_rank(spec, rc, t.world(), static_cast<int64_t>(memory), cuda);
  if (plan.peak_tflops > 0) timing(plan.chosen, plan.peak_tflops, plan.mfu);

  // Generation: the KV cache and recurrent state per sequence, in the compute dtype.
  const double cd = bf16 ? 2 : 4;
  for (const LayerSpec& l : spec.layers) {
    if (l.mixer == MixerKind::kAttention) {
      const AttentionSpec& a = spec.attn;
      plan.kv_bytes_per_1k_tokens +=
          1000 * cd *
          (a.kind == AttentionKind::kMLA ? static_cast<double>(a.kv_lora_rank + a.qk_rope_head_dim)
                                         : static_cast<double>(a.num_kv_heads * (a.head_dim + a.v_dim())));
    } else if (l.mixer == MixerKind::kMamba2) {
      const Mamba2Spec& m = spec.mamba;
      plan.recurrent_state_bytes += 4.0 * m.num_heads * m.head_dim * m.state_size +
                                    cd * m.conv_dim() * (m.conv_kernel - 1);
    } else if (l.mixer == MixerKind::kGatedDeltaNet) {
      const GatedDeltaNetSpec& g = spec.deltanet;
      plan.recurrent_state_bytes += 4.0 * g.num_v_heads * g.head_k_dim * g.head_v_dim +
                                    cd * g.conv_dim() * (g.conv_kernel - 1);
    }
  }

  if (max_suggestions <= 0) return plan;
  // Configurations that fit: the target's ranks first, then more (whole nodes) until some fit.
  const int64_t E = std::max<int64_t>(1, spec.moe.num_experts);
  const int64_t rows = rc.train.global_batch_size;
  ModelFacts facts{spec, rc};
  std::vector<std::pair<std::string, std::string>> precisions = {{"float32", "float32"}};
  if (bf16 && !rc.peft.enabled) {
    precisions = {{"float32", "float32"}, {"remainders", "float32"}, {"remainders", "bfloat16"},
                  {"remainders", "8bit"},  {"none", "bfloat16"},      {"none", "8bit"}};
  }
  for (int64_t world = t.world(), tries = 0; tries < 12 && plan.suggestions.empty(); ++tries) {
    std::map<std::string, RankPlan> best;  // per (ep, checkpointing, micro-batch): the most exact
    std::vector<int64_t> eps;
    for (int64_t ep = 1; ep <= std::min(world, E); ++ep) {
      if (world % ep == 0 && E % ep == 0) eps.push_back(ep);
    }
    for (int64_t ep : eps) {
      for (int64_t zero : world > 1 ? std::vector<int64_t>{0, 1, 2} : std::vector<int64_t>{0}) {
        for (const auto& [masters, state] : precisions) {
          for (bool ckpt : {false, true}) {
            for (int64_t mb = rc.train.micro_batch_size; mb >= 1; mb /= 2) {
              // The global batch stays, its rows split into whole micro-batches on every rank; with
              // more ranks than it has micro-batches, it grows to one micro-batch per rank.
              if (rows % (mb * world) != 0 && rows > mb * world) continue;
              Config c{world, ep, zero, mb, std::max<int64_t>(1, rows / (mb * world)), masters, state, ckpt};
              if (rc.optimizer.in_backward && c.accumulation > 1) continue;
              RankPlan r = plan_config(facts, c, memory, cuda);
              if (!r.fits) continue;
              if (plan.peak_tflops > 0) timing(r, plan.peak_tflops, plan.mfu);
              const std::string key = std::to_string(ep) + "/" + std::to_string(ckpt) + "/" +
                                      std::to_string(mb);
              auto it = best.find(key);
              const auto rank_of = [](const RankPlan& x) {
                return std::make_tuple(precision_loss(x.master_weights, x.state_dtype), x.zero,
                                       x.peak_bytes);
              };
              if (it == best.end() || rank_of(r) < rank_of(it->second)) best[key] = r;
            }
          }
        }
      }
    }
    std::vector<RankPlan> found;
    for (auto& [k, r] : best) found.push_back(r);
    std::sort(found.begin(), found.end(), [](const RankPlan& a, const RankPlan& b) {
      // Faster first (the time model: FLOPs, checkpointing's recompute); then more exact, leaner.
      const double ta = speed(a), tb = speed(b);
      if (std::abs(ta - tb) > 1e-3 * std::max(ta, tb)) return ta > tb;
      const int pa = precision_loss(a.master_weights, a.state_dtype);
      const int pb = precision_loss(b.master_weights, b.state_dtype);
      if (pa != pb) return pa < pb;
      return a.peak_bytes < b.peak_bytes;
    });
    // Only configurations nothing listed beats on speed, exactness and memory at once.
    for (const RankPlan& r : found) {
      const bool dominated = std::any_of(plan.suggestions.begin(), plan.suggestions.end(), [&](const RankPlan& k) {
        return speed(k) >= speed(r) * (1 - 1e-3) &&
               precision_loss(k.master_weights, k.state_dtype) <= precision_loss(r.master_weights, r.state_dtype) &&
               k.peak_bytes <= r.peak_bytes * 1.02;
      });
      if (!dominated) plan.suggestions.push_back(r);
    }
    if (static_cast<int64_t>(plan.suggestions.size()) > max_suggestions) {
      plan.suggestions.resize(static_cast<size_t>(max_suggestions));
    }
    world *= 2;
  }
  return plan;
}

std::string Plan::to_json() const {
  json s = json::array();
  for (const RankPlan& r : suggestions) s.push_back(memory_json(r));
  return json{{"model", model},
              {"parameters", parameters},
              {"active_parameters", active_parameters},
              {"device", device},
              {"peak_tflops", peak_tflops},
              {"peak_source", peak_source},
              {"mfu", mfu},
              {"mfu_source", mfu_source},
              {"plan", memory_json(chosen)},
              {"suggestions", s},
              {"generation", {{"kv_cache_bytes_per_1k_tokens", kv_bytes_per_1k_tokens},
                              {"recurrent_state_bytes_per_sequence", recurrent_state_bytes}}}}
      .dump(2);
}

std::string Plan::to_text() const {
  std::ostringstream o;
  o << "model: " << model << "\n";
  o << "device: " << device << "\n";
  o << "recipe: " << chosen.describe() << "\n";
  if (!chosen.invalid.empty()) o << "  cannot run: " << chosen.invalid << "\n";
  o << "  memory per rank:\n";
  for (const MemoryItem& m : chosen.memory) o << row(m.name, m.bytes, m.what);
  o << row("peak", chosen.peak_bytes,
           "static " + gib(chosen.static_bytes) + " + the step's largest transient " +
               gib(chosen.dynamic_bytes) + " GiB (+ overhead)");
  o << "  " << (chosen.fits ? "fits" : "DOES NOT FIT") << ": " << gib(chosen.peak_bytes)
    << " GiB of " << gib(chosen.available_bytes) << " GiB per rank\n";
  char buf[320];
  std::snprintf(buf, sizeof buf, "  step: %.3g TFLOP per rank", chosen.flops_per_step / 1e12);
  o << buf;
  if (chosen.step_s > 0) {
    std::snprintf(buf, sizeof buf,
                  ", %.3g s at %.4g TFLOP/s (%s) x MFU %.2f (%s): %.0f tokens/s (%.0f per rank)",
                  chosen.step_s, peak_tflops, peak_source.c_str(), mfu, mfu_source.c_str(),
                  chosen.tokens_per_s, chosen.tokens_per_s / static_cast<double>(chosen.world));
    o << buf;
  }
  o << "\n";
  if (kv_bytes_per_1k_tokens > 0 || recurrent_state_bytes > 0) {
    std::snprintf(buf, sizeof buf, "  generation, per sequence: KV cache %.1f MiB per 1,000 tokens",
                  kv_bytes_per_1k_tokens / kMiB);
    o << buf;
    if (recurrent_state_bytes > 0) {
      std::snprintf(buf, sizeof buf, ", recurrent state %.1f MiB", recurrent_state_bytes / kMiB);
      o << buf;
    }
    o << "\n";
  }
  if (suggestions.empty()) {
    o << "no configuration searched fits (up to " << chosen.world * 2048 << " ranks)\n";
  } else {
    o << "configurations that fit, fastest first:\n";
    for (size_t i = 0; i < suggestions.size(); ++i) {
      const RankPlan& r = suggestions[i];
      std::snprintf(buf, sizeof buf, "  %zu. %s: %s GiB per rank", i + 1, r.describe().c_str(),
                    gib(r.peak_bytes).c_str());
      o << buf;
      if (r.tokens_per_s > 0) {
        std::snprintf(buf, sizeof buf, ", %.0f tokens/s", r.tokens_per_s);
        o << buf;
      }
      o << "\n";
    }
  }
  return o.str();
}

namespace {
int64_t status_field(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;  // "kB"
  }
  return 0;
}

int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return -1;
  try {
    return std::stoll(s);
  } catch (...) {
    return -1;
  }
}
}  // namespace

double weight_bytes(const ModelSpec& spec_in, int64_t ep, double bytes) {
  ModelSpec spec = spec_in;
  spec.moe.expert_begin = 0;
  spec.moe.expert_count = ep > 1 && spec.moe.num_experts % ep == 0 ? spec.moe.num_experts / ep : 0;
  const Counts n = count(spec);
  return bytes * n.trained() + 4 * n.buffers;
}

int64_t current_rss() { return status_field("VmRSS"); }
int64_t peak_rss() { return status_field("VmHWM"); }
void reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
}

int64_t available_cpu_memory() {
  if (const char* v = std::getenv("AUTOMOE_AVAILABLE_MEMORY"); v && *v) {
    char* end = nullptr;
    const double b = std::strtod(v, &end);
    AUTOMOE_CHECK(end && *end == '\0' && b >= 0, "AUTOMOE_AVAILABLE_MEMORY=\"", v,
                  "\": expected a number of bytes");
    return static_cast<int64_t>(b);
  }
  int64_t avail = -1;
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    int64_t kb = 0;
    std::string unit;
    while (in >> key >> kb) {
      std::getline(in, unit);
      if (key == "MemAvailable:") avail = kb * 1024;
    }
  }
  // The cgroup's limit less what it uses, less the page cache the kernel reclaims before it kills
  // anything (cgroup v2, then v1's memory controller), for this process's own cgroup.
  std::string v2, v1;
  {
    std::ifstream in("/proc/self/cgroup");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("0::", 0) == 0) v2 = "/sys/fs/cgroup" + line.substr(3);
      const auto colon = line.find(':');
      const auto second = line.find(':', colon + 1);
      if (colon != std::string::npos && second != std::string::npos) {
        const std::string controllers = line.substr(colon + 1, second - colon - 1);
        if (("," + controllers + ",").find(",memory,") != std::string::npos) {
          v1 = "/sys/fs/cgroup/memory" + line.substr(second + 1);
        }
      }
    }
  }
  auto stat = [](const std::string& path, const std::string& key) -> int64_t {
    std::ifstream in(path);
    std::string k;
    int64_t v = 0;
    while (in >> k >> v) {
      if (k == key) return v;
    }
    return 0;
  };
  struct Cg {
    int64_t limit, used, cache;
  };
  for (const Cg& c : {Cg{read_number(v2 + "/memory.max"), read_number(v2 + "/memory.current"),
                         stat(v2 + "/memory.stat", "file")},
                      Cg{read_number(v1 + "/memory.limit_in_bytes"),
                         read_number(v1 + "/memory.usage_in_bytes"),
                         stat(v1 + "/memory.stat", "total_cache")}}) {
    if (c.limit > 0 && c.used >= 0 && c.limit < (int64_t{1} << 60)) {
      const int64_t free = c.limit - std::max<int64_t>(0, c.used - c.cache);
      avail = avail < 0 ? free : std::min(avail, free);
    }
  }
  return std::max<int64_t>(0, avail);
}

}  // namespace automoe::train
