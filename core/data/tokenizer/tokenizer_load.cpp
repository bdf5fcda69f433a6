// Reading and checking a tokenizer.json: the top level, the added tokens
// and the JSON helpers the component readers share. Every refusal names
// the file, the JSON path and the value, so a user can see which part of
// their tokenizer is outside what trainrun implements.
#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_json.h"

namespace trainrun {

namespace tokjson {

void Ctx::fail(const std::string& path, const std::string& what) const {
  TR_FAIL("tokenizer '", file, "': ", path, ": ", what);
}

// Token ids index dense tables (an entry per id up to the largest: bytes,
// known flags), so one hostile id of 2^31 - 1 would cost ~66 GiB before any
// other check. Real vocabularies stay under 300K ids (Gemma 3: 262K), so
// anything above 2^22 is refused, with what its tables would have cost.
void check_token_id_size(const Ctx& c, const std::string& path, uint64_t id) {
  constexpr uint64_t kMaxTokenId = (uint64_t(1) << 22) - 1;
  constexpr uint64_t kTableBytesPerId = sizeof(std::string) + 1;  // id_to_bytes + id_known
  if (id <= kMaxTokenId) return;
  const double gib = double(id + 1) * double(kTableBytesPerId) / double(uint64_t(1) << 30);
  std::ostringstream cost;
  cost.precision(1);
  cost << std::fixed << gib;
  c.fail(path, "id " + std::to_string(id) + " is above the " + std::to_string(kMaxTokenId) +
                   " that trainrun accepts: its id tables hold an entry per id up to the largest, " + cost.str() +
                   " GiB for this one (real vocabularies stay under 300K ids); the file is corrupt");
}

std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 120) s = s.substr(0, 117) + "...";
  return s;
}

const json* member(const json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

bool get_bool(const Ctx& c, const json& obj, const std::string& path, const char* key, bool dflt) {
  const json* v = member(obj, key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_boolean()) c.fail(path + "." + key, "expected true or false, got " + show(*v));
  return v->get<bool>();
}

std::string get_string(const Ctx& c, const json& obj, const std::string& path, const char* key, const std::string& dflt) {
  const json* v = member(obj, key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_string()) c.fail(path + "." + key, "expected a string, got " + show(*v));
  if (find_invalid_utf8(v->get_ref<const std::string&>()) >= 0) c.fail(path + "." + key, "is not valid UTF-8");
  return v->get<std::string>();
}

uint64_t get_uint(const Ctx& c, const json& obj, const std::string& path, const char* key, uint64_t dflt) {
  const json* v = member(obj, key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_number_unsigned() || v->get<uint64_t>() > (1u << 30))
    c.fail(path + "." + key, "expected a small non-negative integer, got " + show(*v));
  return v->get<uint64_t>();
}

uint32_t get_char(const Ctx& c, const json& obj, const std::string& path, const char* key, uint32_t dflt) {
  const json* v = member(obj, key);
  if (!v || v->is_null()) return dflt;
  const std::string s = get_string(c, obj, path, key, "");
  size_t i = 0;
  const uint32_t cp = s.empty() ? 0 : uni::next(s, i);
  if (s.empty() || i != s.size()) c.fail(path + "." + key, "expected one character, got " + show(*v));
  return cp;
}

std::string get_type(const Ctx& c, const json& obj, const std::string& path) {
  if (!obj.is_object()) c.fail(path, "expected an object, got " + show(obj));
  const json* t = member(obj, "type");
  if (!t || !t->is_string()) c.fail(path + ".type", "missing or not a string");
  return t->get<std::string>();
}

const json& get_list(const Ctx& c, const json& obj, const std::string& path, const char* key) {
  const json* list = member(obj, key);
  if (!list || !list->is_array()) c.fail(path + "." + key, "missing or not an array");
  return *list;
}

void compile_regex(const Ctx& c, const std::string& path, const std::string& pattern, bool literal, CompiledRegex& out) {
  int err = 0;
  PCRE2_SIZE off = 0;
  // PCRE2_LITERAL allows PCRE2_UTF but not PCRE2_UCP (nothing to classify).
  const uint32_t opts = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  out.pattern = pattern;
  out.literal = literal;
  out.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err, &off, nullptr);
  if (!out.code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    c.fail(path, "PCRE2 cannot compile " + show(json(pattern)) + " at offset " + std::to_string(off) + ": " +
                     reinterpret_cast<char*>(msg));
  }
  // No JIT on this platform is not an error: the interpreter gives the same matches.
  out.jit = pcre2_jit_compile(out.code, PCRE2_JIT_COMPLETE) == 0;
}

