// Hugging Face tokenizers (tokenizer.json), encoded to the same ids and
// decoded to the same text as the `tokenizers` library (0.19): byte-level
// BPE (GPT-2, Llama 3, Qwen2), SentencePiece-style BPE with byte fallback
// (Llama 2, Mistral, Gemma) and Unigram models.
//
// The pipeline, as HF runs it:
//   1. added tokens: the text is cut at every added token that is matched
//      on the raw text (normalized: false), leftmost-longest; lstrip/rstrip
//      take the whitespace beside it, single_word needs non-word neighbours.
//      Non-special added tokens always match; special ones only when
//      allow_special is set (see "special-token policy" below).
//   2. normalizer (NFC/NFKC/..., Lowercase, Strip, Replace, Prepend,
//      Precompiled) on each remaining piece, then the added tokens with
//      normalized: true are cut out of the normalized text the same way.
//   3. pre-tokenizer: Split (any behavior, invert), ByteLevel, Metaspace,
//      Whitespace, WhitespaceSplit, Punctuation, Digits, in a Sequence.
//   4. model on each pre-token: BPE (lowest-ranked merge first; byte
//      fallback to <0xNN>, unk with fuse_unk, ignore_merges, subword
//      prefix/suffix) or Unigram (Viterbi over the pieces' scores).
//   5. post-processor (TemplateProcessing, Bert/Roberta, ByteLevel) only in
//      with_special_tokens(): encode() adds no BOS/EOS.
// Decoding runs the decoder chain (ByteLevel, ByteFallback, Fuse, Replace,
// Strip, Metaspace) over the tokens' strings; added tokens enter it as
// their content.
//
// Special-token policy: text is data. A special token's spelling inside raw
// text ("<|endoftext|>" in a scraped page) is encoded as ordinary text unless
// the caller passes allow_special (prepare --allow-special), which matches
// special tokens as HF's encode() does. Templates (BOS/EOS, chat headers)
// insert special ids directly, never by spelling them.
//
// Anything the encoder does not implement (WordPiece, BPE dropout,
// UnicodeScripts, ...) is refused at load with the JSON path and the value,
// never silently approximated.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace trainrun {

class Tokenizer;

// Per-thread encoding state: the PCRE2 match data and JIT stacks, and a cache
// of pre-token -> ids (natural text repeats a few thousand words most of the
// time). Not thread-safe; make one per thread from a shared Tokenizer.
class TokenEncoder {
 public:
  explicit TokenEncoder(const Tokenizer& tok);
  ~TokenEncoder();
  TokenEncoder(const TokenEncoder&) = delete;
  TokenEncoder& operator=(const TokenEncoder&) = delete;
  TokenEncoder(TokenEncoder&&) noexcept;

  // Appends the ids of `text` (valid UTF-8, checked: an error names the byte
  // offset) to `out`. No BOS/EOS is added.
  //
  // `continues`: `text` is the rest of a longer text, cut where
  // Tokenizer::can_cut_before_line or can_cut_before_space allows; the
  // normalizer's Prepend (Llama 2's '▁') and Metaspace's prepend_scheme
  // "first" then do not apply at its start, as HF applies them once, at
  // the start of the whole (and after each added token).
  void encode(std::string_view text, bool allow_special, std::vector<uint32_t>& out, bool continues = false);

 private:
  struct State;
  void encode_normalized(std::string_view seg, bool at_start, bool prepend, std::vector<uint32_t>& out);
  void encode_segment(std::string_view seg, bool at_start, std::vector<uint32_t>& out);
  void encode_pretoken(std::string_view piece, bool raw_bytes, std::vector<uint32_t>& out);
  void encode_metaspace_words(std::string_view piece, std::vector<uint32_t>& out);
  const Tokenizer* tok_;
  std::unique_ptr<State> st_;
  bool allow_special_ = false;
};

