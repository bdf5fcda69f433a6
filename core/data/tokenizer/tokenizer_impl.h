// The loaded form of a tokenizer.json, shared by the files of
// core/data/tokenizer (one per concept: normalizers, pre-tokenizers,
// models, decoders and post-processors, added tokens, the encoder).
// Sequences are flattened at load into lists of steps. Private to
// core/data/tokenizer.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/data/tokenizer/tokenizer.h"

namespace trainrun {

// A compiled PCRE2 pattern (UTF + UCP, JIT-compiled when the platform has a JIT).
struct CompiledRegex {
  pcre2_code* code = nullptr;
  bool jit = false;
  bool literal = false;  // a {"String": ...} pattern: matched as text
  std::string pattern;
  CompiledRegex() = default;
  CompiledRegex(const CompiledRegex&) = delete;
  CompiledRegex& operator=(const CompiledRegex&) = delete;
  CompiledRegex(CompiledRegex&& o) noexcept : code(o.code), jit(o.jit), literal(o.literal), pattern(std::move(o.pattern)) {
    o.code = nullptr;
  }
  ~CompiledRegex() { if (code) pcre2_code_free(code); }
};

// Per-thread PCRE2 match state (match data + JIT stack).
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchState();
  ~MatchState();
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

[[noreturn]] void regex_fail(const CompiledRegex& re, int rc, size_t n);

// One match of a regex: [begin, end). Every match in order, empty ones
// included (HF's Split behaviours see them), as the Rust regex engines'
// find_iter yields them.
struct Span {
  size_t b, e;
};
void regex_find_all(const CompiledRegex& re, std::string_view s, MatchState& ms, std::vector<Span>& out);
// Calls emit(piece) for every non-empty match of `re` in `subject` and every
// non-empty gap between them, in order (behavior Isolated): the byte-level
// fast path.
template <typename Emit>
void split_isolated(const CompiledRegex& re, std::string_view subject, MatchState& ms, Emit&& emit);
// `s` with every match of `re` replaced by `content` (HF's Replace).
std::string regex_replace_all(const CompiledRegex& re, std::string_view s, std::string_view content, MatchState& ms);

// Unicode facts the components need, from ICU (tokenizer_unicode.cpp),
// matching the Rust functions HF tokenizers calls.
namespace uni {
// Code point at s[i] (valid UTF-8 assumed); advances i.
uint32_t next(std::string_view s, size_t& i);
bool is_whitespace(uint32_t cp);   // char::is_whitespace (White_Space)
bool is_punctuation(uint32_t cp);  // HF's is_punc: ASCII punctuation or category P*
bool is_numeric(uint32_t cp);      // char::is_numeric: Nd, Nl, No
bool is_word(uint32_t cp);         // the regex crate's \w
enum class Form { NFC, NFD, NFKC, NFKD };
void normalize(Form f, std::string& s);
void lowercase(std::string& s);  // char::to_lowercase per character (full mapping, no context)
// Extended grapheme clusters of s, as unicode-segmentation's graphemes(true).
void graphemes(std::string_view s, std::vector<std::string_view>& out);
}  // namespace uni

// ---- normalizers (tokenizer_normalizer.cpp)
// The SentencePiece charsmap: a darts-clone double-array trie over UTF-8
// byte strings whose values index NUL-terminated replacements.
struct Precompiled {
  std::vector<uint32_t> trie;
  std::string normalized;
  // The replacement of the shortest prefix of `chunk` in the trie, as
  // spm_precompiled's transform (which then replaces the whole chunk).
  bool transform(std::string_view chunk, std::string_view& out) const;
  void apply(std::string& s) const;
};

struct NormStep {
  enum Kind { kNFC, kNFD, kNFKC, kNFKD, kLowercase, kStrip, kReplace, kPrepend, kPrecompiled } kind;
  bool left = false, right = false;     // Strip
  std::string text;                     // Replace: content; Prepend: prepend
  std::shared_ptr<CompiledRegex> re;    // Replace: pattern
  std::shared_ptr<Precompiled> charsmap;
};
// `prepend` false skips the Prepend steps: text that continues a segment
// whose start was normalized already (TokenEncoder::encode's `continues`).
void apply_normalizers(const std::vector<NormStep>& steps, std::string& s, MatchState& ms, bool prepend = true);

// ---- pre-tokenizers (tokenizer_pretokenizer.cpp)
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
struct PreTokStep {
  enum Kind { kByteLevel, kMetaspace, kRegex, kCharClass } kind;
  // ByteLevel: add_prefix_space per piece, then `re` (GPT-2's regex) when
  // use_regex, then bytes -> its 256 code points.
  bool add_prefix_space = false;
  // Metaspace
  uint32_t replacement = 0;
  std::string replacement_utf8;
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  bool split = true;
  // Regex / CharClass splits
  std::shared_ptr<CompiledRegex> re;
  enum CharClass { kWhitespace, kPunctuation, kNumeric, kOneChar } cls = kWhitespace;
  uint32_t ch = 0;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};
// A pre-token and whether it starts at offset 0 of the original text (what
// Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  bool at_start;
};
void apply_pre_tokenizers(const std::vector<PreTokStep>& steps, std::vector<Piece>& pieces, MatchState& ms);

