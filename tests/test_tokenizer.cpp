// The HF byte-level BPE tokenizer (core/data/tokenizer) against the real
// `tokenizers` library: tokenizers that scripts/reference/hf_tokenizer.py
// trains offline (GPT-2 style, GPT-2 with add_prefix_space, Llama 3 style
// with Split + ignore_merges; both merge formats) must give the same ids as
// HF on text chosen to hit the pre-tokenizer regexes' corners, and decoding
// must give the text back. Bad tokenizer.json files are refused with the
// JSON path.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/data/dataset.h"
#include "core/data/document_mask.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

namespace {

using test::hf_python;

test::RunResult hf_tok(const std::string& args) {
  return test::run_command("'" + hf_python() + "' '" + test::source_dir() + "/scripts/reference/hf_tokenizer.py' " +
                           args);
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// Text for the regexes' corners; each entry is one encode() call.
std::vector<std::string> tricky_texts() {
  std::vector<std::string> t = {
      "Hello, World! It's 2024 and I'M here; you'RE there. WE'VE DONE IT, THEY'LL SEE, SHE'D GO, DON'T.",
      "日本語のテキストと中文文本，还有한국어 텍스트。東京タワー",
      "Family: \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 and \U0001F3F3\uFE0F\u200D\U0001F308 "
      "flags \U0001F44D\U0001F3FD ok \U0001F600\U0001F600",
      "line one\r\nline two\r\n\r\nline four\n\n\nend\r",
      "a  b   c\t\td \t \t e      \n    indented\tcode()  \t\n\t\t\tx   ",
      "pi=3.14159265358979323846264338327950288419716939937510 and 1234567890123 x99y 00000",
      "zero\u200Bwidth\u200Djoin\u2060word e\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0352\u0353 \uFEFFbom",
      "العربية نص ومرحبا بالعالم، עברית טקסט שלום. \u202Bembedded\u202C",
      "before <|endoftext|> middle <|eot_id|> <|begin_of_text|>after [TOOL] call <|endoftext|><|endoftext|>",
      "nbsp\u00A0here \u2028sep\u2029 nel\u0085x ctl\x01\x7f\x1b[0m ſ 'S 'ſ \u3000ideo",
      "",
      " ",
      std::string(3000, ' ') + "x" + std::string(70, '\t') + "\n",
      std::string(500, 'a') + " " + std::string(400, '7'),
      "def f(x):\n    return {'k': [1, 2.5e-3, \"s\"]}  # comment\n",
      "Ünïcödé ÀÉÎÕÜ ΑΒΓ αβγ Привет мир ąčęėįšųūž",
  };
  return t;
}

struct Fixture {
  test::TempDir dir{"tok"};
  std::vector<std::string> texts = tricky_texts();
  Fixture() {
    std::string corpus;
    for (const char* f : {"/usr/share/games/fortunes/computers", "/usr/share/games/fortunes/science"}) {
      if (test::file_exists(f)) corpus += test::read_file(f);
    }
    // The tricky text is in the corpus too, so merges over CJK, emoji and
    // whitespace runs exist and are exercised.
    for (int r = 0; r < 20; ++r)
      for (const auto& t : texts) corpus += t + "\n";
    test::write_file(dir / "corpus.txt", corpus);
    const auto r = hf_tok("make --vocab 3000 --dir '" + dir.path() + "' --corpus '" + (dir / "corpus.txt") + "'");
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    // A slice of running prose too.
    texts.push_back(corpus.substr(0, 20000));
    json j = texts;
    test::write_file(dir / "texts.json", j.dump());
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

}  // namespace

TEST_CASE("tokenizer: ids equal HF tokenizers' on tricky text, both merge formats", "[tokenizer][hf]") {
  Fixture& fx = fixture();
  const std::string style = GENERATE("gpt2", "gpt2_prefix", "llama3", "llama3_holes");
  const auto r = hf_tok("encode --tokenizer '" + (fx.dir / (style + ".json")) + "' --texts '" + (fx.dir / "texts.json") +
                        "' --out '" + (fx.dir / (style + ".out.json")) + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json ref = read_json(fx.dir / (style + ".out.json"));
  for (const std::string variant : {style + ".json", style + "_pairs.json"}) {
    const Tokenizer tok = Tokenizer::load(fx.dir / variant);
    TokenEncoder enc(tok);  // one encoder across texts: its cache must not leak between them
    for (size_t i = 0; i < fx.texts.size(); ++i) {
      INFO(variant << " text " << i << ": " << fx.texts[i].substr(0, 200));
      std::vector<uint32_t> plain;
      enc.encode(fx.texts[i], false, plain);
      CHECK(plain == ref["plain"][i].get<std::vector<uint32_t>>());
      CHECK(tok.encode(fx.texts[i], true) == ref["special"][i].get<std::vector<uint32_t>>());
      // Round trip (add_prefix_space adds a space, as in HF), and the same
      // bytes as HF's ByteLevel decoder.
      const bool prefixed = style == "gpt2_prefix" && !fx.texts[i].empty() && fx.texts[i][0] != ' ';
      CHECK(tok.decode(plain) == (prefixed ? " " : "") + fx.texts[i]);
      CHECK(tok.decode(plain) == ref["decoded"][i].get<std::string>());
    }
  }
}

TEST_CASE("tokenizer: ignore_merges emits a pre-token that is in the vocab whole", "[tokenizer]") {
  // In llama3_holes.json some merges are gone: without ignore_merges those
  // words come out in pieces (so the HF comparison above really tests it).
  Fixture& fx = fixture();
  json j = read_json(fx.dir / "llama3_holes.json");
  const Tokenizer with = Tokenizer::from_json_text(j.dump(), "with");
  j["model"]["ignore_merges"] = false;
  const Tokenizer without = Tokenizer::from_json_text(j.dump(), "without");
  const std::string& prose = fx.texts.back();
  const auto a = with.encode(prose), b = without.encode(prose);
  CHECK(a.size() < b.size());
  CHECK(with.decode(a) == prose);
  CHECK(without.decode(b) == prose);
}

TEST_CASE("tokenizer: special tokens, BOS and vocab facts", "[tokenizer]") {
  Fixture& fx = fixture();
  const Tokenizer l3 = Tokenizer::load(fx.dir / "llama3.json");
  const Tokenizer g2 = Tokenizer::load(fx.dir / "gpt2.json");
  REQUIRE(l3.bos_id() == l3.special_id("<|begin_of_text|>"));
  REQUIRE(l3.bos_id() >= 0);
  REQUIRE(g2.bos_id() == -1);
  REQUIRE(g2.special_id("<|endoftext|>") >= 0);
  REQUIRE(g2.special_id("[TOOL]") == -1);  // added but not special
  REQUIRE(g2.token_id("[TOOL]") >= 0);
  REQUIRE(g2.vocab_size() == 3001);
  // Default policy: a special token's spelling is text; allow_special matches it.
  const auto plain = g2.encode("x<|endoftext|>y");
  const auto special = g2.encode("x<|endoftext|>y", true);
  REQUIRE(std::find(plain.begin(), plain.end(), static_cast<uint32_t>(g2.special_id("<|endoftext|>"))) == plain.end());
  REQUIRE(std::find(special.begin(), special.end(), static_cast<uint32_t>(g2.special_id("<|endoftext|>"))) != special.end());
  // Non-special added tokens match either way, as in HF.
  const auto tool = g2.encode("a[TOOL]b");
  REQUIRE(std::find(tool.begin(), tool.end(), static_cast<uint32_t>(g2.token_id("[TOOL]"))) != tool.end());
  REQUIRE(g2.decode(special) == "x<|endoftext|>y");
  REQUIRE_THROWS_WITH(g2.decode({999999}), Contains("999999") && Contains("not in the vocab"));
}

TEST_CASE("tokenizer: invalid UTF-8 is refused with the byte offset", "[tokenizer][errors]") {
  const Tokenizer g2 = Tokenizer::load(fixture().dir / "gpt2.json");
  REQUIRE_THROWS_WITH(g2.encode(std::string("abc\xff") + "def"), Contains("not valid UTF-8") && Contains("offset 3"));
  REQUIRE_THROWS_WITH(g2.encode("ab\xed\xa0\x80"), Contains("offset 2"));   // a surrogate
  REQUIRE_THROWS_WITH(g2.encode("abcd\xc0\xaf"), Contains("offset 4"));     // overlong '/'
  REQUIRE_THROWS_WITH(g2.encode("\xe6\x97"), Contains("offset 0"));         // truncated
  REQUIRE(find_invalid_utf8("ok \xF0\x9F\x98\x80") == -1);
}

TEST_CASE("tokenizer: unsupported or broken tokenizer.json names the JSON path", "[tokenizer][errors]") {
  Fixture& fx = fixture();
  const json good = read_json(fx.dir / "llama3.json");
  auto load_error = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    try {
      Tokenizer::from_json_text(j.dump(), "bad.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // (What was refused here before and is now read — NFC, Unigram, byte
  // fallback, every Split behavior, lstrip, BertProcessing, missing byte
  // symbols — is checked against HF in tests/test_tokenizer_hf.cpp.)
  CHECK_THAT(load_error([](json& j) { j["normalizer"] = {{"type", "BertNormalizer"}}; }),
             Contains("bad.json") && Contains("normalizer.type") && Contains("\"BertNormalizer\"") && Contains("not supported"));
  CHECK_THAT(load_error([](json& j) { j["model"]["type"] = "WordPiece"; }), Contains("model.type") && Contains("WordPiece"));
  CHECK_THAT(load_error([](json& j) { j["model"]["dropout"] = 0.1; }), Contains("model.dropout") && Contains("0.1"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways"; }),
             Contains("pre_tokenizer.pretokenizers[0].behavior") && Contains("Sideways"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = 3; }),
             Contains("pre_tokenizer.pretokenizers[0].invert"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "UnicodeScripts"}}; }),
             Contains("pre_tokenizer.pretokenizers[1].type") && Contains("UnicodeScripts"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
             Contains("pre_tokenizer.pretokenizers[0].pattern.Regex") && Contains("(unclosed") && Contains("PCRE2"));
  CHECK_THAT(load_error([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), Contains("decoder.type") && Contains("WordPiece"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][5] = "a b c"; }), Contains("model.merges[5]") && Contains("a b c"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][7] = json::array({"zzzq", "h"}); }),
             Contains("model.merges[7]") && Contains("zzzq") && Contains("not in model.vocab"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][2] = 17; }), Contains("model.merges[2]") && Contains("17"));
  CHECK_THAT(load_error([](json& j) { j["model"]["vocab"]["Ġthe"] = -4; }), Contains("model.vocab[\"Ġthe\"]") && Contains("-4"));
  CHECK_THAT(load_error([](json& j) { j["added_tokens"][1]["lstrip"] = "yes"; }), Contains("added_tokens[1].lstrip"));
  CHECK_THAT(load_error([](json& j) { j["added_tokens"][0].erase("content"); }), Contains("added_tokens[0].content"));
  CHECK_THAT(load_error([](json& j) { j["truncation"] = {{"max_length", 8}}; }), Contains("truncation"));
  CHECK_THAT(load_error([](json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; }),
             Contains("post_processor.cls") && Contains("[\"token\", id]"));
  CHECK_THAT(load_error([](json& j) { j.erase("model"); }), Contains("model") && Contains("missing"));
  REQUIRE_THROWS_WITH(Tokenizer::from_json_text("{not json", "x.json"), Contains("x.json") && Contains("not valid JSON"));
  REQUIRE_THROWS_WITH(Tokenizer::load(fx.dir / "nope.json"), Contains("nope.json") && Contains("cannot open"));
  CHECK(load_error([](json&) {}) == "(no error)");
}

