// Reading and checking a tokenizer.json. Every refusal names the file, the
// JSON path and the value, so a user can see which part of their tokenizer
// is outside what trainrun implements.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

using json = nlohmann::json;

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

const std::array<uint32_t, 256>& byte_to_codepoint() {
  // Printable Latin-1 bytes map to themselves; the other 68 (controls,
  // space, NBSP, soft hyphen) to 256, 257, ... in byte order.
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const size_t n = s.size();
  auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  for (size_t i = 0; i < n;) {
    const unsigned char b = byte(i);
    if (b < 0x80) {
      out.push_back(char(b));
      ++i;
      continue;
    }
    // Continuation bytes a lead byte needs, and the range of the first one
    // (which excludes overlong forms, surrogates and code points > U+10FFFF).
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) need = 2, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) need = 2;
    else if (b == 0xED) need = 2, hi = 0x9F;
    else if (b == 0xF0) need = 3, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else if (b == 0xF4) need = 3, hi = 0x8F;
    size_t j = i + 1;
    bool ok = need > 0;
    for (int k = 0; k < need; ++k, lo = 0x80, hi = 0xBF) {
      if (j < n && byte(j) >= lo && byte(j) <= hi) {
        ++j;
      } else {
        ok = false;
        break;
      }
    }
    if (ok) out.append(s.substr(i, j - i));
    else out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subpart s[i, j)
    i = j;
  }
  return out;
}

int64_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
    else return static_cast<int64_t>(i);
    if (i + len > n) return static_cast<int64_t>(i);
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return static_cast<int64_t>(i);
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      return static_cast<int64_t>(i);
    i += len;
  }
  return -1;
}

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

// Errors carry "<file>: <json path>: ...".
struct Ctx {
  const std::string& file;
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    TR_FAIL("tokenizer '", file, "': ", path, ": ", what);
  }
};

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
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

bool get_bool(const Ctx& c, const json& obj, const std::string& path, const char* key, bool dflt) {
  const json* v = member(obj, key);
  if (!v || v->is_null()) return dflt;
  if (!v->is_boolean()) c.fail(path + "." + key, "expected true or false, got " + show(*v));
  return v->get<bool>();
}

std::string get_type(const Ctx& c, const json& obj, const std::string& path) {
  if (!obj.is_object()) c.fail(path, "expected an object, got " + show(obj));
  const json* t = member(obj, "type");
  if (!t || !t->is_string()) c.fail(path + ".type", "missing or not a string");
  return t->get<std::string>();
}

void compile_regex(const Ctx& c, const std::string& path, const std::string& pattern, bool literal,
                   CompiledRegex& out) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  out.pattern = pattern;
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

