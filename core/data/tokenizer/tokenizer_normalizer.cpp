// Normalizers: NFC/NFD/NFKC/NFKD, Lowercase, Strip, Replace, Prepend,
// Precompiled (SentencePiece's charsmap) and Sequence, as HF tokenizers
// applies them to the text between added tokens.
#include <cstring>

#include "core/data/tokenizer/tokenizer_json.h"

namespace trainrun {

bool Precompiled::transform(std::string_view chunk, std::string_view& out) const {
  // darts-clone's unit layout: has_leaf bit 8, value the low 31 bits, label
  // the low byte (plus bit 31), offset bits 10.. shifted by bit 9.
  auto has_leaf = [](uint32_t u) { return ((u >> 8) & 1) == 1; };
  auto value = [](uint32_t u) { return u & ((1u << 31) - 1); };
  auto label = [](uint32_t u) { return u & ((1u << 31) | 0xFF); };
  auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); };
  if (trie.empty()) return false;
  size_t pos = 0;
  pos ^= offset(trie[0]);
  for (char ch : chunk) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0) break;
    pos ^= c;
    if (pos >= trie.size()) return false;  // a hostile trie: no match, never out of bounds
    const uint32_t u = trie[pos];
    if (label(u) != c) return false;
    pos ^= offset(u);
    if (pos >= trie.size()) return false;
    if (has_leaf(u)) {
      // The first (shortest) prefix found decides, as spm_precompiled does.
      const size_t at = value(trie[pos]);
      if (at >= normalized.size()) return false;
      const size_t end = normalized.find('\0', at);
      out = std::string_view(normalized).substr(at, (end == std::string::npos ? normalized.size() : end) - at);
      return true;
    }
  }
  return false;
}

void Precompiled::apply(std::string& s) const {
  // Per grapheme: a grapheme under 6 bytes that the trie maps is replaced
  // whole; otherwise each character is looked up on its own. (HF's
  // comment: "Yes, this seems broken"; it is what SentencePiece does.)
  std::vector<std::string_view> gs;
  uni::graphemes(s, gs);
  std::string out;
  out.reserve(s.size());
  std::string_view norm;
  for (std::string_view g : gs) {
    if (g.size() < 6 && transform(g, norm)) {
      out.append(norm);
      continue;
    }
    for (size_t i = 0; i < g.size();) {
      const size_t b = i;
      uni::next(g, i);
      const std::string_view ch = g.substr(b, i - b);
      if (transform(ch, norm)) out.append(norm);
      else out.append(ch);
    }
  }
  s.swap(out);
}

void apply_normalizers(const std::vector<NormStep>& steps, std::string& s, MatchState& ms, bool prepend) {
  for (const NormStep& n : steps) {
    switch (n.kind) {
      case NormStep::kNFC: uni::normalize(uni::Form::NFC, s); break;
      case NormStep::kNFD: uni::normalize(uni::Form::NFD, s); break;
      case NormStep::kNFKC: uni::normalize(uni::Form::NFKC, s); break;
      case NormStep::kNFKD: uni::normalize(uni::Form::NFKD, s); break;
      case NormStep::kLowercase: uni::lowercase(s); break;
      case NormStep::kStrip: {
        size_t b = 0, e = s.size();
        if (n.left)
          for (size_t i = 0; i < s.size();) {
            const size_t at = i;
            if (!uni::is_whitespace(uni::next(s, i))) { b = at; break; }
            b = i;
          }
        if (n.right) {
          // Walk back over whitespace characters from the end.
          size_t i = e;
          while (i > b) {
            size_t st = i - 1;
            while (st > b && (static_cast<unsigned char>(s[st]) & 0xC0) == 0x80) --st;
            size_t k = st;
            if (!uni::is_whitespace(uni::next(s, k))) break;
            i = st;
          }
          e = i;
        }
        s = s.substr(b, e - b);
        break;
      }
      case NormStep::kReplace: s = regex_replace_all(*n.re, s, n.text, ms); break;
      case NormStep::kPrepend:
        if (prepend && !s.empty()) s.insert(0, n.text);
        break;
      case NormStep::kPrecompiled: n.charsmap->apply(s); break;
    }
  }
}

