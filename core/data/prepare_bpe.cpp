// `trainrun prepare --tokenizer tokenizer.json`: text, jsonl and chat data
// into llm.c shards with an HF byte-level BPE tokenizer.
//
// Streaming and parallel: the main thread reads the inputs into batches of
// ~1 MiB (lines for the line formats, line-aligned blocks for text), a
// window of batches is encoded by `threads` OpenMP threads (one
// TokenEncoder each), and the window's tokens are appended in input order,
// so the output does not depend on the thread count. Memory is a window's
// text plus one shard of tokens, whatever the input size.
//
// Atomic: shards go to temp names while the inputs are read and are renamed
// to train_NNNNNN.bin / .mask only once every input was read and encoded
// without error, so a bad line at the end of a 50 GB run leaves the previous
// output as it was (and no temp files).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/dataset.h"
#include "core/data/llmc_format.h"
#include "core/data/chat_template.h"
#include "core/data/prepare_common.h"
#include "core/data/preference_pairs.h"
#include "core/data/prepare_meta.h"
#include "core/data/tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace trainrun {
namespace {

enum class Format { kText, kJsonl, kChat, kAlpaca, kShareGpt, kPreference };

Format parse_format(const std::string& s) {
  if (s == "text") return Format::kText;
  if (s == "jsonl") return Format::kJsonl;
  if (s == "chat") return Format::kChat;
  if (s == "alpaca") return Format::kAlpaca;
  if (s == "sharegpt") return Format::kShareGpt;
  if (s == "preference") return Format::kPreference;
  TR_FAIL("--format: '", s, "' is not one of text, jsonl, chat, alpaca, sharegpt, preference");
}

using namespace chat;  // the templates (core/data/chat_template.h)


// One unit of input: a line (line formats) or a block of a text document.
struct Item {
  int file = 0;
  int64_t line = 0;    // 1-based (line formats)
  int64_t offset = 0;  // byte offset of `raw` in its file
  std::string raw;
  bool doc_start = false;  // text: the first block of a document
  bool line_start = false; // text: `raw` begins a line (--document-separator matches there)
  bool val = false;
};

struct Output {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  int64_t docs = 0, long_docs = 0;
  // preference: per pair {offset of its chosen side in `tokens`, chosen
  // tokens, rejected tokens}; the rejected side follows the chosen one.
  std::vector<std::array<int64_t, 3>> pairs;
  int64_t text_bytes = 0;  // the text these tokens encode (text, jsonl): prepare.json's val_bytes
};

struct Batch {
  std::vector<Item> items;
  size_t bytes = 0;
  Output out[2];  // train, val
  std::string error;
};

struct Job {
  const PrepareOptions& opts;
  Format format;
  const Tokenizer& tok;
  DocStart doc_start;
  const ChatTemplate* tmpl;  // the chat formats
  const std::vector<std::string>& files;
  bool masks;
};

[[noreturn]] void fail_at(const Job& job, const Item& it, const std::string& what) {
  if (job.format == Format::kText) TR_FAIL(job.files[it.file], ": ", what);
  TR_FAIL(job.files[it.file], ":", it.line, ": ", what);
}

const std::string& get_string(const Job& job, const Item& it, const json& obj, const char* key, const std::string& where) {
  auto f = obj.find(key);
  if (f == obj.end()) fail_at(job, it, where + "missing \"" + key + "\"");
  if (!f->is_string()) fail_at(job, it, where + "\"" + key + "\" is not a string (" + std::string(f->type_name()) + ")");
  return f->get_ref<const std::string&>();
}

// `list_name`: the field holding the messages when it is not the format's
// own ("prompt" of a preference row, read as chat messages).
std::vector<Message> parse_messages(const Job& job, const Item& it, const json& j, const char* list_name = nullptr) {
  std::vector<Message> msgs;
  if (job.format == Format::kAlpaca) {
    std::string user = get_string(job, it, j, "instruction", "");
    if (auto in = j.find("input"); in != j.end() && !in->is_null()) {
      if (!in->is_string()) fail_at(job, it, "\"input\" is not a string");
      if (!in->get_ref<const std::string&>().empty()) user += "\n\n" + in->get<std::string>();
    }
    msgs.push_back({"user", user});
    msgs.push_back({"assistant", get_string(job, it, j, "output", "")});
    return msgs;
  }
  const bool sharegpt = job.format == Format::kShareGpt;
  const char* list_key = list_name ? list_name : sharegpt ? "conversations" : "messages";
  const char* role_key = sharegpt ? "from" : "role";
  const char* text_key = sharegpt ? "value" : "content";
  auto list = j.find(list_key);
  if (list == j.end()) fail_at(job, it, std::string("missing \"") + list_key + "\"");
  if (!list->is_array() || list->empty()) fail_at(job, it, std::string("\"") + list_key + "\" is not a non-empty array");
  for (size_t k = 0; k < list->size(); ++k) {
    const json& m = (*list)[k];
    const std::string where = std::string(list_key) + "[" + std::to_string(k) + "]: ";
    if (!m.is_object()) fail_at(job, it, where + "not an object");
    const std::string& r = get_string(job, it, m, role_key, where);
    std::string role;
    if (r == "system") role = "system";
    else if (r == "user" || r == "human") role = "user";
    else if (r == "assistant" || r == "gpt") role = "assistant";
    else
      fail_at(job, it, where + "unknown " + role_key + " \"" + r + "\" (" +
                           (sharegpt ? "expected system, human or gpt)" : "expected system, user or assistant)"));
    msgs.push_back({role, get_string(job, it, m, text_key, where)});
  }
  return msgs;
}

// The conversation as the template renders it, encoded whole (special
// tokens matched, as apply_chat_template does), after the document start
// unless the template already begins with it (its BOS).
void encode_chat(const Job& job, TokenEncoder& enc, const Item& it, const std::vector<Message>& msgs, Output& out) {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> mask;
  try {
    job.tmpl->encode(enc, msgs, false, ids, &mask);
  } catch (const Error& e) {
    fail_at(job, it, e.what());
  }
  if (ids.empty() || ids[0] != job.doc_start.id) {
    out.tokens.push_back(job.doc_start.id);
    out.mask.push_back(job.opts.train_on_input ? 1 : 0);
  }
  out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
  if (job.opts.train_on_input) std::fill(mask.begin(), mask.end(), 1);
  out.mask.insert(out.mask.end(), mask.begin(), mask.end());
}

// A preference row's prompt: a string (one user turn) or chat messages
// ending with a user turn.
std::vector<Message> parse_prompt(const Job& job, const Item& it, const json& j) {
  auto p = j.find("prompt");
  if (p == j.end()) fail_at(job, it, "missing \"prompt\"");
  if (p->is_string()) return {{"user", p->get<std::string>()}};
  if (!p->is_array() || p->empty())
    fail_at(job, it, "\"prompt\" is neither a string nor a non-empty array of messages (" +
                         std::string(p->type_name()) + ")");
  Job as_chat = job;
  as_chat.format = Format::kChat;
  std::vector<Message> msgs = parse_messages(as_chat, it, j, "prompt");
  if (msgs.back().role != "user")
    fail_at(job, it, "prompt: the last message is \"" + msgs.back().role +
                         "\"; a prompt ends with a user turn (the responses are in \"chosen\" and \"rejected\")");
  return msgs;
}

// A response: a string (one assistant turn) or assistant messages.
std::vector<Message> parse_response(const Job& job, const Item& it, const json& j, const char* key) {
  auto r = j.find(key);
  if (r == j.end()) fail_at(job, it, std::string("missing \"") + key + "\"");
  if (r->is_string()) return {{"assistant", r->get<std::string>()}};
  if (!r->is_array() || r->empty())
    fail_at(job, it, std::string("\"") + key + "\" is neither a string nor a non-empty array of assistant messages (" +
                         r->type_name() + ")");
  std::vector<Message> msgs;
  for (size_t k = 0; k < r->size(); ++k) {
    const json& m = (*r)[k];
    const std::string where = std::string(key) + "[" + std::to_string(k) + "]: ";
    if (!m.is_object()) fail_at(job, it, where + "not an object");
    const std::string& role = get_string(job, it, m, "role", where);
    if (role != "assistant")
      fail_at(job, it, where + "role \"" + role + "\"; a response holds assistant messages only (the prompt holds the rest)");
    msgs.push_back({"assistant", get_string(job, it, m, "content", where)});
  }
  return msgs;
}

// Both sides of a pair, each the prompt + its response rendered whole by
// the template, one sequence after the other; the mask covers the
// response's assistant turns only (not the prompt's own earlier ones).
void encode_pair(const Job& job, TokenEncoder& enc, const Item& it, const json& j, Output& out) {
  const std::vector<Message> prompt = parse_prompt(job, it, j);
  size_t prompt_replies = 0;
  for (const Message& m : prompt) prompt_replies += m.role == "assistant";
  std::array<int64_t, 3> rec{static_cast<int64_t>(out.tokens.size()), 0, 0};
  for (int side = 0; side < 2; ++side) {
    const char* key = side == 0 ? "chosen" : "rejected";
    std::vector<Message> msgs = prompt;
    for (Message& m : parse_response(job, it, j, key)) msgs.push_back(std::move(m));
    std::vector<uint32_t> ids;
    std::vector<uint8_t> mask;
    try {
      job.tmpl->encode(enc, msgs, false, ids, &mask, prompt_replies);
    } catch (const Error& e) {
      fail_at(job, it, std::string(key) + ": " + e.what());
    }
    if (std::find(mask.begin(), mask.end(), 1) == mask.end())
      fail_at(job, it, std::string(key) + ": the chat template gives the response no tokens (" +
                           std::to_string(ids.size()) + " tokens, none a reply's); check the template");
    const size_t before = out.tokens.size();
    if (ids.empty() || ids[0] != job.doc_start.id) {
      out.tokens.push_back(job.doc_start.id);
      out.mask.push_back(0);
    }
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.mask.insert(out.mask.end(), mask.begin(), mask.end());
    rec[1 + side] = static_cast<int64_t>(out.tokens.size() - before);
    if (job.opts.seq_len > 0 && rec[1 + side] > job.opts.seq_len + 1) ++out.long_docs;
  }
  out.pairs.push_back(rec);
  ++out.docs;
}

// --document-separator S: a line that is exactly S (a '\r' before its '\n'
// allowed) ends a document; the line itself is dropped and the next text
// starts a new document with the document-start token, as a new file does
// (fortune files separate fortunes with a line "%"). The dropped lines still
// count in text_bytes: the document-start token stands for them, so val_bpb
// stays comparable with a run prepared without the option.
void encode_separated(const Job& job, TokenEncoder& enc, const Item& it, Output& out) {
  const std::string& sep = job.opts.document_separator;
  const std::string& s = it.raw;
  bool new_doc = it.doc_start;  // the next non-empty piece starts a document
  size_t piece = 0;             // start of the text not encoded yet
  auto flush = [&](size_t end) {
    if (end > piece) {
      if (new_doc) out.tokens.push_back(job.doc_start.id);
      // A piece that continues its document (a later block's head): no
      // second Prepend '▁'.
      enc.encode(std::string_view(s).substr(piece, end - piece), job.opts.allow_special, out.tokens, !new_doc);
      if (new_doc) ++out.docs;
      new_doc = false;
    }
  };
  for (size_t line = 0; line < s.size();) {
    const size_t nl = s.find('\n', line);
    const size_t end = nl == std::string::npos ? s.size() : nl;
    size_t len = end - line;
    if (len > 0 && s[line + len - 1] == '\r') --len;
    const bool at_line_start = line > 0 || it.line_start;
    if (at_line_start && len == sep.size() && s.compare(line, len, sep) == 0) {
      flush(line);
      new_doc = true;
      piece = nl == std::string::npos ? s.size() : nl + 1;
    }
    if (nl == std::string::npos) break;
    line = nl + 1;
  }
  flush(s.size());
}

void encode_item(const Job& job, TokenEncoder& enc, const Item& it, Output& out) {
  const size_t first = out.tokens.size();
  if (int64_t bad = find_invalid_utf8(it.raw); bad >= 0)
    fail_at(job, it, "not valid UTF-8 at byte offset " + std::to_string(it.offset + bad) +
                         "; fix the file or leave it out (iconv -f <encoding> -t utf-8 converts it)");
  if (job.format == Format::kText) {
    if (job.opts.document_separator.empty()) {
      if (it.doc_start) out.tokens.push_back(job.doc_start.id);
      // A later block continues its document: no second Prepend '▁'.
      enc.encode(it.raw, job.opts.allow_special, out.tokens, !it.doc_start);
      if (it.doc_start) ++out.docs;
    } else {
      encode_separated(job, enc, it, out);
    }
    out.text_bytes += static_cast<int64_t>(it.raw.size());
    return;
  }
  json j;
  try {
    j = json::parse(it.raw);
  } catch (const json::parse_error& e) {
    fail_at(job, it, std::string("invalid JSON: ") + e.what());
  }
  if (!j.is_object()) fail_at(job, it, "expected a JSON object, got " + std::string(j.type_name()));
  if (job.format == Format::kPreference) {
    encode_pair(job, enc, it, j, out);
    return;
  }
  if (job.format == Format::kJsonl) {
    const std::string& text = get_string(job, it, j, job.opts.text_field.c_str(), "");
    out.tokens.push_back(job.doc_start.id);
    enc.encode(text, job.opts.allow_special, out.tokens);
    out.text_bytes += static_cast<int64_t>(text.size());
  } else {
    encode_chat(job, enc, it, parse_messages(job, it, j), out);
  }
  ++out.docs;
  if (job.opts.seq_len > 0 && static_cast<int64_t>(out.tokens.size() - first) > job.opts.seq_len) ++out.long_docs;
}

// Shards under temp names until commit(); the destructor removes what was
// not committed (an error anywhere leaves the output directory as it was).
class PendingShards {
 public:
  PendingShards(std::string dir, std::string prefix, int64_t cap, int version, bool masks)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), cap_(cap), version_(version), masks_(masks) {}
  ~PendingShards() {
    for (const auto& p : pending_) {
      std::remove(p.first.c_str());
      if (masks_) std::remove(mask_path(p.first).c_str());
    }
  }
  void add(const Output& o) {
    size_t pos = 0;
    while (pos < o.tokens.size()) {
      const size_t take = std::min<size_t>(o.tokens.size() - pos, cap_ - tokens_.size());
      tokens_.insert(tokens_.end(), o.tokens.begin() + pos, o.tokens.begin() + pos + take);
      if (masks_) mask_.insert(mask_.end(), o.mask.begin() + pos, o.mask.begin() + pos + take);
      pos += take;
      total_ += take;
      if (static_cast<int64_t>(tokens_.size()) == cap_) flush();
    }
  }
  void finish() {
    if (!tokens_.empty()) flush();
  }
  // Masks first: a .bin never sits under its final name without its .mask.
  void commit() {
    for (const auto& [tmp, final] : pending_) {
      if (masks_) rename_or_fail(mask_path(tmp), mask_path(final));
      rename_or_fail(tmp, final);
    }
    pending_.clear();
  }
  int64_t tokens() const { return total_; }
  const std::vector<std::string>& names() const { return names_; }
  struct ShardStats {
    std::string name;
    int64_t tokens = 0, targets = 0;
    uint32_t max_token_id = 0;
  };
  const std::vector<ShardStats>& stats() const { return stats_; }

