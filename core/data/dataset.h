// Token sources and the global sample cursor.
//
// A dataset is one virtual stream of tokens (the concatenation of all shards
// in sorted path order). Sample s is the window of T+1 tokens starting at
// token s*T: inputs are the first T, targets the last T. A global batch is
// `global_batch_size` consecutive samples starting at the cursor; rank r of
// W reading micro-batch m of M takes samples [cursor + (m*W + r)*B, +B).
// The cursor (a sample index, wrapping at the end of an epoch) is the only
// data state a checkpoint needs to store.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Number of distinct samples of length T+1 (stride T) in one epoch.
  virtual int64_t num_samples(int T) const = 0;
  // Write B samples starting at global sample index `first` (wrapping modulo
  // num_samples) into inputs (B*T) and targets (B*T) as int32 token ids.
  virtual void read_samples(int64_t first, int B, int T, int32_t* inputs, int32_t* targets) const = 0;
  // Largest token id + 1 this source can produce (checked against vocab).
  virtual int vocab_bound() const = 0;
  // Human-readable description for the log ("3 llm.c shards, 1.2M tokens").
  virtual std::string describe() const = 0;
  // Exact entropy rate in nats/token if known (synthetic sources), else < 0.
  virtual double entropy_floor() const { return -1.0; }
  // Tokens in one epoch of the stream, or -1 when unbounded (synthetic).
  virtual int64_t num_tokens() const { return -1; }
  // True when the source carries a loss mask (prepare's chat formats):
  // read_samples then writes -1 for every masked target (ignored by the loss).
  virtual bool has_mask() const { return false; }
  // The number of targets in the loss among samples [first, first + B)
  // (B*T without a mask). The trainer divides the step's loss by this count
  // over the whole global batch, so every rank computes the same scale.
  virtual int64_t count_targets(int64_t first, int B, int T) const { return int64_t(B) * T; }
  // Tokens [pos, pos + n) of the stream and, when `mask` is not null, their
  // mask bytes (1 = a target in the loss; all 1 without a mask), for
  // readers that cut their own sequences (preference pairs). Token files
  // have it; the default fails naming describe().
  virtual void read_span(int64_t pos, int64_t n, int32_t* tokens, uint8_t* mask) const;
};

// Fails with "<key>: the data (<describe()>) holds N tokens, fewer than
// model.seq_len + 1 = T+1; ..." when the source cannot yield one sample of seq_len + 1 tokens
// (i.e. num_samples(seq_len) == 0). open_train_source / open_val_source call it.
void check_source_length(const TokenSource& src, int seq_len, const std::string& key);

// Memory-mapped token files. `pattern` is a path or a glob; `format` is
// llmc | raw_uint16 | raw_uint32. `key` (e.g. "data.train") is named in errors.
// Checks headers, sizes and (unless vocab_size <= 0) that every token id is < vocab_size.
std::unique_ptr<TokenSource> open_token_files(const std::string& pattern, const std::string& format,
                                              int vocab_size, const std::string& key);

// Seeded random first-order Markov chain over V tokens. Each sample starts
// from a state drawn from the stationary distribution, so every target token
// has conditional entropy exactly H (the entropy rate), reported by entropy_floor().
// `split` (0 train, 1 val) selects an independent sample stream.
std::unique_ptr<TokenSource> make_synthetic_source(const SyntheticSpec& spec, int vocab_size, int split);

// Build the train / val sources of a job (val may be null when data.val is empty
// and the format is not synthetic).
std::unique_ptr<TokenSource> open_train_source(const JobSpec& job);
std::unique_ptr<TokenSource> open_val_source(const JobSpec& job);

// `trainrun prepare`: text into llm.c shards `train_000000.bin`... and
// `val_000000.bin` in output_dir (format: docs/data-format.md).
//  - without a tokenizer: byte-level (vocab 256, uint16); the last
//    val_fraction of each input's bytes go to val;
//  - with an HF tokenizer.json: its byte-level BPE, documents separated by
//    its BOS (or <|endoftext|>), uint16 shards when the vocab fits, else
//    v7 uint32; for the chat formats a loss mask `train_000000.mask` (one
//    uint8 per token, 1 = a target in the loss) beside each shard.
// Returns a one-line summary.
struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_dir;
  double val_fraction = 0.01;
  int64_t shard_tokens = 100'000'000;  // tokens per shard file
  std::string tokenizer;               // tokenizer.json; empty = byte-level
  std::string format = "text";         // text | jsonl | chat | alpaca | sharegpt
  std::string text_field = "text";     // jsonl: the field holding the document
  int seq_len = 0;                     // > 0: each split must hold seq_len + 1 tokens; longer documents counted
  int threads = 0;                     // encoding threads; 0 = all cores
  std::string chat_template;           // llama3 | chatml | plain | NAME | FILE; empty = the model's (core/data/chat_template.h)
  bool train_on_input = false;         // chat formats: every token in the loss, not only the replies
  bool allow_special = false;          // match special tokens spelled in the text (HF's default); off = text is data
  std::string document_separator;      // text: a line holding only this ends a document (fortunes: "%"); empty = off
  bool progress = true;                // the MB/s + ETA line on stderr
};
std::string prepare_byte_shards(const PrepareOptions& opts);
std::string prepare_tokenized_shards(const PrepareOptions& opts);
// Either of the two, by opts.tokenizer; refuses options the byte path lacks.
std::string prepare_shards(const PrepareOptions& opts);

// Write an llm.c shard (used by prepare and by tests). version 1 = uint16, 7 = uint32.
void write_llmc_shard(const std::string& path, const std::vector<uint32_t>& tokens, int version);

}  // namespace trainrun
