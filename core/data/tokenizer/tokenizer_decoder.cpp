// Decoders (ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace,
// Sequence) as HF's decode_chain runs them over the tokens' strings, and
// post-processors (TemplateProcessing, ByteLevel, Bert, Roberta, Sequence)
// as the ids they put around a sequence.
#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer_json.h"

namespace trainrun {

namespace {

// Bytes of a token under the ByteLevel decoder: its characters mapped back
// through the byte table, or its UTF-8 as is when one is not in the table.
void byte_level_bytes(const std::string& t, std::string& out) {
  const size_t at = out.size();
  for (size_t i = 0; i < t.size();) {
    const int b = byte_of_codepoint(uni::next(t, i));
    if (b < 0) {
      out.resize(at);
      out += t;
      return;
    }
    out += static_cast<char>(b);
  }
}

}  // namespace

std::string Tokenizer::decode(const std::vector<uint32_t>& ids) const {
  const Impl& im = *impl_;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= im.vocab_size || !im.id_known[ids[i]])
      TR_FAIL("tokenizer '", im.name, "': cannot decode id ", ids[i], " at position ", i, ": not in the vocab (size ",
              im.vocab_size, ")");
  if (im.byte_level_decode) {
    std::string out;
    for (uint32_t id : ids) out += im.id_to_bytes[id];
    return out;
  }
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (uint32_t id : ids) toks.push_back(im.id_to_token[id]);
  if (!im.has_decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
    return out;
  }
  MatchState ms;
  for (size_t k = 0; k < im.decoders.size(); ++k) {
    const DecodeStep& d = im.decoders[k];
    std::vector<std::string> next;
    switch (d.kind) {
      case DecodeStep::kByteLevel: {
        std::string bytes;
        for (const auto& t : toks) byte_level_bytes(t, bytes);
        // HF makes it a string here (lossy); the last step keeps the bytes,
        // so decode() stays exact and utf8_lossy of it is HF's text.
        next.push_back(k + 1 == im.decoders.size() ? bytes : utf8_lossy(bytes));
        break;
      }
      case DecodeStep::kByteFallback: {
        std::string pend;
        size_t npend = 0;
        auto flush = [&] {
          if (!npend) return;
          if (find_invalid_utf8(pend) < 0) next.push_back(pend);
          else
            for (size_t j = 0; j < npend; ++j) next.push_back("\xEF\xBF\xBD");
          pend.clear();
          npend = 0;
        };
        for (auto& t : toks) {
          auto hex = [](char ch) {
            return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
          };
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && hex(t[3]) >= 0 && hex(t[4]) >= 0) {
            pend += static_cast<char>(hex(t[3]) * 16 + hex(t[4]));
            ++npend;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case DecodeStep::kFuse: {
        std::string all;
        for (const auto& t : toks) all += t;
        next.push_back(std::move(all));
        break;
      }
      case DecodeStep::kReplace:
        for (const auto& t : toks) next.push_back(regex_replace_all(*d.re, t, d.content, ms));
        break;
      case DecodeStep::kStrip:
        for (const auto& t : toks) {
          std::vector<std::pair<size_t, uint32_t>> cs;  // (byte offset, code point)
          for (size_t i = 0; i < t.size();) {
            const size_t b = i;
            cs.push_back({b, uni::next(t, i)});
          }
          size_t start = 0, stop = cs.size();
          for (size_t i = 0; i < std::min(d.start, cs.size()) && cs[i].second == d.ch; ++i) start = i + 1;
          for (size_t i = 0; i < d.stop && i < cs.size(); ++i) {
            const size_t idx = cs.size() - i - 1;
            if (cs[idx].second != d.ch) break;
            stop = idx;
          }
          if (stop < start) stop = start;
          const size_t b = start < cs.size() ? cs[start].first : t.size();
          const size_t e = stop < cs.size() ? cs[stop].first : t.size();
          next.push_back(t.substr(b, e - b));
        }
        break;
      case DecodeStep::kMetaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          std::string o;
          const std::string& t = toks[i];
          for (size_t j = 0; j < t.size();) {
            const size_t b = j;
            const uint32_t cp = uni::next(t, j);
            if (cp == d.ch) {
              if (!(i == 0 && d.prepend)) o += ' ';
            } else {
              o.append(t, b, j - b);
            }
          }
          next.push_back(std::move(o));
        }
        break;
    }
    toks.swap(next);
  }
  std::string out;
  for (const auto& t : toks) out += t;
  return out;
}

std::vector<uint32_t> Tokenizer::with_special_tokens(const std::vector<uint32_t>& ids) const {
  std::vector<uint32_t> out(impl_->pp_prefix);
  out.insert(out.end(), ids.begin(), ids.end());
  out.insert(out.end(), impl_->pp_suffix.begin(), impl_->pp_suffix.end());
  return out;
}

namespace tokjson {

void load_decoder(const Ctx& c, const json& d, const std::string& path, std::vector<DecodeStep>& out) {
  if (d.is_null()) return;
  const std::string type = get_type(c, d, path);
  DecodeStep s;
  if (type == "Sequence") {
    const json& list = get_list(c, d, path, "decoders");
    for (size_t i = 0; i < list.size(); ++i) load_decoder(c, list[i], path + ".decoders[" + std::to_string(i) + "]", out);
    return;
  } else if (type == "ByteLevel") {
    s.kind = DecodeStep::kByteLevel;
  } else if (type == "ByteFallback") {
    s.kind = DecodeStep::kByteFallback;
  } else if (type == "Fuse") {
    s.kind = DecodeStep::kFuse;
  } else if (type == "Replace") {
    s.kind = DecodeStep::kReplace;
    s.re = get_pattern(c, d, path);
    s.content = get_string(c, d, path, "content", "");
  } else if (type == "Strip") {
    s.kind = DecodeStep::kStrip;
    s.ch = get_char(c, d, path, "content", ' ');
    s.start = get_uint(c, d, path, "start", 0);
    s.stop = get_uint(c, d, path, "stop", 0);
  } else if (type == "Metaspace") {
    s.kind = DecodeStep::kMetaspace;
    s.ch = get_char(c, d, path, "replacement", 0x2581);
    std::string scheme = get_string(c, d, path, "prepend_scheme", "always");
    if (const json* a = member(d, "add_prefix_space"); a && a->is_boolean() && !a->get<bool>()) scheme = "never";
    if (scheme != "always" && scheme != "first" && scheme != "never")
      c.fail(path + ".prepend_scheme", "expected \"always\", \"first\" or \"never\", got " + show(json(scheme)));
    s.prepend = scheme != "never";
  } else if (type == "WordPiece" || type == "BPEDecoder" || type == "CTC") {
    c.fail(path + ".type", "decoder " + show(json(type)) + " is not supported (it decodes encoder-model or speech vocabularies)");
  } else {
    c.fail(path + ".type", "decoder " + show(json(type)) + " is unknown");
  }
  out.push_back(std::move(s));
}

namespace {

uint32_t special_ref(const Ctx& c, const json& p, const std::string& path, const std::string& name,
                     const Tokenizer::Impl& impl, std::vector<uint32_t>& ids) {
  // TemplateProcessing lists each special token's ids in special_tokens.
  if (const json* st = member(p, "special_tokens"); st && st->is_object()) {
    if (const json* e = member(*st, name.c_str()); e && e->is_object()) {
      const json* v = member(*e, "ids");
      if (!v || !v->is_array()) c.fail(path + ".special_tokens." + name + ".ids", "missing or not an array");
      for (const json& x : *v) {
        if (!x.is_number_unsigned() || x.get<uint64_t>() >= impl.vocab_size)
          c.fail(path + ".special_tokens." + name + ".ids", show(x) + " is not an id of the vocab");
        ids.push_back(x.get<uint32_t>());
      }
      return 0;
    }
    c.fail(path, "template names special token " + show(json(name)) + ", which special_tokens lacks");
  }
  // Bert/Roberta: [token, id]
  const json* v = member(p, name.c_str());
  if (!v || !v->is_array() || v->size() != 2 || !(*v)[1].is_number_unsigned())
    c.fail(path + "." + name, "expected [\"token\", id]");
  ids.push_back((*v)[1].get<uint32_t>());
  return 0;
}

}  // namespace

void load_post_processor(const Ctx& c, const json& p, const std::string& path, Tokenizer::Impl& impl) {
  if (p.is_null()) return;
  const std::string type = get_type(c, p, path);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& list = get_list(c, p, path, "processors");
    for (size_t i = 0; i < list.size(); ++i)
      load_post_processor(c, list[i], path + ".processors[" + std::to_string(i) + "]", impl);
    return;
  }
  std::vector<uint32_t> pre, post;
  if (type == "TemplateProcessing") {
    const json* single = member(p, "single");
    if (!single || !single->is_array()) c.fail(path + ".single", "missing or not an array");
    bool seen_a = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      const std::string ipath = path + ".single[" + std::to_string(i) + "]";
      if (const json* sq = member(item, "Sequence")) {
        if (seen_a || !sq->is_object() || sq->value("id", "") != "A")
          c.fail(ipath, "a single-sequence template has one {\"Sequence\": {\"id\": \"A\"}}, got " + show(item));
        seen_a = true;
        continue;
      }
      const json* st = member(item, "SpecialToken");
      if (!st || !st->is_object() || !st->contains("id") || !(*st)["id"].is_string())
        c.fail(ipath, "expected {\"SpecialToken\": {\"id\": ...}} or {\"Sequence\": ...}, got " + show(item));
      special_ref(c, p, path, (*st)["id"].get<std::string>(), impl, seen_a ? post : pre);
    }
    if (!seen_a) c.fail(path + ".single", "has no {\"Sequence\": {\"id\": \"A\"}}");
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    special_ref(c, p, path, "cls", impl, pre);
    special_ref(c, p, path, "sep", impl, post);
  } else {
    c.fail(path + ".type", "post-processor " + show(json(type)) + " is unknown");
  }
  // A later processor wraps what the earlier ones made.
  impl.pp_prefix.insert(impl.pp_prefix.begin(), pre.begin(), pre.end());
  impl.pp_suffix.insert(impl.pp_suffix.end(), post.begin(), post.end());
  if (!impl.pp_prefix.empty()) impl.bos = impl.pp_prefix.front();
}

}  // namespace tokjson
}  // namespace trainrun