 private:
  static std::string mask_path(const std::string& bin) {
    // ".../train_000000.bin[.tmp.PID]" -> ".../train_000000.mask[.tmp.PID]"
    std::string s = bin;
    s.replace(s.rfind(".bin"), 4, ".mask");
    return s;
  }
  static void rename_or_fail(const std::string& from, const std::string& to) {
    if (std::rename(from.c_str(), to.c_str()) != 0)
      TR_FAIL("cannot rename '", from, "' to '", to, "': ", detail::errno_string());
  }
  void flush() {
    const std::string name = prep::shard_name(prefix_, static_cast<int>(names_.size()));
    const std::string final = dir_ + "/" + name;
    const std::string tmp = final + ".tmp." + std::to_string(::getpid());
    pending_.emplace_back(tmp, final);
    names_.push_back(name);
    int32_t header[llmc::kHeaderInts] = {};
    header[0] = version_ == llmc::kVersionU16 ? llmc::kMagicU16 : llmc::kMagicU32;
    header[1] = version_;
    header[2] = static_cast<int32_t>(tokens_.size());
    std::string bytes(reinterpret_cast<const char*>(header), sizeof header);
    if (version_ == llmc::kVersionU16) {
      std::vector<uint16_t> narrow(tokens_.begin(), tokens_.end());
      bytes.append(reinterpret_cast<const char*>(narrow.data()), narrow.size() * 2);
    } else {
      bytes.append(reinterpret_cast<const char*>(tokens_.data()), tokens_.size() * 4);
    }
    if (masks_) prep::write_file_atomic(mask_path(tmp), mask_.data(), mask_.size(), false);
    prep::write_file_atomic(tmp, bytes.data(), bytes.size(), false);
    // What prepare.json records of the shard, so a job checks the counts
    // and the largest id once instead of scanning every token at start.
    ShardStats st;
    st.name = name;
    st.tokens = static_cast<int64_t>(tokens_.size());
    for (uint32_t t : tokens_) st.max_token_id = std::max(st.max_token_id, t);
    for (uint8_t m : mask_) st.targets += m;
    stats_.push_back(st);
    tokens_.clear();
    mask_.clear();
  }
  std::string dir_, prefix_;
  int64_t cap_;
  int version_;
  bool masks_;
  std::vector<uint32_t> tokens_;
  std::vector<uint8_t> mask_;
  std::vector<std::pair<std::string, std::string>> pending_;
  std::vector<std::string> names_;
  std::vector<ShardStats> stats_;
  int64_t total_ = 0;
};

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", static_cast<int>(t / 3600), static_cast<int>(t / 60 % 60),
                static_cast<int>(t % 60));
  return buf;
}

