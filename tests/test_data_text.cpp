// The text behind a run's token ids (core/train/data_text.h,
// core/data/prepare_meta.h):
//  - a run on BPE shards samples at its end through the tokenizer that made
//    them (prepare.json names it): the sample is that tokenizer's decode of
//    the very ids `trainrun generate` samples from the weights with the
//    same seed, and `generate --checkpoint RUN` prints the same text (the
//    run keeps a copy of the tokenizer);
//  - a tokenizer that is gone, or changed since prepare, fails the job
//    before its first step, naming prepare.json, the file and the hashes;
//  - prepare.json's val_bytes is the byte count of the text the val tokens
//    encode, and val bits per byte = val_loss x val_tokens / val_bytes / ln 2
//    in metrics.jsonl, for BPE and for byte-level shards (where it is
//    val_loss / ln 2).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <random>

#include "core/data/dataset.h"
#include "core/data/prepare_meta.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

json read_json(const std::string& path) { return json::parse(test::read_file(path)); }

// ~24 KB of English-like lines from a fixed vocabulary: BPE learns its
// words, and a 3-step model samples from a 300-id vocab.
std::string corpus_text(unsigned seed) {
  const char* words[] = {"the", "meaning", "of",   "life", "is",    "a",     "cat",  "sat",  "on",    "mat",
                         "and", "dog",     "ran",  "far",  "away",  "from",  "home", "into", "night", "we",
                         "are", "what",    "eat",  "time", "flies", "like",  "an",   "arrow", "fruit", "banana"};
  std::mt19937 rng(seed);
  std::ostringstream os;
  for (int line = 0; line < 800; ++line) {
    const int n = 3 + int(rng() % 6);
    for (int w = 0; w < n; ++w) os << (w ? " " : "") << words[rng() % (sizeof words / sizeof *words)];
    os << ".\n";
  }
  return os.str();
}

// Every token of a shard pattern, through the trainer's own reader.
std::vector<uint32_t> all_tokens(const std::string& pattern) {
  const auto src = open_token_files(pattern, "llmc", 0, "test");
  const int64_t n = src->num_tokens();
  REQUIRE(n >= 2);
  std::vector<int32_t> in(size_t(n - 1)), tgt(size_t(n - 1));
  src->read_samples(0, 1, int(n - 1), in.data(), tgt.data());
  std::vector<uint32_t> out(in.begin(), in.end());
  out.push_back(uint32_t(tgt.back()));
  return out;
}

// A BPE tokenizer (vocab 300, <|endoftext|> separating documents) trained on
// two text files, and the files prepared with it (10% val).
struct BpeData {
  test::TempDir dir{"data_text"};
  std::string tok, data;
  BpeData() {
    fs::create_directories(dir / "text");
    test::write_file(dir / "text/a.txt", corpus_text(1));
    test::write_file(dir / "text/b.txt", corpus_text(2));
    tok = dir / "tok/tokenizer.json";
    data = dir / "data";
    auto t = test::run_trainrun("tokenizer train --input '" + dir / "text" + "' --vocab-size 300 --special-tokens "
                                "'<|endoftext|>' --output '" + dir / "tok" + "' --quiet");
    INFO(t.err);
    REQUIRE(t.exit_code == 0);
    auto p = test::run_trainrun("prepare --input '" + dir / "text" + "' --output '" + data + "' --tokenizer '" + tok +
                                "' --val-fraction 0.1");
    INFO(p.err);
    REQUIRE(p.exit_code == 0);
  }
  // A 1-layer GPT-2 on these shards, 3 steps, evaluated at the end.
  std::string job(const std::string& run, int sample_tokens) const {
    return "model: {arch: gpt2, n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 300, seq_len: 32}\n"
           "data: {format: llmc, train: '" + data + "/train_*.bin', val: '" + data + "/val_*.bin'}\n"
           "train: {global_batch_size: 4, micro_batch_size: 4, max_steps: 3, warmup_steps: 1, eval_interval: 3, "
           "eval_steps: 2, seed: 42}\n"
           "checkpoint: {final: 'false'}\n"
           "output: {dir: '" + run + "', sample_tokens: " + std::to_string(sample_tokens) +
           ", sample_prompt: 'the cat'}\n";
  }
  test::RunResult train(const std::string& name, int sample_tokens) const {
    test::write_file(dir / (name + ".yaml"), job(dir / name, sample_tokens));
    return test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / (name + ".yaml") +
                             "'");
  }
};

