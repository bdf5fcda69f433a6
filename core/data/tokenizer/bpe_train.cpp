// Stage 2 of `trainrun tokenizer train` (the rules are in bpe_train.h): the
// merge loop over the counted words, and the tokenizer.json it becomes.
//
// Data layout: every distinct word is a run of symbol ids in one flat array
// (shrinking in place as merges join symbols); a pair (left, right) is one
// uint64 key; its count and the words it was seen in sit in a flat table.
// A max-heap holds (count, pair) entries that may be stale: a popped entry
// whose count is no longer the pair's is pushed back with the current one
// (counts only fall, except for pairs just formed, which are pushed fresh),
// so the first entry popped with its pair's current count is the best pair.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/chat/builtin_templates.h"
#include "core/data/prepare_common.h"
#include "core/data/tokenizer/bpe_train.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

namespace {

namespace fs = std::filesystem;

uint64_t pair_key(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

// pair -> index into the per-pair arrays; open addressing, never shrinks.
class PairIndex {
 public:
  PairIndex() { slots_.assign(1 << 16, kEmpty); keys_.assign(1 << 16, 0); }
  // The pair's index, inserting it as `next` when new.
  uint32_t find_or_add(uint64_t key, uint32_t next, bool& added) {
    if ((count_ + 1) * 2 > slots_.size()) grow();
    for (size_t i = hash(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i] == kEmpty) {
        slots_[i] = next;
        keys_[i] = key;
        ++count_;
        added = true;
        return next;
      }
      if (keys_[i] == key) {
        added = false;
        return slots_[i];
      }
    }
  }

 private:
  static constexpr uint32_t kEmpty = ~0u;
  static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 20); }
  void grow() {
    std::vector<uint32_t> old_slots(slots_.size() * 2, kEmpty);
    std::vector<uint64_t> old_keys(keys_.size() * 2, 0);
    old_slots.swap(slots_);
    old_keys.swap(keys_);
    for (size_t j = 0; j < old_slots.size(); ++j) {
      if (old_slots[j] == kEmpty) continue;
      for (size_t i = hash(old_keys[j]) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1))
        if (slots_[i] == kEmpty) {
          slots_[i] = old_slots[j];
          keys_[i] = old_keys[j];
          break;
        }
    }
  }
  std::vector<uint32_t> slots_;
  std::vector<uint64_t> keys_;
  size_t count_ = 0;
};

