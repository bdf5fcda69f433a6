// Pre-tokenizers, as HF tokenizers splits: every splitting one lists its
// matches and the gaps between them, then a behavior (Removed, Isolated,
// MergedWithPrevious, MergedWithNext, Contiguous) turns that list into
// pieces; empty pieces are dropped. ByteLevel and Metaspace also rewrite
// the text. (The byte-level fast path in tokenizer_encode.cpp does the
// common Split(Isolated) + ByteLevel case without copying.)
#include "core/data/tokenizer/tokenizer_json.h"

namespace trainrun {

namespace {

struct Mark {
  size_t b, e;
  bool match;
};

// Matches of a per-character predicate: each matching character is its own
// match (HF's Pattern for Fn(char) -> bool).
template <typename Pred>
void char_matches(std::string_view s, Pred&& pred, std::vector<Mark>& out) {
  size_t last = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t b = i;
    const uint32_t cp = uni::next(s, i);
    if (pred(cp)) {
      if (last < b) out.push_back({last, b, false});
      out.push_back({b, i, true});
      last = i;
    }
  }
  if (last < s.size()) out.push_back({last, s.size(), false});
}

void split_piece(const PreTokStep& st, const Piece& in, MatchState& ms, std::vector<Piece>& out) {
  const std::string_view s = in.text;
  std::vector<Mark> marks;
  if (st.re) {  // Split, Whitespace, ByteLevel's own regex
    std::vector<Span> m;
    regex_find_all(*st.re, s, ms, m);
    size_t prev = 0;
    for (const Span& sp : m) {
      if (prev != sp.b) marks.push_back({prev, sp.b, false});
      marks.push_back({sp.b, sp.e, true});
      prev = sp.e;
    }
    if (prev != s.size()) marks.push_back({prev, s.size(), false});
  } else {
    switch (st.cls) {
      case PreTokStep::kWhitespace: char_matches(s, uni::is_whitespace, marks); break;
      case PreTokStep::kPunctuation: char_matches(s, uni::is_punctuation, marks); break;
      case PreTokStep::kNumeric: char_matches(s, uni::is_numeric, marks); break;
      case PreTokStep::kOneChar: char_matches(s, [&](uint32_t cp) { return cp == st.ch; }, marks); break;
    }
  }
  if (st.invert)
    for (Mark& m : marks) m.match = !m.match;
  // (begin, end, remove)
  std::vector<Mark> splits;
  bool prev_match = false;
  switch (st.behavior) {
    case SplitBehavior::kIsolated:
      for (const Mark& m : marks) splits.push_back({m.b, m.e, false});
      break;
    case SplitBehavior::kRemoved:
      splits = marks;
      break;
    case SplitBehavior::kContiguous:
      for (const Mark& m : marks) {
        if (m.match == prev_match && !splits.empty()) splits.back().e = m.e;
        else splits.push_back({m.b, m.e, false});
        prev_match = m.match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Mark& m : marks) {
        if (m.match && !prev_match && !splits.empty()) splits.back().e = m.e;
        else splits.push_back({m.b, m.e, false});
        prev_match = m.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (size_t k = marks.size(); k-- > 0;) {
        const Mark& m = marks[k];
        if (m.match && !prev_match && !splits.empty()) splits.back().b = m.b;
        else splits.push_back({m.b, m.e, false});
        prev_match = m.match;
      }
      std::reverse(splits.begin(), splits.end());
      break;
  }
  for (const Mark& sp : splits) {
    if (sp.match || sp.e == sp.b) continue;  // `match` here means "remove"
    out.push_back({std::string(s.substr(sp.b, sp.e - sp.b)), in.at_start && sp.b == 0});
  }
}

}  // namespace

void apply_pre_tokenizers(const std::vector<PreTokStep>& steps, std::vector<Piece>& pieces, MatchState& ms) {
  std::vector<Piece> next;
  for (const PreTokStep& st : steps) {
    next.clear();
    for (Piece& p : pieces) {
      switch (st.kind) {
        case PreTokStep::kByteLevel: {
          if (st.add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
          std::vector<Piece> parts;
          if (st.re) {
            split_piece(st, p, ms, parts);
          } else {
            parts.push_back(std::move(p));
          }
          for (Piece& q : parts) {
            std::string mapped;
            mapped.reserve(q.text.size() * 2);
            for (char ch : q.text) append_utf8(byte_to_codepoint()[static_cast<unsigned char>(ch)], mapped);
            next.push_back({std::move(mapped), q.at_start});
          }
          break;
        }
        case PreTokStep::kMetaspace: {
          std::string t;
          t.reserve(p.text.size() + 8);
          for (char ch : p.text) {
            if (ch == ' ') t += st.replacement_utf8;
            else t += ch;
          }
          const bool starts = t.compare(0, st.replacement_utf8.size(), st.replacement_utf8) == 0;
          if (!starts && (st.prepend == PreTokStep::kAlways || (st.prepend == PreTokStep::kFirst && p.at_start)))
            t.insert(0, st.replacement_utf8);
          Piece q{std::move(t), p.at_start};
          if (!st.split) {
            if (!q.text.empty()) next.push_back(std::move(q));
          } else {
            PreTokStep sp;
            sp.kind = PreTokStep::kCharClass;
            sp.cls = PreTokStep::kOneChar;
            sp.ch = st.replacement;
            sp.behavior = SplitBehavior::kMergedWithNext;
            split_piece(sp, q, ms, next);
          }
          break;
        }
        case PreTokStep::kRegex:
        case PreTokStep::kCharClass:
          split_piece(st, p, ms, next);
          break;
      }
    }
    pieces.swap(next);
  }
}

namespace tokjson {

namespace {

SplitBehavior get_behavior(const Ctx& c, const json& p, const std::string& path, SplitBehavior dflt) {
  const json* b = member(p, "behavior");
  if (!b || b->is_null()) return dflt;
  const std::string v = b->is_string() ? b->get<std::string>() : "";
  if (v == "Removed") return SplitBehavior::kRemoved;
  if (v == "Isolated") return SplitBehavior::kIsolated;
  if (v == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (v == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (v == "Contiguous") return SplitBehavior::kContiguous;
  c.fail(path + ".behavior",
         "expected Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous, got " + show(*b));
}

PreTokStep char_split(PreTokStep::CharClass cls, SplitBehavior b, bool invert = false) {
  PreTokStep s;
  s.kind = PreTokStep::kCharClass;
  s.cls = cls;
  s.behavior = b;
  s.invert = invert;
  return s;
}

}  // namespace

void load_pre_tokenizer(const Ctx& c, const json& p, const std::string& path, std::vector<PreTokStep>& out) {
  if (p.is_null()) return;
  const std::string type = get_type(c, p, path);
  PreTokStep s;
  if (type == "Sequence") {
    const json& list = get_list(c, p, path, "pretokenizers");
    for (size_t i = 0; i < list.size(); ++i)
      load_pre_tokenizer(c, list[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  }
  if (type == "ByteLevel") {
    s.kind = PreTokStep::kByteLevel;
    s.add_prefix_space = get_bool(c, p, path, "add_prefix_space", true);
    if (get_bool(c, p, path, "use_regex", true)) {
      s.re = std::make_shared<CompiledRegex>();
      compile_regex(c, path, kGpt2Pattern, false, *s.re);
    }
    s.behavior = SplitBehavior::kIsolated;
  } else if (type == "Metaspace") {
    s.kind = PreTokStep::kMetaspace;
    s.replacement = get_char(c, p, path, "replacement", 0x2581);
    append_utf8(s.replacement, s.replacement_utf8);
    const std::string scheme = get_string(c, p, path, "prepend_scheme", "always");
    if (scheme == "always") s.prepend = PreTokStep::kAlways;
    else if (scheme == "first") s.prepend = PreTokStep::kFirst;
    else if (scheme == "never") s.prepend = PreTokStep::kNever;
    else c.fail(path + ".prepend_scheme", "expected \"always\", \"first\" or \"never\", got " + show(json(scheme)));
    // Files older than prepend_scheme say add_prefix_space.
    if (const json* a = member(p, "add_prefix_space"); a && a->is_boolean() && !a->get<bool>()) {
      if (s.prepend != PreTokStep::kNever && member(p, "prepend_scheme"))
        c.fail(path + ".add_prefix_space", "false contradicts prepend_scheme " + show(json(scheme)));
      s.prepend = PreTokStep::kNever;
    }
    s.split = get_bool(c, p, path, "split", true);
  } else if (type == "Split") {
    s.kind = PreTokStep::kRegex;
    s.re = get_pattern(c, p, path);
    s.behavior = get_behavior(c, p, path, SplitBehavior::kIsolated);
    if (!member(p, "behavior")) c.fail(path + ".behavior", "missing");
    s.invert = get_bool(c, p, path, "invert", false);
  } else if (type == "Whitespace") {
    // \w+|[^\w\s]+ kept, the rest removed.
    s.kind = PreTokStep::kRegex;
    s.re = std::make_shared<CompiledRegex>();
    compile_regex(c, path, R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]+|[^\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\s]+)",
                  false, *s.re);
    s.behavior = SplitBehavior::kRemoved;
    s.invert = true;
  } else if (type == "WhitespaceSplit") {
    s = char_split(PreTokStep::kWhitespace, SplitBehavior::kRemoved);
  } else if (type == "Punctuation") {
    s = char_split(PreTokStep::kPunctuation, get_behavior(c, p, path, SplitBehavior::kIsolated));
  } else if (type == "Digits") {
    s = char_split(PreTokStep::kNumeric, get_bool(c, p, path, "individual_digits", false) ? SplitBehavior::kIsolated
                                                                                          : SplitBehavior::kContiguous);
  } else if (type == "BertPreTokenizer") {
    out.push_back(char_split(PreTokStep::kWhitespace, SplitBehavior::kRemoved));
    s = char_split(PreTokStep::kPunctuation, SplitBehavior::kIsolated);
  } else if (type == "CharDelimiterSplit") {
    s = char_split(PreTokStep::kOneChar, SplitBehavior::kRemoved);
    s.ch = get_char(c, p, path, "delimiter", 0);
  } else if (type == "UnicodeScripts" || type == "FixedLength") {
    c.fail(path + ".type", "pre-tokenizer " + show(json(type)) +
                               " is not supported (no causal LM ships it; UnicodeScripts needs HF's own script table)");
  } else {
    c.fail(path + ".type", "pre-tokenizer " + show(json(type)) + " is unknown");
  }
  out.push_back(std::move(s));
}

}  // namespace tokjson
}  // namespace trainrun