namespace tokjson {

namespace {

std::string base64_decode(const Ctx& c, const std::string& path, const std::string& in) {
  auto val = [](char ch) -> int {
    if (ch >= 'A' && ch <= 'Z') return ch - 'A';
    if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') return ch - '0' + 52;
    if (ch == '+') return 62;
    if (ch == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(in.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const char ch = in[i];
    if (ch == '=') break;
    const int v = val(ch);
    if (v < 0) c.fail(path, "is not base64 (byte " + std::to_string(i) + ")");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

}  // namespace

void load_normalizer(const Ctx& c, const json& n, const std::string& path, std::vector<NormStep>& out) {
  if (n.is_null()) return;
  const std::string type = get_type(c, n, path);
  NormStep s{};
  if (type == "Sequence") {
    const json& list = get_list(c, n, path, "normalizers");
    for (size_t i = 0; i < list.size(); ++i) load_normalizer(c, list[i], path + ".normalizers[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "NFC") {
    s.kind = NormStep::kNFC;
  } else if (type == "NFD") {
    s.kind = NormStep::kNFD;
  } else if (type == "NFKC") {
    s.kind = NormStep::kNFKC;
  } else if (type == "NFKD") {
    s.kind = NormStep::kNFKD;
  } else if (type == "Lowercase") {
    s.kind = NormStep::kLowercase;
  } else if (type == "Strip") {
    s.kind = NormStep::kStrip;
    s.left = get_bool(c, n, path, "strip_left", false);
    s.right = get_bool(c, n, path, "strip_right", false);
  } else if (type == "Replace") {
    s.kind = NormStep::kReplace;
    s.re = get_pattern(c, n, path);
    s.text = get_string(c, n, path, "content", "");
  } else if (type == "Prepend") {
    s.kind = NormStep::kPrepend;
    s.text = get_string(c, n, path, "prepend", "");
  } else if (type == "Precompiled") {
    s.kind = NormStep::kPrecompiled;
    const json* m = member(n, "precompiled_charsmap");
    if (!m || !m->is_string()) c.fail(path + ".precompiled_charsmap", "missing or not a base64 string");
    const std::string blob = base64_decode(c, path + ".precompiled_charsmap", m->get<std::string>());
    auto pc = std::make_shared<Precompiled>();
    if (!blob.empty()) {
      uint32_t trie_bytes = 0;
      if (blob.size() < 4) c.fail(path + ".precompiled_charsmap", "is shorter than its 4-byte header");
      std::memcpy(&trie_bytes, blob.data(), 4);  // little-endian, as every supported host
      if (trie_bytes % 4 != 0 || trie_bytes > blob.size() - 4)
        c.fail(path + ".precompiled_charsmap", "declares a " + std::to_string(trie_bytes) + "-byte trie in a " +
                                                   std::to_string(blob.size()) + "-byte charsmap");
      pc->trie.resize(trie_bytes / 4);
      std::memcpy(pc->trie.data(), blob.data() + 4, trie_bytes);
      pc->normalized = blob.substr(4 + trie_bytes);
      if (find_invalid_utf8(pc->normalized) >= 0) c.fail(path + ".precompiled_charsmap", "its replacements are not UTF-8");
    }
    s.charsmap = std::move(pc);
  } else if (type == "BertNormalizer" || type == "StripAccents" || type == "Nmt" || type == "ByteLevel") {
    c.fail(path + ".type", "normalizer " + show(json(type)) +
                               " is not supported (encoder-model normalizers; causal LMs ship NFC/NFKC, Replace, "
                               "Prepend, Precompiled, Lowercase, Strip)");
  } else {
    c.fail(path + ".type", "normalizer " + show(json(type)) + " is unknown");
  }
  out.push_back(std::move(s));
}

}  // namespace tokjson
}  // namespace trainrun