// ---- models (tokenizer_model.cpp)
// Open-addressing map (pair of ids) -> (rank, merged id). The hot loop of BPE
// is this lookup; std::unordered_map's node chasing costs ~2x here.
class MergeTable {
 public:
  void build(const std::vector<std::array<uint32_t, 4>>& merges);  // {left, right, rank, merged}
  bool find(uint32_t left, uint32_t right, uint32_t& rank, uint32_t& merged) const {
    if (slots_.empty()) return false;
    const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == kEmpty) return false;
      if (s.key == key) {
        rank = s.rank;
        merged = s.merged;
        return true;
      }
    }
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 17); }
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0, merged = 0;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
};

constexpr uint32_t kNoId = ~0u;

struct Unigram {
  std::vector<double> score;  // (V)
  int64_t unk_id = -1;
  double unk_score = 0;  // min score - 10, as HF
  // Byte trie of the pieces: edge (node << 8 | byte) -> child; node -> id.
  std::unordered_map<uint64_t, uint32_t> edges;
  std::vector<uint32_t> node_id;  // kNoId where no piece ends
};

struct Model {
  bool unigram = false;
  std::unordered_map<std::string, uint32_t> vocab;  // token string -> id, as written in model.vocab
  // BPE
  MergeTable merges;
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int64_t unk_id = -1;
  std::string prefix, suffix;  // continuing_subword_prefix, end_of_word_suffix
  std::array<uint32_t, 256> byte_fallback_id{};  // id of <0xNN>, kNoId when absent
  // Byte-level fast path: id of each byte's code-point symbol (kNoId when
  // the vocab lacks it) and the vocab keyed by raw bytes (ignore_merges).
  std::array<uint32_t, 256> byte_id{};
  std::unordered_map<std::string, uint32_t> raw_vocab;
  Unigram uni;
  // Some merge "a b" has a not ending in '▁' and b starting with '▁': it
  // could join text across a '▁' that follows another character (see
  // Tokenizer::Impl::split_at_metaspace).
  bool merge_joins_metaspace = false;
};

// U+2581, SentencePiece's word-start mark, in UTF-8.
constexpr std::string_view kMetaUtf8 = "\xE2\x96\x81";

// Scratch space of one encoder for the models.
struct ModelScratch {
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    uint32_t len;  // 0 once merged into its left neighbour
  };
  // A merge candidate: the pair starting at symbol `pos`. The heap pops the
  // lowest rank first and, among equal ranks, the leftmost pair, which is
  // the order HF's BPE (and GPT-2's merge loop) applies merges in.
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    uint32_t left, right, merged;
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Symbol> syms;
  std::vector<Candidate> heap;
  struct Node {
    double score;
    int64_t start;  // -1: not reached
    uint32_t id;
  };
  std::vector<Node> lattice;
};
// The ids of one pre-token (a string of the model's alphabet).
void model_tokenize(const Model& m, std::string_view piece, ModelScratch& sc, std::vector<uint32_t>& out);
// Byte-level BPE on raw bytes (the fast path: each byte's symbol is byte_id).
void bpe_tokenize_bytes(const Model& m, std::string_view raw, ModelScratch& sc, std::vector<uint32_t>& out);

