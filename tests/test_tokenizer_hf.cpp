// Every tokenizer family causal LMs ship, against HF `tokenizers` itself:
// scripts/reference/hf_tokenizer_zoo.py trains SentencePiece BPE and Unigram
// models offline and converts them with transformers' slow->fast converters
// (Llama 2 legacy, Mistral, Gemma, T5's Precompiled charsmap), and builds
// others with `tokenizers` (Qwen2's NFC + regex, a byte-level vocab missing
// bytes with unk, a character BPE with every BPE knob and added-token flag,
// Split with each behavior and invert). On hard text each must give HF's
// ids (special tokens as text and matched, with and without the
// post-processor) and HF's decode, also of random id lists.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <functional>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

namespace {

json read_json(const std::string& path) { return json::parse(test::read_file(path)); }

std::vector<std::string> hard_texts() {
  return {
      "Hello, World! It's 2024 and I'M here; you'RE there. DON'T.",
      "日本語のテキストと中文文本，还有한국어 텍스트。東京タワー",
      "Family: \U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 and \U0001F3F3\uFE0F\u200D\U0001F308 "
      "flags \U0001F44D\U0001F3FD ok \U0001F600\U0001F600",
      "line one\r\nline two\r\n\r\nline four\n\n\nend\r",
      "   leading spaces and trailing   ",
      " one leading space",
      "a  b   c\t\td \t \t e      \n    indented\tcode()  \t\n\t\t\tx   ",
      "pi=3.14159265358979 and 1234567890123 x99y 00000 ½ ² ٣٤٥ Ⅻ",
      "zero\u200Bwidth\u200Djoin e\u0301 n\u0303 a\u0308\u0304 \uFEFFbom ﬁ ｆｕｌｌ ㍻ Å Ω",
      "ctl\x01\x02\x7f\x1b[0m bell\a nul-free \x0b\x0c",
      "nbsp\u00A0here \u2028sep\u2029 nel\u0085x \u3000ideo ſ İstanbul ΣΑΣ",
      "<s> begin </s> end <unk> <pad> <0x41> <mask> [TOOL] <|endoftext|> <|im_start|>user<|im_end|>",
      "say hello, hellothere, hello! <mask>   spaced   <tool>   after [RAW]x Ünïcödé ÜNÏ",
      "<start_of_turn>user\nhi<end_of_turn>\n▁literal▁meta ▁▁",
      "",
      " ",
      "\n",
      std::string(300, ' ') + "x" + std::string(20, '\t'),
      "def f(x):\n    return {'k': [1, 2.5e-3, \"s\"]}  # comment\n",
      "Ünïcödé ÀÉÎÕÜ ΑΒΓ αβγ Привет мир ąčęėįšųūž العربية עברית",
  };
}

// The zoo's tokenizer files take ~15 s of Python to train, and CTest runs
// each case below in its own process: they are made once per build, in
// <build>/test-cache/tokzoo-<hash of corpus and script>, and copied into
// each process's own directory (where the cases write their outputs). A
// change to the corpus or to the script gives another hash, so a stale zoo
// is never used; two processes that race both make it, and the first
// rename wins.
struct Zoo {
  test::TempDir dir{"tokzoo"};
  std::vector<std::string> texts = hard_texts();
  Zoo() {
    namespace fs = std::filesystem;
    std::string corpus;
    for (const char* f : {"/usr/share/games/fortunes/computers", "/usr/share/games/fortunes/science"})
      if (test::file_exists(f)) corpus += test::read_file(f);
    // The hard texts are in the corpus too, so pieces over CJK, emoji and
    // whitespace runs exist (and byte fallback still has bytes to do).
    for (int r = 0; r < 5; ++r)
      for (const auto& t : texts) corpus += t + "\n";
    const std::string args = "make --vocab 1000";
    const std::string script = test::read_file(test::source_dir() + "/scripts/reference/hf_tokenizer_zoo.py");
    char key[32];
    std::snprintf(key, sizeof key, "%016zx", std::hash<std::string>{}(corpus + "\n" + script + "\n" + args));
    const fs::path cache = fs::read_symlink("/proc/self/exe").parent_path() / "test-cache" / ("tokzoo-" + std::string(key));
    if (!fs::exists(cache / "corpus.txt")) {
      const fs::path tmp = cache.string() + ".tmp." + std::to_string(::getpid());
      fs::create_directories(tmp);
      test::write_file((tmp / "corpus.txt").string(), corpus);
      const auto r = run(args + " --dir '" + tmp.string() + "' --corpus '" + (tmp / "corpus.txt").string() + "'");
      INFO(r.out << r.err);
      REQUIRE(r.exit_code == 0);
      std::error_code ec;
      fs::rename(tmp, cache, ec);  // fails when another process got there first: use its zoo
      fs::remove_all(tmp, ec);
    }
    fs::copy(cache, dir.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    REQUIRE(test::read_file(dir / "corpus.txt") == corpus);
    texts.push_back(corpus.substr(1000, 6000));  // running prose
    test::write_file(dir / "texts.json", json(texts).dump());
  }
  static test::RunResult run(const std::string& args) {
    return test::run_command("'" + test::hf_python() + "' '" + test::source_dir() +
                             "/scripts/reference/hf_tokenizer_zoo.py' " + args);
  }
};

Zoo& zoo() {
  static Zoo z;
  return z;
}

}  // namespace

TEST_CASE("tokenizer zoo: ids and decode equal HF tokenizers' for every family", "[tokenizer][hf]") {
  Zoo& z = zoo();
  const std::string name =
      GENERATE("llama2", "mistral", "gemma", "t5", "unigram_bf", "qwen2", "unk_bytes", "charbpe", "split_removed",
               "split_removed_inv", "split_isolated", "split_isolated_inv", "split_merged_with_previous",
               "split_merged_with_previous_inv", "split_merged_with_next", "split_merged_with_next_inv",
               "split_contiguous", "split_contiguous_inv");
  const std::string path = z.dir / (name + ".json");
  const auto r = Zoo::run("encode --tokenizer '" + path + "' --texts '" + (z.dir / "texts.json") + "' --out '" +
                          (z.dir / (name + ".out.json")) + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json ref = read_json(z.dir / (name + ".out.json"));
  const Tokenizer tok = Tokenizer::load(path);
  TokenEncoder enc(tok);  // one encoder across texts: its cache must not leak between them
  for (size_t i = 0; i < z.texts.size(); ++i) {
    INFO(name << " text " << i << ": " << z.texts[i].substr(0, 200));
    std::vector<uint32_t> plain;
    enc.encode(z.texts[i], false, plain);
    CHECK(plain == ref["plain"][i].get<std::vector<uint32_t>>());
    const auto special = tok.encode(z.texts[i], true);
    CHECK(special == ref["special"][i].get<std::vector<uint32_t>>());
    CHECK(tok.with_special_tokens(special) == ref["with_special"][i].get<std::vector<uint32_t>>());
    if (!ref["decoded"][i].is_null()) CHECK(utf8_lossy(tok.decode(plain)) == ref["decoded"][i].get<std::string>());
  }
  const auto lists = ref["lists"].get<std::vector<std::vector<uint32_t>>>();
  for (size_t i = 0; i < lists.size(); ++i) {
    INFO(name << " id list " << i);
    if (ref["lists_decoded"][i].is_null()) continue;  // HF panicked on it (see hf_tokenizer_zoo.py)
    CHECK(utf8_lossy(tok.decode(lists[i])) == ref["lists_decoded"][i].get<std::string>());
  }
}

TEST_CASE("tokenizer zoo: the families use what they claim to", "[tokenizer][hf]") {
  // The comparison above only tests a component if the file has it: check
  // the converters wrote what the names say.
  Zoo& z = zoo();
  const json llama = read_json(z.dir / "llama2.json");
  CHECK(llama["model"]["byte_fallback"] == true);
  CHECK(llama["normalizer"]["normalizers"][0]["type"] == "Prepend");
  CHECK(read_json(z.dir / "mistral.json")["pre_tokenizer"]["prepend_scheme"] == "first");
  const json t5 = read_json(z.dir / "t5.json");
  CHECK(t5["model"]["type"] == "Unigram");
  CHECK(t5["normalizer"]["normalizers"][0]["type"] == "Precompiled");
  CHECK(t5["normalizer"]["normalizers"][0]["precompiled_charsmap"].get<std::string>().size() > 1000);
  CHECK(read_json(z.dir / "qwen2.json")["normalizer"]["type"] == "NFC");
  CHECK(read_json(z.dir / "gemma.json")["pre_tokenizer"]["behavior"] == "MergedWithPrevious");
  // unk_bytes really lacks byte symbols, and the hard texts hit them.
  const json ub = read_json(z.dir / "unk_bytes.json");
  CHECK(!ub["model"]["vocab"].contains("Ā"));  // byte 0x00's symbol
  const Tokenizer u = Tokenizer::load(z.dir / "unk_bytes.json");
  const auto ids = u.encode("ctl\x01\x02 日本");
  CHECK(std::count(ids.begin(), ids.end(), static_cast<uint32_t>(u.token_id("<unk>"))) >= 2);
  const json cb = read_json(z.dir / "charbpe.json");
  CHECK(cb["model"]["continuing_subword_prefix"] == "##");
  CHECK(cb["model"]["end_of_word_suffix"] == "</w>");
}

TEST_CASE("tokenizer zoo: every component type HF tokenizers defines is read as HF does, or refused with a reason",
          "[tokenizer][hf]") {
  // The types of tokenizers 0.19 (normalizers/mod.rs, pre_tokenizers/mod.rs,
  // models/mod.rs, decoders/mod.rs, processors/mod.rs), each swapped into
  // the character BPE: a supported one must give HF's ids and decode, a
  // refused one an error naming the JSON path and why.
  Zoo& z = zoo();
  const json base = read_json(z.dir / "charbpe.json");
  const json charsmap = read_json(z.dir / "t5.json")["normalizer"]["normalizers"][0];
  const uint32_t cls = base["model"]["vocab"]["[CLS]"], sep = base["model"]["vocab"]["[SEP]"];
  const json tmpl = json::parse(R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
      "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
      "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [)" + std::to_string(cls) + R"(], "tokens": ["[CLS]"]},
                         "[SEP]": {"id": "[SEP]", "ids": [)" + std::to_string(sep) + R"(], "tokens": ["[SEP]"]}}})");
  struct Component {
    std::string slot;  // the top-level key it goes in
    json config;
    std::string refused;  // empty: supported
  };
  const std::string no = "not supported";
  const std::vector<Component> all = {
      {"normalizer", {{"type", "BertNormalizer"}, {"clean_text", true}, {"handle_chinese_chars", true}, {"strip_accents", nullptr}, {"lowercase", true}}, no},
      {"normalizer", {{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}}, ""},
      {"normalizer", {{"type", "StripAccents"}}, no},
      {"normalizer", {{"type", "NFC"}}, ""},
      {"normalizer", {{"type", "NFD"}}, ""},
      {"normalizer", {{"type", "NFKC"}}, ""},
      {"normalizer", {{"type", "NFKD"}}, ""},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "NFD"}}, {{"type", "Lowercase"}}}}}, ""},
      {"normalizer", {{"type", "Lowercase"}}, ""},
      {"normalizer", {{"type", "Nmt"}}, no},
      {"normalizer", charsmap, ""},
      {"normalizer", {{"type", "Replace"}, {"pattern", {{"Regex", "[aeiou]+"}}}, {"content", "_"}}, ""},
      {"normalizer", {{"type", "Prepend"}, {"prepend", "\u2581"}}, ""},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}, ""},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}, ""},
      {"pre_tokenizer", {{"type", "CharDelimiterSplit"}, {"delimiter", "e"}}, ""},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}, {"split", true}}, ""},
      {"pre_tokenizer", {{"type", "Whitespace"}}, ""},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {{{"type", "WhitespaceSplit"}}, {{"type", "Digits"}, {"individual_digits", false}}}}}, ""},
      {"pre_tokenizer", {{"type", "Split"}, {"pattern", {{"String", "e"}}}, {"behavior", "Contiguous"}, {"invert", false}}, ""},
      {"pre_tokenizer", {{"type", "Punctuation"}, {"behavior", "MergedWithNext"}}, ""},
      {"pre_tokenizer", {{"type", "WhitespaceSplit"}}, ""},
      {"pre_tokenizer", {{"type", "Digits"}, {"individual_digits", true}}, ""},
      {"pre_tokenizer", {{"type", "UnicodeScripts"}}, no},
      {"decoder", {{"type", "BPEDecoder"}, {"suffix", "</w>"}}, no},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}, ""},
      {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}, no},
      {"decoder", {{"type", "Metaspace"}, {"replacement", "#"}, {"prepend_scheme", "always"}, {"split", true}}, ""},
      {"decoder", {{"type", "CTC"}, {"pad_token", "<pad>"}, {"word_delimiter_token", "|"}, {"cleanup", true}}, no},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, {{"type", "Strip"}, {"content", "<"}, {"start", 1}, {"stop", 2}}}}}, ""},
      {"decoder", {{"type", "Replace"}, {"pattern", {{"Regex", "#+"}}}, {"content", "-"}}, ""},
      {"decoder", {{"type", "Fuse"}}, ""},
      {"decoder", {{"type", "Strip"}, {"content", "#"}, {"start", 2}, {"stop", 0}}, ""},
      {"decoder", {{"type", "ByteFallback"}}, ""},
      {"post_processor", {{"type", "RobertaProcessing"}, {"sep", {"[SEP]", sep}}, {"cls", {"[CLS]", cls}}, {"trim_offsets", true}, {"add_prefix_space", true}}, ""},
      {"post_processor", {{"type", "BertProcessing"}, {"sep", {"[SEP]", sep}}, {"cls", {"[CLS]", cls}}}, ""},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}, ""},
      {"post_processor", tmpl, ""},
      {"post_processor", {{"type", "Sequence"}, {"processors", {{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}}, tmpl}}}, ""},
      {"model", {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"continuing_subword_prefix", "##"}, {"max_input_chars_per_word", 100}, {"vocab", {{"[UNK]", 0}}}}, no},
      {"model", {{"type", "WordLevel"}, {"vocab", {{"[UNK]", 0}}}, {"unk_token", "[UNK]"}}, no},
  };
  std::vector<std::string> supported;
  for (size_t k = 0; k < all.size(); ++k) {
    const Component& c = all[k];
    json j = base;
    j[c.slot] = c.config;
    const std::string path = z.dir / ("component_" + std::to_string(k) + ".json");
    test::write_file(path, j.dump());
    INFO(c.slot << " " << c.config["type"]);
    if (c.refused.empty()) {
      supported.push_back(path);
      continue;
    }
    try {
      Tokenizer::load(path);
      FAIL("loaded, but it should be refused");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Contains(c.slot + ".type") && Contains(c.config["type"].get<std::string>()) && Contains(c.refused));
    }
  }
  std::string args = "encode --texts '" + (z.dir / "texts.json") + "' --tokenizer";
  for (const auto& p : supported) args += " '" + p + "'";
  const auto r = Zoo::run(args);
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  for (const auto& p : supported) {
    const json ref = read_json(p.substr(0, p.size() - 5) + ".out.json");
    const json cfg = read_json(p);
    const Tokenizer tok = Tokenizer::load(p);
    for (size_t i = 0; i < z.texts.size(); ++i) {
      INFO(p << " text " << i << ": " << z.texts[i].substr(0, 120));
      const auto plain = tok.encode(z.texts[i], false);
      CHECK(plain == ref["plain"][i].get<std::vector<uint32_t>>());
      CHECK(tok.with_special_tokens(tok.encode(z.texts[i], true)) == ref["with_special"][i].get<std::vector<uint32_t>>());
      if (!ref["decoded"][i].is_null()) CHECK(utf8_lossy(tok.decode(plain)) == ref["decoded"][i].get<std::string>());
    }
  }
}

