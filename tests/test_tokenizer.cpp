// The HF byte-level BPE tokenizer (core/data/tokenizer) against the real
// `tokenizers` library: tokenizers that scripts/reference/hf_tokenizer.py
// trains offline (GPT-2 style, GPT-2 with add_prefix_space, Llama 3 style
// with Split + ignore_merges; both merge formats) must give the same ids as
// HF on text chosen to hit the pre-tokenizer regexes' corners, and decoding
// must give the text back. Bad tokenizer.json files are refused with the
// JSON path.
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

namespace {

// Missing venv is a FAILURE, not a skip (CI installs it: scripts/install-deps.sh --test).
std::string hf_python() {
  const std::string py = test::source_dir() + "/.venv/bin/python";
  if (!test::file_exists(py) || test::run_command("'" + py + "' -c 'import tokenizers'").exit_code != 0)
    FAIL("HF tokenizers is not available (looked for " << py << " able to `import tokenizers`); run "
         "scripts/install-deps.sh --test");
  return py;
}

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
  CHECK_THAT(load_error([](json& j) { j["normalizer"] = {{"type", "NFC"}}; }),
             Contains("bad.json") && Contains("normalizer") && Contains("\"NFC\"") && Contains("not supported"));
  CHECK_THAT(load_error([](json& j) { j["model"]["type"] = "Unigram"; }),
             Contains("model.type") && Contains("Unigram"));
  CHECK_THAT(load_error([](json& j) { j["model"]["type"] = "WordPiece"; }), Contains("model.type") && Contains("WordPiece"));
  CHECK_THAT(load_error([](json& j) { j["model"]["dropout"] = 0.1; }), Contains("model.dropout") && Contains("0.1"));
  CHECK_THAT(load_error([](json& j) { j["model"]["byte_fallback"] = true; }), Contains("model.byte_fallback"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
             Contains("pre_tokenizer.pretokenizers[0].behavior") && Contains("Removed"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; }),
             Contains("pre_tokenizer.pretokenizers[0].invert"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Whitespace"}}; }),
             Contains("pre_tokenizer.pretokenizers[1].type") && Contains("Whitespace"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; }),
             Contains("pre_tokenizer.pretokenizers[0].pattern.Regex") && Contains("(unclosed") && Contains("PCRE2"));
  CHECK_THAT(load_error([](json& j) {
               auto& p = j["pre_tokenizer"]["pretokenizers"];
               std::swap(p[0], p[1]);
             }),
             Contains("pre_tokenizer.pretokenizers[1]") && Contains("ByteLevel must come last"));
  CHECK_THAT(load_error([](json& j) { j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0]; }),
             Contains("pre_tokenizer") && Contains("no ByteLevel"));
  CHECK_THAT(load_error([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), Contains("decoder.type") && Contains("WordPiece"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][5] = "a b c"; }), Contains("model.merges[5]") && Contains("a b c"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][7] = json::array({"zzzq", "h"}); }),
             Contains("model.merges[7]") && Contains("zzzq") && Contains("not in model.vocab"));
  CHECK_THAT(load_error([](json& j) { j["model"]["merges"][2] = 17; }), Contains("model.merges[2]") && Contains("17"));
  CHECK_THAT(load_error([](json& j) { j["model"]["vocab"]["Ġthe"] = -4; }), Contains("model.vocab[\"Ġthe\"]") && Contains("-4"));
  CHECK_THAT(load_error([](json& j) { j["model"]["vocab"].erase("Ā"); }),
             Contains("model.vocab") && Contains("0x00") && Contains("byte-level symbols"));
  CHECK_THAT(load_error([](json& j) { j["added_tokens"][1]["lstrip"] = true; }), Contains("added_tokens[1].lstrip"));
  CHECK_THAT(load_error([](json& j) { j["added_tokens"][0].erase("content"); }), Contains("added_tokens[0].content"));
  CHECK_THAT(load_error([](json& j) { j["truncation"] = {{"max_length", 8}}; }), Contains("truncation"));
  CHECK_THAT(load_error([](json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; }),
             Contains("post_processor.type") && Contains("BertProcessing"));
  CHECK_THAT(load_error([](json& j) { j.erase("model"); }), Contains("model") && Contains("missing"));
  REQUIRE_THROWS_WITH(Tokenizer::from_json_text("{not json", "x.json"), Contains("x.json") && Contains("not valid JSON"));
  REQUIRE_THROWS_WITH(Tokenizer::load(fx.dir / "nope.json"), Contains("nope.json") && Contains("cannot open"));
  CHECK(load_error([](json&) {}) == "(no error)");
}
