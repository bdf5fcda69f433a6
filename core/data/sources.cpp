// A job's train / val sources, chosen from data.format.
#include "core/common/error.h"
#include "core/data/dataset.h"
#include "core/data/preference_pairs.h"

namespace trainrun {

void TokenSource::read_span(int64_t, int64_t, int32_t*, uint8_t*) const {
  TR_FAIL("data: ", describe(), " cannot be read by token offset (only token files can: prepare's shards)");
}

void check_source_length(const TokenSource& src, int seq_len, const std::string& key) {
  TR_CHECK(seq_len > 0, "model.seq_len: must be positive, got ", seq_len);
  if (src.num_samples(seq_len) > 0) return;
  TR_FAIL(key, ": the data (", src.describe(), ") holds ", src.num_tokens(),
          " tokens, fewer than model.seq_len + 1 = ", static_cast<int64_t>(seq_len) + 1,
          " (one sample is seq_len inputs plus the next token); add data or lower model.seq_len");
}

namespace {
std::unique_ptr<TokenSource> open_files(const JobSpec& job, const std::string& pattern, const std::string& key) {
  auto src = open_token_files(pattern, job.data.format, job.model.vocab_size, key);
  check_source_length(*src, job.model.seq_len, key);
  return src;
}
}  // namespace

std::unique_ptr<TokenSource> open_train_source(const JobSpec& job) {
  if (job.data.format == "synthetic") return make_synthetic_source(job.data.synthetic, job.model.vocab_size, 0);
  if (job.data.train.empty())
    TR_FAIL("data.train: not set; set it to a token file or glob (e.g. data/train_*.bin, made by `trainrun prepare`) "
            "or use data.format: synthetic");
  // Preference pairs are read pair by pair (core/data/preference_pairs.h);
  // an sft job on them would train on the rejected answers too.
  if (job.train.objective != "sft") return open_preference_source(job, job.data.train, "data.train");
  if (is_preference_data(job.data.train))
    TR_FAIL("data.train: '", job.data.train, "' holds preference pairs (prepare --format preference) and "
            "train.objective is sft, which would train on the rejected responses too; set train.objective: dpo, "
            "ipo or orpo, or prepare the chosen conversations with --format chat");
  return open_files(job, job.data.train, "data.train");
}

std::unique_ptr<TokenSource> open_val_source(const JobSpec& job) {
  if (job.data.format == "synthetic") return make_synthetic_source(job.data.synthetic, job.model.vocab_size, 1);
  if (job.data.val.empty()) return nullptr;
  return open_files(job, job.data.val, "data.val");
}

}  // namespace trainrun