// ---- SentencePiece BPE: words cut before '▁', files cut before spaces ----------

namespace {

// Equal, or where they first differ (Catch would print 100K ids).
std::string first_difference(const std::vector<uint32_t>& got, const std::vector<uint32_t>& want) {
  const size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want[i])
      return "differ at token " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " + std::to_string(want[i]);
  if (got.size() != want.size()) return "lengths differ: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  return "equal";
}

// > 200 KB without a newline: the hard texts on one line, with runs of
// spaces, digits, CJK and emoji between them. Llama 2 and Mistral have no
// pre-tokenizer, so HF encodes this as one BPE word.
std::string one_line_text() {
  std::string unit;
  for (const std::string& t : hard_texts()) {
    for (char c : t)
      if (c != '\n' && c != '\r') unit += c;
    unit += "  ";
  }
  unit += "1234567890 00 7" + std::string(17, ' ') + "日本語のテキスト，中文文本。\U0001F600\U0001F468\u200D\U0001F469x▁▁y ▁z";
  std::string s;
  while (s.size() < 200000) s += unit + std::to_string(s.size()) + " ";
  return s;
}

// One uint16 shard's tokens (the zoo's vocabs are small).
std::vector<uint32_t> read_u16_shard(const std::string& path) {
  const std::string b = test::read_file(path);
  REQUIRE(b.size() >= 1024);
  int32_t h[3];
  std::memcpy(h, b.data(), sizeof h);
  REQUIRE(h[1] == 1);
  REQUIRE(b.size() == 1024 + 2 * static_cast<size_t>(h[2]));
  std::vector<uint32_t> t(static_cast<size_t>(h[2]));
  for (size_t i = 0; i < t.size(); ++i) {
    uint16_t v;
    std::memcpy(&v, b.data() + 1024 + 2 * i, 2);
    t[i] = v;
  }
  return t;
}

}  // namespace

