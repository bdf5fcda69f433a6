// `trainrun tokenizer train` against HF tokenizers' BpeTrainer
// (scripts/reference/hf_bpe_train.py trains the same documents with the same
// settings): equal merges, vocab and added tokens for the Llama 3 and GPT-2
// pre-tokenizers (and with min_frequency stopping the loop); the ids of a
// held-out text equal HF's with our file loaded in HF tokenizers and in
// transformers, and ours with HF's file; the word counts do not depend on
// how the text is cut into blocks or on the thread count, so the files of 1
// and 2 threads are byte-identical; bad input is refused by file:line or
// flag; the tie rule on a hand-made case; encode/decode from the shell and
// prepare --tokenizer read what train writes.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/data/tokenizer/bpe_train.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

namespace {

const char* const kFortunes[] = {"/usr/share/games/fortunes/computers", "/usr/share/games/fortunes/science",
                                 "/usr/share/games/fortunes/linux"};

// A ~450 KB corpus: three fortune files (one has UTF-8) and a file of hard
// text (CJK, emoji, CRLF, digit runs, whitespace runs), each one document;
// held-out texts from another fortune file and the hard text.
struct Corpus {
  test::TempDir dir{"toktrain"};
  std::vector<std::string> files;
  std::vector<std::string> heldout;
  std::string inputs;  // the files, shell-quoted
  Corpus() {
    for (const char* f : kFortunes) {
      INFO("the fortunes corpus is missing: apt-get install fortunes (scripts/install-deps.sh)");
      REQUIRE(test::file_exists(f));
      files.push_back(f);
    }
    const std::string hard =
        "Hello, World! It's 2024 and I'M here; you'RE there. DON'T.\n"
        "日本語のテキストと中文文本，还有한국어 텍스트。東京タワー \U0001F600\U0001F600 \U0001F44D\U0001F3FD\n"
        "line one\r\nline two\r\n\r\nline four\n\n\nend\r\n"
        "pi=3.14159265358979 and 1234567890123 x99y ½ ² ٣٤٥\n"
        "a  b   c\t\td \t \t e      \n    indented\tcode()  \t\n\t\t\tx   \n"
        "def f(x):\n    return {'k': [1, 2.5e-3, \"s\"]}  # comment\n";
    std::string text;
    for (int i = 0; i < 20; ++i) text += hard;
    test::write_file(dir / "hard.txt", text);
    files.push_back(dir / "hard.txt");
    for (const auto& f : files) inputs += " '" + f + "'";
    const std::string wisdom = test::read_file("/usr/share/games/fortunes/wisdom");
    auto boundary = [&](size_t i) {  // the next UTF-8 character start
      while (i < wisdom.size() && (static_cast<unsigned char>(wisdom[i]) & 0xC0) == 0x80) ++i;
      return i;
    };
    for (size_t i = 0; i < 8; ++i) {
      const size_t b = boundary(i * 2500), e = boundary((i + 1) * 2500);
      heldout.push_back(wisdom.substr(b, e - b));
    }
    heldout.push_back(hard);
    heldout.push_back("  spaced\n\n\n  out  \t text <|endoftext|> <|eot_id|> unseen: Ωμέγα ℵ");
    test::write_file(dir / "heldout.json", json(heldout).dump());
  }
};

Corpus& corpus() {
  static Corpus c;
  return c;
}

test::RunResult hf_script(const std::string& args) {
  return test::run_command("'" + test::hf_python() + "' '" + test::source_dir() +
                           "/scripts/reference/hf_bpe_train.py' " + args);
}

std::string quoted(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += " '" + x + "'";
  return s;
}

json read_json(const std::string& path) { return json::parse(test::read_file(path)); }

}  // namespace