// ---- prepare --tokenizer ---------------------------------------------------------

namespace {

struct Shard {
  int version = 0;
  std::vector<uint32_t> tokens;
};

Shard read_shard(const std::string& path) {
  const std::string b = test::read_file(path);
  REQUIRE(b.size() >= 1024);
  int32_t h[3];
  std::memcpy(h, b.data(), sizeof h);
  Shard s;
  s.version = h[1];
  const size_t w = s.version == 1 ? 2 : 4;
  REQUIRE(b.size() == 1024 + w * static_cast<size_t>(h[2]));
  for (int32_t i = 0; i < h[2]; ++i) {
    uint32_t v = 0;
    std::memcpy(&v, b.data() + 1024 + w * i, w);
    s.tokens.push_back(v);
  }
  return s;
}

std::vector<uint8_t> read_mask(const std::string& path) {
  const std::string b = test::read_file(path);
  return std::vector<uint8_t>(b.begin(), b.end());
}

// HF's ids for each text (special tokens as text, as prepare's default).
std::vector<std::vector<uint32_t>> hf_encode(const std::string& tokenizer, const std::vector<std::string>& texts,
                                             const test::TempDir& dir) {
  test::write_file(dir / "q.json", json(texts).dump());
  const auto r = hf_tok("encode --tokenizer '" + tokenizer + "' --texts '" + (dir / "q.json") + "' --out '" +
                        (dir / "a.json") + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  return read_json(dir / "a.json")["plain"].get<std::vector<std::vector<uint32_t>>>();
}

// Equal, or where they first differ (Catch would print a million ids).
std::string first_difference(const std::vector<uint32_t>& got, const std::vector<uint32_t>& want) {
  const size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want[i])
      return "differ at token " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want[i]);
  if (got.size() != want.size())
    return "lengths differ: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  return "equal";
}

