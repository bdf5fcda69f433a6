// Encoding: added-token cuts, normalizers, pre-tokenizers, the model, with a
// per-encoder cache of pre-token -> ids. Byte-level BPE behind Split(Isolated)
// pre-tokenizers takes a fast path that splits views of the text and maps
// bytes straight to symbols.
#include <cstring>
#include <deque>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

struct TokenEncoder::State {
  MatchState ms;
  ModelScratch sc;
  // Pre-token -> ids. Keys live in `keys` (a deque never moves its
  // elements, so the views stay valid); ids in `pool`.
  std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;
  std::deque<std::string> keys;
  std::vector<uint32_t> pool;
  std::vector<Piece> pieces;
};

// Bounded so a long run over diverse text (code, many scripts) cannot grow
// without limit; natural text hits well under this many distinct words.
static constexpr size_t kCacheEntries = 1 << 18;

TokenEncoder::TokenEncoder(const Tokenizer& tok) : tok_(&tok), st_(std::make_unique<State>()) {}
TokenEncoder::~TokenEncoder() = default;
TokenEncoder::TokenEncoder(TokenEncoder&&) noexcept = default;

namespace {

struct Hit {
  size_t b, e;
  uint32_t id;
};

// HF's AddedVocabulary::find_matches: leftmost-longest matches over all the
// set's tokens (a skipped special token still consumes its text), then
// single_word, lstrip and rstrip.
void find_added(const AddedSet& set, std::string_view s, bool allow_special, std::vector<Hit>& hits) {
  hits.clear();
  const size_t n = s.size();
  size_t start_offset = 0;
  for (size_t i = 0; i < n;) {
    const AddedToken* hit = nullptr;
    for (uint32_t k : set.by_first[static_cast<unsigned char>(s[i])]) {
      const AddedToken& a = *set.tokens[k];
      if (a.content.size() <= n - i && std::memcmp(s.data() + i, a.content.data(), a.content.size()) == 0) {
        hit = &a;
        break;  // sorted longest first
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    i = e;
    if (hit->special && !allow_special) continue;
    if (hit->single_word) {
      // The regex crate's \w on the characters either side.
      bool word_before = false, word_after = false;
      if (b > 0) {
        size_t p = b - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t q = p;
        word_before = uni::is_word(uni::next(s, q));
      }
      if (e < n) {
        size_t q = e;
        word_after = uni::is_word(uni::next(s, q));
      }
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      size_t nb = b;
      while (nb > 0) {
        size_t p = nb - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t q = p;
        if (!uni::is_whitespace(uni::next(s, q))) break;
        nb = p;
      }
      b = std::max(nb, start_offset);
    }
    if (hit->rstrip) {
      size_t ne = e;
      while (ne < n) {
        size_t q = ne;
        if (!uni::is_whitespace(uni::next(s, q))) break;
        ne = q;
      }
      e = ne;
    }
    hits.push_back({b, e, hit->id});
    start_offset = e;
  }
}

}  // namespace

void TokenEncoder::encode(std::string_view text, bool allow_special, std::vector<uint32_t>& out, bool continues) {
  const Tokenizer::Impl& im = *tok_->impl_;
  allow_special_ = allow_special;
  if (int64_t bad = find_invalid_utf8(text); bad >= 0)
    TR_FAIL("tokenizer: the text is not valid UTF-8 at byte offset ", bad, "; fix or drop that input");
  // The segment at offset 0 of a continuing text is the rest of one whose
  // start was normalized (and pre-tokenized) already.
  const bool first = !continues;
  if (im.raw_added.empty()) {
    encode_normalized(text, first, first, out);
    return;
  }
  std::vector<Hit> hits;
  find_added(im.raw_added, text, allow_special, hits);
  size_t last = 0;
  for (const Hit& h : hits) {
    if (h.b > last) encode_normalized(text.substr(last, h.b - last), first && last == 0, first || last > 0, out);
    out.push_back(h.id);
    last = std::max(last, h.e);
  }
  if (last < text.size()) encode_normalized(text.substr(last), first && last == 0, first || last > 0, out);
}

void TokenEncoder::encode_normalized(std::string_view seg, bool at_start, bool prepend, std::vector<uint32_t>& out) {
  const Tokenizer::Impl& im = *tok_->impl_;
  if (seg.empty()) return;
  if (im.normalizers.empty() && im.norm_added.empty()) {
    encode_segment(seg, at_start, out);
    return;
  }
  std::string s(seg);
  apply_normalizers(im.normalizers, s, st_->ms, prepend);
  if (im.norm_added.empty()) {
    encode_segment(s, at_start, out);
    return;
  }
  // Added tokens with normalized: true, matched in the normalized text
  // (special ones among them follow allow_special as above).
  std::vector<Hit> hits;
  find_added(im.norm_added, s, allow_special_, hits);
  const std::string_view sv = s;
  size_t last = 0;
  for (const Hit& h : hits) {
    if (h.b > last) encode_segment(sv.substr(last, h.b - last), at_start && last == 0, out);
    out.push_back(h.id);
    last = std::max(last, h.e);
  }
  if (last < sv.size()) encode_segment(sv.substr(last), at_start && last == 0, out);
}

void TokenEncoder::encode_segment(std::string_view seg, bool at_start, std::vector<uint32_t>& out) {
  if (seg.empty()) return;
  const Tokenizer::Impl& im = *tok_->impl_;
  if (im.fast_byte_level) {
    // Recursion over the split steps; depth is the number of steps (1 or 2).
    struct Walker {
      TokenEncoder& enc;
      const Tokenizer::Impl& im;
      std::vector<uint32_t>& out;
      void run(size_t step, std::string_view piece) {
        std::string prefixed;
        if (step == im.byte_level_step && im.add_prefix_space && piece.front() != ' ') {
          prefixed.reserve(piece.size() + 1);
          prefixed += ' ';
          prefixed += piece;
          piece = prefixed;
        }
        if (step == im.fast_splits.size()) {
          enc.encode_pretoken(piece, true, out);
          return;
        }
        split_isolated(*im.fast_splits[step], piece, enc.st_->ms, [&](std::string_view p) { run(step + 1, p); });
      }
    } w{*this, im, out};
    w.run(0, seg);
    return;
  }
  auto& pieces = st_->pieces;
  pieces.clear();
  pieces.push_back({std::string(seg), at_start});
  apply_pre_tokenizers(im.pretok, pieces, st_->ms);
  // encode_pretoken may not touch `pieces`; move them out for the loop.
  std::vector<Piece> local;
  local.swap(pieces);
  for (const Piece& p : local) {
    if (im.split_at_metaspace) encode_metaspace_words(p.text, out);
    else encode_pretoken(p.text, false, out);
  }
  local.clear();
  pieces.swap(local);
}

// Impl::split_at_metaspace: the parts of `piece` cut before every '▁'
// that follows another character ("▁▁▁x" stays whole), each through the
// model and the cache.
void TokenEncoder::encode_metaspace_words(std::string_view piece, std::vector<uint32_t>& out) {
  const size_t m = kMetaUtf8.size();
  size_t start = 0;
  for (size_t j = piece.find(kMetaUtf8, 1); j != std::string_view::npos; j = piece.find(kMetaUtf8, j + m)) {
    // The character before j is a '▁' exactly when its 3 bytes are (UTF-8
    // lead bytes never occur inside a character).
    if (j >= m && piece.substr(j - m, m) == kMetaUtf8) continue;
    encode_pretoken(piece.substr(start, j - start), false, out);
    start = j;
  }
  encode_pretoken(piece.substr(start), false, out);
}

void TokenEncoder::encode_pretoken(std::string_view piece, bool raw_bytes, std::vector<uint32_t>& out) {
  if (piece.empty()) return;
  State& st = *st_;
  if (auto it = st.cache.find(piece); it != st.cache.end()) {
    out.insert(out.end(), st.pool.begin() + it->second.first, st.pool.begin() + it->second.first + it->second.second);
    return;
  }
  const Tokenizer::Impl& im = *tok_->impl_;
  const size_t first = out.size();
  if (raw_bytes) bpe_tokenize_bytes(im.model, piece, st.sc, out);
  else model_tokenize(im.model, piece, st.sc, out);
  // Long pieces (whitespace runs, base64) rarely repeat: not worth the memory.
  if (piece.size() > 128) return;
  if (st.cache.size() >= kCacheEntries) {
    st.cache.clear();
    st.keys.clear();
    st.pool.clear();
  }
  const uint32_t off = static_cast<uint32_t>(st.pool.size());
  st.pool.insert(st.pool.end(), out.begin() + first, out.end());
  st.keys.emplace_back(piece);
  st.cache.emplace(std::string_view(st.keys.back()), std::make_pair(off, static_cast<uint32_t>(out.size() - first)));
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  TokenEncoder enc(*this);
  std::vector<uint32_t> ids;
  enc.encode(text, allow_special, ids);
  return ids;
}

}  // namespace trainrun