TEST_CASE("tokenizer train: merges, vocab and ids equal HF BpeTrainer's", "[tokenizer][hf]") {
  Corpus& c = corpus();
  struct Case {
    std::string pre;
    int vocab;
    int min_frequency;
    std::vector<std::string> special;
  };
  const Case k = GENERATE(
      Case{"llama3", 1500, 0, {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}},
      Case{"gpt2", 1500, 0, {"<|endoftext|>"}},
      // min_frequency ends the loop before the vocab is full.
      Case{"gpt2", 30000, 40, {"<|endoftext|>", "<pad>"}});
  const std::string tag = k.pre + std::to_string(k.vocab);
  INFO(tag);
  const std::string ours = c.dir / ("ours_" + tag), hf = c.dir / ("hf_" + tag);
  auto r = test::run_trainrun("tokenizer train --input" + c.inputs + " --vocab-size " + std::to_string(k.vocab) +
                              " --output '" + ours + "' --pre-tokenizer " + k.pre + " --min-frequency " +
                              std::to_string(k.min_frequency) + " --special-tokens" + quoted(k.special) +
                              " --threads 2 --quiet");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  r = hf_script("train --input" + c.inputs + " --vocab " + std::to_string(k.vocab) + " --out '" + hf +
                "' --pre-tokenizer " + k.pre + " --min-frequency " + std::to_string(k.min_frequency) + " --special" +
                quoted(k.special) + " --threads 2");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);

  const json a = read_json(ours + "/tokenizer.json"), b = read_json(hf + "/tokenizer.json");
  const auto& am = a["model"]["merges"];
  const auto& bm = b["model"]["merges"];
  REQUIRE(am.size() == bm.size());
  for (size_t i = 0; i < am.size(); ++i) {
    INFO("merge " << i);
    REQUIRE(am[i] == bm[i]);
  }
  CHECK(a["model"]["vocab"] == b["model"]["vocab"]);
  CHECK(a["added_tokens"] == b["added_tokens"]);
  CHECK(a["pre_tokenizer"] == b["pre_tokenizer"]);
  CHECK(a == b);  // every section, as HF writes it
  if (k.min_frequency > 0) CHECK(a["model"]["vocab"].size() < size_t(k.vocab));
  else CHECK(a["model"]["vocab"].size() == size_t(k.vocab));

  // Held-out ids: HF with our file (and transformers with our directory)
  // against ours with our file and with HF's.
  const bool with_transformers = k.pre == "llama3";
  r = hf_script("encode --tokenizer '" + ours + "/tokenizer.json' --texts '" + (c.dir / "heldout.json") + "' --out '" +
                (c.dir / "enc.json") + "'" + (with_transformers ? " --transformers" : ""));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json enc = read_json(c.dir / "enc.json");
  const Tokenizer tok_ours = Tokenizer::load(ours + "/tokenizer.json"), tok_hf = Tokenizer::load(hf + "/tokenizer.json");
  size_t n_ids = 0;
  for (size_t i = 0; i < c.heldout.size(); ++i) {
    INFO("held-out text " << i);
    const auto want = enc["ids"][i].get<std::vector<uint32_t>>();
    n_ids += want.size();
    CHECK(tok_ours.encode(c.heldout[i]) == want);
    CHECK(tok_hf.encode(c.heldout[i]) == want);
    CHECK(tok_ours.decode(want) == c.heldout[i]);
    // (transformers matches special tokens spelled in text: not in this one.)
    if (with_transformers && c.heldout[i].find("<|") == std::string::npos)
      CHECK(enc["transformers_ids"][i].get<std::vector<uint32_t>>() == want);
  }
  CHECK(n_ids > 1000);
  if (with_transformers) {
    // The Llama 3 specials bring Llama 3's chat template and its eos.
    CHECK(enc["eos_token"] == "<|eot_id|>");
    REQUIRE(enc.contains("chat"));
    CHECK_THAT(enc["chat"].get<std::string>(),
               Contains("<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"));
  } else {
    CHECK_FALSE(read_json(ours + "/tokenizer_config.json").contains("chat_template"));
  }
}

