// What a run knows of the text behind its token ids, from the prepare.json
// that `trainrun prepare` left beside its shards (core/data/prepare_meta.h):
//  - the tokenizer that made data.train's ids, so the end-of-run sample
//    encodes output.sample_prompt and prints text, and a copy of it in
//    output.dir, so `trainrun generate --checkpoint RUN` does too;
//  - data.val's tokens per byte of text, so val loss is also reported in
//    bits per byte: val_loss (nats/token) x tokens/byte / ln 2, the one
//    figure that compares runs of different tokenizers (a byte-level run's
//    tokens/byte is 1).
#pragma once
#include <memory>
#include <string>

#include "core/config/job_spec.h"
#include "core/data/tokenizer/tokenizer.h"

namespace trainrun {

struct DataText {
  std::unique_ptr<Tokenizer> tokenizer;  // null: byte-level or synthetic data, or no record
  std::string tokenizer_path;
  double val_tokens_per_byte = -1;       // < 0: unknown (no data.val, or no record)
};

// `need_tokenizer`: the end-of-run sample needs it (output.sample_tokens >
// 0); then a recorded tokenizer that is missing or changed since prepare is
// an error naming prepare.json and the file, before training starts. Else
// it is a warning and the run has no copy. `copy_to` (rank 0's output.dir,
// "" elsewhere): where tokenizer.json (and tokenizer_config.json) go.
DataText open_data_text(const JobSpec& job, bool need_tokenizer, const std::string& copy_to);

// val bits per byte from a val loss in nats per token; < 0 when unknown.
double bits_per_byte(double val_loss_nats, double tokens_per_byte);

}  // namespace trainrun