// "prepare: 12.3 / 45.6 MB (27%), 38.2 MB/s, ETA 0:00:01": in place on a
// terminal, else one line every 10 s (logs stay short).
class Progress {
 public:
  Progress(int64_t total, bool on) : total_(total), on_(on), tty_(::isatty(2)), t0_(clock::now()), last_(t0_) {}
  void update(int64_t done, bool final) {
    if (!on_) return;
    const auto now = clock::now();
    const double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.5 : 10.0)) return;
    last_ = now;
    const double el = std::chrono::duration<double>(now - t0_).count();
    const double rate = el > 0 ? done / el : 0;
    char buf[160];
    std::snprintf(buf, sizeof buf, "prepare: %.1f / %.1f MB (%d%%), %.1f MB/s, ETA %s", done / 1e6, total_ / 1e6,
                  total_ > 0 ? static_cast<int>(100.0 * done / total_) : 100, rate / 1e6,
                  rate > 0 ? fmt_duration((total_ - done) / rate).c_str() : "?");
    if (tty_) std::fprintf(stderr, "\r%s%s", buf, final ? "\n" : "");
    else std::fprintf(stderr, "%s\n", buf);
  }
  double elapsed() const { return std::chrono::duration<double>(clock::now() - t0_).count(); }

 private:
  using clock = std::chrono::steady_clock;
  int64_t total_;
  bool on_, tty_;
  clock::time_point t0_, last_;
};

