// Models: BPE (byte-level or over characters, with byte_fallback, unk_token
// and fuse_unk, ignore_merges, continuing_subword_prefix and
// end_of_word_suffix) and Unigram (SentencePiece's Viterbi, as HF's
// encode_optimized), each turning one pre-token into ids.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_json.h"

namespace trainrun {

void MergeTable::build(const std::vector<std::array<uint32_t, 4>>& merges) {
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  count_ = 0;
  for (const auto& m : merges) {
    const uint64_t key = (static_cast<uint64_t>(m[0]) << 32) | m[1];
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == kEmpty) { s.key = key; ++count_; }
      if (s.key == key) {
        // A repeated pair keeps its last rank, as HF's HashMap collect does.
        s.rank = m[2];
        s.merged = m[3];
        break;
      }
    }
  }
}

namespace {

[[noreturn]] void unk_missing(const Model& m) {
  TR_FAIL("tokenizer: the text has a character the vocab cannot spell and model.unk_token ",
          m.unk_id == -2 ? "is not in model.vocab" : "is not set", "; HF tokenizers fails on it too");
}

// Applies the merges to sc.syms (lowest rank first, leftmost among equal
// ranks) and appends the resulting ids.
void bpe_merge(const Model& m, ModelScratch& sc, std::vector<uint32_t>& out) {
  auto& syms = sc.syms;
  auto& heap = sc.heap;
  const int32_t n = static_cast<int32_t>(syms.size());
  if (n == 0) return;
  heap.clear();
  uint32_t rank, merged;
  for (int32_t i = 0; i + 1 < n; ++i)
    if (m.merges.find(syms[i].id, syms[i + 1].id, rank, merged)) heap.push_back({rank, i, syms[i].id, syms[i + 1].id, merged});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const ModelScratch::Candidate c = heap.back();
    heap.pop_back();
    ModelScratch::Symbol& s = syms[c.pos];
    // Stale: an earlier merge consumed or changed one side. A symbol's id
    // names the exact text it covers from its position, so equal ids mean
    // the same pair.
    if (s.len == 0 || s.id != c.left || s.next < 0 || syms[s.next].id != c.right) continue;
    ModelScratch::Symbol& r = syms[s.next];
    s.id = c.merged;
    s.len += r.len;
    r.len = 0;
    s.next = r.next;
    if (s.next >= 0) syms[s.next].prev = c.pos;
    if (s.prev >= 0 && m.merges.find(syms[s.prev].id, s.id, rank, merged)) {
      heap.push_back({rank, s.prev, syms[s.prev].id, s.id, merged});
      std::push_heap(heap.begin(), heap.end());
    }
    if (s.next >= 0 && m.merges.find(s.id, syms[s.next].id, rank, merged)) {
      heap.push_back({rank, c.pos, s.id, syms[s.next].id, merged});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

// Pending unknown run (HF's `unk`): flushed before the next known symbol.
struct UnkRun {
  bool open = false;
  uint32_t len = 0;
};

void push_sym(ModelScratch& sc, uint32_t id, uint32_t len) {
  const int32_t i = static_cast<int32_t>(sc.syms.size());
  if (i > 0) sc.syms[i - 1].next = i;
  sc.syms.push_back({id, i - 1, -1, len});
}

void flush_unk(const Model& m, ModelScratch& sc, UnkRun& u) {
  if (u.open) push_sym(sc, static_cast<uint32_t>(m.unk_id), u.len);
  u.open = false;
}

// An unknown character of `len` bytes: unk (fused with the run before it
// when fuse_unk), or dropped when the model has no unk_token.
void unknown(const Model& m, ModelScratch& sc, UnkRun& u, uint32_t len) {
  if (m.unk_id == -1) return;
  if (m.unk_id < 0) unk_missing(m);
  if (u.open && m.fuse_unk) {
    u.len += len;
    return;
  }
  flush_unk(m, sc, u);
  u.open = true;
  u.len = len;
}

void bpe_word(const Model& m, std::string_view w, ModelScratch& sc, std::vector<uint32_t>& out) {
  if (m.ignore_merges) {
    if (auto it = m.vocab.find(std::string(w)); it != m.vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  sc.syms.clear();
  UnkRun u;
  std::string key;
  for (size_t i = 0; i < w.size();) {
    const size_t b = i;
    uni::next(w, i);
    const std::string_view ch = w.substr(b, i - b);
    key.clear();
    if (b > 0) key += m.prefix;
    key += ch;
    if (i == w.size()) key += m.suffix;
    if (auto it = m.vocab.find(key); it != m.vocab.end()) {
      flush_unk(m, sc, u);
      push_sym(sc, it->second, static_cast<uint32_t>(ch.size()));
      continue;
    }
    if (m.byte_fallback) {
      bool all = true;
      for (char c : key) all = all && m.byte_fallback_id[static_cast<unsigned char>(c)] != kNoId;
      if (all) {
        // As HF: the byte tokens go in without flushing a pending unk first.
        for (char c : key) push_sym(sc, m.byte_fallback_id[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    unknown(m, sc, u, static_cast<uint32_t>(ch.size()));
  }
  flush_unk(m, sc, u);
  bpe_merge(m, sc, out);
}

void unigram_word(const Model& m, std::string_view s, ModelScratch& sc, std::vector<uint32_t>& out) {
  const Unigram& g = m.uni;
  const size_t n = s.size();
  auto& best = sc.lattice;
  best.assign(n + 1, {0.0, -1, 0});
  for (size_t at = 0; at < n;) {
    const double here = best[at].score;
    size_t k = at;
    uni::next(s, k);
    const size_t mblen = k - at;
    bool single = false;
    uint32_t node = 0;
    for (size_t j = at; j < n; ++j) {
      auto e = g.edges.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[j]));
      if (e == g.edges.end()) break;
      node = e->second;
      const uint32_t id = g.node_id[node];
      if (id == kNoId) continue;
      const size_t end = j + 1;
      const double cand = g.score[id] + here;
      if (best[end].start < 0 || cand > best[end].score) best[end] = {cand, static_cast<int64_t>(at), id};
      if (end - at == mblen) single = true;
    }
    if (!single) {
      if (g.unk_id < 0) TR_FAIL("tokenizer: the text has a character the Unigram vocab lacks and model.unk_id is null");
      const double cand = g.unk_score + here;
      if (best[at + mblen].start < 0 || cand > best[at + mblen].score)
        best[at + mblen] = {cand, static_cast<int64_t>(at), static_cast<uint32_t>(g.unk_id)};
    }
    at += mblen;
  }
  // Back from the end; consecutive unk nodes fuse into one string.
  std::vector<std::pair<size_t, size_t>> pieces;  // reversed (begin, end)
  std::vector<uint8_t> is_unk;
  for (size_t end = n; end > 0;) {
    const size_t b = static_cast<size_t>(best[end].start);
    const bool unk = g.unk_id >= 0 && best[end].id == static_cast<uint32_t>(g.unk_id);
    if (unk && !is_unk.empty() && is_unk.back()) pieces.back().first = b;
    else {
      pieces.push_back({b, end});
      is_unk.push_back(unk);
    }
    end = b;
  }
  for (size_t k = pieces.size(); k-- > 0;) {
    const std::string piece(s.substr(pieces[k].first, pieces[k].second - pieces[k].first));
    if (auto it = m.vocab.find(piece); it != m.vocab.end()) {
      out.push_back(it->second);
      continue;
    }
    if (m.byte_fallback) {
      bool all = true;
      for (char c : piece) all = all && m.byte_fallback_id[static_cast<unsigned char>(c)] != kNoId;
      if (all) {
        for (char c : piece) out.push_back(m.byte_fallback_id[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    out.push_back(static_cast<uint32_t>(g.unk_id));
  }
}

}  // namespace

void model_tokenize(const Model& m, std::string_view piece, ModelScratch& sc, std::vector<uint32_t>& out) {
  if (piece.empty()) return;
  if (m.unigram) unigram_word(m, piece, sc, out);
  else bpe_word(m, piece, sc, out);
}

void bpe_tokenize_bytes(const Model& m, std::string_view raw, ModelScratch& sc, std::vector<uint32_t>& out) {
  if (m.ignore_merges) {
    if (auto it = m.raw_vocab.find(std::string(raw)); it != m.raw_vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  sc.syms.resize(raw.size());
  bool all_known = true;
  for (size_t i = 0; i < raw.size(); ++i) {
    const uint32_t id = m.byte_id[static_cast<unsigned char>(raw[i])];
    all_known = all_known && id != kNoId;
    sc.syms[i] = {id, static_cast<int32_t>(i) - 1, i + 1 < raw.size() ? static_cast<int32_t>(i) + 1 : -1, 1};
  }
  if (!all_known) {
    // A vocab without some byte symbols: those bytes are unknown characters.
    sc.syms.clear();
    UnkRun u;
    for (char c : raw) {
      const uint32_t id = m.byte_id[static_cast<unsigned char>(c)];
      if (id == kNoId) {
        unknown(m, sc, u, 1);
      } else {
        flush_unk(m, sc, u);
        push_sym(sc, id, 1);
      }
    }
    flush_unk(m, sc, u);
  }
  bpe_merge(m, sc, out);
}

namespace tokjson {

namespace {

void load_bpe(const Ctx& c, const json& m, Tokenizer::Impl& impl) {
  Model& md = impl.model;
  if (const json* d = member(m, "dropout"); d && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0))
    c.fail("model.dropout", show(*d) + " is not supported (BPE dropout makes encoding random); set it to null");
  md.byte_fallback = get_bool(c, m, "model", "byte_fallback", false);
  md.fuse_unk = get_bool(c, m, "model", "fuse_unk", false);
  md.ignore_merges = get_bool(c, m, "model", "ignore_merges", false);
  md.prefix = get_string(c, m, "model", "continuing_subword_prefix", "");
  md.suffix = get_string(c, m, "model", "end_of_word_suffix", "");
  const json* vocab = member(m, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty()) c.fail("model.vocab", "missing, empty or not an object");
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() > 0x7FFFFFFF)
      c.fail("model.vocab[" + show(json(it.key())) + "]", "expected a non-negative id, got " + show(it.value()));
    check_token_id_size(c, "model.vocab[" + show(json(it.key())) + "]", it.value().get<uint64_t>());
    md.vocab[it.key()] = it.value().get<uint32_t>();
  }
  const std::string unk = get_string(c, m, "model", "unk_token", "");
  if (!unk.empty()) {
    auto it = md.vocab.find(unk);
    md.unk_id = it == md.vocab.end() ? -2 : it->second;  // -2: HF fails when an unk is needed
  }
  const json* merges = member(m, "merges");
  if (!merges || !merges->is_array()) c.fail("model.merges", "missing or not an array");
  std::vector<std::array<uint32_t, 4>> table;
  table.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& e = (*merges)[i];
    const std::string path = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (e.is_string()) {
      // "a b": exactly one space, as HF requires.
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        c.fail(path, "expected \"left right\" (two tokens, one space), got " + show(e));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      c.fail(path, "expected \"left right\" or [\"left\", \"right\"], got " + show(e));
    }
    // The merged token drops the right side's continuing_subword_prefix.
    if (b.size() < md.prefix.size()) c.fail(path, "token " + show(json(b)) + " is shorter than continuing_subword_prefix");
    const std::string ab = a + b.substr(md.prefix.size());
    auto ia = md.vocab.find(a), ib = md.vocab.find(b), im = md.vocab.find(ab);
    if (ia == md.vocab.end()) c.fail(path, "token " + show(json(a)) + " of " + show(e) + " is not in model.vocab");
    if (ib == md.vocab.end()) c.fail(path, "token " + show(json(b)) + " of " + show(e) + " is not in model.vocab");
    if (im == md.vocab.end()) c.fail(path, "the merged token " + show(json(ab)) + " is not in model.vocab");
    table.push_back({ia->second, ib->second, static_cast<uint32_t>(i), im->second});
    const bool a_ends_meta = a.size() >= kMetaUtf8.size() && a.compare(a.size() - kMetaUtf8.size(), kMetaUtf8.size(), kMetaUtf8) == 0;
    if (!a_ends_meta && b.compare(0, kMetaUtf8.size(), kMetaUtf8) == 0) md.merge_joins_metaspace = true;
  }
  md.merges.build(table);
}

// The f64 that serde_json (without its float_roundtrip feature, as HF
// tokenizers builds it) reads from the text a score was written as: the
// decimal digits as a u64 converted to f64, then one multiply or divide by
// a power of ten. For 17-digit scores that rounds twice and can land one
// ulp off the correctly rounded value nlohmann gives; the Viterbi's ties
// (runs of equal-scored segmentations) then fall the other way. The text
// is recovered as the shortest round-trip form of the value, which is what
// serde_json (ryu) wrote.
double serde_json_f64(double v) {
  if (!std::isfinite(v) || v == 0.0) return v;
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  const std::string_view t(buf, static_cast<size_t>(res.ptr - buf));
  size_t i = 0;
  const bool neg = t[0] == '-';
  if (neg) ++i;
  uint64_t sig = 0;
  int exp = 0, digits = 0;
  bool frac = false;
  for (; i < t.size() && t[i] != 'e' && t[i] != 'E'; ++i) {
    if (t[i] == '.') {
      frac = true;
      continue;
    }
    if (digits >= 19) return v;  // serde's overflow path: not reached by shortest forms
    sig = sig * 10 + static_cast<uint64_t>(t[i] - '0');
    ++digits;
    if (frac) --exp;
  }
  if (i < t.size()) exp += std::atoi(std::string(t.substr(i + 1)).c_str());
  static const std::array<double, 309> pow10 = [] {
    std::array<double, 309> p{};
    for (int k = 0; k < 309; ++k) p[k] = std::stod("1e" + std::to_string(k));
    return p;
  }();
  double f = static_cast<double>(sig);
  for (;;) {
    const int a = exp < 0 ? -exp : exp;
    if (a < 309) {
      f = exp >= 0 ? f * pow10[a] : f / pow10[a];
      break;
    }
    if (exp >= 0) return v;
    f /= 1e308;
    exp += 308;
  }
  return neg ? -f : f;
}

void load_unigram(const Ctx& c, const json& m, Tokenizer::Impl& impl) {
  Model& md = impl.model;
  md.unigram = true;
  md.byte_fallback = get_bool(c, m, "model", "byte_fallback", false);
  const json* vocab = member(m, "vocab");
  if (!vocab || !vocab->is_array() || vocab->empty()) c.fail("model.vocab", "missing, empty or not an array of [piece, score]");
  Unigram& g = md.uni;
  g.node_id.push_back(kNoId);
  double min_score = 1e300;
  for (size_t i = 0; i < vocab->size(); ++i) {
    const json& e = (*vocab)[i];
    if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_number())
      c.fail("model.vocab[" + std::to_string(i) + "]", "expected [\"piece\", score], got " + show(e));
    const std::string piece = e[0].get<std::string>();
    const double score = e[1].is_number_float() ? serde_json_f64(e[1].get<double>()) : e[1].get<double>();
    md.vocab[piece] = static_cast<uint32_t>(i);
    g.score.push_back(score);
    min_score = std::min(min_score, score);
    uint32_t node = 0;
    for (char ch : piece) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(ch);
      auto it = g.edges.find(key);
      if (it == g.edges.end()) {
        it = g.edges.emplace(key, static_cast<uint32_t>(g.node_id.size())).first;
        g.node_id.push_back(kNoId);
      }
      node = it->second;
    }
    if (!piece.empty()) g.node_id[node] = static_cast<uint32_t>(i);
  }
  // A piece listed twice: the trie leads to the id token_to_ids keeps (the last).
  for (const auto& [piece, id] : md.vocab) {
    uint32_t node = 0;
    for (char ch : piece) node = g.edges.at((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(ch));
    if (!piece.empty()) g.node_id[node] = id;
  }
  g.unk_score = min_score - 10.0;
  if (const json* u = member(m, "unk_id"); u && !u->is_null()) {
    if (!u->is_number_unsigned() || u->get<uint64_t>() >= vocab->size())
      c.fail("model.unk_id", show(*u) + " is not an index into model.vocab");
    g.unk_id = static_cast<int64_t>(u->get<uint64_t>());
    md.unk_id = g.unk_id;
  }
}

}  // namespace

void load_model(const Ctx& c, const json& m, Tokenizer::Impl& impl) {
  const std::string type = get_type(c, m, "model");
  if (type == "BPE") load_bpe(c, m, impl);
  else if (type == "Unigram") load_unigram(c, m, impl);
  else if (type == "WordPiece" || type == "WordLevel")
    c.fail("model.type", show(json(type)) + " is not supported (encoder-model vocabularies; BPE and Unigram are)");
  else
    c.fail("model.type", show(json(type)) + " is unknown (BPE and Unigram are supported)");
  Model& md = impl.model;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    auto it = md.vocab.find(name);
    md.byte_fallback_id[b] = it == md.vocab.end() ? kNoId : it->second;
    std::string sym;
    append_utf8(byte_to_codepoint()[b], sym);
    auto s = md.vocab.find(sym);
    md.byte_id[b] = s == md.vocab.end() ? kNoId : s->second;
  }
}

}  // namespace tokjson
}  // namespace trainrun
