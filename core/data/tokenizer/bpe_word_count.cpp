// Stage 1 of `trainrun tokenizer train` (bpe_train.h): the pre-tokenized
// words of every input and their counts, in bounded memory, on N threads.
// A reader hands out blocks (under a lock, so files are read once, in
// order); each thread pre-tokenizes its block with the PCRE2 regex and
// counts the words in a table of its own; the tables are merged once, at
// the end, and sorted, so the result does not depend on the thread count.
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/prepare_common.h"
#include "core/data/tokenizer/bpe_train.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

namespace {

// Open-addressing table word -> count; the words' bytes live in one arena.
class WordTable {
 public:
  WordTable() { slots_.resize(1 << 16); }
  void add(std::string_view w, uint64_t n) { add_hashed(w, XXH3_64bits(w.data(), w.size()), n); }
  void add_hashed(std::string_view w, uint64_t h, uint64_t n) {
    if ((used_ + 1) * 4 > slots_.size() * 3) grow();
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      Slot& s = slots_[i];
      if (s.count == 0) {
        s = {h, n, arena_.size(), static_cast<uint32_t>(w.size())};
        arena_.append(w);
        ++used_;
        return;
      }
      if (s.hash == h && s.len == w.size() && std::memcmp(arena_.data() + s.off, w.data(), w.size()) == 0) {
        s.count += n;
        return;
      }
    }
  }
  // Adds every word of `o` (which is left empty).
  void absorb(WordTable& o) {
    for (const Slot& s : o.slots_)
      if (s.count) add_hashed(std::string_view(o.arena_.data() + s.off, s.len), s.hash, s.count);
    o = WordTable();
  }
  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.count) f(std::string_view(arena_.data() + s.off, s.len), s.count);
  }
  size_t size() const { return used_; }

 private:
  struct Slot {
    uint64_t hash = 0, count = 0;  // count 0: empty
    size_t off = 0;
    uint32_t len = 0;
  };
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (!s.count) continue;
      for (size_t i = s.hash & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1))
        if (!slots_[i].count) {
          slots_[i] = s;
          break;
        }
    }
  }
  std::vector<Slot> slots_;
  std::string arena_;
  size_t used_ = 0;
};

bool is_ascii_letter(unsigned char c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; }
bool is_printable_ascii(unsigned char c) { return c > ' ' && c < 0x7F; }

// The last i in (0, n) where text may be cut so that the pre-tokens of
// text[0, i) and text[i, n) are those of the whole (the GPT-2 and Llama 3
// regexes: see prepare_bpe.cpp's cut rules), 0 if none:
//   "<printable ASCII>\n" | "<ASCII letter>"
//   "<printable ASCII>" | " <ASCII letter>"
size_t last_cut(const std::string& t, size_t n) {
  for (size_t i = n - 1; i >= 2; --i) {
    const auto a = static_cast<unsigned char>(t[i - 2]), b = static_cast<unsigned char>(t[i - 1]),
               c = static_cast<unsigned char>(t[i]);
    if (b == '\n' && c != '\n' && is_ascii_letter(c) && is_printable_ascii(a)) return i;
    if (c == ' ' && i + 1 < n && is_ascii_letter(static_cast<unsigned char>(t[i + 1])) && is_printable_ascii(b))
      return i;
  }
  return 0;
}

struct Block {
  std::string text;
  size_t file = 0;          // index into the file list
  uint64_t first_line = 1;  // line number of text[0]
};

// Hands out the blocks of every file in order. Text: a file is one
// document, cut at last_cut (a block with no cut point keeps growing).
// jsonl: blocks end at a line end.
class BlockReader {
 public:
  // A block grows past block_bytes only to reach a cut point.
  BlockReader(std::vector<std::string> files, bool jsonl, size_t block_bytes)
      : files_(std::move(files)), jsonl_(jsonl), block_(std::max<size_t>(block_bytes, 16)) {}
  const std::string& file(size_t i) const { return files_[i]; }
  size_t files() const { return files_.size(); }
  uint64_t bytes_read() const { return bytes_; }

