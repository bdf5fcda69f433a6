// Preference pairs: the index `trainrun prepare --format preference` writes
// beside its shards, and the token source a preference objective reads.
//
// The shards hold each pair's two sequences back to back in the split's
// token stream (chosen, then rejected; each starts with the document start
// token, its mask 1 on the response's tokens only). `<split>.pairs`
// (train.pairs, val.pairs) says where: a header {"TRPAIRS1", uint64 pair
// count} and per pair three little-endian int64 {stream offset of the
// chosen side, chosen tokens, rejected tokens}; the rejected side starts at
// offset + chosen tokens.
#pragma once
#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/data/dataset.h"

namespace trainrun {

// Streams pair records to `<final>.tmp.<pid>`; commit() renames it into
// place, the destructor removes an uncommitted one (prepare's atomicity).
class PairIndexWriter {
 public:
  explicit PairIndexWriter(std::string final_path);
  ~PairIndexWriter();
  PairIndexWriter(const PairIndexWriter&) = delete;
  PairIndexWriter& operator=(const PairIndexWriter&) = delete;
  void add(const std::array<int64_t, 3>& rec);  // {offset, chosen, rejected}
  void commit();
  int64_t pairs() const { return count_; }

 private:
  std::string final_, tmp_;
  std::FILE* f_ = nullptr;
  int64_t count_ = 0;
};

// The pairs of `path`; every record is checked against the stream's
// `stream_tokens` (an error names the file and the pair).
std::vector<std::array<int64_t, 3>> read_pair_index(const std::string& path, int64_t stream_tokens);

// A token source over preference pairs, sample = one row of T tokens:
//  - unpacked (data.document_mask off): row 2p is pair p's chosen side,
//    row 2p + 1 its rejected side, each from position 0, padded;
//  - packed (data.document_mask on): row p holds both sides, chosen then
//    rejected, which the document mask keeps apart (the rejected side
//    starts with the separator: its own document, positions from 0).
// A micro-batch of B rows (B even when unpacked) thus holds whole pairs:
// both sides land in the same micro-batch on the same rank. Padding is
// token 0 with target -1. Sequence k of a micro-batch is its pair k / 2's
// chosen (k even) or rejected (k odd) side.
class PreferenceSource final : public TokenSource {
 public:
  PreferenceSource(std::unique_ptr<TokenSource> stream, std::vector<std::array<int64_t, 3>> pairs, bool packed,
                   int seq_len, std::string key);
  int64_t num_samples(int T) const override;
  void read_samples(int64_t first, int B, int T, int32_t* inputs, int32_t* targets) const override;
  int vocab_bound() const override { return stream_->vocab_bound(); }
  std::string describe() const override;
  int64_t num_tokens() const override { return stream_->num_tokens(); }
  bool has_mask() const override { return true; }
  int64_t count_targets(int64_t first, int B, int T) const override;

  bool packed() const { return packed_; }
  int64_t num_pairs() const { return int64_t(pairs_.size()); }
  int rows_per_pair() const { return packed_ ? 1 : 2; }
  // For rows [first, first + B): seq (B*T) = the micro-batch's sequence
  // index (0 .. 2 * pairs - 1) of each target in the loss, else -1; pair_ids
  // (2 * pairs / 2 = pairs entries) = each of its pairs' global index.
  void read_segments(int64_t first, int B, int T, int32_t* seq, int64_t* pair_ids) const;
  // The targets of the chosen sides among rows [first, first + B) (ORPO's
  // NLL term is their mean over the global batch).
  int64_t count_chosen_targets(int64_t first, int B, int T) const;

 private:
  // Pair p's side s: tokens and 0/1 mask.
  void side(int64_t p, int s, std::vector<int32_t>& tok, std::vector<uint8_t>& mask) const;
  int64_t pair_of_row(int64_t row) const;
  std::unique_ptr<TokenSource> stream_;
  std::vector<std::array<int64_t, 3>> pairs_;
  bool packed_;
  std::string key_;
};

// data.train / data.val as preference pairs: the shards (`pattern`) and
// the .pairs file of their split beside them (prepare.json must say
// format preference). Refuses a pair longer than a row (model.seq_len + 1
// tokens per side, or both sides together when packed), naming it.
std::unique_ptr<PreferenceSource> open_preference_source(const JobSpec& job, const std::string& pattern,
                                                         const std::string& key);
// True when the directory of `pattern` holds a prepare.json of format
// preference (an sft job on it would train on the rejected answers too).
bool is_preference_data(const std::string& pattern);

}  // namespace trainrun