struct QueueEntry {
  int64_t count;
  uint64_t pair;
  // std::priority_queue pops the largest: the highest count, then the smallest pair.
  bool operator<(const QueueEntry& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

class MergeLoop {
 public:
  MergeLoop(const WordCounts& wc, const std::array<uint32_t, 256>& byte_id) {
    size_t total = 0;
    for (const auto& w : wc.words) total += w.first.size();
    syms_.reserve(total);
    start_.reserve(wc.words.size());
    for (const auto& [word, n] : wc.words) {
      start_.push_back(syms_.size());
      len_.push_back(static_cast<uint32_t>(word.size()));
      freq_.push_back(static_cast<int64_t>(n));
      for (unsigned char c : word) syms_.push_back(byte_id[c]);
    }
    for (uint32_t w = 0; w < start_.size(); ++w) {
      const uint32_t* s = &syms_[start_[w]];
      for (uint32_t i = 0; i + 1 < len_[w]; ++i) {
        const uint32_t p = pair_of(pair_key(s[i], s[i + 1]));
        count_[p] += freq_[w];
        note_word(p, w);
      }
    }
    for (uint32_t p = 0; p < keys_.size(); ++p)
      if (count_[p] > 0) queue_.push({count_[p], keys_[p]});
  }

  // The next pair to merge, or false when none is left (or the best is
  // below min_frequency).
  bool pop_best(uint64_t min_frequency, uint64_t& pair) {
    while (!queue_.empty()) {
      QueueEntry top = queue_.top();
      queue_.pop();
      const int64_t now = count_[pair_of(top.pair)];
      if (top.count != now) {
        top.count = now;
        queue_.push(top);
        continue;
      }
      if (top.count < 1 || static_cast<int64_t>(min_frequency) > top.count) return false;
      pair = top.pair;
      return true;
    }
    return false;
  }

  // Replaces every occurrence of `pair` by `merged` in the words it was seen
  // in, updates the counts of the pairs around each, and queues the pairs
  // that gained occurrences.
  void merge(uint64_t pair, uint32_t merged) {
    const uint32_t p = pair_of(pair);
    std::vector<uint32_t> words;
    words.swap(where_[p]);
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    const uint32_t a = static_cast<uint32_t>(pair >> 32), b = static_cast<uint32_t>(pair);
    ++step_;
    touched_.clear();
    for (uint32_t w : words) merge_word(w, a, b, merged);
    for (uint32_t q : touched_)
      if (count_[q] > 0) queue_.push({count_[q], keys_[q]});
  }

 private:
  uint32_t pair_of(uint64_t key) {
    bool added = false;
    const uint32_t p = index_.find_or_add(key, static_cast<uint32_t>(keys_.size()), added);
    if (added) {
      keys_.push_back(key);
      count_.push_back(0);
      where_.emplace_back();
      stamp_.push_back(0);
    }
    return p;
  }
  void note_word(uint32_t p, uint32_t w) {
    auto& v = where_[p];
    if (v.empty() || v.back() != w) v.push_back(w);
  }
  void change(uint32_t left, uint32_t right, int sign, uint32_t w) {
    const uint32_t p = pair_of(pair_key(left, right));
    count_[p] += sign * freq_[w];
    if (sign > 0) {
      note_word(p, w);
      if (stamp_[p] != step_) {
        stamp_[p] = step_;
        touched_.push_back(p);
      }
    }
  }
  // Left to right, without overlap: "a a a" -> "ab a" for (a, a).
  void merge_word(uint32_t w, uint32_t a, uint32_t b, uint32_t merged) {
    uint32_t* s = &syms_[start_[w]];
    const uint32_t n = len_[w];
    uint32_t out = 0;
    for (uint32_t r = 0; r < n;) {
      if (r + 1 < n && s[r] == a && s[r + 1] == b) {
        if (out > 0) {
          change(s[out - 1], a, -1, w);
          change(s[out - 1], merged, +1, w);
        }
        if (r + 2 < n) {
          change(b, s[r + 2], -1, w);
          change(merged, s[r + 2], +1, w);
        }
        s[out++] = merged;
        r += 2;
      } else {
        s[out++] = s[r++];
      }
    }
    len_[w] = out;
  }

  std::vector<uint32_t> syms_;   // every word's symbols, word after word
  std::vector<size_t> start_;    // (words) first symbol
  std::vector<uint32_t> len_;    // (words) symbols left
  std::vector<int64_t> freq_;    // (words) occurrences in the input
  PairIndex index_;
  std::vector<uint64_t> keys_;   // (pairs) the pair
  std::vector<int64_t> count_;   // (pairs) occurrences over all words
  std::vector<std::vector<uint32_t>> where_;  // (pairs) words it was seen in since its last merge
  std::vector<uint32_t> stamp_;  // (pairs) the merge step that last queued it
  std::vector<uint32_t> touched_;
  uint32_t step_ = 0;
  std::priority_queue<QueueEntry> queue_;
};

std::string bytes_to_symbols(std::string_view raw) {
  std::string out;
  for (unsigned char c : raw) append_utf8(byte_to_codepoint()[c], out);
  return out;
}

}  // namespace

BpeModel train_bpe(const WordCounts& wc, const BpeTrainOptions& opt) {
  BpeModel m;
  std::unordered_map<std::string, uint32_t> ids;
  auto add = [&](const std::string& tok) {
    auto [it, fresh] = ids.emplace(tok, static_cast<uint32_t>(m.vocab.size()));
    if (fresh) m.vocab.push_back(tok);
    return it->second;
  };
  for (const auto& s : opt.special_tokens) {
    TR_CHECK(!s.empty(), "--special-tokens: an empty token; give each special token its text");
    add(s);
  }
  m.n_special = m.vocab.size();
  // The alphabet in code point order of the ByteLevel characters.
  std::array<int, 256> bytes{};
  for (int b = 0; b < 256; ++b) bytes[b] = b;
  std::sort(bytes.begin(), bytes.end(),
            [](int x, int y) { return byte_to_codepoint()[x] < byte_to_codepoint()[y]; });
  std::array<uint32_t, 256> byte_id{};
  for (int b : bytes) byte_id[b] = add(bytes_to_symbols(std::string(1, static_cast<char>(b))));
  TR_CHECK(opt.vocab_size >= m.vocab.size(), "--vocab-size: ", opt.vocab_size, " is smaller than the 256-byte alphabet",
           m.n_special ? " + " + std::to_string(m.n_special) + " special token(s)" : std::string(), " (",
           m.vocab.size(), "); ask for at least ", m.vocab.size());

  MergeLoop loop(wc, byte_id);
  std::vector<uint64_t> merges;
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  uint64_t pair = 0;
  while (m.vocab.size() < opt.vocab_size && loop.pop_best(opt.min_frequency, pair)) {
    const uint32_t a = static_cast<uint32_t>(pair >> 32), b = static_cast<uint32_t>(pair);
    const uint32_t merged = add(m.vocab[a] + m.vocab[b]);
    merges.push_back(pair);
    loop.merge(pair, merged);
    if (opt.progress) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last > std::chrono::milliseconds(500)) {
        last = now;
        std::fprintf(stderr, "\rtokenizer train: merges: %zu / %zu tokens, %.1f s   ", m.vocab.size(),
                     size_t(opt.vocab_size), std::chrono::duration<double>(now - t0).count());
      }
    }
  }
  if (opt.progress)
    std::fprintf(stderr, "\rtokenizer train: merges: %zu / %zu tokens, %.1f s   \n", m.vocab.size(),
                 size_t(opt.vocab_size), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  // A pair merged twice keeps its last rank (HF's merge map does).
  std::unordered_map<uint64_t, size_t> last_rank;
  for (size_t i = 0; i < merges.size(); ++i) last_rank[merges[i]] = i;
  for (size_t i = 0; i < merges.size(); ++i)
    if (last_rank[merges[i]] == i)
      m.merges.emplace_back(static_cast<uint32_t>(merges[i] >> 32), static_cast<uint32_t>(merges[i]));
  return m;
}