std::shared_ptr<CompiledRegex> get_pattern(const Ctx& c, const json& obj, const std::string& path) {
  const json* pat = member(obj, "pattern");
  if (!pat || !pat->is_object()) c.fail(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
  auto re = std::make_shared<CompiledRegex>();
  if (const json* r = member(*pat, "Regex"); r && r->is_string())
    compile_regex(c, path + ".pattern.Regex", r->get<std::string>(), false, *re);
  else if (const json* l = member(*pat, "String"); l && l->is_string())
    compile_regex(c, path + ".pattern.String", l->get<std::string>(), true, *re);
  else
    c.fail(path + ".pattern", "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}, got " + show(*pat));
  return re;
}

}  // namespace tokjson

using namespace tokjson;

void AddedSet::build() {
  for (auto& v : by_first) v.clear();
  for (uint32_t k = 0; k < tokens.size(); ++k)
    if (!tokens[k]->content.empty()) by_first[static_cast<unsigned char>(tokens[k]->content[0])].push_back(k);
  for (auto& v : by_first)
    std::stable_sort(v.begin(), v.end(),
                     [&](uint32_t x, uint32_t y) { return tokens[x]->content.size() > tokens[y]->content.size(); });
}

namespace {

void load_added_tokens(const Ctx& c, const json& root, Tokenizer::Impl& impl) {
  const json* list = member(root, "added_tokens");
  if (!list || list->is_null()) return;
  if (!list->is_array()) c.fail("added_tokens", "expected an array, got " + show(*list));
  impl.added.reserve(list->size());
  MatchState ms;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) c.fail(path, "expected an object, got " + show(t));
    const json* id = member(t, "id");
    if (!id || !id->is_number_unsigned() || id->get<uint64_t>() > 0x7FFFFFFF)
      c.fail(path + ".id", "missing or not a non-negative integer");
    check_token_id_size(c, path + ".id", id->get<uint64_t>());
    AddedToken a;
    a.id = id->get<uint32_t>();
    a.spelled = get_string(c, t, path, "content", "");
    if (a.spelled.empty()) c.fail(path + ".content", "missing or empty");
    a.special = get_bool(c, t, path, "special", false);
    a.normalized = get_bool(c, t, path, "normalized", !a.special);
    a.lstrip = get_bool(c, t, path, "lstrip", false);
    a.rstrip = get_bool(c, t, path, "rstrip", false);
    a.single_word = get_bool(c, t, path, "single_word", false);
    // A normalized token is matched in normalized text, so by its
    // normalized spelling (HF's split_normalized_trie).
    a.content = a.spelled;
    if (a.normalized) apply_normalizers(impl.normalizers, a.content, ms);
    impl.added_by_content[a.spelled] = a.id;
    if (a.id >= impl.vocab_size) {
      impl.vocab_size = a.id + 1;
      impl.id_to_token.resize(impl.vocab_size);
      impl.id_known.resize(impl.vocab_size, 0);
    }
    impl.id_known[a.id] = 1;
    impl.id_to_token[a.id] = a.spelled;
    impl.any_special = impl.any_special || a.special;
    impl.added.push_back(std::move(a));
  }
  for (const AddedToken& a : impl.added) (a.normalized ? impl.norm_added : impl.raw_added).tokens.push_back(&a);
  impl.raw_added.build();
  impl.norm_added.build();
}