// Byte-level spelling -> bytes; false when a code point is not one of the 256.
bool byte_level_to_bytes(const std::string& tok, std::string& bytes) {
  static const std::unordered_map<uint32_t, uint8_t> cp_to_byte = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    for (int b = 0; b < 256; ++b) m[byte_to_codepoint()[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  bytes.clear();
  const auto* p = reinterpret_cast<const unsigned char*>(tok.data());
  for (size_t i = 0; i < tok.size();) {
    const size_t len = p[i] < 0x80 ? 1 : p[i] < 0xE0 ? 2 : p[i] < 0xF0 ? 3 : 4;
    if (i + len > tok.size()) return false;
    uint32_t cp = len == 1 ? p[i] : len == 2 ? (p[i] & 0x1F) : len == 3 ? (p[i] & 0x0F) : (p[i] & 0x07);
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
    auto f = cp_to_byte.find(cp);
    if (f == cp_to_byte.end()) return false;
    bytes += static_cast<char>(f->second);
    i += len;
  }
  return true;
}

struct PreTokState {
  bool saw_byte_level = false;
  bool byte_level_regex = false;
};

void load_pre_tokenizer(const Ctx& c, const json& pt, const std::string& path, Tokenizer::Impl& impl,
                        PreTokState& st) {
  const std::string type = get_type(c, pt, path);
  if (type == "Sequence") {
    const json* list = member(pt, "pretokenizers");
    if (!list || !list->is_array()) c.fail(path + ".pretokenizers", "missing or not an array");
    for (size_t i = 0; i < list->size(); ++i)
      load_pre_tokenizer(c, (*list)[i], path + ".pretokenizers[" + std::to_string(i) + "]", impl, st);
    return;
  }
  // ByteLevel turns bytes into code points: a split after it would see the
  // mapped text, which trainrun does not model.
  if (st.saw_byte_level)
    c.fail(path, "a " + show(json(type)) + " pre-tokenizer after ByteLevel is not supported; ByteLevel must come last");
  if (type == "ByteLevel") {
    st.saw_byte_level = true;
    impl.byte_level_step = impl.splits.size();
    impl.add_prefix_space = get_bool(c, pt, path, "add_prefix_space", true);
    st.byte_level_regex = get_bool(c, pt, path, "use_regex", true);
    if (st.byte_level_regex) {
      SplitStep s;
      compile_regex(c, path, kGpt2Pattern, false, s.re);
      impl.splits.push_back(std::move(s));
    }
    return;
  }
  if (type == "Split") {
    const json* pat = member(pt, "pattern");
    if (!pat || !pat->is_object()) c.fail(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    const json* behavior = member(pt, "behavior");
    if (!behavior || !behavior->is_string() || behavior->get<std::string>() != "Isolated")
      c.fail(path + ".behavior", "only \"Isolated\" is supported, got " + (behavior ? show(*behavior) : "nothing"));
    if (get_bool(c, pt, path, "invert", false)) c.fail(path + ".invert", "true is not supported (only false)");
    SplitStep s;
    if (const json* r = member(*pat, "Regex"); r && r->is_string())
      compile_regex(c, path + ".pattern.Regex", r->get<std::string>(), false, s.re);
    else if (const json* l = member(*pat, "String"); l && l->is_string())
      compile_regex(c, path + ".pattern.String", l->get<std::string>(), true, s.re);
    else
      c.fail(path + ".pattern", "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}, got " + show(*pat));
    impl.splits.push_back(std::move(s));
    return;
  }
  c.fail(path + ".type", "pre-tokenizer " + show(json(type)) +
                             " is not supported (ByteLevel, Split with behavior Isolated, or a Sequence of them)");
}

void check_decoder(const Ctx& c, const json& d, const std::string& path) {
  if (d.is_null()) return;
  const std::string type = get_type(c, d, path);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json* list = member(d, "decoders");
    if (!list || !list->is_array()) c.fail(path + ".decoders", "missing or not an array");
    for (size_t i = 0; i < list->size(); ++i) check_decoder(c, (*list)[i], path + ".decoders[" + std::to_string(i) + "]");
    return;
  }
  c.fail(path + ".type", "decoder " + show(json(type)) + " is not supported (only ByteLevel)");
}

// The post-processor is not applied by encode() (prepare adds BOS/EOS
// itself); it is read for the BOS that the model expects.
void load_post_processor(const Ctx& c, const json& p, const std::string& path, Tokenizer::Impl& impl) {
  if (p.is_null()) return;
  const std::string type = get_type(c, p, path);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json* list = member(p, "processors");
    if (!list || !list->is_array()) c.fail(path + ".processors", "missing or not an array");
    for (size_t i = 0; i < list->size(); ++i)
      load_post_processor(c, (*list)[i], path + ".processors[" + std::to_string(i) + "]", impl);
    return;
  }
  if (type == "TemplateProcessing") {
    const json* single = member(p, "single");
    if (!single || !single->is_array()) c.fail(path + ".single", "missing or not an array");
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      if (item.contains("Sequence")) break;  // only what comes before $A is a BOS
      const json* st = member(item, "SpecialToken");
      if (!st || !st->is_object() || !st->contains("id") || !(*st)["id"].is_string())
        c.fail(path + ".single[" + std::to_string(i) + "]", "expected {\"SpecialToken\": {\"id\": ...}}, got " + show(item));
      const std::string name = (*st)["id"].get<std::string>();
      auto it = impl.added_by_content.find(name);
      if (it == impl.added_by_content.end()) {
        auto v = impl.vocab.find(name);
        if (v == impl.vocab.end())
          c.fail(path + ".single[" + std::to_string(i) + "]", "special token " + show(json(name)) + " is not in the vocab");
        impl.bos = v->second;
      } else {
        impl.bos = it->second;
      }
    }
    return;
  }
  c.fail(path + ".type", "post-processor " + show(json(type)) +
                             " is not supported (ByteLevel, TemplateProcessing, or a Sequence of them)");
}

