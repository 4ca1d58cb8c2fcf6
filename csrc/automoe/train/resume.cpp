#include "automoe/train/resume.h"

#include <iostream>

#include "automoe/core/error.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/train/run_dir.h"

namespace automoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Checkpoints past the one `latest` names are leftovers of a killed run (renamed into place,
// `latest` never moved): this run recreates them, and they must not count for keep_last.
// Past one the recipe names (resume_from), they are set aside as step-N.aside, never deleted.
void clear_later_checkpoints(const Recipe& rc, const fs::path& run, int64_t step) {
  for (const auto& e : fs::directory_iterator(run)) {
    const auto s = step_of(e.path().filename().string());
    if (!s || *s <= step) continue;
    if (rc.checkpoint.resume_from.empty()) {
      fs::remove_all(e.path());
      continue;
    }
    const fs::path aside = e.path().string() + ".aside";
    AUTOMOE_CHECK(!fs::exists(aside), "checkpoint.resume_from: cannot set ", e.path().string(),
                  " aside: ", aside.string(), " exists; move one of them away");
    fs::rename(e.path(), aside);
    std::cerr << "automoe train: note: checkpoint.resume_from: " << e.path().string()
              << " set aside as " << aside.string() << "\n";
  }
}

}  // namespace

json run_identity(const Recipe& rc, const TrainData& data, const TokenDataset& train_set,
                  bool lora) {
  // What a LoRA run's checkpoints depend on (export_merged only changes the export).
  json peft_identity = json::parse(rc.to_json()).value("peft", json(nullptr));
  if (peft_identity.is_object()) peft_identity.erase("export_merged");
  return {{"model_path", rc.model.path},
          {"train_data", data.train_key},
          {"train_documents", train_set.num_docs()},
          {"train_tokens", train_set.num_tokens()},
          {"peft", lora ? peft_identity : json(nullptr)}};
}

void check_same_kind_of_run(const json& state, const json& identity, const fs::path& run,
                            bool lora) {
  const json saved_peft = state.value("peft", json(nullptr));
  AUTOMOE_CHECK(
      saved_peft == identity["peft"], "cannot resume ", run.string(), ": its checkpoint ",
      saved_peft.is_null() ? "is a full fine-tune" : "holds LoRA adapters " + saved_peft.dump(),
      ", but the recipe asks for ",
      lora ? "LoRA " + identity["peft"].dump() : std::string("a full fine-tune"),
      "; use another checkpoint.dir, or the recipe's peft section as it was");
}

void check_same_origin(const json& saved, const json& identity, const Recipe& rc,
                       const fs::path& run, bool lora) {
  AUTOMOE_CHECK(!lora || !saved.contains("model_path") || saved["model_path"] == rc.model.path,
                "cannot resume ", run.string(), ": its LoRA adapters were trained on ",
                saved["model_path"].get<std::string>(), ", and model.path is now ", rc.model.path,
                " (the adapters only make sense on the base they were trained on); use another "
                "checkpoint.dir, or the model.path it started from");
  if (saved.contains("model_path") && saved["model_path"] != rc.model.path) {
    std::cerr << "automoe train: note: resuming a run that started from "
              << saved["model_path"].get<std::string>() << "; its weights come from the "
              << "checkpoint, config and tokenizer from " << rc.model.path << "\n";
  }
  for (const auto& key : {"train_data", "train_documents", "train_tokens"}) {
    AUTOMOE_CHECK(!saved.contains(key) || saved.at(key) == identity.at(key), "cannot resume ",
                  run.string(), ": its checkpoint was trained on other data (", key, " ",
                  saved.value(key, json()).dump(), ", now ", identity.at(key).dump(),
                  "); use another checkpoint.dir (or remove this one to start over)");
  }
}

void resume_run(const Recipe& rc, const RunPlace& place, const json& identity,
                int64_t train_documents, TrainModel& m, TrainerState& st) {
  AdamW& opt = m.ts.opt;
  const fs::path& run = place.run;
  opt.materialize();  // ZeRO-1: full tensors to load into, then this rank's slices of them
  const json saved = load_checkpoint(
      run, place.resume_name, opt, m.ts.buffers, st, m.own.begin,
      [&](const json& state) { check_same_kind_of_run(state, identity, run, m.lora); });
  opt.absorb();
  opt.release();
  if (!place.dev.is_cuda() && saved.contains("cpu_gemm") && saved["cpu_gemm"].is_string()) {
    ops::cpu::adopt_gemm_decisions(saved["cpu_gemm"].get<std::string>());
  }
  check_same_origin(saved, identity, rc, run, m.lora);
  if (place.lead) clear_later_checkpoints(rc, run, st.step);
  if (place.lead && !rc.checkpoint.resume_from.empty()) {
    write_file_atomic((run / "latest").string(), place.resume_name + "\n");
  }
  AUTOMOE_CHECK(st.pos.epoch >= 0 && st.pos.cursor >= 0 && st.pos.cursor < train_documents,
                (run / "latest").string(), ": data position (epoch ", st.pos.epoch, ", document ",
                st.pos.cursor, ") is outside the training data's ", train_documents, " documents");
  opt.publish(m.ts.model_params);
}

}  // namespace automoe::train