// The encoder's fast path: Split(Isolated) steps, then ByteLevel last; a
// byte-level BPE without subword affixes or byte fallback.
void choose_fast_path(Tokenizer::Impl& impl) {
  const Model& m = impl.model;
  if (m.unigram || m.byte_fallback || !m.prefix.empty() || !m.suffix.empty() || impl.pretok.empty()) return;
  const PreTokStep& last = impl.pretok.back();
  if (last.kind != PreTokStep::kByteLevel) return;
  for (size_t i = 0; i + 1 < impl.pretok.size(); ++i) {
    const PreTokStep& s = impl.pretok[i];
    if (s.kind != PreTokStep::kRegex || s.behavior != SplitBehavior::kIsolated || s.invert) return;
  }
  for (size_t i = 0; i + 1 < impl.pretok.size(); ++i) impl.fast_splits.push_back(impl.pretok[i].re.get());
  impl.byte_level_step = impl.fast_splits.size();
  impl.add_prefix_space = last.add_prefix_space;
  if (last.re) impl.fast_splits.push_back(last.re.get());
  // raw_vocab: the vocab keyed by bytes, for ignore_merges on raw pieces.
  if (m.ignore_merges) {
    for (const auto& [tok, id] : m.vocab) {
      std::string bytes;
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        const int b = byte_of_codepoint(uni::next(tok, i));
        ok = b >= 0;
        bytes += static_cast<char>(b);
      }
      if (ok) impl.model.raw_vocab.emplace(bytes, id);
    }
  }
  impl.fast_byte_level = true;
}

bool ends_with_meta(std::string_view s) {
  return s.size() >= kMetaUtf8.size() && s.substr(s.size() - kMetaUtf8.size()) == kMetaUtf8;
}

// Impl::split_at_metaspace. Cut "...x|▁..." (x any character but '▁'):
// the symbols left of the cut are the characters' pieces, <0xNN> byte
// fallbacks and unk, so the rightmost of them, and every merge of it with
// its left neighbours, is a token whose string does not end with '▁'; the
// leftmost symbol right of the cut is the piece "▁", and every merge of it
// with its right neighbours starts with '▁'. A merge across the cut would
// be a merge "a b" with a not ending and b starting with '▁', and the
// loader found none (Model::merge_joins_metaspace), so the merges on each
// side are those each side gets alone, in the same order. What else must
// hold:
//   - "▁" is a vocab piece (else the right side starts with byte fallbacks
//     or an unk that fuse_unk joins to an unk on the left);
//   - unk's string has no '▁' (an unk symbol on the left must not look
//     like one that ends with it), and no two strings share an id (the
//     merges are keyed by id; the strings are what was checked);
//   - not ignore_merges (the whole word, or a part, found in the vocab is
//     emitted as one id: a part in the vocab whose whole is not would
//     change the ids), no continuing_subword_prefix or end_of_word_suffix
//     (they depend on where the word starts and ends).
void choose_metaspace_split(Tokenizer::Impl& impl, bool duplicate_ids) {
  const Model& m = impl.model;
  if (impl.fast_byte_level || m.unigram || m.ignore_merges || !m.prefix.empty() || !m.suffix.empty() ||
      m.merge_joins_metaspace || duplicate_ids)
    return;
  if (m.vocab.find(std::string(kMetaUtf8)) == m.vocab.end()) return;
  if (m.unk_id >= 0 && impl.id_to_token[m.unk_id].find(kMetaUtf8) != std::string::npos) return;
  impl.split_at_metaspace = true;
}