std::string trim_newline(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace

TEST_CASE("data text: a BPE run's end-of-run sample is its tokenizer's decode of the ids generate samples",
          "[data_text]") {
  BpeData d;
  const auto r = d.train("run", 24);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // The run keeps the data's tokenizer: the same bytes.
  REQUIRE(test::file_exists(d.dir / "run/tokenizer.json"));
  CHECK(test::read_file(d.dir / "run/tokenizer.json") == test::read_file(d.tok));
  CHECK(test::file_exists(d.dir / "run/tokenizer_config.json"));

  // The ids, with no tokenizer anywhere near: the weights alone (a bare
  // copy), the prompt as the tokenizer encodes it, the sample's seed,
  // temperature and top-k.
  fs::create_directories(d.dir / "bare");
  fs::copy_file(d.dir / "run/model.safetensors", d.dir / "bare/model.safetensors");
  const auto enc = test::run_trainrun("tokenizer encode --tokenizer '" + d.tok + "' --text 'the cat'");
  REQUIRE(enc.exit_code == 0);
  const std::string prompt_ids = trim_newline(enc.out);
  REQUIRE(prompt_ids.find(' ') != std::string::npos);  // more than one id: "the cat" is two words
  const auto ids = test::run_trainrun("generate --checkpoint '" + d.dir / "bare/model.safetensors" + "' --prompt '" +
                                      prompt_ids + "' --max-tokens 24 --temperature 0.8 --top-k 40 --seed 42");
  INFO(ids.err);
  REQUIRE(ids.exit_code == 0);
  const std::string sampled_ids = trim_newline(ids.out);
  REQUIRE(sampled_ids.rfind(prompt_ids + " ", 0) == 0);
  const auto dec = test::run_trainrun("tokenizer decode --tokenizer '" + d.tok + "' --ids '" + sampled_ids + "'");
  REQUIRE(dec.exit_code == 0);
  const std::string text = dec.out;
  REQUIRE(text.rfind("the cat", 0) == 0);
  CHECK(text.size() > std::string("the cat").size() + 24);  // 24 tokens of words, each more than a byte
  // One worker runs in process: its log is stderr.
  CHECK_THAT(r.err, Contains("sample:\n" + text + "\n"));
  CHECK_THAT(r.err, Contains("data: tokenizer " + d.tok));

  // `generate` on the run directory finds the run's copy and prints the same text.
  const auto g = test::run_trainrun("generate --checkpoint '" + d.dir / "run" +
                                    "' --prompt 'the cat' --max-tokens 24 --temperature 0.8 --top-k 40 --seed 42");
  INFO(g.err);
  REQUIRE(g.exit_code == 0);
  CHECK(g.out == text + "\n");
  CHECK_THAT(g.err, Contains("generate: tokenizer " + d.dir / "run/tokenizer.json"));

  // --stop TEXT: the same sample, ended right after the first sampled token
  // that TEXT encodes to (a sampled token whose text encodes back to it).
  std::vector<std::string> id_list;
  {
    std::istringstream is(sampled_ids);
    for (std::string w; is >> w;) id_list.push_back(w);
  }
  const size_t n_prompt = size_t(std::count(prompt_ids.begin(), prompt_ids.end(), ' ') + 1);
  std::string stop_text, stop_id;
  for (size_t k = n_prompt; k < id_list.size() && stop_id.empty(); ++k) {
    const auto one = test::run_trainrun("tokenizer decode --tokenizer '" + d.tok + "' --ids " + id_list[k]);
    const std::string t = one.out;
    if (one.exit_code != 0 || t.empty() || t.find_first_of("'\n") != std::string::npos) continue;
    const auto back = test::run_trainrun("tokenizer encode --tokenizer '" + d.tok + "' --text '" + t + "'");
    if (trim_newline(back.out) == id_list[k]) stop_text = t, stop_id = id_list[k];
  }
  REQUIRE(!stop_id.empty());
  size_t first = n_prompt;
  while (id_list[first] != stop_id) ++first;
  std::string kept;
  for (size_t k = 0; k <= first; ++k) kept += (k ? " " : "") + id_list[k];
  const auto want = test::run_trainrun("tokenizer decode --tokenizer '" + d.tok + "' --ids '" + kept + "'");
  REQUIRE(want.exit_code == 0);
  const auto stopped = test::run_trainrun("generate --checkpoint '" + d.dir / "run" + "' --prompt 'the cat' "
                                          "--max-tokens 24 --temperature 0.8 --top-k 40 --seed 42 --stop '" +
                                          stop_text + "'");
  INFO("stop at '" << stop_text << "' (id " << stop_id << ", token " << first - n_prompt + 1 << " of 24)");
  INFO(stopped.err);
  REQUIRE(stopped.exit_code == 0);
  CHECK(stopped.out == want.out + "\n");
  if (first + 1 < id_list.size()) CHECK(stopped.out.size() < g.out.size());
  // A special token by its text: <|endoftext|> (never sampled here: the whole 24 tokens).
  const auto eot = test::run_trainrun("generate --checkpoint '" + d.dir / "run" + "' --prompt 'the cat' "
                                      "--max-tokens 24 --temperature 0.8 --top-k 40 --seed 42 --stop '<|endoftext|>'");
  REQUIRE(eot.exit_code == 0);
  if (sampled_ids.find(' ' + trim_newline(test::run_trainrun("tokenizer encode --tokenizer '" + d.tok +
                                                             "' --text '<|endoftext|>' --allow-special").out)) ==
      std::string::npos)
    CHECK(eot.out == g.out);
  // Bad input: more than one token, and no tokenizer to read it with.
  const auto two = test::run_trainrun("generate --checkpoint '" + d.dir / "run" + "' --prompt 'the cat' "
                                      "--max-tokens 4 --stop 'the cat'");
  CHECK(two.exit_code == 1);
  CHECK_THAT(two.err, Contains("generate --stop 'the cat'") && Contains(" encodes it to ") && Contains(" tokens; --stop") &&
                          Contains("takes one token"));
  const auto bare = test::run_trainrun("generate --checkpoint '" + d.dir / "bare/model.safetensors" + "' --prompt '" +
                                       prompt_ids + "' --max-tokens 4 --stop '<|endoftext|>'");
  CHECK(bare.exit_code == 1);
  CHECK_THAT(bare.err, Contains("--stop need a tokenizer"));
}

TEST_CASE("data text: a tokenizer gone or changed since prepare fails the job before its first step, named",
          "[data_text]") {
  BpeData d;
  const std::string meta = d.data + "/prepare.json";
  const std::string original = test::read_file(d.tok);
  const std::string recorded = read_json(meta)["tokenizer_xxh64"];
  REQUIRE(recorded == file_xxh64(d.tok));

  SECTION("gone") {
    fs::rename(d.tok, d.dir / "tok/moved.json");
    const auto r = d.train("run", 8);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("data.train") && Contains(meta) && Contains("'" + d.tok + "', which is not there") &&
                          Contains("trainrun prepare --tokenizer"));
    CHECK(r.err.find("step 1/") == std::string::npos);
    // Without a sample the run trains; it only has no tokenizer to hand on.
    const auto quiet = d.train("run0", 0);
    INFO(quiet.err);
    CHECK(quiet.exit_code == 0);
    CHECK_THAT(quiet.err, Contains("which is not there") && Contains("gets no tokenizer.json"));
    CHECK_FALSE(test::file_exists(d.dir / "run0/tokenizer.json"));
  }
  SECTION("changed (one byte more: the same tokens, but not provably the data's)") {
    test::write_file(d.tok, original + "\n");
    const std::string now = file_xxh64(d.tok);
    REQUIRE(now != recorded);
    const auto r = d.train("run", 8);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("data.train: the tokenizer '" + d.tok + "' has changed") && Contains(meta) &&
                          Contains("records xxhash64 " + recorded) && Contains("now hashes to " + now));
    CHECK(r.err.find("step 1/") == std::string::npos);
  }
}