constexpr size_t kBatchBytes = 1 << 20;

// Where a text document may be cut into blocks encoded apart with the ids
// of the whole (when Tokenizer::can_cut_before_line: GPT-2's, Llama 3's or
// Qwen2's pre-tokenizer regex, no prefix space). A cut at i splits
// text[0, i) | text[i, ...); it is safe when no pre-token can span i and the
// one starting at i does not depend on what comes before (the regexes have
// no lookbehind):
//   "<printable ASCII>\n" | "<ASCII letter>"  (Tokenizer::can_cut_before_line)
//   "<printable ASCII, not space>" | " <ASCII letter>": the run before ends at
//        a non-space character, and " ?\p{L}+" (GPT-2) or
//        "[^\r\n\p{L}\p{N}]?\p{L}+" (Llama 3, Qwen2) starts at the space, before
//        any whitespace alternative; code and prose without newlines have these
//   "<CJK letter>" | "<CJK punctuation>" (，。、！？；：): the letter run ends
//        before the punctuation, and the pre-token at it (punctuation run, or
//        punctuation + letters) reads only what follows; CJK prose has these
// A whitespace character before the cut would not do ("\s+(?!\S)" would
// take it with the next space).
// SentencePiece-style BPE without a word-splitting pre-tokenizer (Llama 2,
// Mistral; Tokenizer::can_cut_before_space) has one rule of its own:
//   "<printable ASCII, not space>" | " ": the space becomes a '▁' that
//        starts a BPE word the model cuts before anyway; the block after is
//        encoded as a continuation (no second Prepend '▁'). Not where an
//        added token may end: the text after a matched one is a segment of
//        its own, which HF does give a Prepend '▁'.
bool is_ascii_letter(unsigned char c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; }
bool is_printable_ascii(unsigned char c) { return c > ' ' && c < 0x7F; }