class Tokenizer {
 public:
  // Loads and checks `path` (a tokenizer.json). Errors name the file, the
  // JSON path (e.g. "pre_tokenizer.pretokenizers[0].behavior") and the value.
  static Tokenizer load(const std::string& path);
  static Tokenizer from_json_text(const std::string& json_text, const std::string& name);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // One-shot helpers (a fresh TokenEncoder per call: use TokenEncoder in loops).
  std::vector<uint32_t> encode(std::string_view text, bool allow_special = false) const;
  // The decoded ids (added/special tokens as their content), as bytes:
  // utf8_lossy() of it is HF's decode(skip_special_tokens=False). (A
  // ByteLevel decoder's output is kept exact, so ids that end inside a
  // character keep their bytes.) Throws on an id outside the vocab.
  std::string decode(const std::vector<uint32_t>& ids) const;
  // `ids` with what the post-processor adds around one sequence (HF's
  // encode(add_special_tokens=True) is with_special_tokens(encode(text))).
  std::vector<uint32_t> with_special_tokens(const std::vector<uint32_t>& ids) const;

  // Largest id + 1 over the vocab and the added tokens.
  uint32_t vocab_size() const;
  // Id of a token string (vocab entry in its byte-level spelling, or an added
  // token's content); -1 if none.
  int64_t token_id(const std::string& token) const;
  // Id of a special added token by content, -1 if none.
  int64_t special_id(const std::string& content) const;
  // The BOS the post-processor prepends (TemplateProcessing's special token
  // before $A, as Llama 3 ships), -1 when it adds none (GPT-2).
  int64_t bos_id() const;
  const std::string& name() const;
  // True when cutting text at "<printable ASCII>\n|<ASCII letter>" never
  // changes the ids (both sides, encoded alone, give the ids of the whole):
  // the pre-tokenizers are GPT-2's, Llama 3's or Qwen2's regexes, and
  // ByteLevel adds no prefix space. A whitespace before the '\n' would not
  // do: "\s+(?!\S)" matches " \n" whole at the end of a piece, but " " and
  // "\n" apart when a letter follows. prepare cuts big files there to
  // encode them in parallel.
  bool can_cut_before_line() const;
  // True when the BPE model cuts each pre-token before every '▁' that
  // follows another character and encodes the parts apart (SentencePiece
  // vocabularies, where no merge joins across such a point: the ids are
  // those of the whole). Without it a Llama 2 or Mistral document is one
  // BPE word of millions of symbols.
  bool splits_at_metaspace() const;
  // True when cutting text before a ' ' that follows a printable ASCII
  // character other than ' ' never changes the ids, the part after encoded
  // with encode(..., continues = true): splits_at_metaspace(), normalizers
  // that map each character alone (Replace of one character) or Prepend,
  // no pre-tokenizer, Metaspace alone or Gemma's Split(" ") after its
  // Replace(" ", "▁") (which leaves it no space), no added token with a space,
  // a '▁' or lstrip/rstrip/single_word. The space becomes a '▁' where the
  // model cuts anyway. prepare cuts Llama 2 / Mistral / Gemma style files there.
  bool can_cut_before_space() const;
  // The contents of the added tokens (special or not), in id order: what
  // matches before the pre-tokenizer (prepare checks its other cut points
  // against them).
  std::vector<std::string> added_token_contents() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class TokenEncoder;
};

// First invalid UTF-8 byte offset in `s`, or -1 when it is valid (overlong
// forms, surrogates and code points above U+10FFFF are invalid, as in
// Rust's str and PCRE2).
int64_t find_invalid_utf8(std::string_view s);

// `s` with every maximal invalid UTF-8 subsequence replaced by U+FFFD, as
// Rust's String::from_utf8_lossy (what HF's ByteLevel decoder returns for
// ids that end inside a character): text for a terminal, where
// Tokenizer::decode gives the exact bytes.
std::string utf8_lossy(std::string_view s);

}  // namespace trainrun
