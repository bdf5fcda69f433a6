// Text facts the tokenizer components share: UTF-8 helpers, the byte-level
// alphabet, PCRE2 matching, and the Unicode properties, normal forms, case
// mapping and grapheme clusters HF tokenizers takes from Rust crates, here
// from ICU (Debian's libicu).
#include <unicode/brkiter.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/ustring.h>
#include <unicode/utext.h>

#include <cstring>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun {

const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

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

int byte_of_codepoint(uint32_t cp) {
  static const std::array<int16_t, 324> inv = [] {
    std::array<int16_t, 324> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[byte_to_codepoint()[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return cp < inv.size() ? inv[cp] : -1;
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

// ---- PCRE2

MatchState::MatchState() {
  md = pcre2_match_data_create(1, nullptr);
  mctx = pcre2_match_context_create(nullptr);
  // The default 32 KiB JIT stack overflows on long whitespace runs under
  // \s+(?!\S); 8 MiB covers any input a line-oriented corpus has.
  jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  TR_CHECK(md && mctx && jit_stack, "tokenizer: out of memory creating the PCRE2 match state");
  pcre2_jit_stack_assign(mctx, nullptr, jit_stack);
}

MatchState::~MatchState() {
  if (md) pcre2_match_data_free(md);
  if (mctx) pcre2_match_context_free(mctx);
  if (jit_stack) pcre2_jit_stack_free(jit_stack);
}

void regex_fail(const CompiledRegex& re, int rc, size_t n) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  TR_FAIL("tokenizer: regex ", re.pattern, " failed on a ", n, "-byte piece: ", reinterpret_cast<char*>(msg));
}

void regex_find_all(const CompiledRegex& re, std::string_view subject, MatchState& ms, std::vector<Span>& out) {
  out.clear();
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t start = 0;
  while (start <= n) {
    const int rc = re.jit ? pcre2_jit_match(re.code, s, n, start, 0, ms.md, ms.mctx)
                          : pcre2_match(re.code, s, n, start, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) regex_fail(re, rc, n);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    out.push_back({ov[0], ov[1]});
    if (ov[1] == ov[0]) {
      // After an empty match the search resumes one character on.
      start = ov[1] + 1;
      while (start < n && (static_cast<unsigned char>(subject[start]) & 0xC0) == 0x80) ++start;
    } else {
      start = ov[1];
    }
  }
}

std::string regex_replace_all(const CompiledRegex& re, std::string_view s, std::string_view content, MatchState& ms) {
  std::vector<Span> m;
  regex_find_all(re, s, ms, m);
  if (m.empty()) return std::string(s);
  std::string out;
  size_t last = 0;
  for (const Span& sp : m) {
    out.append(s.substr(last, sp.b - last));
    out.append(content);
    last = sp.e;
  }
  out.append(s.substr(last));
  return out;
}

// ---- Unicode

namespace uni {

uint32_t next(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const unsigned char c = p[i];
  if (c < 0x80) return p[i++];
  const size_t len = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  uint32_t cp = len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
  i += len;
  return cp;
}

bool is_whitespace(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 9 && cp <= 13);
  return u_isUWhiteSpace(static_cast<UChar32>(cp));
}

bool is_punctuation(uint32_t cp) {
  if (cp < 0x80) return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) || (cp >= 123 && cp <= 126);
  return u_ispunct(static_cast<UChar32>(cp));
}

bool is_numeric(uint32_t cp) {
  const int8_t t = u_charType(static_cast<UChar32>(cp));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool is_word(uint32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  const auto c = static_cast<UChar32>(cp);
  const int8_t t = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK ||
         t == U_COMBINING_SPACING_MARK || t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION ||
         u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL);
}

static bool ascii(std::string_view s) {
  for (char ch : s)
    if (static_cast<unsigned char>(ch) >= 0x80) return false;
  return true;
}

void normalize(Form f, std::string& s) {
  if (ascii(s)) return;  // every normal form leaves ASCII as it is
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* n = f == Form::NFC    ? icu::Normalizer2::getNFCInstance(st)
                              : f == Form::NFD  ? icu::Normalizer2::getNFDInstance(st)
                              : f == Form::NFKC ? icu::Normalizer2::getNFKCInstance(st)
                                                : icu::Normalizer2::getNFKDInstance(st);
  TR_CHECK(U_SUCCESS(st), "tokenizer: ICU cannot load its normalization data: ", u_errorName(st));
  if (n->isNormalizedUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), st) && U_SUCCESS(st)) return;
  st = U_ZERO_ERROR;
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  icu::StringByteSink<std::string> sink(&out);
  n->normalizeUTF8(0, icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), sink, nullptr, st);
  TR_CHECK(U_SUCCESS(st), "tokenizer: ICU normalization failed: ", u_errorName(st));
  s.swap(out);
}

void lowercase(std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
      ++i;
      continue;
    }
    const uint32_t cp = next(s, i);
    // One code point alone: its full lowercase mapping with no context, as
    // Rust's char::to_lowercase (U+0130 gives two code points, Σ gives σ).
    UChar in[2], low[8];
    int32_t n_in = 0;
    U16_APPEND_UNSAFE(in, n_in, static_cast<UChar32>(cp));
    UErrorCode st = U_ZERO_ERROR;
    const int32_t n_low = u_strToLower(low, 8, in, n_in, "", &st);
    if (U_FAILURE(st)) {
      append_utf8(cp, out);
      continue;
    }
    for (int32_t k = 0; k < n_low;) {
      UChar32 o;
      U16_NEXT_UNSAFE(low, k, o);
      append_utf8(static_cast<uint32_t>(o), out);
    }
  }
  s.swap(out);
}

void graphemes(std::string_view s, std::vector<std::string_view>& out) {
  out.clear();
  if (s.empty()) return;
  UErrorCode st = U_ZERO_ERROR;
  thread_local std::unique_ptr<icu::BreakIterator> bi(icu::BreakIterator::createCharacterInstance(icu::Locale::getRoot(), st));
  TR_CHECK(bi && U_SUCCESS(st), "tokenizer: ICU cannot make a grapheme break iterator: ", u_errorName(st));
  UText* ut = utext_openUTF8(nullptr, s.data(), static_cast<int64_t>(s.size()), &st);
  TR_CHECK(U_SUCCESS(st), "tokenizer: ICU cannot open the text: ", u_errorName(st));
  bi->setText(ut, st);
  int32_t prev = bi->first();
  for (int32_t p = bi->next(); p != icu::BreakIterator::DONE; p = bi->next()) {
    out.push_back(s.substr(static_cast<size_t>(prev), static_cast<size_t>(p - prev)));
    prev = p;
  }
  utext_close(ut);
}

}  // namespace uni
}  // namespace trainrun