// The code point of the 3-byte UTF-8 sequence at p, or 0.
uint32_t utf8_3byte(const std::string& s, size_t p) {
  if (p + 3 > s.size()) return 0;
  const auto a = static_cast<unsigned char>(s[p]), b = static_cast<unsigned char>(s[p + 1]),
             c = static_cast<unsigned char>(s[p + 2]);
  if ((a & 0xF0) != 0xE0 || (b & 0xC0) != 0x80 || (c & 0xC0) != 0x80) return 0;
  return (uint32_t(a & 0x0F) << 12) | (uint32_t(b & 0x3F) << 6) | uint32_t(c & 0x3F);
}
bool is_cjk_letter(uint32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3041 && cp <= 0x3096) || (cp >= 0x30A1 && cp <= 0x30FA) ||
         (cp >= 0xAC00 && cp <= 0xD7A3);
}
bool is_cjk_punct(uint32_t cp) {
  return cp == 0x3001 || cp == 0x3002 || cp == 0xFF0C || cp == 0xFF01 || cp == 0xFF1F || cp == 0xFF1B || cp == 0xFF1A;
}
// Which of the rules above hold: an added token (matched before the
// pre-tokenizer) holding a space or a CJK punctuation mark could match
// across such a cut.
struct CutRules {
  bool line = false, space = false, cjk = false;
  bool meta = false;  // the SentencePiece rule (alone)
  std::array<std::vector<std::string>, 256> added_by_last;  // meta: added tokens by their last byte
  bool any() const { return line || meta; }
};
CutRules cut_rules(const Tokenizer& tok) {
  CutRules r;
  if (tok.can_cut_before_space()) {
    r.meta = true;
    for (const std::string& a : tok.added_token_contents())
      if (!a.empty()) r.added_by_last[static_cast<unsigned char>(a.back())].push_back(a);
    return r;
  }
  if (!tok.can_cut_before_line()) return r;
  r.line = r.space = r.cjk = true;
  for (const std::string& a : tok.added_token_contents()) {
    if (a.find(' ') != std::string::npos) r.space = false;
    for (size_t k = 0; k + 3 <= a.size(); ++k)
      if (is_cjk_punct(utf8_3byte(a, k))) r.cjk = false;
  }
  return r;
}
bool cut_point(const std::string& s, size_t i, const CutRules& r) {
  if (i < 3 || i + 1 >= s.size()) return false;
  const auto prev = static_cast<unsigned char>(s[i - 1]), cur = static_cast<unsigned char>(s[i]);
  if (r.meta) {
    if (cur != ' ' || !is_printable_ascii(prev)) return false;
    for (const std::string& a : r.added_by_last[prev])
      if (a.size() <= i && s.compare(i - a.size(), a.size(), a) == 0) return false;
    return true;
  }
  if (prev == '\n') return r.line && is_printable_ascii(static_cast<unsigned char>(s[i - 2])) && is_ascii_letter(cur);
  if (cur == ' ') return r.space && is_printable_ascii(prev) && is_ascii_letter(static_cast<unsigned char>(s[i + 1]));
  return r.cjk && is_cjk_punct(utf8_3byte(s, i)) && is_cjk_letter(utf8_3byte(s, i - 3));
}
// Bytes past a position that cut_point() reads: a position closer than this
// to the buffer's end is scanned again once more bytes arrive.
constexpr size_t kCutLookahead = 3;

// The last cut point at or after `from`, or 0.
size_t last_cut_point(const std::string& s, size_t from, const CutRules& r) {
  for (size_t i = s.size(); i-- > std::max<size_t>(from, 3);)
    if (cut_point(s, i, r)) return i;
  return 0;
}

// Reads the inputs into batches and hands each full window to `flush`.
class Reader {
 public:
  Reader(const Job& job, size_t window, std::function<void(std::vector<Batch>&)> flush)
      : job_(job), window_(window), flush_(std::move(flush)) {
    batches_.emplace_back();
  }
  void read_all() {
    for (int f = 0; f < static_cast<int>(job_.files.size()); ++f) {
      if (job_.format == Format::kText) read_text(f);
      else read_lines(f);
    }
    flush_(batches_);
  }
  // Text: the blocks the documents were cut into (each encoded alone).
  int64_t text_blocks() const { return text_blocks_; }

 private:
  void push(Item&& it) {
    Batch& b = batches_.back();
    b.bytes += it.raw.size();
    b.items.push_back(std::move(it));
    if (b.bytes >= kBatchBytes || b.items.size() >= 8192) {
      if (batches_.size() == window_) {
        flush_(batches_);
        batches_.clear();
      }
      batches_.emplace_back();
    }
  }