TEST_CASE("tokenizer zoo: SentencePiece BPE cuts words before '▁' and keeps HF's ids on 200 KB one-line text",
          "[tokenizer][hf]") {
  Zoo& z = zoo();
  const std::string text = one_line_text();
  REQUIRE(text.size() >= 200000);
  REQUIRE(text.find('\n') == std::string::npos);
  const std::vector<std::string> texts = {text, " " + text, "  " + text + "  "};
  test::write_file(z.dir / "long.json", json(texts).dump());
  for (const std::string name : {"llama2", "mistral", "gemma"}) {
    INFO(name);
    const std::string path = z.dir / (name + ".json");
    const Tokenizer tok = Tokenizer::load(path);
    // The split path is taken (else these are whole-document BPE words),
    // and prepare may cut their files before spaces.
    CHECK(tok.splits_at_metaspace());
    CHECK(tok.can_cut_before_space());
    const std::string out = z.dir / (name + ".long.out.json");
    const auto r = Zoo::run("encode --tokenizer '" + path + "' --texts '" + (z.dir / "long.json") + "' --out '" + out + "'");
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const json ref = read_json(out);
    TokenEncoder enc(tok);
    for (size_t i = 0; i < texts.size(); ++i) {
      INFO("text " << i);
      std::vector<uint32_t> plain;
      enc.encode(texts[i], false, plain);
      CHECK(first_difference(plain, ref["plain"][i].get<std::vector<uint32_t>>()) == "equal");
      CHECK(first_difference(tok.encode(texts[i], true), ref["special"][i].get<std::vector<uint32_t>>()) == "equal");
      if (!ref["decoded"][i].is_null()) CHECK(utf8_lossy(tok.decode(plain)) == ref["decoded"][i].get<std::string>());
    }
  }
}