std::vector<uint32_t> concat_shards(const std::string& dir, const std::string& prefix) {
  std::vector<uint32_t> all;
  for (int i = 0;; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "/%s_%06d.bin", prefix.c_str(), i);
    if (!test::file_exists(dir + name)) break;
    auto s = read_shard(dir + name);
    all.insert(all.end(), s.tokens.begin(), s.tokens.end());
  }
  return all;
}

// prepare's train/val cut of a text file: the first line start at or after
// n - ceil(n * f).
size_t val_cut(const std::string& s, double f) {
  const size_t from = s.size() - static_cast<size_t>(std::ceil(s.size() * f));
  const size_t nl = s.find('\n', from > 0 ? from - 1 : 0);
  return nl == std::string::npos || nl + 1 >= s.size() ? from : std::max(nl + 1, from);
}

}  // namespace

TEST_CASE("prepare --tokenizer: text files give HF's ids, BOS/EOS per document, any thread count", "[prepare][hf]") {
  Fixture& fx = fixture();
  test::TempDir d("prep");
  // > 1 MiB, so a file is cut into blocks encoded on different threads.
  std::string big;
  while (big.size() < 2'000'000) big += test::read_file(fx.dir / "corpus.txt");
  // Where a cut at any '\n' would change the ids ("\n\n  " is one
  // pre-token): only the '\n' before "Line" is a safe cut.
  while (big.size() < 4'000'000) big += "Line of text\n\n  indented code\n\t\n \n";
  const std::string small = fx.texts[1] + "\n" + fx.texts[3] + "\nend <|endoftext|> of it\n";
  test::write_file(d / "in/a.txt", big);
  test::write_file(d / "in/b.txt", small);
  for (const std::string style : {"gpt2", "llama3"}) {
    INFO(style);
    const std::string tj = fx.dir / (style + ".json");
    const Tokenizer tok = Tokenizer::load(tj);
    const uint32_t sep = static_cast<uint32_t>(style == "gpt2" ? tok.special_id("<|endoftext|>") : tok.bos_id());
    const double f = 0.01;
    const size_t ca = val_cut(big, f), cb = val_cut(small, f);
    const auto ids = hf_encode(tj, {big.substr(0, ca), big.substr(ca), small.substr(0, cb), small.substr(cb)}, d);
    std::vector<uint32_t> want_train, want_val;
    for (int k : {0, 2}) {
      want_train.push_back(sep);
      want_train.insert(want_train.end(), ids[k].begin(), ids[k].end());
      want_val.push_back(sep);
      want_val.insert(want_val.end(), ids[k + 1].begin(), ids[k + 1].end());
    }
    for (const int threads : {1, 3}) {
      INFO("threads " << threads);
      const auto r = test::run_trainrun("prepare --tokenizer '" + tj + "' --input '" + (d / "in") + "' --output '" +
                                        (d / "out") + "' --val-fraction 0.01 --threads " + std::to_string(threads) +
                                        " --shard-tokens 200000");
      INFO(r.out << r.err);
      REQUIRE(r.exit_code == 0);
      REQUIRE_THAT(r.err, Contains("MB/s") && Contains("ETA"));
      REQUIRE_THAT(r.out, Contains("4 documents") && Contains("uint16"));
      REQUIRE(read_shard(d / "out/train_000000.bin").version == 1);
      CHECK(first_difference(concat_shards(d / "out", "train"), want_train) == "equal");
      CHECK(first_difference(concat_shards(d / "out", "val"), want_val) == "equal");
      REQUIRE_FALSE(test::file_exists(d / "out/train_000000.mask"));  // text: no mask
    }
  }
}

