// Hugging Face byte-level BPE tokenizers (tokenizer.json), the kind GPT-2,
// Llama 3 and Mistral-Nemo ship, encoded to the same ids as the `tokenizers`
// library. (Qwen2's adds an NFC normalizer, which is refused: no normalizer
// is implemented.)
//
// The pipeline, as HF runs it for these models:
//   1. added tokens: the text is cut at every added token (leftmost-longest
//      match). Non-special added tokens always match; special ones only when
//      allow_special is set (see "special-token policy" below).
//   2. pre-tokenizer: each remaining segment is split into pre-tokens by
//      Split(Regex, Isolated) and/or ByteLevel(use_regex: GPT-2's regex),
//      optionally in a Sequence; ByteLevel (last) maps bytes to its 256
//      printable code points.
//   3. BPE on each pre-token: start from one symbol per byte and apply the
//      lowest-ranked merge until none applies. With ignore_merges, a
//      pre-token that is itself in the vocab is emitted whole.
// Decoding (the ByteLevel decoder) concatenates the tokens' strings and maps
// the code points back to bytes; added tokens decode as their content.
//
// Special-token policy: text is data. A special token's spelling inside raw
// text ("<|endoftext|>" in a scraped page) is encoded as ordinary text unless
// the caller passes allow_special (prepare --allow-special), which matches
// special tokens as HF's encode() does. Templates (BOS/EOS, chat headers)
// insert special ids directly, never by spelling them.
//
// Anything the encoder does not implement (a normalizer, a non-BPE model,
// BPE dropout, another pre-tokenizer or decoder, ...) is refused at load with
// the JSON path and the value, never silently approximated.
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
  void encode(std::string_view text, bool allow_special, std::vector<uint32_t>& out);

 private:
  struct State;
  void encode_segment(std::string_view seg, std::vector<uint32_t>& out);
  void encode_pretoken(std::string_view piece, std::vector<uint32_t>& out);
  const Tokenizer* tok_;
  std::unique_ptr<State> st_;
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
  // Bytes of the decoded ids (added/special tokens as their content). Throws
  // on an id outside the vocab.
  std::string decode(const std::vector<uint32_t>& ids) const;

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