  // One document per file, or two with val: the last val_fraction of the
  // bytes, from the first line start at or after that point.
  void read_text(int f) {
    const std::string& path = job_.files[f];
    std::ifstream in(path, std::ios::binary);
    if (!in) TR_FAIL("--input: cannot open '", path, "': ", detail::errno_string());
    std::error_code ec;
    const int64_t n = static_cast<int64_t>(fs::file_size(path, ec));
    const int64_t nval = static_cast<int64_t>(std::ceil(static_cast<double>(n) * job_.opts.val_fraction));
    const int64_t cut = nval > 0 ? val_cut(path, n, n - nval) : n;
    std::string carry;
    size_t scanned = 0;  // carry[0, scanned) holds no cut point
    int64_t carry_off = 0, pos = 0;
    bool doc_start = true;
    bool line_start = true;  // the next block begins a line
    std::vector<char> buf(kBatchBytes);
    const CutRules rules = cut_rules(job_.tok);
    const bool can_cut = rules.any();
    while (pos < n) {
      // Reads never cross the train/val cut, so the train document ends exactly there.
      const int64_t limit = pos < cut ? cut : n;
      in.read(buf.data(), static_cast<std::streamsize>(std::min<int64_t>(limit - pos, buf.size())));
      const int64_t got = in.gcount();
      if (got <= 0) TR_FAIL("--input: '", path, "' ended after ", pos, " of ", n, " bytes; did it change while being read?");
      carry.append(buf.data(), static_cast<size_t>(got));
      pos += got;
      if (pos == cut && cut < n) {
        const bool ends_line = !carry.empty() && carry.back() == '\n';
        emit_text(f, std::move(carry), carry_off, doc_start, line_start, false);
        line_start = ends_line;
        carry.clear();
        scanned = 0;
        carry_off = pos;
        doc_start = true;
        continue;
      }
      if (can_cut && carry.size() >= kBatchBytes) {
        // The last cut point in the bytes not scanned yet: each byte is
        // scanned once (a text without cut points no longer rescans its
        // whole buffer every MiB), and the buffer is cut at least every MiB
        // wherever the text has one.
        const size_t at = last_cut_point(carry, scanned, rules);
        scanned = carry.size() > kCutLookahead ? carry.size() - kCutLookahead : 0;
        if (at > 0) {
          emit_text(f, carry.substr(0, at), carry_off, doc_start, line_start, pos > cut);
          line_start = carry[at - 1] == '\n';
          carry.erase(0, at);
          carry_off += static_cast<int64_t>(at);
          scanned = carry.size() > kCutLookahead ? carry.size() - kCutLookahead : 0;
          doc_start = false;
        }
      }
    }
    emit_text(f, std::move(carry), carry_off, doc_start, line_start, cut < n);
  }
  // The start of the first line at or after `from`; when no line starts
  // there, `from` itself moved back to the start of a UTF-8 character.
  static int64_t val_cut(const std::string& path, int64_t n, int64_t from) {
    std::ifstream in(path, std::ios::binary);
    int64_t p = std::max<int64_t>(from - 1, 0);
    in.seekg(p);
    std::vector<char> buf(1 << 16);
    while (p < n && in) {
      in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
      const int64_t got = in.gcount();
      if (got <= 0) break;
      const void* nl = std::memchr(buf.data(), '\n', static_cast<size_t>(got));
      if (nl) {
        const int64_t at = p + (static_cast<const char*>(nl) - buf.data()) + 1;
        if (at < n) return std::max(at, from);
        break;
      }
      p += got;
    }
    std::ifstream again(path, std::ios::binary);
    int64_t c = from;
    while (c > 0) {
      again.seekg(c);
      const int ch = again.get();
      if (ch == EOF || (ch & 0xC0) != 0x80) break;
      --c;
    }
    return c;
  }
  void emit_text(int f, std::string text, int64_t off, bool doc_start, bool line_start, bool val) {
    if (text.empty()) return;  // an empty val part adds no lone separator
    ++text_blocks_;
    Item it;
    it.file = f;
    it.offset = off;
    it.raw = std::move(text);
    it.doc_start = doc_start;
    it.line_start = line_start;
    it.val = val;
    push(std::move(it));
  }

  // One record per non-blank line; record k of a file goes to val when
  // floor((k+1) f) > floor(k f): an even spread, the same on every run.
  void read_lines(int f) {
    const std::string& path = job_.files[f];
    std::ifstream in(path, std::ios::binary);
    if (!in) TR_FAIL("--input: cannot open '", path, "': ", detail::errno_string());
    std::string line;
    int64_t lineno = 0, off = 0, k = 0;
    const double fr = job_.opts.val_fraction;
    while (std::getline(in, line)) {
      ++lineno;
      const int64_t this_off = off;
      off += static_cast<int64_t>(line.size()) + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      Item it;
      it.file = f;
      it.line = lineno;
      it.offset = this_off;
      it.raw = std::move(line);
      it.val = std::floor((k + 1) * fr) > std::floor(k * fr);
      ++k;
      push(std::move(it));
      line.clear();
    }
  }

  const Job& job_;
  size_t window_;
  std::function<void(std::vector<Batch>&)> flush_;
  std::vector<Batch> batches_;
  int64_t text_blocks_ = 0;
};

}  // namespace

