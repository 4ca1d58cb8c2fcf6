#include "automoe/train/export.h"

#include <filesystem>
#include <map>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/core/log.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/lora.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;

// The adapters as trained (their float32 masters) as PEFT's adapter directory, which PEFT loads
// onto Transformers' model of model.path; on request also the merged model. Under expert
// parallelism the routed experts' adapters are gathered over the EP group (bitwise: the files are
// the one-process export's), every replica holding the same adapters; rank 0 writes. The merged
// model is written collectively, each rank merging its own experts' rows.
Exported export_adapters(const Recipe& rc, const RunPlace& place, TrainModel& m,
                         const parallel::World& world, c10::ScalarType export_dtype,
                         ExpertsLayout layout) {
  const AdamW& opt = m.ts.opt;
  const bool sharded = m.mesh.ep > 1;
  std::vector<LoraSite> trained = m.lora_sites, whole;
  for (auto& site : trained) {
    for (size_t i = 0; i < opt.names.size(); ++i) {
      if (opt.names[i] == site.a_name()) site.a = opt.master[i];
      if (opt.names[i] == site.b_name()) site.b = opt.master[i];
    }
  }
  for (const auto& site : trained) {  // (one site's whole adapters at a time, kept by rank 0 only)
    LoraSite w = site;
    if (sharded && site.experts) {
      w.a = parallel::all_gather_rows(world.ep, site.a, "LoRA export (experts' adapters)");
      w.b = parallel::all_gather_rows(world.ep, site.b, "LoRA export (experts' adapters)");
      w.experts_count = w.a.size(0);
    }
    if (!place.lead) continue;
    w.a = w.a.cpu();
    w.b = w.b.cpu();
    whole.push_back(std::move(w));
  }
  const c10::ScalarType adapter_dtype =
      rc.checkpoint.export_dtype == "auto" ? at::kFloat : export_dtype;
  std::string error;  // (a failed write on rank 0 fails the export on every rank)
  if (place.lead) {
    try {
      write_peft_adapter((place.run / "export").string(), m.lora_config, whole,
                         fs::absolute(rc.model.path).lexically_normal().string(), adapter_dtype);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (place.dist) {
    parallel::agree(world.world, error, world.device, "LoRA export");
  } else if (!error.empty()) {
    throw Error(error);
  }
  whole.clear();
  Exported out{{{"export", (place.run / "export").string()}},
               (place.run / "export").string() + " (PEFT adapter)"};
  if (!rc.peft.export_merged) return place.lead ? out : Exported{};
  if (m.decoder().has_quantized() && place.lead) {
    log_info("export-merged: the base's experts were held ",
             rc.model.quantize != "none" ? rc.model.quantize : m.spec().bnb_quantized,
             ": the merged model's experts are their dequantised values plus the adapters' "
             "product, in ", dtype_to_name(export_dtype), " (not the original checkpoint's weights; "
             "PEFT's merge into a quantised base rounds likewise)");
  }
  // Each weight merged where it lives: dense ones by rank 0, experts' rows by the ranks of
  // replica 0 (the others pass their shapes only: write_pretrained).
  std::map<int64_t, const LoraSite*> by_slot;
  for (const auto& site : trained) by_slot[site.slot] = &site;
  NamedTensors merged;
  const auto& params = m.decoder().named_parameters();
  const auto& trainable = m.decoder().trainable();
  const std::vector<ParamDecl> decls = parameter_layout(m.spec());
  error.clear();
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, t] = params[i];
      const c10::ScalarType dt = trainable[i] ? export_dtype : t.scalar_type();
      const bool writes = decls[i].routed_expert && sharded ? world.dp_rank() == 0 : place.lead;
      if (!writes) {
        merged.emplace_back(name, at::empty(t.sizes(), at::TensorOptions().dtype(dt).device(at::kMeta)));
        continue;
      }
      const auto it = by_slot.find(static_cast<int64_t>(i));
      // A quantised base's weight merges dequantised (bitsandbytes' values, then + ΔW).
      const at::Tensor base = m.decoder().dense(static_cast<int64_t>(i));
      merged.emplace_back(name, it != by_slot.end() ? merge_lora(*it->second, base, export_dtype).cpu()
                                                    : base.detach().to(at::kCPU, dt));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (place.dist) {
    parallel::agree(world.world, error, world.device, "merged export");
  } else if (!error.empty()) {
    throw Error(error);
  }
  write_pretrained(m.pm.config, layout, m.pm.source_dir, m.spec(), merged,
                   (place.run / "export-merged").string(), SaveOptions{},
                   place.dist ? &world : nullptr);
  if (!place.lead) return {};
  out.fields["export_merged"] = (place.run / "export-merged").string();
  out.where += " and " + (place.run / "export-merged").string() + " (merged Hugging Face model)";
  return out;
}

// In parameter_layout order: the trained weights, the buffers as they are (float32). Under
// expert parallelism the export is collective: each rank of replica 0 writes its experts' rows
// into the shard files and rank 0 the dense tensors (the others pass only their shapes).
Exported export_model(const RunPlace& place, TrainModel& m, const parallel::World& world,
                      c10::ScalarType export_dtype, ExpertsLayout layout) {
  AdamW& opt = m.ts.opt;
  NamedTensors exported;
  opt.materialize();
  std::string error;  // (a copy failing on one rank fails the export on every rank)
  try {
    const bool writes_experts = world.dp_rank() == 0;
    auto mine = [&](const at::Tensor& t, bool expert, c10::ScalarType dt) {
      if (expert ? writes_experts : place.lead) return t.detach().to(at::kCPU, dt);
      return at::empty(t.sizes(), at::TensorOptions().dtype(dt).device(at::kMeta));
    };
    size_t next_param = 0, next_buffer = 0;
    for (const bool trainable : m.decoder().trainable()) {
      if (trainable) {
        const size_t i = next_param++;
        // (bf16 masters exported as bf16: the weights as trained, no copy; otherwise the float32
        // master, rebuilt from its remainder where it has one)
        const at::Tensor w =
            opt.master[i].scalar_type() == export_dtype ? opt.master[i] : opt.master_f32(i);
        exported.emplace_back(opt.names[i], mine(w, opt.expert[i], export_dtype));
      } else {
        const auto& [name, t] = m.ts.buffers[next_buffer++];
        exported.emplace_back(name, mine(t, false, t.scalar_type()));
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  opt.release();
  if (place.dist) {
    parallel::agree(world.world, error, world.device, "export");
  } else if (!error.empty()) {
    throw Error(error);
  }
  write_pretrained(m.pm.config, layout, m.pm.source_dir, m.spec(), exported,
                   (place.run / "export").string(), SaveOptions{}, place.dist ? &world : nullptr);
  const std::string dir = (place.run / "export").string();
  return {{{"export", dir}}, "Hugging Face model in " + dir};
}

}  // namespace

Exported export_run(const Recipe& rc, const RunPlace& place, TrainModel& m,
                    const parallel::World& world) {
  // A Hugging Face directory in the checkpoint's dtype (or the one asked for).
  const c10::ScalarType export_dtype =
      rc.checkpoint.export_dtype == "auto"
          ? m.stored
          : dtype_from_name(rc.checkpoint.export_dtype, "checkpoint.export_dtype");
  ExpertsLayout layout = m.pm.layout;
  if (rc.checkpoint.export_layout == "per-expert") layout = ExpertsLayout::kPerExpert;
  if (rc.checkpoint.export_layout == "fused") layout = ExpertsLayout::kFused;
  if (m.lora) return export_adapters(rc, place, m, world, export_dtype, layout);
  return export_model(place, m, world, export_dtype, layout);
}

}  // namespace automoe::train