  bool next(Block& out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (;;) {
      if (!in_.is_open()) {
        if (next_file_ >= files_.size()) return false;
        cur_ = next_file_++;
        in_.open(files_[cur_], std::ios::binary);
        TR_CHECK(in_.good(), "--input: cannot open '", files_[cur_], "': ", std::strerror(errno));
        line_ = 1;
        carry_.clear();
      }
      std::string buf = std::move(carry_);
      carry_.clear();
      size_t cut = 0;
      bool eof = false;
      while (!eof) {
        const size_t have = buf.size();
        buf.resize(have + block_);
        in_.read(&buf[have], static_cast<std::streamsize>(block_));
        const size_t got = static_cast<size_t>(in_.gcount());
        buf.resize(have + got);
        bytes_ += got;
        if (in_.bad()) TR_FAIL("--input: error reading '", files_[cur_], "': ", std::strerror(errno));
        eof = got < block_;
        if (eof) break;
        cut = jsonl_ ? buf.rfind('\n') + 1 : last_cut(buf, buf.size());  // rfind npos + 1 == 0
        if (cut > 0) break;
      }
      if (eof) {
        in_.close();
        cut = buf.size();
      }
      if (cut == 0) continue;  // an empty file
      carry_.assign(buf, cut, std::string::npos);
      buf.resize(cut);
      out.text = std::move(buf);
      out.file = cur_;
      out.first_line = line_;
      line_ += static_cast<uint64_t>(std::count(out.text.begin(), out.text.end(), '\n'));
      return true;
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::string> files_;
  bool jsonl_;
  size_t block_;
  size_t next_file_ = 0, cur_ = 0;
  std::ifstream in_;
  std::string carry_;
  uint64_t line_ = 1, bytes_ = 0;
};

uint64_t line_of(const Block& b, size_t offset) {
  return b.first_line + static_cast<uint64_t>(std::count(b.text.begin(), b.text.begin() + offset, '\n'));
}

void check_utf8(const BpeTrainOptions& opt, const BlockReader& rd, const Block& b, std::string_view text,
                size_t base) {
  const int64_t bad = find_invalid_utf8(text);
  if (bad < 0) return;
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(text[bad]));
  TR_FAIL("--input: ", rd.file(b.file), ":", line_of(b, base + static_cast<size_t>(bad)), ": invalid UTF-8 (byte ", hex,
          "); the tokenizer trains on UTF-8 text: convert the file (iconv -t UTF-8)");
}

// Counts the pre-tokens of one block into `table`.
void count_block(const BpeTrainOptions& opt, const CompiledRegex& re, const BlockReader& rd, const Block& b,
                 MatchState& ms, WordTable& table, uint64_t& words, int& docs) {
  auto count_text = [&](std::string_view text) {
    split_isolated(re, text, ms, [&](std::string_view w) {
      table.add(w, 1);
      ++words;
    });
  };
  if (opt.format == "text") {
    check_utf8(opt, rd, b, b.text, 0);
    count_text(b.text);
    if (b.first_line == 1) ++docs;
    return;
  }
  size_t pos = 0;
  while (pos < b.text.size()) {
    size_t end = b.text.find('\n', pos);
    if (end == std::string::npos) end = b.text.size();
    const std::string_view line(b.text.data() + pos, end - pos);
    const size_t at = pos;
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank line
    auto where = [&] { return rd.file(b.file) + ":" + std::to_string(line_of(b, at)); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      TR_FAIL("--input: ", where(), ": not a JSON line (", e.what(), "); --format jsonl needs one JSON object per line");
    }
    const auto it = j.is_object() ? j.find(opt.text_field) : j.end();
    if (!j.is_object() || it == j.end())
      TR_FAIL("--input: ", where(), ": no field \"", opt.text_field, "\"", j.is_object() ? "" : " (not an object)",
              "; pass --text-field with the field that holds the text");
    if (!it->is_string())
      TR_FAIL("--input: ", where(), ": field \"", opt.text_field, "\" is ", it->type_name(), ", not a string");
    const std::string& text = it->get_ref<const std::string&>();
    // nlohmann checks UTF-8 while parsing: the text is valid.
    count_text(text);
    ++docs;
  }
}

}  // namespace

// The pre-tokenizer's regex by --pre-tokenizer's name: this stage splits
// the text, the merges and the written tokenizer.json name the same one.
const char* bpe_pre_tokenizer_pattern(const std::string& name) {
  if (name == "llama3") return kLlama3Pattern;
  if (name == "gpt2") return kGpt2Pattern;
  TR_FAIL("--pre-tokenizer: '", name, "' is not llama3 or gpt2");
}

WordCounts count_words(const BpeTrainOptions& opt) {
  TR_CHECK(opt.format == "text" || opt.format == "jsonl", "--format: '", opt.format, "' is not text or jsonl");
  const char* pattern = bpe_pre_tokenizer_pattern(opt.pre_tokenizer);
  CompiledRegex re;
  {
    int err = 0;
    PCRE2_SIZE off = 0;
    re.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                            &off, nullptr);
    TR_CHECK(re.code, "--pre-tokenizer: internal regex does not compile at offset ", off);
    re.jit = pcre2_jit_compile(re.code, PCRE2_JIT_COMPLETE) == 0;
    re.pattern = pattern;
  }
  const prep::InputSet in = prep::select_text_files(opt.inputs);
  BlockReader reader(in.texts, opt.format == "jsonl", opt.block_bytes);
  const int nthreads = opt.threads > 0 ? opt.threads : std::max(1u, std::thread::hardware_concurrency());

  std::vector<WordTable> tables(nthreads);
  std::vector<uint64_t> words(nthreads, 0);
  std::vector<int> docs(nthreads, 0);
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex err_mu;
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> done_threads{0};
  auto work = [&](int t) {
    try {
      MatchState ms;
      Block b;
      while (!failed && reader.next(b))
        count_block(opt, re, reader, b, ms, tables[t], words[t], docs[t]);
    } catch (...) {
      std::lock_guard<std::mutex> lock(err_mu);
      if (!error) error = std::current_exception();
      failed = true;
    }
    ++done_threads;
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) pool.emplace_back(work, t);
  // The progress line comes from a thread of its own, so thread 0 counts too.
  std::thread progress;
  if (opt.progress) {
    progress = std::thread([&] {
      while (done_threads < nthreads) {
        for (int i = 0; i < 10 && done_threads < nthreads; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "\rtokenizer train: counting words: %.1f MB read, %.1f s (%.1f MB/s)   ",
                     reader.bytes_read() / 1e6, s, reader.bytes_read() / 1e6 / std::max(s, 1e-9));
      }
    });
  }
  work(0);
  for (auto& th : pool) th.join();
  if (progress.joinable()) progress.join();
  if (opt.progress) std::fprintf(stderr, "\n");  // end the progress line (before an error, too)
  if (error) std::rethrow_exception(error);

  WordCounts wc;
  for (int t = 1; t < nthreads; ++t) tables[0].absorb(tables[t]);
  wc.words.reserve(tables[0].size());
  tables[0].for_each([&](std::string_view w, uint64_t n) { wc.words.emplace_back(std::string(w), n); });
  std::sort(wc.words.begin(), wc.words.end());
  for (int t = 0; t < nthreads; ++t) {
    wc.total_words += words[t];
    wc.documents += docs[t];
  }
  wc.bytes = reader.bytes_read();
  return wc;
}

}  // namespace trainrun