// Impl::cut_before_space (Tokenizer::can_cut_before_space's conditions).
void choose_space_cuts(Tokenizer::Impl& impl) {
  if (!impl.split_at_metaspace) return;
  // Normalizers that map each character on its own (so the normalized
  // whole is the normalized parts, joined) except Prepend, which the
  // continuing part skips: Prepend, and Replace of one literal character.
  // Whether the normalized text can still hold a ' ' (Gemma's Replace
  // turns every one into '▁').
  bool spaces_left = true;
  for (const NormStep& n : impl.normalizers) {
    if (n.kind == NormStep::kPrepend) {
      spaces_left = spaces_left || n.text.find(' ') != std::string::npos;
      continue;
    }
    if (n.kind != NormStep::kReplace || !n.re->literal) return;
    size_t i = 0;
    if (n.re->pattern.empty() || (uni::next(n.re->pattern, i), i != n.re->pattern.size())) return;
    if (n.text.find(' ') != std::string::npos) spaces_left = true;
    else if (n.re->pattern == " ") spaces_left = false;
  }
  // No pre-tokenizer; Metaspace alone (its ' ' -> '▁' is per character,
  // its prepend does not apply to a part that starts with '▁' or starts
  // past offset 0, and its split is before '▁'); or Gemma's Split(" ")
  // (not inverted) on text without a ' ', where it never splits.
  const PreTokStep* meta = nullptr;
  if (!impl.pretok.empty()) {
    if (impl.pretok.size() != 1) return;
    const PreTokStep& p = impl.pretok[0];
    if (p.kind == PreTokStep::kMetaspace && p.replacement == 0x2581) meta = &p;
    else if (!(p.kind == PreTokStep::kRegex && p.re->literal && p.re->pattern == " " && !p.invert && !spaces_left))
      return;
  }
  MatchState ms;
  auto model_text = [&](std::string s) {
    apply_normalizers(impl.normalizers, s, ms, false);
    if (meta) {
      std::string t;
      for (char ch : s) {
        if (ch == ' ') t += kMetaUtf8;
        else t += ch;
      }
      s.swap(t);
    }
    return s;
  };
  // The space must become a '▁' (the part after the cut starts the BPE
  // word there), and the printable ASCII character before it must stay
  // something that does not end with '▁'.
  if (model_text(" ").compare(0, kMetaUtf8.size(), kMetaUtf8) != 0) return;
  for (int c = 0x21; c < 0x7F; ++c) {
    const std::string t = model_text(std::string(1, static_cast<char>(c)));
    if (t.empty() || ends_with_meta(t)) return;
  }
  // An added token matched across the cut, or taking the space beside it.
  for (const AddedToken& a : impl.added) {
    if (a.lstrip || a.rstrip || a.single_word) return;
    for (const std::string* s : {&a.content, &a.spelled})
      if (s->find(' ') != std::string::npos || s->find(kMetaUtf8) != std::string::npos) return;
  }
  impl.cut_before_space = true;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) TR_FAIL("tokenizer '", path, "': cannot open: ", detail::errno_string(), "; pass a Hugging Face tokenizer.json");
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json_text(ss.str(), path);
}