void write_bpe_tokenizer(const BpeModel& m, const BpeTrainOptions& opt, const std::string& dir) {
  using ojson = nlohmann::ordered_json;
  ojson tj;
  tj["version"] = "1.0";
  tj["truncation"] = nullptr;
  tj["padding"] = nullptr;
  ojson added = ojson::array();
  for (size_t i = 0; i < m.n_special; ++i)
    added.push_back({{"id", i}, {"content", m.vocab[i]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  tj["added_tokens"] = added;
  tj["normalizer"] = nullptr;
  const ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                            {"use_regex", opt.pre_tokenizer == "gpt2"}};
  if (opt.pre_tokenizer == "gpt2") {
    tj["pre_tokenizer"] = byte_level;
  } else {
    tj["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers",
                            {{{"type", "Split"},
                              {"pattern", {{"Regex", bpe_pre_tokenizer_pattern(opt.pre_tokenizer)}}},
                              {"behavior", "Isolated"},
                              {"invert", false}},
                             byte_level}}};
  }
  tj["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}};
  tj["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  ojson vocab = ojson::object();
  for (size_t i = 0; i < m.vocab.size(); ++i) vocab[m.vocab[i]] = i;
  ojson merges = ojson::array();
  for (const auto& [a, b] : m.merges) merges.push_back(m.vocab[a] + " " + m.vocab[b]);
  tj["model"] = {{"type", "BPE"},        {"dropout", nullptr},      {"unk_token", nullptr},
                 {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                 {"fuse_unk", false},    {"byte_fallback", false},  {"ignore_merges", false},
                 {"vocab", vocab},       {"merges", merges}};

  // tokenizer_config.json: what transformers' AutoTokenizer needs, and a
  // chat template when the special tokens are a known template's.
  auto has = [&](const char* s) {
    return std::find(opt.special_tokens.begin(), opt.special_tokens.end(), s) != opt.special_tokens.end();
  };
  ojson cfg;
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast";
  cfg["clean_up_tokenization_spaces"] = false;
  cfg["model_max_length"] = 1000000000000000019884624838656.0;
  std::string chat;
  if (has("<|begin_of_text|>") && has("<|start_header_id|>") && has("<|end_header_id|>") && has("<|eot_id|>")) {
    chat = "llama3";
    cfg["bos_token"] = "<|begin_of_text|>";
    cfg["eos_token"] = "<|eot_id|>";
  } else if (has("<|im_start|>") && has("<|im_end|>")) {
    chat = "chatml";
    cfg["eos_token"] = "<|im_end|>";
  } else {
    for (const char* eos : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
      if (has(eos)) {
        cfg["eos_token"] = eos;
        break;
      }
  }
  if (!chat.empty()) cfg["chat_template"] = chat::builtin_template_source(chat);

  const std::string tok_text = tj.dump(2) + "\n", cfg_text = cfg.dump(2) + "\n";
  prep::prepare_output_dir(dir);
  prep::write_file_atomic((fs::path(dir) / "tokenizer.json").string(), tok_text.data(), tok_text.size(), true);
  prep::write_file_atomic((fs::path(dir) / "tokenizer_config.json").string(), cfg_text.data(), cfg_text.size(), true);
}

std::string train_tokenizer(const BpeTrainOptions& opt, const std::string& output_dir) {
  TR_CHECK(!opt.inputs.empty(), "--input: no input given; pass text or jsonl files or directories");
  TR_CHECK(opt.vocab_size > 0, "--vocab-size: give the vocabulary size (>= 256 + the special tokens)");
  bpe_pre_tokenizer_pattern(opt.pre_tokenizer);
  // Refuse a too-small vocab before reading a terabyte.
  std::vector<std::string> distinct;
  for (const auto& s : opt.special_tokens) TR_CHECK(!s.empty(), "--special-tokens: an empty token; give each special token its text");
  for (const auto& s : opt.special_tokens)
    if (std::find(distinct.begin(), distinct.end(), s) == distinct.end()) distinct.push_back(s);
  TR_CHECK(opt.vocab_size >= 256 + distinct.size(), "--vocab-size: ", opt.vocab_size,
           " is smaller than the 256-byte alphabet + ", distinct.size(), " special token(s) (", 256 + distinct.size(),
           "); ask for at least ", 256 + distinct.size());
  prep::prepare_output_dir(output_dir);
  const auto t0 = std::chrono::steady_clock::now();
  const WordCounts wc = count_words(opt);
  const double t_count = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const BpeModel m = train_bpe(wc, opt);
  const double t_all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  write_bpe_tokenizer(m, opt, output_dir);
  return detail::cat("tokenizer train: ", m.vocab.size(), " tokens (", m.n_special, " special, 256 bytes, ",
                     m.merges.size(), " merges) from ", wc.documents, " document(s), ", wc.bytes, " bytes, ",
                     wc.total_words, " words (", wc.words.size(), " distinct); counting ", t_count, " s, merges ",
                     t_all - t_count, " s -> ", (fs::path(output_dir) / "tokenizer.json").string());
}

}  // namespace trainrun