TEST_CASE("data text: val bits per byte from prepare.json's val_bytes, BPE and byte-level", "[data_text]") {
  BpeData d;
  const json meta = read_json(d.data + "/prepare.json");
  // val_bytes is the text the val tokens encode: decode them, less the
  // document-start tokens (prepare adds them; they are no text).
  const Tokenizer tok = Tokenizer::load(d.tok);
  const std::vector<uint32_t> val = all_tokens(d.data + "/val_*.bin");
  REQUIRE(int64_t(val.size()) == meta["val_tokens"].get<int64_t>());
  std::vector<uint32_t> text_ids;
  for (uint32_t t : val)
    if (int64_t(t) != meta["document_start_id"].get<int64_t>()) text_ids.push_back(t);
  CHECK(int64_t(val.size() - text_ids.size()) == 2);  // one per input file
  const int64_t val_bytes = meta["val_bytes"];
  CHECK(int64_t(tok.decode(text_ids).size()) == val_bytes);
  const double tpb = double(val.size()) / double(val_bytes);
  CHECK(tpb < 0.6);  // words merged: fewer tokens than bytes
  CHECK(prepared_val_tokens_per_byte(d.data + "/val_*.bin", "data.val") == Approx(tpb).epsilon(1e-15));

  const auto r = d.train("run", 0);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  auto last_eval = [](const std::string& metrics) {
    json rec;
    std::istringstream is(test::read_file(metrics));
    for (std::string line; std::getline(is, line);)
      if (json j = json::parse(line); j.contains("val_loss")) rec = j;
    REQUIRE(rec.contains("val_bpb"));
    return rec;
  };
  const json rec = last_eval(d.dir / "run/metrics.jsonl");
  const double loss = rec["val_loss"];
  CHECK(rec["val_bpb"].get<double>() == Approx(loss * tpb / std::log(2.0)).epsilon(1e-12));
  CHECK_THAT(r.err, Contains(" | val_bpb ") && Contains("bits/byte) at step 3"));

  // Byte-level shards: one token per byte, so bits per byte is val_loss / ln 2.
  const auto p = test::run_trainrun("prepare --input '" + d.dir / "text" + "' --output '" + d.dir / "bytes" +
                                    "' --val-fraction 0.1");
  REQUIRE(p.exit_code == 0);
  const json bmeta = read_json(d.dir / "bytes/prepare.json");
  // ceil(n x 0.1) of each file's bytes (prepare's byte-level split).
  const int64_t n = int64_t(corpus_text(1).size()), m = int64_t(corpus_text(2).size());
  const int64_t want = int64_t(std::ceil(n * 0.1)) + int64_t(std::ceil(m * 0.1));
  CHECK(bmeta["val_bytes"].get<int64_t>() == want);
  CHECK(bmeta["val_tokens"].get<int64_t>() == want);
  CHECK(bmeta["tokenizer"] == "");
  test::write_file(d.dir / "bytes.yaml", d.job(d.dir / "brun", 0));
  const auto b = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + d.dir /
                                   "bytes.yaml' --set model.vocab_size=256 --set data.train='" + d.dir /
                                   "bytes/train_*.bin' --set data.val='" + d.dir / "bytes/val_*.bin'");
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  const json brec = last_eval(d.dir / "brun/metrics.jsonl");
  CHECK(brec["val_bpb"].get<double>() == Approx(brec["val_loss"].get<double>() / std::log(2.0)).epsilon(1e-12));
}