TEST_CASE("tokenizer train: word counts do not depend on blocks, threads or the format", "[tokenizer]") {
  Corpus& c = corpus();
  BpeTrainOptions opt;
  opt.inputs = c.files;
  opt.progress = false;
  for (const char* pre : {"llama3", "gpt2"}) {
    INFO(pre);
    opt.pre_tokenizer = pre;
    opt.threads = 1;
    opt.block_bytes = size_t(64) << 20;  // each file one block
    const WordCounts whole = count_words(opt);
    REQUIRE(whole.documents == 4);
    REQUIRE(whole.words.size() > 10000);
    for (int threads : {1, 3}) {
      INFO("threads " << threads);
      opt.threads = threads;
      opt.block_bytes = 2000;  // hundreds of cuts per file
      const WordCounts cut = count_words(opt);
      CHECK(cut.words == whole.words);
      CHECK(cut.total_words == whole.total_words);
      CHECK(cut.documents == 4);
    }
    // The same documents as jsonl lines.
    std::string lines;
    for (const auto& f : c.files) lines += json({{"id", 1}, {"body", test::read_file(f)}}).dump() + "\n\n";
    test::write_file(c.dir / "docs.jsonl", lines);
    BpeTrainOptions jo = opt;
    jo.inputs = {c.dir / "docs.jsonl"};
    jo.format = "jsonl";
    jo.text_field = "body";
    jo.threads = 2;
    jo.block_bytes = 1000;
    const WordCounts from_jsonl = count_words(jo);
    CHECK(from_jsonl.words == whole.words);
    CHECK(from_jsonl.documents == 4);
  }
}

TEST_CASE("tokenizer train: 1 and 2 threads write identical files", "[tokenizer]") {
  Corpus& c = corpus();
  // ~5 MB, so the default 4 MB blocks cut it too.
  std::string big;
  for (const auto& f : c.files) big += test::read_file(f);
  std::string text;
  while (text.size() < (size_t(5) << 20)) text += big;
  test::write_file(c.dir / "big.txt", text);
  std::string files[2];
  for (int t : {1, 2}) {
    const std::string out = c.dir / ("threads" + std::to_string(t));
    const auto r = test::run_trainrun("tokenizer train --input '" + (c.dir / "big.txt") + "'" + c.inputs +
                                      " --vocab-size 2000 --output '" + out + "' --threads " + std::to_string(t));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("counting words"));  // the progress line
    CHECK_THAT(r.out, Contains("2000 tokens (0 special, 256 bytes, "));
    files[t - 1] = test::read_file(out + "/tokenizer.json");
  }
  CHECK(files[0] == files[1]);
}

TEST_CASE("tokenizer train: ties go to the smallest pair, occurrences merge left to right", "[tokenizer]") {
  BpeTrainOptions opt;
  opt.progress = false;
  auto merges_of = [&](std::vector<std::pair<std::string, uint64_t>> words, uint32_t vocab) {
    WordCounts wc;
    wc.words = std::move(words);
    opt.vocab_size = vocab;
    const BpeModel m = train_bpe(wc, opt);
    std::vector<std::string> out;
    for (const auto& [a, b] : m.merges) out.push_back(m.vocab[a] + " " + m.vocab[b]);
    return out;
  };
  // Equal counts: (c, d) and (a, b) tie; 'a' has the smaller id.
  CHECK(merges_of({{"cd", 3}, {"ab", 3}}, 257) == std::vector<std::string>{"a b"});
  CHECK(merges_of({{"cd", 4}, {"ab", 3}}, 257) == std::vector<std::string>{"c d"});
  // Ids follow the ByteLevel characters' code points: ' ' is U+0120 'Ġ',
  // after every printable byte, so (x, y) wins the tie with (Ġ, x).
  CHECK(merges_of({{" x", 2}, {"xy", 2}}, 257) == std::vector<std::string>{"x y"});
  // "aaaa": (a, a) x3 -> "aa aa" (not "aa a a"), then (aa, aa).
  CHECK(merges_of({{"aaaa", 1}}, 300) == std::vector<std::string>{"a a", "aa aa"});
  // min_frequency: a pair seen fewer times is never merged.
  opt.min_frequency = 3;
  CHECK(merges_of({{"ab", 3}, {"cd", 2}}, 300) == std::vector<std::string>{"a b"});
  opt.min_frequency = 0;
  opt.special_tokens = {"<s>", "</s>"};
  WordCounts wc;
  wc.words = {{"ab", 1}};
  opt.vocab_size = 257;
  CHECK_THROWS_WITH(train_bpe(wc, opt), Contains("--vocab-size: 257 is smaller than the 256-byte alphabet + 2 special token(s) (258)"));
}

