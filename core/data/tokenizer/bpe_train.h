// Training a byte-level BPE tokenizer (`trainrun tokenizer train`): the
// merges HF tokenizers' BpeTrainer learns with the ByteLevel alphabet, from
// text streamed through the same pre-tokenizer regexes the encoder uses.
//
// The two stages:
//   1. count_words: every input is read in blocks (text: cut where the
//      pre-tokenizer's splits cannot change, see Tokenizer::can_cut_before_line;
//      jsonl: at line ends), each block pre-tokenized and its words counted
//      by a pool of threads, each into its own table; the tables are merged
//      at the end. Memory: threads x (2 x block_bytes + the longest stretch of
//      text without a cut point) for text, plus the distinct words (each once
//      per thread that saw it, ~ its length + 32 bytes): the size of the input
//      costs time, not memory.
//   2. train_bpe: the merge loop, as BpeTrainer (tokenizers 0.19) runs it:
//        ids 0.. are the special tokens, then the 256 byte symbols in code
//        point order of their ByteLevel characters, then one id per merge;
//        each step merges the pair of the highest count over all words
//        (count x the word's frequency); among equal counts, the pair of the
//        smallest (left id, right id); the loop stops at vocab_size tokens,
//        when no pair is left, or when the best count is below
//        min_frequency. Occurrences are merged left to right without
//        overlap ("a a a" -> "aa a").
//      Like BpeTrainer, the count of a pair just merged is not lowered, so a
//      pair that was queued twice (which happens only when a merge rebuilds
//      a token that already exists, e.g. "ab"+"c" and "a"+"bc") is merged
//      again and listed again; the merge list keeps its last place, as HF's
//      merge map does. Where HF's second merge covers the words its second
//      queue entry listed (an order Rust's heap decides), this one covers
//      every word the pair was seen in at once: the merges equal HF's except
//      in that rare case, and then the encoded ids still do (the same pairs
//      merge, in an order that only differs between merges of equal count).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace trainrun {

struct BpeTrainOptions {
  std::vector<std::string> inputs;     // files or directories (walked, sorted; binary files skipped)
  std::string format = "text";         // text: one document per file; jsonl: one per line
  std::string text_field = "text";     // jsonl: the field holding the document
  std::string pre_tokenizer = "llama3";  // llama3 | gpt2: the split regex (byte-level after it)
  std::vector<std::string> special_tokens;  // ids 0.. in this order; never split into merges
  uint32_t vocab_size = 0;             // specials + 256 bytes + merges
  uint64_t min_frequency = 0;          // a pair seen fewer times is never merged
  int threads = 0;                     // 0: every core
  bool progress = true;                // a progress line on stderr
  size_t block_bytes = 4 << 20;        // text read per block (tests make it small to cut often)
};

// Pre-tokenized words (raw bytes) and how often each occurs, sorted by word.
struct WordCounts {
  std::vector<std::pair<std::string, uint64_t>> words;
  uint64_t total_words = 0;  // occurrences
  uint64_t bytes = 0;        // input text read
  int documents = 0;
};

struct BpeModel {
  std::vector<std::string> vocab;  // (V) id -> token: specials as given, others in ByteLevel characters
  std::vector<std::pair<uint32_t, uint32_t>> merges;  // in rank order, duplicates removed (last kept)
  size_t n_special = 0;
};

WordCounts count_words(const BpeTrainOptions& opt);
BpeModel train_bpe(const WordCounts& wc, const BpeTrainOptions& opt);

// The regex of a pre_tokenizer name (the error names --pre-tokenizer).
const char* bpe_pre_tokenizer_pattern(const std::string& name);
// tokenizer.json and tokenizer_config.json (a chat template when the
// special tokens hold Llama 3's or ChatML's) in `dir`, written atomically.
void write_bpe_tokenizer(const BpeModel& m, const BpeTrainOptions& opt, const std::string& dir);

// count_words -> train_bpe -> write_bpe_tokenizer; returns a one-line summary.
std::string train_tokenizer(const BpeTrainOptions& opt, const std::string& output_dir);

}  // namespace trainrun