TEST_CASE("data text: prepare.json files of one split: tokens per byte summed, one tokenizer, bad records named",
          "[data_text]") {
  test::TempDir d("data_text_meta");
  fs::create_directories(d / "a");
  fs::create_directories(d / "b");
  test::write_file(d / "a/val_000000.bin", "");
  test::write_file(d / "b/val_000000.bin", "");
  test::write_file(d / "a/prepare.json", R"({"tokenizer": "", "val_tokens": 100, "val_bytes": 300})");
  test::write_file(d / "b/prepare.json", R"({"tokenizer": "", "val_tokens": 50, "val_bytes": 100})");
  const std::string both = d / "*/val_*.bin";
  CHECK(prepared_val_tokens_per_byte(both, "data.val") == 150.0 / 400.0);
  CHECK(prepared_val_tokens_per_byte(d / "a/val_*.bin", "data.val") == 100.0 / 300.0);
  CHECK(prepared_tokenizer(both, "data.train", true).path.empty());  // bytes: nothing to check

  SECTION("one without val_bytes (a chat split, an older prepare): unknown, not a guess") {
    test::write_file(d / "b/prepare.json", R"({"tokenizer": "t.json", "val_tokens": 50})");
    CHECK(prepared_val_tokens_per_byte(both, "data.val") < 0);
    // ... and b's shards are of another tokenizer than a's bytes.
    REQUIRE_THROWS_WITH(prepared_tokenizer(both, "data.train", false),
                        Contains("data.train") && Contains(d / "b/prepare.json") && Contains("'t.json'") &&
                            Contains(d / "a/prepare.json") && Contains("different tokenizers"));
  }
  SECTION("two tokenizers with different hashes") {
    test::write_file(d / "a/prepare.json", R"({"tokenizer": "t.json", "tokenizer_xxh64": "0000000000000001"})");
    test::write_file(d / "b/prepare.json", R"({"tokenizer": "t.json", "tokenizer_xxh64": "0000000000000002"})");
    REQUIRE_THROWS_WITH(prepared_tokenizer(both, "data.train", false), Contains("different tokenizers"));
  }
}