void load_model(const Ctx& c, const json& m, Tokenizer::Impl& impl) {
  const std::string type = get_type(c, m, "model");
  if (type != "BPE")
    c.fail("model.type", show(json(type)) + " is not supported; trainrun reads byte-level BPE tokenizers only");
  if (const json* d = member(m, "dropout"); d && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0))
    c.fail("model.dropout", show(*d) + " is not supported (BPE dropout makes encoding random); set it to null");
  if (get_bool(c, m, "model", "byte_fallback", false))
    c.fail("model.byte_fallback", "true is not supported (byte-level BPE needs no fallback)");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = member(m, k); v && !v->is_null() && !(v->is_string() && v->get<std::string>().empty()))
      c.fail(std::string("model.") + k, show(*v) + " is not supported with byte-level BPE; it must be null");
  impl.ignore_merges = get_bool(c, m, "model", "ignore_merges", false);

  const json* vocab = member(m, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty()) c.fail("model.vocab", "missing, empty or not an object");
  uint32_t max_id = 0;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() > 0x7FFFFFFF)
      c.fail("model.vocab[" + show(json(it.key())) + "]", "expected a non-negative id, got " + show(it.value()));
    check_token_id_size(c, "model.vocab[" + show(json(it.key())) + "]", it.value().get<uint64_t>());
    const uint32_t id = it.value().get<uint32_t>();
    impl.vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  impl.vocab_size = max_id + 1;

  impl.id_to_bytes.assign(impl.vocab_size, {});
  impl.id_known.assign(impl.vocab_size, 0);
  for (const auto& [tok, id] : impl.vocab) {
    std::string bytes;
    const bool mapped = byte_level_to_bytes(tok, bytes);
    // As HF's decoder: a token that is not all byte-level symbols decodes as its UTF-8.
    impl.id_to_bytes[id] = mapped ? bytes : tok;
    impl.id_known[id] = 1;
    if (mapped) impl.raw_vocab.emplace(bytes, id);
  }
  std::string missing;
  int nmissing = 0;
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    append_utf8(byte_to_codepoint()[b], sym);
    auto it = impl.vocab.find(sym);
    if (it == impl.vocab.end()) {
      if (nmissing++ < 4) missing += (missing.empty() ? "" : ", ") + std::string("0x") + "0123456789abcdef"[b >> 4] + "0123456789abcdef"[b & 15];
      continue;
    }
    impl.byte_id[b] = it->second;
  }
  // HF drops such bytes silently (no unk token); trainrun would rather not lose text.
  if (nmissing)
    c.fail("model.vocab", "lacks the byte-level symbols of " + std::to_string(nmissing) + " byte(s) (" + missing +
                              (nmissing > 4 ? ", ..." : "") +
                              "); text with them could not be encoded. Train with initial_alphabet=ByteLevel.alphabet()");

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
    auto ia = impl.vocab.find(a), ib = impl.vocab.find(b), im = impl.vocab.find(a + b);
    if (ia == impl.vocab.end()) c.fail(path, "token " + show(json(a)) + " of " + show(e) + " is not in model.vocab");
    if (ib == impl.vocab.end()) c.fail(path, "token " + show(json(b)) + " of " + show(e) + " is not in model.vocab");
    if (im == impl.vocab.end()) c.fail(path, "the merged token " + show(json(a + b)) + " is not in model.vocab");
    table.push_back({ia->second, ib->second, static_cast<uint32_t>(i), im->second});
  }
  impl.merges.build(table);
}