std::string prepare_tokenized_shards(const PrepareOptions& opts) {
  const double f = opts.val_fraction;
  TR_CHECK(f >= 0.0 && f <= 0.5, "--val-fraction: ", f,
           " is outside [0, 0.5]; it is the fraction of the data kept for validation (e.g. 0.01)");
  TR_CHECK(opts.shard_tokens > 0 && opts.shard_tokens <= INT32_MAX, "prepare: shard size ", opts.shard_tokens,
           " tokens must be in [1, ", INT32_MAX, "]");
  TR_CHECK(opts.seq_len >= 0, "--seq-len: ", opts.seq_len, " must be >= 0 (0: no check)");
  TR_CHECK(opts.threads >= 0, "--threads: ", opts.threads, " must be >= 0 (0: all cores)");
  TR_CHECK(!opts.inputs.empty(), "--input: no input given; pass text or jsonl files or directories");
  const Format format = parse_format(opts.format);
  const bool preference = format == Format::kPreference;
  const bool chat = format == Format::kChat || format == Format::kAlpaca || format == Format::kShareGpt || preference;
  if (!chat && !opts.chat_template.empty())
    TR_FAIL("--chat-template: only the chat formats (chat, alpaca, sharegpt, preference) use a template; --format is ",
            opts.format);
  if (!opts.document_separator.empty() && format != Format::kText)
    TR_FAIL("--document-separator: only --format text splits a file into documents (each ", opts.format,
            " record is one already); leave it out");
  if (opts.document_separator.find_first_of("\r\n") != std::string::npos)
    TR_FAIL("--document-separator: '", opts.document_separator, "' holds a line break; it is the whole text of one line "
            "(e.g. '%' for fortune files)");
  if (!chat && opts.train_on_input)
    TR_FAIL("--train-on-input: only the chat formats (chat, alpaca, sharegpt) have a loss mask; --format is ", opts.format);
  if (preference && opts.train_on_input)
    TR_FAIL("--train-on-input: --format preference compares the responses only (the prompt is the same on both "
            "sides); leave it out");

  const Tokenizer tok = Tokenizer::load(opts.tokenizer);
  const prep::InputSet in = prep::select_text_files(opts.inputs);
  std::unique_ptr<ChatTemplate> tmpl;
  if (chat) tmpl = std::make_unique<ChatTemplate>(ChatTemplate::resolve(tok, opts.tokenizer, opts.chat_template));
  Job job{opts, format, tok, resolve_doc_start(tok), tmpl.get(), in.texts, chat};
  prep::prepare_output_dir(opts.output_dir);

  const int threads = opts.threads > 0 ? opts.threads : std::max(1u, std::thread::hardware_concurrency());
  const int version = tok.vocab_size() <= 65536 ? llmc::kVersionU16 : llmc::kVersionU32;
  PendingShards train(opts.output_dir, "train", opts.shard_tokens, version, chat);
  PendingShards val(opts.output_dir, "val", opts.shard_tokens, version, chat);
  // preference: each split's pair index, renamed into place with its shards.
  std::unique_ptr<PairIndexWriter> pairs[2];
  if (preference)
    for (int s = 0; s < 2; ++s)
      pairs[s] = std::make_unique<PairIndexWriter>(opts.output_dir + (s ? "/val.pairs" : "/train.pairs"));
  std::vector<TokenEncoder> encoders;
  encoders.reserve(threads);
  for (int t = 0; t < threads; ++t) encoders.emplace_back(tok);

  int64_t total_bytes = 0;
  for (const auto& p : in.texts) {
    std::error_code ec;
    total_bytes += static_cast<int64_t>(fs::file_size(p, ec));
  }
  Progress progress(total_bytes, opts.progress);
  int64_t done_bytes = 0, docs = 0, long_docs = 0, val_bytes = 0;
  auto flush = [&](std::vector<Batch>& window) {
    const int nb = static_cast<int>(window.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int b = 0; b < nb; ++b) {
      TokenEncoder& enc = encoders[omp_get_thread_num()];
      Batch& batch = window[b];
      try {
        for (const Item& it : batch.items) encode_item(job, enc, it, batch.out[it.val ? 1 : 0]);
      } catch (const std::exception& e) {
        batch.error = e.what();
      }
    }
    // The first failing batch in input order: the same message whatever the thread count.
    for (Batch& batch : window) {
      if (!batch.error.empty()) throw Error(batch.error);
      for (int s = 0; s < 2 && preference; ++s) {
        const int64_t base = (s ? val : train).tokens();
        for (auto rec : batch.out[s].pairs) {
          rec[0] += base;
          pairs[s]->add(rec);
        }
      }
      train.add(batch.out[0]);
      val.add(batch.out[1]);
      for (const Output& o : batch.out) {
        docs += o.docs;
        long_docs += o.long_docs;
      }
      val_bytes += batch.out[1].text_bytes;
      done_bytes += static_cast<int64_t>(batch.bytes);
      batch = Batch{};
    }
    progress.update(std::min(done_bytes, total_bytes), false);
  };
  Reader reader(job, static_cast<size_t>(threads) * 4, flush);
  reader.read_all();
  train.finish();
  val.finish();
  progress.update(total_bytes, true);

  TR_CHECK(train.tokens() > 0, "--input: the inputs gave no train tokens (", val.tokens(),
           " val tokens); pass more data or lower --val-fraction");
  if (opts.seq_len > 0) {
    TR_CHECK(train.tokens() > opts.seq_len, "--seq-len: the train split holds ", train.tokens(),
             " tokens, fewer than seq_len + 1 = ", opts.seq_len + 1, "; pass more data or a smaller --seq-len");
    TR_CHECK(val.tokens() == 0 || val.tokens() > opts.seq_len, "--seq-len: the val split holds ", val.tokens(),
             " tokens, fewer than seq_len + 1 = ", opts.seq_len + 1,
             "; raise --val-fraction, pass more data, or --val-fraction 0 for no val split");
  }
  train.commit();
  val.commit();
  for (int s = 0; s < 2 && preference; ++s) pairs[s]->commit();
  // Another format's run leaves no pair index for a job to pair up wrongly.
  for (const char* stale : {"/train.pairs", "/val.pairs"})
    if (!preference) std::remove((opts.output_dir + stale).c_str());
  std::set<std::string> keep;
  for (const auto* w : {&train, &val})
    for (const auto& n : w->names()) {
      keep.insert(n);
      if (chat) keep.insert(n.substr(0, n.size() - 4) + ".mask");
    }
  if (int removed = prep::remove_stale_shards(opts.output_dir, keep))
    TR_LOG_INFO("prepare: removed ", removed, " stale shard file(s) from an earlier run in ", opts.output_dir);

  // What the shards were made with, so a job can refuse a model whose
  // vocab is smaller than the tokenizer's before it trains (token_files.cpp).
  json shards = json::object();
  uint32_t max_id = 0;
  for (const auto* w : {&train, &val})
    for (const auto& st : w->stats()) {
      json one = {{"tokens", st.tokens}, {"max_token_id", st.max_token_id}};
      if (chat) one["targets"] = st.targets;
      shards[st.name] = one;
      max_id = std::max(max_id, st.max_token_id);
    }
  // tokenizer_path and its hash: what a job samples text with, and how it
  // knows the file is still the one that made these ids (prepare_meta.h).
  json meta = {{"tokenizer", opts.tokenizer},
               {"tokenizer_path", fs::absolute(opts.tokenizer).lexically_normal().string()},
               {"tokenizer_xxh64", file_xxh64(opts.tokenizer)},
               {"vocab_size", tok.vocab_size()},
               {"format", opts.format},
               {"document_start", job.doc_start.name},
               {"document_start_id", job.doc_start.id},
               {"chat_template", chat ? tmpl->description() : ""},
               {"loss_masks", chat},
               {"pairs", preference ? json{{"train", pairs[0]->pairs()}, {"val", pairs[1]->pairs()}} : json()},
               {"train_tokens", train.tokens()},
               {"val_tokens", val.tokens()},
               {"max_token_id", max_id},
               {"shards", shards}};
  // Bits per byte need the text's bytes; a chat split's tokens are a template's rendering of it.
  if (!chat) meta["val_bytes"] = val_bytes;
  const std::string meta_text = meta.dump(2) + "\n";
  prep::write_file_atomic(opts.output_dir + "/prepare.json", meta_text.data(), meta_text.size(), true);

  const double secs = progress.elapsed();
  std::ostringstream os;
  os << "prepared " << in.texts.size() << " " << opts.format << " file" << (in.texts.size() == 1 ? "" : "s");
  if (!in.binary.empty() || in.duplicates) os << " (skipped " << in.binary.size() << " binary, " << in.duplicates << " duplicate)";
  os << ", " << docs << " document" << (docs == 1 ? "" : "s");
  // How far the threads could share the text: a document is cut only where
  // the tokenizer allows (see cut_point).
  if (format == Format::kText) os << " (" << reader.text_blocks() << " block" << (reader.text_blocks() == 1 ? "" : "s") << ")";
  os << " -> " << opts.output_dir << ": " << train.tokens()
     << " train tokens in " << prep::shard_range(train.names()) << ", " << val.tokens() << " val tokens in "
     << prep::shard_range(val.names()) << "; tokenizer " << opts.tokenizer << " (vocab " << tok.vocab_size() << ", "
     << (version == llmc::kVersionU16 ? "uint16" : "uint32 v7") << "), documents start with " << job.doc_start.name;
  if (chat) os << ", chat template " << tmpl->description() << ", loss masks (.mask)";
  if (preference) os << ", " << pairs[0]->pairs() << " train / " << pairs[1]->pairs() << " val pairs (.pairs)";
  if (opts.seq_len > 0) os << "; " << long_docs << " document(s) longer than --seq-len " << opts.seq_len;
  char rate[64];
  std::snprintf(rate, sizeof rate, "; %.1f MB in %.2f s (%.1f MB/s, %d thread%s)", total_bytes / 1e6, secs,
                secs > 0 ? total_bytes / 1e6 / secs : 0.0, threads, threads == 1 ? "" : "s");
  os << rate;
  return os.str();
}

std::string prepare_shards(const PrepareOptions& opts) {
  if (!opts.tokenizer.empty()) return prepare_tokenized_shards(opts);
  if (opts.format != "text")
    TR_FAIL("--format ", opts.format, " needs --tokenizer tokenizer.json (byte-level prepare reads text only)");
  if (!opts.chat_template.empty() || opts.train_on_input || opts.allow_special || !opts.document_separator.empty())
    TR_FAIL("--chat-template, --train-on-input, --allow-special and --document-separator need --tokenizer tokenizer.json");
  return prepare_byte_shards(opts);
}

}  // namespace trainrun