TEST_CASE("data text: prepare --document-separator splits text files into documents at lines holding only it",
          "[data_text]") {
  test::TempDir dir{"doc_sep"};
  fs::create_directories(dir / "text");
  // Over 1 MiB, so the reader cuts the file into blocks (at line starts
  // before a letter: the lines hold no spaces) and some blocks begin with a
  // separator line. Lines that only contain or resemble the separator stay
  // text; a separator with '\r' before its '\n', one at the very start and
  // two in a row (no empty document) are separators.
  const char* words[] = {"cat", "dog", "ENDING", "END ", "xEND", "sat", "mat", "home", "night", "arrow"};
  std::mt19937 rng(5);
  std::vector<std::string> docs;
  std::string file = "END\n";
  while (file.size() < (5u << 18)) {
    std::string doc;
    for (int n = 1 + int(rng() % 4); n-- > 0;) doc += std::string(words[rng() % 10]) + "\n";
    docs.push_back(doc);
    file += doc + (rng() % 7 == 0 ? "END\r\n" : rng() % 7 == 0 ? "END\nEND\n" : "END\n");
  }
  docs.push_back("last\n");
  file += "last\n";  // no separator after the last document
  test::write_file(dir / "text/a.txt", file);
  auto t = test::run_trainrun("tokenizer train --input '" + dir / "text" + "' --vocab-size 300 --special-tokens "
                              "'<|endoftext|>' --output '" + dir / "tok" + "' --quiet");
  INFO(t.err);
  REQUIRE(t.exit_code == 0);
  const std::string prep = "prepare --input '" + dir / "text" + "' --tokenizer '" + dir / "tok/tokenizer.json" + "'";
  auto p = test::run_trainrun(prep + " --output '" + dir / "data" + "' --val-fraction 0 --document-separator END");
  INFO(p.err);
  REQUIRE(p.exit_code == 0);
  CHECK_THAT(p.out, Contains(std::to_string(docs.size()) + " documents (2 blocks)"));

  // The reference: each document encoded alone after <|endoftext|>.
  const Tokenizer tok = Tokenizer::load(dir / "tok/tokenizer.json");
  const json meta = read_json(dir / "data/prepare.json");
  const uint32_t eot = meta["document_start_id"].get<uint32_t>();
  std::vector<uint32_t> want;
  for (const std::string& d : docs) {
    want.push_back(eot);
    for (uint32_t id : tok.encode(d)) want.push_back(id);
  }
  const std::vector<uint32_t> got = all_tokens(dir / "data/train_*.bin");
  REQUIRE(got.size() == want.size());
  CHECK(got == want);
  // The dropped separator lines count as text (the document-start token
  // stands for them), so bits per byte compares with a run without the
  // option: val_bytes is the whole val part, from the first line start at or
  // after the last 10% of the file.
  auto v = test::run_trainrun(prep + " --output '" + dir / "val" + "' --val-fraction 0.1 --document-separator END");
  REQUIRE(v.exit_code == 0);
  const int64_t n = int64_t(file.size());
  const int64_t val_start = int64_t(file.find('\n', size_t(n - int64_t(std::ceil(n * 0.1)) - 1))) + 1;
  CHECK(read_json(dir / "val/prepare.json")["val_bytes"].get<int64_t>() == n - val_start);

  // Bad input: a separator with a line break, with a format whose records are
  // documents already, or without a tokenizer.
  auto nl = test::run_trainrun(prep + " --output '" + dir / "x" + "' --document-separator \"$(printf 'a\\nb')\"");
  CHECK(nl.exit_code == 1);
  CHECK_THAT(nl.err, Contains("--document-separator: 'a\nb' holds a line break"));
  auto js = test::run_trainrun(prep + " --output '" + dir / "x" + "' --format jsonl --document-separator '%'");
  CHECK(js.exit_code == 1);
  CHECK_THAT(js.err, Contains("--document-separator: only --format text splits a file") && Contains("jsonl"));
  auto by = test::run_trainrun("prepare --input '" + dir / "text" + "' --output '" + dir / "x" +
                               "' --document-separator '%'");
  CHECK(by.exit_code == 1);
  CHECK_THAT(by.err, Contains("--document-separator need --tokenizer tokenizer.json"));
}