void load_added_tokens(const Ctx& c, const json& root, Tokenizer::Impl& impl) {
  const json* list = member(root, "added_tokens");
  if (!list || list->is_null()) return;
  if (!list->is_array()) c.fail("added_tokens", "expected an array, got " + show(*list));
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) c.fail(path, "expected an object, got " + show(t));
    const json* id = member(t, "id");
    const json* content = member(t, "content");
    if (!id || !id->is_number_unsigned() || id->get<uint64_t>() > 0x7FFFFFFF)
      c.fail(path + ".id", "missing or not a non-negative integer");
    check_token_id_size(c, path + ".id", id->get<uint64_t>());
    if (!content || !content->is_string() || content->get<std::string>().empty())
      c.fail(path + ".content", "missing, empty or not a string");
    // These change where a token matches; none of the supported models sets them.
    for (const char* k : {"single_word", "lstrip", "rstrip"})
      if (get_bool(c, t, path, k, false)) c.fail(path + "." + k, "true is not supported (only false)");
    AddedToken a;
    a.id = id->get<uint32_t>();
    a.content = content->get<std::string>();
    a.special = get_bool(c, t, path, "special", false);
    if (find_invalid_utf8(a.content) >= 0) c.fail(path + ".content", "is not valid UTF-8");
    impl.added_by_content[a.content] = a.id;
    if (a.id >= impl.vocab_size) {
      impl.vocab_size = a.id + 1;
      impl.id_to_bytes.resize(impl.vocab_size);
      impl.id_known.resize(impl.vocab_size, 0);
    }
    impl.id_known[a.id] = 1;
    // HF's decoder maps an added token's characters through the byte table
    // too; printable ASCII maps to itself, so "<|eot_id|>" decodes as spelled.
    std::string bytes;
    const bool mapped = byte_level_to_bytes(a.content, bytes);
    impl.id_to_bytes[a.id] = mapped ? bytes : a.content;
    impl.any_special = impl.any_special || a.special;
    impl.any_plain_added = impl.any_plain_added || !a.special;
    impl.added.push_back(std::move(a));
  }
  for (uint32_t k = 0; k < impl.added.size(); ++k)
    impl.added_by_first[static_cast<unsigned char>(impl.added[k].content[0])].push_back(k);
  for (auto& v : impl.added_by_first)
    std::stable_sort(v.begin(), v.end(), [&](uint32_t x, uint32_t y) {
      return impl.added[x].content.size() > impl.added[y].content.size();
    });
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
  if (const json* n = member(root, "normalizer"); n && !n->is_null()) {
    // An empty Sequence is a no-op some exporters write.
    const bool empty_seq = n->is_object() && n->value("type", "") == "Sequence" && n->contains("normalizers") &&
                           (*n)["normalizers"].is_array() && (*n)["normalizers"].empty();
    if (!empty_seq)
      c.fail("normalizer", (n->is_object() && n->contains("type") ? show((*n)["type"]) : show(*n)) +
                               " is not supported; byte-level BPE tokenizers have \"normalizer\": null");
  }
  if (const json* t = member(root, "truncation"); t && !t->is_null())
    c.fail("truncation", show(*t) + " is not supported (it would cut documents); set it to null");
  const json* model = member(root, "model");
  if (!model) c.fail("model", "missing");
  load_model(c, *model, *impl);
  load_added_tokens(c, root, *impl);
  const json* pt = member(root, "pre_tokenizer");
  if (!pt || pt->is_null()) c.fail("pre_tokenizer", "missing; a byte-level BPE tokenizer needs a ByteLevel pre-tokenizer");
  PreTokState st;
  load_pre_tokenizer(c, *pt, "pre_tokenizer", *impl, st);
  if (!st.saw_byte_level)
    c.fail("pre_tokenizer", "has no ByteLevel pre-tokenizer; only byte-level BPE tokenizers are supported");
  if (const json* d = member(root, "decoder")) check_decoder(c, *d, "decoder");
  if (const json* p = member(root, "post_processor")) load_post_processor(c, *p, "post_processor", *impl);
  return Tokenizer(std::move(impl));
}

uint32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::name() const { return impl_->name; }
int64_t Tokenizer::bos_id() const { return impl_->bos; }

bool Tokenizer::can_cut_before_line() const {
  static const char* const known[] = {
      kGpt2Pattern,
      // Llama 3
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      // Qwen2
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
  };
  if (impl_->add_prefix_space) return false;
  for (const auto& s : impl_->splits) {
    bool ok = false;
    for (const char* k : known) ok = ok || s.re.pattern == k;
    if (!ok) return false;
  }
  // An added token spanning "\n" + letter could match across the cut.
  for (const auto& a : impl_->added)
    if (a.content.find('\n') != std::string::npos) return false;
  return true;
}

int64_t Tokenizer::token_id(const std::string& token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return -1;
}

int64_t Tokenizer::special_id(const std::string& content) const {
  for (const auto& a : impl_->added)
    if (a.special && a.content == content) return a.id;
  return -1;
}

std::string Tokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id >= impl_->vocab_size || !impl_->id_known[id])
      TR_FAIL("tokenizer '", impl_->name, "': cannot decode id ", id, " at position ", i, ": not in the vocab (size ",
              impl_->vocab_size, ")");
    out += impl_->id_to_bytes[id];
  }
  return out;
}

}  // namespace trainrun