// ---- decoders and post-processors (tokenizer_decoder.cpp)
struct DecodeStep {
  enum Kind { kByteLevel, kByteFallback, kFuse, kReplace, kStrip, kMetaspace } kind;
  std::shared_ptr<CompiledRegex> re;  // Replace
  std::string content;                // Replace
  uint32_t ch = 0;                    // Strip's content, Metaspace's replacement
  size_t start = 0, stop = 0;         // Strip
  bool prepend = true;                // Metaspace: prepend_scheme != never
};

struct AddedToken {
  std::string content;  // what is matched: normalized when `normalized`
  std::string spelled;  // as in the file
  uint32_t id = 0;
  bool special = false, normalized = false, lstrip = false, rstrip = false, single_word = false;
};

// Leftmost-longest matching over a set of added tokens.
struct AddedSet {
  std::vector<const AddedToken*> tokens;
  std::array<std::vector<uint32_t>, 256> by_first;  // indices into tokens, longest first
  bool empty() const { return tokens.empty(); }
  void build();
};

struct Tokenizer::Impl {
  std::string name;  // the file, for messages
  std::vector<NormStep> normalizers;
  std::vector<PreTokStep> pretok;
  Model model;
  std::vector<DecodeStep> decoders;
  bool has_decoder = false;
  // Fast path: Split(Isolated) steps then ByteLevel, byte-level BPE.
  bool fast_byte_level = false;
  std::vector<const CompiledRegex*> fast_splits;  // Split steps, then ByteLevel's regex when use_regex
  size_t byte_level_step = 0;                      // index in fast_splits where ByteLevel acts
  bool add_prefix_space = false;
  std::vector<std::shared_ptr<CompiledRegex>> regex_keep;  // owns what fast_splits points to
  // SentencePiece-style BPE (Llama 2, Mistral, Gemma) has no pre-tokenizer
  // that splits words, so a whole document would be one BPE word. When no
  // merge can join text across a '▁' that follows another character (see
  // choose_metaspace_split), each pre-token is cut before every such '▁'
  // and the parts go through the model (and the cache) one by one: the ids
  // are those of the whole, as HF's BPE gives them.
  bool split_at_metaspace = false;
  // Tokenizer::can_cut_before_space (prepare's cut points for these).
  bool cut_before_space = false;

  std::vector<std::string> id_to_token;  // (V) the string decoders receive
  std::vector<uint8_t> id_known;         // (V) 1 where the id exists
  std::vector<std::string> id_to_bytes;  // (V) decoded bytes, when the decoder is ByteLevel alone
  bool byte_level_decode = false;

  std::vector<AddedToken> added;
  AddedSet raw_added, norm_added;
  bool any_special = false;
  std::unordered_map<std::string, uint32_t> added_by_content;
  std::vector<uint32_t> pp_prefix, pp_suffix;  // ids the post-processor puts around a sequence
  int64_t bos = -1;
  uint32_t vocab_size = 0;
};

// GPT-2's pre-tokenizer regex, which ByteLevel(use_regex: true) applies.
extern const char* const kGpt2Pattern;
// Llama 3's pre-tokenizer regex (a Split before ByteLevel(use_regex: false)).
extern const char* const kLlama3Pattern;

// The 256 code points ByteLevel maps bytes to (GPT-2's bytes_to_unicode).
const std::array<uint32_t, 256>& byte_to_codepoint();
// Code point -> byte for those 256, -1 for any other.
int byte_of_codepoint(uint32_t cp);
void append_utf8(uint32_t cp, std::string& out);

template <typename Emit>
void split_isolated(const CompiledRegex& re, std::string_view subject, MatchState& ms, Emit&& emit) {
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t start = 0, last = 0;
  while (start <= n) {
    // The text was checked as UTF-8 once, in encode(): no per-match check.
    const int rc = re.jit ? pcre2_jit_match(re.code, s, n, start, 0, ms.md, ms.mctx)
                          : pcre2_match(re.code, s, n, start, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) regex_fail(re, rc, n);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    const size_t b = ov[0], e = ov[1];
    if (e == b) {
      // An empty match splits nothing; step over one UTF-8 character.
      start = b + 1;
      while (start < n && (static_cast<unsigned char>(subject[start]) & 0xC0) == 0x80) ++start;
      continue;
    }
    if (b > last) emit(subject.substr(last, b - last));
    emit(subject.substr(b, e - b));
    last = start = e;
  }
  if (last < n) emit(subject.substr(last));
}

}  // namespace trainrun
