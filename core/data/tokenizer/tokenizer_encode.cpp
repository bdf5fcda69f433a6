// Encoding: added-token cuts, regex pre-tokenization (PCRE2), byte-level BPE.
#include <algorithm>
#include <cstring>
#include <deque>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

namespace {

// A merge candidate: the pair starting at symbol `pos`. The heap pops the
// lowest rank first and, among equal ranks, the leftmost pair, which is
// the order HF's BPE (and GPT-2's merge loop) applies merges in.
struct Candidate {
  uint32_t rank;
  int32_t pos;
  uint32_t left, right, merged;
  bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

struct Symbol {
  uint32_t id;
  int32_t prev, next;
  uint32_t len;  // bytes covered; 0 once merged into its left neighbour
};

}  // namespace

struct TokenEncoder::State {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  // Pre-token -> ids. Keys live in `keys` (a deque never moves its
  // elements, so the views stay valid); ids in `pool`.
  std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;
  std::deque<std::string> keys;
  std::vector<uint32_t> pool;
  std::vector<Symbol> syms;
  std::vector<Candidate> heap;
  ~State() {
    if (md) pcre2_match_data_free(md);
    if (mctx) pcre2_match_context_free(mctx);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
  }
};

// Bounded so a long run over diverse text (code, many scripts) cannot grow
// without limit; natural text hits well under this many distinct words.
static constexpr size_t kCacheEntries = 1 << 18;

TokenEncoder::TokenEncoder(const Tokenizer& tok) : tok_(&tok), st_(std::make_unique<State>()) {
  st_->md = pcre2_match_data_create(1, nullptr);
  st_->mctx = pcre2_match_context_create(nullptr);
  // The default 32 KiB JIT stack overflows on long whitespace runs under
  // \s+(?!\S); 8 MiB covers any input a line-oriented corpus has.
  st_->jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  TR_CHECK(st_->md && st_->mctx && st_->jit_stack, "tokenizer: out of memory creating the PCRE2 match state");
  pcre2_jit_stack_assign(st_->mctx, nullptr, st_->jit_stack);
}
TokenEncoder::~TokenEncoder() = default;
TokenEncoder::TokenEncoder(TokenEncoder&&) noexcept = default;

void TokenEncoder::encode(std::string_view text, bool allow_special, std::vector<uint32_t>& out) {
  const Tokenizer::Impl& im = *tok_->impl_;
  if (int64_t bad = find_invalid_utf8(text); bad >= 0)
    TR_FAIL("tokenizer: the text is not valid UTF-8 at byte offset ", bad, "; fix or drop that input");
  if (!im.any_plain_added && !(allow_special && im.any_special)) {
    encode_segment(text, out);
    return;
  }
  // Leftmost-longest added-token matching, as HF's added vocabulary does.
  size_t last = 0, i = 0;
  const size_t n = text.size();
  while (i < n) {
    const auto& cands = im.added_by_first[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (uint32_t k : cands) {
      const AddedToken& a = im.added[k];
      if ((a.special && !allow_special) || a.content.size() > n - i) continue;
      if (std::memcmp(text.data() + i, a.content.data(), a.content.size()) == 0) {
        hit = &a;
        break;  // sorted longest first
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    encode_segment(text.substr(last, i - last), out);
    out.push_back(hit->id);
    i += hit->content.size();
    last = i;
  }
  encode_segment(text.substr(last), out);
}

namespace {

// Calls emit(piece) for every match of `re` in `subject` and every non-empty
// gap between them, in order (behavior Isolated).
template <typename Emit>
void split_isolated(const CompiledRegex& re, std::string_view subject, pcre2_match_data* md,
                    pcre2_match_context* mctx, Emit&& emit) {
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t start = 0, last = 0;
  while (start <= n) {
    // The text was checked as UTF-8 once, in encode(): no per-match check.
    const int rc = re.jit ? pcre2_jit_match(re.code, s, n, start, 0, md, mctx)
                          : pcre2_match(re.code, s, n, start, PCRE2_NO_UTF_CHECK, md, mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      TR_FAIL("tokenizer: regex ", re.pattern, " failed on a ", n, "-byte piece: ", reinterpret_cast<char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
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

}  // namespace

void TokenEncoder::encode_segment(std::string_view seg, std::vector<uint32_t>& out) {
  if (seg.empty()) return;
  const Tokenizer::Impl& im = *tok_->impl_;
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
      if (step == im.splits.size()) {
        enc.encode_pretoken(piece, out);
        return;
      }
      split_isolated(im.splits[step].re, piece, enc.st_->md, enc.st_->mctx,
                     [&](std::string_view p) { run(step + 1, p); });
    }
  } w{*this, im, out};
  w.run(0, seg);
}

void TokenEncoder::encode_pretoken(std::string_view piece, std::vector<uint32_t>& out) {
  State& st = *st_;
  if (auto it = st.cache.find(piece); it != st.cache.end()) {
    out.insert(out.end(), st.pool.begin() + it->second.first, st.pool.begin() + it->second.first + it->second.second);
    return;
  }
  const Tokenizer::Impl& im = *tok_->impl_;
  const size_t first = out.size();
  std::string key(piece);
  auto whole = im.ignore_merges ? im.raw_vocab.find(key) : im.raw_vocab.end();
  if (whole != im.raw_vocab.end()) {
    out.push_back(whole->second);
  } else {
    const int32_t n = static_cast<int32_t>(piece.size());
    auto& syms = st.syms;
    auto& heap = st.heap;
    syms.resize(n);
    heap.clear();
    for (int32_t i = 0; i < n; ++i)
      syms[i] = {im.byte_id[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, 1};
    uint32_t rank, merged;
    for (int32_t i = 0; i + 1 < n; ++i)
      if (im.merges.find(syms[i].id, syms[i + 1].id, rank, merged))
        heap.push_back({rank, i, syms[i].id, syms[i + 1].id, merged});
    std::make_heap(heap.begin(), heap.end());
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end());
      const Candidate c = heap.back();
      heap.pop_back();
      Symbol& s = syms[c.pos];
      // Stale: an earlier merge consumed or changed one side. A symbol's id
      // names the exact bytes it covers from its position, so equal ids
      // mean the same pair.
      if (s.len == 0 || s.id != c.left || s.next < 0 || syms[s.next].id != c.right) continue;
      Symbol& r = syms[s.next];
      s.id = c.merged;
      s.len += r.len;
      r.len = 0;
      s.next = r.next;
      if (s.next >= 0) syms[s.next].prev = c.pos;
      if (s.prev >= 0 && im.merges.find(syms[s.prev].id, s.id, rank, merged)) {
        heap.push_back({rank, s.prev, syms[s.prev].id, s.id, merged});
        std::push_heap(heap.begin(), heap.end());
      }
      if (s.next >= 0 && im.merges.find(s.id, syms[s.next].id, rank, merged)) {
        heap.push_back({rank, c.pos, s.id, syms[s.next].id, merged});
        std::push_heap(heap.begin(), heap.end());
      }
    }
    for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
  }
  // Long pieces (whitespace runs, base64) rarely repeat: not worth the memory.
  if (piece.size() > 128) return;
  if (st.cache.size() >= kCacheEntries) {
    st.cache.clear();
    st.keys.clear();
    st.pool.clear();
  }
  const uint32_t off = static_cast<uint32_t>(st.pool.size());
  st.pool.insert(st.pool.end(), out.begin() + first, out.end());
  st.keys.push_back(std::move(key));
  st.cache.emplace(std::string_view(st.keys.back()), std::make_pair(off, static_cast<uint32_t>(out.size() - first)));
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  TokenEncoder enc(*this);
  std::vector<uint32_t> ids;
  enc.encode(text, allow_special, ids);
  return ids;
}

}  // namespace trainrun