Tokenizer Tokenizer::from_json_text(const std::string& text, const std::string& name) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    TR_FAIL("tokenizer '", name, "': not valid JSON (", e.what(), "); pass a Hugging Face tokenizer.json");
  }
  const Ctx c{name};
  if (!root.is_object()) c.fail("(top level)", "expected an object, got " + show(root));
  auto impl = std::make_unique<Impl>();
  impl->name = name;
  if (const json* t = member(root, "truncation"); t && !t->is_null())
    c.fail("truncation", show(*t) + " is not supported (it would cut documents); set it to null");
  if (const json* n = member(root, "normalizer")) load_normalizer(c, *n, "normalizer", impl->normalizers);
  const json* model = member(root, "model");
  if (!model) c.fail("model", "missing");
  load_model(c, *model, *impl);
  uint32_t max_id = 0;
  for (const auto& [tok, id] : impl->model.vocab) max_id = std::max(max_id, id);
  impl->vocab_size = max_id + 1;
  impl->id_to_token.assign(impl->vocab_size, {});
  impl->id_known.assign(impl->vocab_size, 0);
  bool duplicate_ids = false;
  for (const auto& [tok, id] : impl->model.vocab) {
    duplicate_ids = duplicate_ids || impl->id_known[id];
    impl->id_to_token[id] = tok;
    impl->id_known[id] = 1;
  }
  load_added_tokens(c, root, *impl);
  if (const json* pt = member(root, "pre_tokenizer")) load_pre_tokenizer(c, *pt, "pre_tokenizer", impl->pretok);
  if (const json* d = member(root, "decoder"); d && !d->is_null()) {
    impl->has_decoder = true;
    load_decoder(c, *d, "decoder", impl->decoders);
  }
  if (const json* p = member(root, "post_processor")) load_post_processor(c, *p, "post_processor", *impl);
  choose_fast_path(*impl);
  choose_metaspace_split(*impl, duplicate_ids);
  choose_space_cuts(*impl);
  // A ByteLevel decoder alone decodes token by token: precompute the bytes.
  if (impl->has_decoder && impl->decoders.size() == 1 && impl->decoders[0].kind == DecodeStep::kByteLevel) {
    impl->byte_level_decode = true;
    impl->id_to_bytes.resize(impl->vocab_size);
    for (uint32_t id = 0; id < impl->vocab_size; ++id) {
      const std::string& t = impl->id_to_token[id];
      std::string bytes;
      bool ok = true;
      for (size_t i = 0; i < t.size() && ok;) {
        const int b = byte_of_codepoint(uni::next(t, i));
        ok = b >= 0;
        bytes += static_cast<char>(b);
      }
      impl->id_to_bytes[id] = ok ? bytes : t;
    }
  }
  return Tokenizer(std::move(impl));
}

uint32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::name() const { return impl_->name; }
int64_t Tokenizer::bos_id() const { return impl_->bos; }

bool Tokenizer::can_cut_before_line() const {
  static const char* const known[] = {
      kGpt2Pattern,
      kLlama3Pattern,
      // Qwen2
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
  };
  // Only the byte-level regex pipelines are known to be cut-safe; a
  // normalizer working per character (NFC composes across neither '\n' nor
  // an ASCII letter's start) keeps them so.
  if (!impl_->fast_byte_level || impl_->add_prefix_space) return false;
  for (const NormStep& n : impl_->normalizers)
    if (n.kind != NormStep::kNFC && n.kind != NormStep::kNFKC && n.kind != NormStep::kNFD && n.kind != NormStep::kNFKD)
      return false;
  for (const CompiledRegex* s : impl_->fast_splits) {
    bool ok = false;
    for (const char* k : known) ok = ok || s->pattern == k;
    if (!ok) return false;
  }
  // An added token spanning "\n" + letter could match across the cut; one
  // that strips whitespace could take the '\n'.
  for (const auto& a : impl_->added)
    if (a.content.find('\n') != std::string::npos || a.lstrip || a.rstrip) return false;
  return true;
}

bool Tokenizer::splits_at_metaspace() const { return impl_->split_at_metaspace; }
bool Tokenizer::can_cut_before_space() const { return impl_->cut_before_space; }

std::vector<std::string> Tokenizer::added_token_contents() const {
  std::vector<std::string> out;
  for (const auto& a : impl_->added) out.push_back(a.content);
  return out;
}

int64_t Tokenizer::token_id(const std::string& token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->model.vocab.find(token); it != impl_->model.vocab.end()) return it->second;
  return -1;
}

int64_t Tokenizer::special_id(const std::string& content) const {
  for (const auto& a : impl_->added)
    if (a.special && a.spelled == content) return a.id;
  return -1;
}

}  // namespace trainrun