TEST_CASE("prepare --tokenizer: jsonl records, --text-field, val spread, --allow-special, uint32 shards", "[prepare][hf]") {
  Fixture& fx = fixture();
  test::TempDir d("prep");
  std::vector<std::string> docs;
  std::string lines;
  for (int i = 0; i < 9; ++i) {
    docs.push_back(fx.texts[i] + " #" + std::to_string(i));
    lines += json{{"body", docs.back()}, {"id", i}}.dump() + (i == 4 ? "\r\n\n   \n" : "\n");
  }
  test::write_file(d / "a.jsonl", lines);
  const std::string tj = fx.dir / "gpt2.json";
  const Tokenizer tok = Tokenizer::load(tj);
  const uint32_t eot = static_cast<uint32_t>(tok.special_id("<|endoftext|>"));
  const auto ids = hf_encode(tj, docs, d);
  auto run = [&](const std::string& extra) {
    const auto r = test::run_trainrun("prepare --tokenizer '" + tj + "' --format jsonl --text-field body --input '" +
                                      (d / "a.jsonl") + "' --output '" + (d / "out") + "' " + extra);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    return r;
  };
  run("--val-fraction 0.25");
  // Record k goes to val when floor((k+1)/4) > floor(k/4): records 3 and 7.
  std::vector<uint32_t> want_train, want_val;
  for (int k = 0; k < 9; ++k) {
    auto& w = (k == 3 || k == 7) ? want_val : want_train;
    w.push_back(eot);
    w.insert(w.end(), ids[k].begin(), ids[k].end());
  }
  CHECK(concat_shards(d / "out", "train") == want_train);
  CHECK(concat_shards(d / "out", "val") == want_val);

  // --val-fraction 0: no val shard (the old one is removed).
  run("--val-fraction 0");
  REQUIRE_FALSE(test::file_exists(d / "out/val_000000.bin"));

  // --allow-special: record 8 spells <|endoftext|>; by default it is text.
  const auto plain = concat_shards(d / "out", "train");
  run("--val-fraction 0 --allow-special");
  const auto special = concat_shards(d / "out", "train");
  CHECK(std::count(plain.begin(), plain.end(), eot) == 9);
  CHECK(std::count(special.begin(), special.end(), eot) == 9 + 3);

  // A vocab past 65536 ids: llm.c v7 uint32 shards.
  json big = read_json(tj);
  big["added_tokens"].push_back({{"id", 70000}, {"content", "<|big|>"}, {"special", true}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  test::write_file(d / "big.json", big.dump());
  const auto r = test::run_trainrun("prepare --tokenizer '" + (d / "big.json") + "' --format jsonl --text-field body --input '" +
                                    (d / "a.jsonl") + "' --output '" + (d / "out32") + "' --val-fraction 0");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE_THAT(r.out, Contains("uint32"));
  const Shard s = read_shard(d / "out32/train_000000.bin");
  CHECK(s.version == 7);
  CHECK(s.tokens == plain);
}

namespace {

// Decodes the tokens where mask == want.
std::string decode_masked(const Tokenizer& tok, const std::vector<uint32_t>& ids, const std::vector<uint8_t>& mask,
                          uint8_t want) {
  std::vector<uint32_t> sel;
  for (size_t i = 0; i < ids.size(); ++i)
    if (mask[i] == want) sel.push_back(ids[i]);
  return tok.decode(sel);
}

}  // namespace

TEST_CASE("prepare --tokenizer: chat, sharegpt and alpaca masks cover exactly the assistant replies", "[prepare]") {
  Fixture& fx = fixture();
  test::TempDir d("prep");
  const std::string l3 = fx.dir / "llama3.json";
  // A ChatML tokenizer: the GPT-2 one plus <|im_start|> / <|im_end|>.
  json cm = read_json(fx.dir / "gpt2.json");
  for (auto [id, name] : {std::pair{3001, "<|im_start|>"}, std::pair{3002, "<|im_end|>"}})
    cm["added_tokens"].push_back({{"id", id}, {"content", name}, {"special", true}, {"single_word", false},
                                  {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  test::write_file(d / "chatml.json", cm.dump());

  const std::string sys = "You are terse.", u1 = "Hi 日本 <|eot_id|>?", a1 = "Hello!  How can I help?\n",
                    u2 = "2+2", a2 = "4 \U0001F600";
  const json chat = {{"messages",
                      {{{"role", "system"}, {"content", sys}}, {{"role", "user"}, {"content", u1}},
                       {{"role", "assistant"}, {"content", a1}}, {{"role", "user"}, {"content", u2}},
                       {{"role", "assistant"}, {"content", a2}}}}};
  const json share = {{"conversations",
                       {{{"from", "system"}, {"value", sys}}, {{"from", "human"}, {"value", u1}},
                        {{"from", "gpt"}, {"value", a1}}, {{"from", "human"}, {"value", u2}},
                        {{"from", "gpt"}, {"value", a2}}}}};
  const json alpaca = {{"instruction", u1}, {"input", u2}, {"output", a1}};
  test::write_file(d / "chat.jsonl", chat.dump() + "\n");
  test::write_file(d / "share.jsonl", share.dump() + "\n");
  test::write_file(d / "alpaca.jsonl", alpaca.dump() + "\n");

  struct Case {
    std::string format, file, tokenizer, tmpl, want_full, want_target;
  };
  // llama3: Meta's Llama 3.1 template (contents trimmed, the dated system header).
  const std::string h = "<|start_header_id|>", e = "<|end_header_id|>\n\n", eot = "<|eot_id|>";
  const std::string dates = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  const std::string a1t = "Hello!  How can I help?";
  const std::string l3_conv = "<|begin_of_text|>" + h + "system" + e + dates + sys + eot + h + "user" + e + u1 + eot +
                              h + "assistant" + e + a1t + eot + h + "user" + e + u2 + eot + h + "assistant" + e + a2 +
                              eot;
  const std::string cm_conv = "<|endoftext|><|im_start|>system\n" + sys + "<|im_end|>\n<|im_start|>user\n" + u1 +
                              "<|im_end|>\n<|im_start|>assistant\n" + a1 + "<|im_end|>\n<|im_start|>user\n" + u2 +
                              "<|im_end|>\n<|im_start|>assistant\n" + a2 + "<|im_end|>\n";
  const std::string pl_conv = "<|endoftext|>System: " + sys + "\n\nUser: " + u1 + "\n\nAssistant: " + a1 +
                              "\n\nUser: " + u2 + "\n\nAssistant: " + a2 + "\n\n";
  const std::vector<Case> cases = {
      {"chat", "chat.jsonl", l3, "", l3_conv, a1t + eot + a2 + eot},
      {"sharegpt", "share.jsonl", l3, "llama3", l3_conv, a1t + eot + a2 + eot},
      {"alpaca", "alpaca.jsonl", l3, "",
       "<|begin_of_text|>" + h + "system" + e + dates + eot + h + "user" + e + u1 + "\n\n" + u2 + eot + h +
           "assistant" + e + a1t + eot,
       a1t + eot},
      // The assistant's turn is what it adds to the text: "<|im_end|>\n" too.
      {"chat", "chat.jsonl", d / "chatml.json", "", cm_conv, a1 + "<|im_end|>\n" + a2 + "<|im_end|>\n"},
      // "Assistant: Hello" encoded whole: " Hello" crosses into the reply and
      // ends inside it, so it is a target.
      {"chat", "chat.jsonl", fx.dir / "gpt2.json", "", pl_conv, " " + a1 + "\n\n" + " " + a2 + "\n\n"},
  };
  for (const auto& c : cases) {
    INFO(c.format << " " << c.tokenizer);
    const Tokenizer tok = Tokenizer::load(c.tokenizer);
    for (const bool all : {false, true}) {
      const auto r = test::run_trainrun("prepare --tokenizer '" + c.tokenizer + "' --format " + c.format + " --input '" +
                                        (d / c.file) + "' --output '" + (d / "out") + "' --val-fraction 0" +
                                        (c.tmpl.empty() ? "" : " --chat-template " + c.tmpl) +
                                        (all ? " --train-on-input" : ""));
      INFO(r.out << r.err);
      REQUIRE(r.exit_code == 0);
      const auto ids = read_shard(d / "out/train_000000.bin").tokens;
      const auto mask = read_mask(d / "out/train_000000.mask");
      REQUIRE(mask.size() == ids.size());
      CHECK(tok.decode(ids) == c.want_full);
      // The rendered text is encoded whole with special tokens matched, as
      // apply_chat_template does: the user's "<|eot_id|>" is the special id.
      if (const int64_t eot_id = tok.special_id("<|eot_id|>"); eot_id >= 0)
        CHECK(std::count(ids.begin(), ids.end(), static_cast<uint32_t>(eot_id)) == (c.format == "alpaca" ? 4 : 6));
      if (all) {
        CHECK(std::count(mask.begin(), mask.end(), 1) == static_cast<long>(mask.size()));
      } else {
        CHECK(decode_masked(tok, ids, mask, 1) == c.want_target);
      }
    }
  }
}

TEST_CASE("prepare --tokenizer: bad input names file:line or the byte offset and leaves the output as it was",
          "[prepare][errors]") {
  Fixture& fx = fixture();
  test::TempDir d("prep");
  const std::string l3 = fx.dir / "llama3.json";
  test::write_file(d / "good.jsonl", "{\"text\": \"fine\"}\n");
  auto prep = [&](const std::string& args) {
    return test::run_trainrun("prepare --tokenizer '" + l3 + "' --output '" + (d / "out") + "' --val-fraction 0 " + args);
  };
  REQUIRE(prep("--format jsonl --input '" + (d / "good.jsonl") + "'").exit_code == 0);
  const std::string before = test::read_file(d / "out/train_000000.bin");

  struct Bad {
    std::string format, content, want1, want2;
  };
  const std::vector<Bad> bads = {
      {"jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": oops}\n", "x.jsonl:3:", "invalid JSON"},
      {"jsonl", "{\"text\": \"ok\"}\n\n{\"body\": \"ok\"}\n", "x.jsonl:3:", "missing \"text\""},
      {"jsonl", "{\"text\": 5}\n", "x.jsonl:1:", "not a string"},
      {"jsonl", "[1, 2]\n", "x.jsonl:1:", "expected a JSON object"},
      {"chat", "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n{\"messages\": [{\"role\": \"bot\", \"content\": \"a\"}]}\n",
       "x.jsonl:2:", "unknown role \"bot\""},
      {"chat", "{\"msgs\": []}\n", "x.jsonl:1:", "missing \"messages\""},
      {"chat", "{\"messages\": [{\"role\": \"user\"}]}\n", "x.jsonl:1:", "messages[0]: missing \"content\""},
      {"sharegpt", "{\"conversations\": [{\"from\": \"robot\", \"value\": \"a\"}]}\n", "x.jsonl:1:", "unknown from \"robot\""},
      {"alpaca", "{\"instruction\": \"a\"}\n", "x.jsonl:1:", "missing \"output\""},
      {"jsonl", "{\"text\": \"ok\"}\n{\"text\": \"bad \xff byte\"}\n", "x.jsonl:2:", "byte offset 29"},
      {"text", std::string("fine text\nthen \xc3\x28 bad"), "x.jsonl:", "not valid UTF-8 at byte offset 15"},
  };
  for (const auto& b : bads) {
    INFO(b.format << ": " << b.content);
    test::write_file(d / "x.jsonl", b.content);
    const auto r = prep("--format " + b.format + " --input '" + (d / "x.jsonl") + "' --threads 2");
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains(b.want1) && Contains(b.want2));
    // Nothing half-written: the earlier output is intact and no temp file is left.
    CHECK(test::read_file(d / "out/train_000000.bin") == before);
    for (const auto& f : std::filesystem::directory_iterator(d / "out"))
      CHECK(f.path().filename().string().find(".tmp") == std::string::npos);
  }
  // Options that do not fit together, and templates the tokenizer cannot do.
  CHECK_THAT(prep("--format jsonl --chat-template llama3 --input '" + (d / "good.jsonl") + "'").err,
             Contains("--chat-template") && Contains("only the chat formats"));
  test::write_file(d / "c.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n");
  CHECK_THAT(prep("--format chat --chat-template chatml --input '" + (d / "c.jsonl") + "'").err,
             Contains("--chat-template chatml") && Contains("<|im_start|>"));
  CHECK_THAT(test::run_trainrun("prepare --format jsonl --input '" + (d / "good.jsonl") + "' --output '" + (d / "o2") + "'").err,
             Contains("--format jsonl needs --tokenizer"));
  CHECK_THAT(prep("--format jsonl --seq-len 64 --input '" + (d / "good.jsonl") + "'").err,
             Contains("--seq-len") && Contains("65"));
  CHECK_THAT(test::run_trainrun("prepare --tokenizer '" + (d / "nope.json") + "' --input '" + (d / "good.jsonl") +
                                "' --output '" + (d / "o3") + "'").err,
             Contains("nope.json") && Contains("cannot open"));
  CHECK(test::read_file(d / "out/train_000000.bin") == before);

  // The tokenizer's vocab against model.vocab_size, at job start (prepare.json).
  REQUIRE(read_json(d / "out/prepare.json")["vocab_size"] == 3001);
  REQUIRE_THROWS_WITH(open_token_files(d / "out/train_*.bin", "llmc", 3000, "data.train"),
                      Contains("data.train") && Contains("3001 ids") && Contains("model.vocab_size = 3000") &&
                          Contains("prepare.json"));
  REQUIRE(open_token_files(d / "out/train_*.bin", "llmc", 3001, "data.train")->num_tokens() > 0);

  // data.document_mask's default separator: prepare.json's document_start_id
  // is the token every document starts with (the shard's first token).
  const std::string shard = test::read_file(d / "out/train_000000.bin");
  REQUIRE(shard.size() >= 1026);
  const int first = int(uint8_t(shard[1024])) | int(uint8_t(shard[1025])) << 8;  // uint16 after the 1024-byte header
  CHECK(read_json(d / "out/prepare.json")["document_start_id"] == first);
  const JobSpec job = parse_job_spec("model: {n_layer: 1, n_head: 2, n_embd: 8, vocab_size: 3001, seq_len: 8}\n"
                                     "data: {train: '" + (d / "out/train_*.bin") + "', document_mask: true}\n",
                                     "job.yaml");
  CHECK(resolve_document_separator(job) == first);
}

namespace {

// The "loss" of every metrics.jsonl record of a run.
std::vector<double> run_losses(const std::string& dir) {
  std::vector<double> out;
  std::istringstream is(test::read_file(dir + "/metrics.jsonl"));
  for (std::string l; std::getline(is, l);) {
    const json j = json::parse(l);
    if (j.contains("loss") && j.contains("step")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

}  // namespace

TEST_CASE("train on masked chat shards: the loss is the mean over the global batch's targets, any micro-batch/rank split",
          "[prepare][train]") {
  Fixture& fx = fixture();
  test::TempDir d("sft");
  // Conversations of uneven lengths, so micro-batches hold different numbers
  // of targets and a per-micro-batch mean would differ from the global one.
  std::string lines;
  const std::string& prose = fx.texts.back();
  for (int i = 0; i < 120; ++i) {
    const std::string user = prose.substr((i * 131) % 5000, 20 + (i * 37) % 150);
    const std::string reply = prose.substr((i * 71) % 5000, 5 + (i * 53) % 90);
    lines += json{{"messages", {{{"role", "user"}, {"content", user}}, {{"role", "assistant"}, {"content", reply}}}}}.dump() + "\n";
  }
  test::write_file(d / "chat.jsonl", lines);
  const std::string tj = fx.dir / "llama3.json";
  for (const std::string& out : {std::string("masked"), std::string("all")}) {
    const auto r = test::run_trainrun("prepare --tokenizer '" + tj + "' --format chat --input '" + (d / "chat.jsonl") +
                                      "' --output '" + (d / out) + "' --val-fraction 0" +
                                      (out == "all" ? " --train-on-input" : ""));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
  }
  auto job = [&](const std::string& data, const std::string& run, int micro, int nproc) {
    test::write_file(d / (run + ".yaml"),
                     "model: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 3001, seq_len: 32}\n"
                     "data: {format: llmc, train: '" + (d / data) + "/train_*.bin'}\n"
                     "train: {global_batch_size: 8, micro_batch_size: " + std::to_string(micro) +
                     ", max_steps: 4, lr: 1.0e-3, warmup_steps: 1, log_interval: 1, eval_interval: 0}\n"
                     "output: {dir: '" + (d / run) + "', sample_tokens: 0}\n"
                     "parallel: {nproc_per_node: " + std::to_string(nproc) + "}\n");
    const auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + (d / (run + ".yaml")) + "'");
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    REQUIRE_THAT(r.out + r.err, Contains("with loss masks") || Contains(data == "all" ? "with loss masks" : "?"));
    return run_losses(d / run);
  };
  const auto one = job("masked", "m8", 8, 1);       // one micro-batch
  const auto accum = job("masked", "m2", 2, 1);     // 4 micro-batches
  const auto ranks = job("masked", "m2r2", 2, 2);   // 2 ranks x 2 micro-batches
  const auto all = job("all", "a8", 8, 1);
  REQUIRE(one.size() == 4);
  REQUIRE(accum.size() == 4);
  REQUIRE(ranks.size() == 4);
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("step " << i + 1 << ": one " << one[i] << " accum " << accum[i] << " ranks " << ranks[i] << " all " << all[i]);
    CHECK(std::fabs(accum[i] - one[i]) <= 1e-5 * one[i]);
    CHECK(std::fabs(ranks[i] - one[i]) <= 1e-5 * one[i]);
    CHECK(std::fabs(all[i] - one[i]) > 1e-4 * one[i]);  // the mask changes what is averaged
  }
  // At the random init every token's loss is about log V, so a mean over the
  // targets in the loss is too; a sum over them divided by all B*T tokens
  // (the unmasked normalisation) would be a fraction of it.
  CHECK(std::fabs(one[0] - all[0]) < 0.02 * all[0]);
  CHECK(std::fabs(one[0] - std::log(3001.0)) < 0.05 * one[0]);
}

TEST_CASE("prepare.json records each shard's tokens and largest id: checked once at open, each sample as it is read",
          "[prepare][data]") {
  Fixture& fx = fixture();
  test::TempDir d("prep_meta");
  const std::string tj = fx.dir / "gpt2.json";
  test::write_file(d / "a.txt", test::read_file("/usr/share/games/fortunes/computers").substr(0, 30000));
  auto r = test::run_trainrun("prepare --tokenizer '" + tj + "' --input '" + (d / "a.txt") + "' --output '" +
                              (d / "out") + "' --val-fraction 0.1 --shard-tokens 3000");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json meta = read_json(d / "out/prepare.json");
  int64_t train = 0;
  uint32_t max_all = 0;
  for (const auto& [name, rec] : meta["shards"].items()) {
    INFO(name);
    const Shard sh = read_shard(d / ("out/" + name));
    CHECK(rec["tokens"].get<int64_t>() == static_cast<int64_t>(sh.tokens.size()));
    CHECK(rec["max_token_id"].get<uint32_t>() == *std::max_element(sh.tokens.begin(), sh.tokens.end()));
    if (name.rfind("train_", 0) == 0) train += rec["tokens"].get<int64_t>();
    max_all = std::max(max_all, rec["max_token_id"].get<uint32_t>());
  }
  CHECK(meta["shards"].size() >= 3);
  CHECK(meta["train_tokens"].get<int64_t>() == train);
  CHECK(meta["max_token_id"].get<uint32_t>() == max_all);
  const int vocab = static_cast<int>(Tokenizer::load(tj).vocab_size());
  const std::string pattern = d / "out/train_*.bin";
  {
    auto src = open_token_files(pattern, "llmc", vocab, "data.train");
    CHECK(src->vocab_bound() <= static_cast<int>(max_all) + 1);  // from the records of the train shards
    std::vector<int32_t> in(64), tg(64);
    for (int64_t s = 0; s < src->num_samples(64); ++s) src->read_samples(s, 1, 64, in.data(), tg.data());
  }
  // The vocabulary against the record, without reading a token (with the
  // tokenizer's vocab_size left out, which is checked first).
  json no_vocab = meta;
  no_vocab.erase("vocab_size");
  test::write_file(d / "out/prepare.json", no_vocab.dump());
  CHECK_THROWS_WITH(open_token_files(pattern, "llmc", static_cast<int>(max_all), "data.train"),
                    Contains("has token ids up to " + std::to_string(max_all)) && Contains("prepare.json"));
  test::write_file(d / "out/prepare.json", meta.dump());

  // A token corrupted past the vocabulary: the job opens (nothing scans the
  // tokens at start); the sample that reads it fails, naming file and offset.
  const std::string shard0 = d / "out/train_000000.bin";
  std::string bytes = test::read_file(shard0);
  bytes[1024 + 2 * 1000] = char(0xFF);
  bytes[1024 + 2 * 1000 + 1] = char(0xFF);
  test::write_file(shard0, bytes);
  {
    auto src = open_token_files(pattern, "llmc", vocab, "data.train");
    std::vector<int32_t> in(64), tg(64);
    src->read_samples(0, 1, 64, in.data(), tg.data());  // tokens 0..64: fine
    CHECK_THROWS_WITH(src->read_samples(1000 / 64, 1, 64, in.data(), tg.data()),
                      Contains("train_000000.bin' has token id 65535 at token index 1000 (byte offset 3024)"));
  }
  // A record that does not match the shard is refused at open.
  json bad = meta;
  bad["shards"]["train_000001.bin"]["tokens"] = 5;
  test::write_file(d / "out/prepare.json", bad.dump());
  CHECK_THROWS_WITH(open_token_files(pattern, "llmc", vocab, "data.train"),
                    Contains("records 5 tokens for '" + d / "out/train_000001.bin") &&
                        Contains("from different runs"));

  // Masks: a corrupt byte is caught by the sample that reads it.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "yo"}}}}};
  std::string lines;
  for (int i = 0; i < 40; ++i) lines += chat.dump() + "\n";
  test::write_file(d / "c.jsonl", lines);
  r = test::run_trainrun("prepare --tokenizer '" + tj + "' --format chat --input '" + (d / "c.jsonl") + "' --output '" +
                         (d / "chat") + "' --val-fraction 0");
  REQUIRE(r.exit_code == 0);
  std::string m = test::read_file(d / "chat/train_000000.mask");
  m[200] = 7;
  test::write_file(d / "chat/train_000000.mask", m);
  auto src = open_token_files(d / "chat/train_*.bin", "llmc", vocab, "data.train");
  std::vector<int32_t> in(32), tg(32);
  CHECK_THROWS_WITH(src->read_samples(200 / 32, 1, 32, in.data(), tg.data()),
                    Contains("train_000000.mask' has byte 7 at index 200"));
}

TEST_CASE("tokenizer: utf8_lossy replaces each maximal invalid subpart with U+FFFD, as Python and Rust do",
          "[tokenizer]") {
  // Truncated sequences, stray continuations, overlongs, surrogates, > U+10FFFF, valid text between.
  const std::vector<std::string> cases = {"ok", "\x84\xf7\xb0", "a\xe2\x82", "\xe2\x82\xac\xe2", "\xc0\xaf",
                                          "\xed\xa0\x80x", "\xf4\x90\x80\x80", "\xf0\x9f\x98", "\xf0\x9f\x98\x80!",
                                          "\xe0\x80\xaf", "\xff\xfe", "caf\xc3\xa9\xc3"};
  test::TempDir dir("lossy");
  std::string hex_in;
  for (const std::string& c : cases) {
    for (unsigned char b : c) {
      char h[3];
      std::snprintf(h, sizeof h, "%02x", b);
      hex_in += h;
    }
    hex_in += "\n";
  }
  test::write_file(dir / "in.txt", hex_in);
  const test::RunResult r = test::run_command(
      "'" + hf_python() + "' -c \"import sys\nfor l in open(sys.argv[1]):\n"
      "    print(bytes.fromhex(l.strip()).decode('utf-8', 'replace').encode('utf-8').hex())\" '" + dir / "in.txt" + "'");
  REQUIRE(r.exit_code == 0);
  std::istringstream want(r.out);
  for (const std::string& c : cases) {
    std::string line;
    REQUIRE(std::getline(want, line));
    std::string got_hex;
    for (unsigned char b : utf8_lossy(c)) {
      char h[3];
      std::snprintf(h, sizeof h, "%02x", b);
      got_hex += h;
    }
    INFO("case " << got_hex);
    CHECK(got_hex == line);
    CHECK(find_invalid_utf8(utf8_lossy(c)) == -1);
  }
}