TEST_CASE("tokenizer: a merge that joins across '▁' (\"a ▁b\" -> \"a▁b\") keeps whole-word BPE, with HF's ids",
          "[tokenizer][hf]") {
  Zoo& z = zoo();
  // Llama 2's normalizer and decoder over a hand-made vocab. With the merge
  // "a ▁b", "▁a▁b" is one word ("▁", "a▁b"): cut before the '▁' it would be
  // "▁a" + "▁b". The same vocab without that merge ("a▁b" unreachable) is
  // safe to cut; with ignore_merges a part found whole in the vocab would
  // skip the merges the whole word gets, so it is not.
  auto make = [](bool cross_merge, bool ignore_merges, bool gemma_split) {
    json merges = json::array({"▁ b", "▁ ▁", "▁ a", "b a"});
    if (cross_merge) merges.insert(merges.begin() + 1, "a ▁b");
    json j = json{
        {"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr},
        {"added_tokens", json::array({{{"id", 0}, {"content", "<unk>"}, {"single_word", false}, {"lstrip", false},
                                       {"rstrip", false}, {"normalized", false}, {"special", true}}})},
        {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array({
             {{"type", "Prepend"}, {"prepend", "▁"}},
             {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}})}}},
        {"pre_tokenizer", nullptr}, {"post_processor", nullptr},
        {"decoder", {{"type", "Sequence"}, {"decoders", json::array({
             {{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
             {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
             {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
        {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"}, {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr}, {"fuse_unk", true}, {"byte_fallback", true},
                   {"ignore_merges", ignore_merges},
                   {"vocab", {{"<unk>", 0}, {"▁", 1}, {"a", 2}, {"b", 3}, {"▁b", 4}, {"a▁b", 5}, {"▁a", 6}, {"▁▁", 7},
                              {"ba", 8}}},
                   {"merges", merges}}}};
    if (gemma_split) {
      // Gemma's Split(" ") after the spaces became '▁', but a later Replace
      // makes spaces again ("c" -> " "): the Split then cuts the text, so
      // prepare may not (the model's split still holds).
      j["normalizer"]["normalizers"][0] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}};
      j["normalizer"]["normalizers"].push_back({{"type", "Replace"}, {"pattern", {{"String", "c"}}}, {"content", " "}});
      j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}, {"invert", false}};
    }
    return j;
  };
  struct Case {
    std::string name;
    bool cross, ignore, gemma_split, split, cut;
  };
  const std::vector<Case> cases = {{"cross", true, false, false, false, false},
                                   {"nocross", false, false, false, true, true},
                                   {"cross_ignore", true, true, false, false, false},
                                   {"space_split", false, false, true, true, false}};
  const std::vector<std::string> texts = {"a b", "ab ba b  b a b", " a b", "a  b", "ca b cb", "a b a b a b b a", "b▁a"};
  test::write_file(z.dir / "cross_texts.json", json(texts).dump());
  std::string args = "encode --texts '" + (z.dir / "cross_texts.json") + "' --tokenizer";
  for (const Case& c : cases) {
    test::write_file(z.dir / ("cross_" + c.name + ".json"), make(c.cross, c.ignore, c.gemma_split).dump());
    args += " '" + (z.dir / ("cross_" + c.name + ".json")) + "'";
  }
  const auto r = Zoo::run(args);
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  for (const Case& c : cases) {
    INFO(c.name);
    const Tokenizer tok = Tokenizer::load(z.dir / ("cross_" + c.name + ".json"));
    CHECK(tok.splits_at_metaspace() == c.split);
    CHECK(tok.can_cut_before_space() == c.cut);
    const json ref = read_json(z.dir / ("cross_" + c.name + ".out.json"));
    size_t joined = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      INFO("text " << i << ": " << texts[i]);
      const auto ids = tok.encode(texts[i]);
      CHECK(ids == ref["plain"][i].get<std::vector<uint32_t>>());
      if (!ref["decoded"][i].is_null()) CHECK(utf8_lossy(tok.decode(ids)) == ref["decoded"][i].get<std::string>());
      joined += std::count(ids.begin(), ids.end(), 5u);
    }
    // HF really joins across the '▁' where the merge exists (so a cut there
    // would differ), and never where it does not.
    if (c.cross && !c.ignore) CHECK(joined > 0);
    if (!c.cross) CHECK(joined == 0);
  }
}

TEST_CASE("prepare --tokenizer: Llama 2 / Mistral / Gemma style files are cut before spaces for the threads, with HF's ids",
          "[prepare][hf]") {
  Zoo& z = zoo();
  test::TempDir d("prepspm");
  // > 1 MiB, so the file is cut into blocks; prose with spaces (cut points)
  // and the one-line hard text (CJK, emoji, space runs) in the middle. Past
  // 1 MiB, where the block would be cut, every space follows "</s>": text
  // after a matched added token (--allow-special) is a segment HF gives a
  // Prepend '▁' of its own, so no cut there; the cut goes further back.
  const std::string corpus = test::read_file(z.dir / "corpus.txt");
  std::string big;
  while (big.size() < 700000) big += corpus;
  big += one_line_text();
  while (big.size() < 1'150'000) big += "x</s> ";
  while (big.size() < 1'300'000) big += corpus;
  // A document that starts with spaces: its Prepend '▁' is still there.
  const std::string small = "  two leading spaces, then a short document of its own.";
  test::write_file(d / "in/a.txt", big);
  test::write_file(d / "in/b.txt", small);
  test::write_file(d / "docs.json", json({big, small}).dump());
  for (const std::string name : {"llama2", "mistral", "gemma"}) {
    INFO(name);
    const std::string tj = z.dir / (name + ".json");
    const Tokenizer tok = Tokenizer::load(tj);
    REQUIRE(tok.can_cut_before_space());
    REQUIRE(tok.bos_id() >= 0);
    const auto r = Zoo::run("encode --ids-only --tokenizer '" + tj + "' --texts '" + (d / "docs.json") + "' --out '" +
                            (d / "docs.out.json") + "'");
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const json ref = read_json(d / "docs.out.json");
    for (const bool special : {false, true}) {
      std::vector<uint32_t> want;
      for (const auto& ids : ref[special ? "special" : "plain"].get<std::vector<std::vector<uint32_t>>>()) {
        want.push_back(static_cast<uint32_t>(tok.bos_id()));
        want.insert(want.end(), ids.begin(), ids.end());
      }
      for (const int threads : {1, 3}) {
        INFO("threads " << threads << (special ? ", --allow-special" : ""));
        const auto p = test::run_trainrun("prepare --tokenizer '" + tj + "' --input '" + (d / "in") + "' --output '" +
                                          (d / "out") + "' --val-fraction 0 --threads " + std::to_string(threads) +
                                          " --shard-tokens 10000000" + (special ? " --allow-special" : ""));
        INFO(p.out << p.err);
        REQUIRE(p.exit_code == 0);
        // The big document really was cut (into 2 blocks), the small one not.
        CHECK_THAT(p.out, Contains("2 documents (3 blocks)"));
        CHECK(first_difference(read_u16_shard(d / "out/train_000000.bin"), want) == "equal");
      }
    }
  }
}