TEST_CASE("tokenizer train: bad input is refused by file:line or flag, and nothing is written", "[tokenizer]") {
  test::TempDir d("toktrain_bad");
  const std::string out = d / "out";
  auto train = [&](const std::string& args) {
    return test::run_trainrun("tokenizer train --output '" + out + "' --quiet " + args);
  };
  auto expect_error = [&](const test::RunResult& r, const std::string& what) {
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains(what));
    CHECK_FALSE(test::file_exists(out + "/tokenizer.json"));
  };
  test::write_file(d / "ok.txt", "some text to count\n");
  expect_error(train("--input '" + (d / "missing.txt") + "' --vocab-size 300"),
               "--input: '" + (d / "missing.txt") + "' does not exist");
  expect_error(train("--input '" + (d / "ok.txt") + "' --vocab-size 256 --special-tokens '<|endoftext|>'"),
               "--vocab-size: 256 is smaller than the 256-byte alphabet + 1 special token(s) (257); ask for at least 257");
  test::write_file(d / "bad.txt", "line one\nline two\nthree \xff\xfe here\n");
  expect_error(train("--input '" + (d / "bad.txt") + "' --vocab-size 300"), d / "bad.txt" + ":3: invalid UTF-8 (byte 0xFF)");
  test::write_file(d / "a.jsonl", "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n");
  expect_error(train("--format jsonl --input '" + (d / "a.jsonl") + "' --vocab-size 300"),
               d / "a.jsonl" + ":2: no field \"text\"; pass --text-field");
  test::write_file(d / "b.jsonl", "{\"text\": 12}\n");
  expect_error(train("--format jsonl --input '" + (d / "b.jsonl") + "' --vocab-size 300"),
               d / "b.jsonl" + ":1: field \"text\" is number, not a string");
  test::write_file(d / "c.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"\n");
  expect_error(train("--format jsonl --input '" + (d / "c.jsonl") + "' --vocab-size 300"),
               d / "c.jsonl" + ":3: not a JSON line");
  const auto r = train("--input '" + (d / "ok.txt") + "' --vocab-size 300 --pre-tokenizer bert");
  CHECK(r.exit_code == 2);  // a usage error, from the flag's check
  CHECK_THAT(r.err, Contains("--pre-tokenizer"));
}

TEST_CASE("tokenizer encode/decode from the shell, and prepare reads a trained tokenizer", "[tokenizer]") {
  Corpus& c = corpus();
  const std::string dir = c.dir / "shell";
  auto r = test::run_trainrun("tokenizer train --input" + c.inputs + " --vocab-size 800 --output '" + dir +
                              "' --special-tokens '<|endoftext|>' --quiet");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  const std::string text = "The computer said: \"It's 42.\"\n  Ωμέγα!";
  test::write_file(c.dir / "in.txt", text);
  r = test::run_trainrun("tokenizer encode --tokenizer '" + dir + "' < '" + (c.dir / "in.txt") + "'");
  REQUIRE(r.exit_code == 0);
  std::string want;
  for (uint32_t id : tok.encode(text)) want += (want.empty() ? "" : " ") + std::to_string(id);
  CHECK(r.out == want + "\n");
  const std::string ids = r.out;
  r = test::run_trainrun("tokenizer decode --tokenizer '" + dir + "/tokenizer.json' --ids '" + ids + "'");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == text);
  r = test::run_trainrun("tokenizer encode --tokenizer '" + dir + "' --text '<|endoftext|>' --allow-special");
  CHECK(r.out == "0\n");
  r = test::run_trainrun("tokenizer decode --tokenizer '" + dir + "' --ids '5 800'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("'800' is not a token id"));

  r = test::run_trainrun("prepare --input" + c.inputs + " --tokenizer '" + dir + "/tokenizer.json' --output '" +
                         (c.dir / "shards") + "' --val-fraction 0.1");
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(test::file_exists(c.dir / "shards/train_000000.bin"));
}
