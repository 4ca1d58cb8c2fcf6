#include "automoe/train/inputs.h"

#include "automoe/core/error.h"
#include "automoe/train/flops.h"

namespace automoe::train {

TrainInputs open_inputs(const Recipe& rc, const TrainData& data, const ModelSpec& spec) {
  TrainInputs in;
  in.train_set = std::make_unique<TokenDataset>(data.train);
  const TokenDataset& train_set = *in.train_set;
  const int64_t max_tok = train_set.max_token();
  AUTOMOE_CHECK(max_tok < spec.vocab_size, data.train, ": token id ", max_tok,
                " is outside the model's vocabulary (", spec.vocab_size,
                "): was the data tokenised with another tokenizer?");
  // Cutting documents at data.seq_len: said on the console; a dataset left without a single loss
  // token is refused (it would train nothing and export the model unchanged).
  in.cut = truncation_at(train_set, rc.data.seq_len);
  const Truncation& cut = in.cut;
  AUTOMOE_CHECK(cut.documents_without_loss < train_set.num_docs(), data.train, ": none of its ",
                train_set.num_docs(),
                " documents has a token to learn within "
                "data.seq_len = ",
                rc.data.seq_len, " tokens (", cut.documents_cut_to_no_loss,
                " have them only past that length: their prompts are longer); raise data.seq_len "
                "or shorten the prompts");
  const int64_t pad = spec.pad_token_id >= 0 ? spec.pad_token_id : 0;
  in.batcher = std::make_unique<Batcher>(train_set, rc.train.micro_batch_size, rc.data.seq_len,
                                         rc.data.packing, rc.data.shuffle, rc.train.seed, pad);
  {
    // A step larger than the data itself repeats documents within the step: a typo, not a plan.
    const int64_t rows_per_epoch =
        Batcher(train_set, 1, rc.data.seq_len, rc.data.packing, false, 0, pad).count_until({}, 1.0);
    AUTOMOE_CHECK(rc.train.global_batch_size <= rows_per_epoch,
                  "train.global_batch_size: a step of ", rc.train.global_batch_size, " rows (",
                  rc.train.micro_batch_size, " x ", rc.train.grad_accumulation_steps,
                  ") is more than the ", rows_per_epoch, " rows of data.seq_len tokens that ",
                  data.train, " holds: every step would repeat documents; use at most ",
                  rows_per_epoch);
  }
  if (!data.validation.empty()) {
    in.val_set = std::make_unique<TokenDataset>(data.validation);
    AUTOMOE_CHECK(in.val_set->max_token() < spec.vocab_size, data.validation,
                  ": token ids outside the model's vocabulary");
    in.val_batches = Batcher(*in.val_set, rc.train.micro_batch_size, rc.data.seq_len,
                             rc.data.packing, false, 0, pad)
                         .all_in_order();
  }
  const int64_t accum = rc.train.grad_accumulation_steps;
  in.total_steps = rc.train.max_steps > 0
                       ? rc.train.max_steps
                       : (in.batcher->count_until({}, rc.train.epochs) + accum - 1) / accum;
  return in;
}

StepPlan plan_step(const Batcher& batcher, DataPosition& pos, int64_t accum, int64_t world_size,
                   int64_t rank, const ModelSpec& spec) {
  StepPlan p;
  p.start = pos;
  for (int64_t i = 0; i < accum; ++i) {
    const MicroBatch c = batcher.next(pos, /*tensors=*/false);
    p.loss_tokens += static_cast<double>(c.loss_tokens);
    p.truncated += c.truncated;
    if (c.loss_tokens > 0) {
      p.tokens += static_cast<double>(c.real_tokens);
      p.flops += static_cast<double>(c.real_tokens) * training_flops_per_token(spec, c.length);
    }
    if (i % world_size == rank) p.mine.push_back(i);
  }
  return p;
}

MicroBatch StepBatches::get(int64_t i) {
  for (; index_ < i; ++index_) batcher_.next(cursor_, /*tensors=*/false);
  ++index_;
  return batcher_.next(cursor_);
}

}  // namespace automoe::train