TEST_CASE("data text: export of a from-scratch BPE run carries its data's tokenizer, AutoTokenizer ids equal "
          "trainrun's", "[data_text]") {
  BpeData d;
  const auto r = d.train("run", 0);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string out = d.dir / "hf";
  const auto e = test::run_trainrun("export --checkpoint '" + d.dir / "run" + "' --out '" + out + "'");
  INFO(e.err);
  REQUIRE(e.exit_code == 0);
  CHECK(test::read_file(out + "/tokenizer.json") == test::read_file(d.tok));
  // transformers loads model and tokenizer from the one directory; the
  // tokenizer's ids (special token matched, no BOS added) are trainrun's.
  const std::string text = "the cat sat on the mat.\nwhat time flies<|endoftext|>banana arrow";
  test::write_file(d.dir / "load.py",
                   "import json, sys\n"
                   "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                   "m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
                   "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
                   "print(json.dumps({'class': type(t).__name__, 'vocab': m.config.vocab_size,\n"
                   "                  'ids': t(sys.argv[2])['input_ids']}))\n");
  const auto py = test::run_command("'" + test::hf_python() + "' '" + d.dir / "load.py" + "' '" + out + "' '" +
                                    text + "'");
  INFO(py.err);
  REQUIRE(py.exit_code == 0);
  const json got = json::parse(py.out);
  CHECK(got["class"] == "PreTrainedTokenizerFast");
  CHECK(got["vocab"] == 300);
  const std::vector<uint32_t> want = Tokenizer::load(d.tok).encode(text, true);
  CHECK(got["ids"].get<std::vector<uint32_t>>() == want);
  CHECK(want.size() > 8);  // words merged, the special token one id
}
