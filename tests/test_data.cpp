// Token files, the synthetic Markov source and `prepare`.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>

#include "core/common/error.h"
#include "core/data/dataset.h"
#include "core/data/document_mask.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using trainrun::test::TempDir;
using trainrun::test::write_file;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

std::string header(int32_t magic, int32_t version, int32_t ntok) {
  std::string h(1024, '\0');
  int32_t v[3] = {magic, version, ntok};
  std::memcpy(&h[0], v, sizeof v);
  return h;
}

template <typename U>
std::string token_bytes(const std::vector<uint32_t>& toks) {
  std::string s(toks.size() * sizeof(U), '\0');
  for (size_t i = 0; i < toks.size(); ++i) {
    U u = static_cast<U>(toks[i]);
    std::memcpy(&s[i * sizeof(U)], &u, sizeof(U));
  }
  return s;
}

std::vector<uint32_t> iota_tokens(size_t n, uint32_t first, uint32_t mod) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = (first + static_cast<uint32_t>(i)) % mod;
  return t;
}

// Checks every sample of `src` against the reference stream, plus a batch
// that wraps past the end of the epoch.
void check_samples(const TokenSource& src, const std::vector<uint32_t>& stream, int T) {
  int64_t ns = src.num_samples(T);
  REQUIRE(ns == (static_cast<int64_t>(stream.size()) - 1) / T);
  int B = static_cast<int>(ns) + 2;
  std::vector<int32_t> in(B * T), tg(B * T);
  src.read_samples(0, B, T, in.data(), tg.data());
  for (int b = 0; b < B; ++b) {
    int64_t s = b % ns;
    for (int t = 0; t < T; ++t) {
      INFO("sample " << b << " t " << t);
      REQUIRE(in[b * T + t] == static_cast<int32_t>(stream[s * T + t]));
      REQUIRE(tg[b * T + t] == static_cast<int32_t>(stream[s * T + t + 1]));
    }
  }
  // Random access and negative indices wrap like the batch above.
  std::vector<int32_t> in1(T), tg1(T);
  src.read_samples(-1, 1, T, in1.data(), tg1.data());
  REQUIRE(in1[0] == static_cast<int32_t>(stream[(ns - 1) * T]));
}

JobSpec job_with(const std::string& train, const std::string& val, int vocab, int seq_len) {
  JobSpec job;
  job.data.train = train;
  job.data.val = val;
  job.model.vocab_size = vocab;
  job.model.seq_len = seq_len;
  return job;
}

}  // namespace

// ---- round trips ------------------------------------------------------------

TEST_CASE("data: llm.c v1 shard round trip", "[data]") {
  TempDir d("data");
  auto toks = iota_tokens(1001, 3, 50257);
  write_llmc_shard(d / "a.bin", toks, 1);
  REQUIRE(fs::file_size(d / "a.bin") == 1024 + 2 * 1001);
  auto src = open_token_files(d / "a.bin", "llmc", 50257, "data.train");
  REQUIRE(src->num_tokens() == 1001);
  REQUIRE(src->vocab_bound() == 1004);
  REQUIRE_THAT(src->describe(), Contains("1 llm.c shard") && Contains("uint16"));
  check_samples(*src, toks, 10);
  check_samples(*src, toks, 1000);
}

TEST_CASE("data: llm.c v7 shard round trip with ids above 65535", "[data]") {
  TempDir d("data");
  auto toks = iota_tokens(500, 127000, 128256);
  write_llmc_shard(d / "a.bin", toks, 7);
  REQUIRE(fs::file_size(d / "a.bin") == 1024 + 4 * 500);
  auto src = open_token_files(d / "a.bin", "llmc", 128256, "data.train");
  check_samples(*src, toks, 7);
  REQUIRE(src->vocab_bound() == 127500);  // largest id + 1
}

TEST_CASE("data: raw uint16 and uint32 files round trip", "[data]") {
  TempDir d("data");
  auto t16 = iota_tokens(300, 60000, 65536);
  write_file(d / "r16.bin", token_bytes<uint16_t>(t16));
  check_samples(*open_token_files(d / "r16.bin", "raw_uint16", 65536, "data.train"), t16, 16);
  auto t32 = iota_tokens(300, 99990, 100000);
  write_file(d / "r32.bin", token_bytes<uint32_t>(t32));
  auto src = open_token_files(d / "r32.bin", "raw_uint32", 100000, "data.val");
  REQUIRE_THAT(src->describe(), Contains("raw_uint32"));
  check_samples(*src, t32, 16);
}

TEST_CASE("data: shards in sorted glob order form one stream whose windows span shards", "[data]") {
  TempDir d("data");
  // Byte order, not numeric: c10 before c2. Sizes make windows straddle files.
  std::vector<std::pair<std::string, size_t>> files = {{"c2.bin", 12}, {"a.bin", 7}, {"c10.bin", 3}, {"b.bin", 5}};
  std::map<std::string, std::vector<uint32_t>> content;
  uint32_t next = 0;
  for (auto& [name, n] : files) {
    content[name] = iota_tokens(n, next, 1 << 20);
    next += static_cast<uint32_t>(n);
  }
  for (auto& [name, toks] : content) write_llmc_shard(d / name, toks, name == "b.bin" ? 7 : 1);
  write_file(d / "notes.txt", "not a shard");
  std::vector<uint32_t> stream;
  for (const char* name : {"a.bin", "b.bin", "c10.bin", "c2.bin"})
    stream.insert(stream.end(), content[name].begin(), content[name].end());
  auto src = open_token_files(d / "*.bin", "llmc", 0, "data.train");
  REQUIRE(src->num_tokens() == 27);
  REQUIRE_THAT(src->describe(), Contains("4 llm.c shards") && Contains("uint16+uint32"));
  for (int T : {1, 2, 4, 5, 13, 26}) check_samples(*src, stream, T);
}

// ---- errors -----------------------------------------------------------------

TEST_CASE("data: token file errors name the key, the file and what to do", "[data][errors]") {
  TempDir d("data");
  auto open = [&](const std::string& path, const std::string& fmt = "llmc", int vocab = 50257) {
    return open_token_files(path, fmt, vocab, "data.train");
  };

  SECTION("no file matches the glob") {
    REQUIRE_THROWS_WITH(open(d / "train_*.bin"),
                        Contains("data.train") && Contains("no file matches") && Contains("train_*.bin") &&
                            Contains("trainrun prepare"));
  }
  SECTION("cannot open") {
    REQUIRE_THROWS_WITH(open(d / "missing.bin"),
                        Contains("data.train") && Contains("cannot open") && Contains("missing.bin") &&
                            Contains("No such file"));
    if (::geteuid() != 0) {
      write_file(d / "locked.bin", header(20240520, 1, 1) + token_bytes<uint16_t>({1}));
      ::chmod((d / "locked.bin").c_str(), 0);
      REQUIRE_THROWS_WITH(open(d / "locked.bin"), Contains("cannot open") && Contains("Permission denied"));
    }
  }
  SECTION("a directory") {
    fs::create_directories(d / "sub");
    REQUIRE_THROWS_WITH(open(d / "sub"), Contains("data.train") && Contains("is a directory") && Contains("*.bin"));
  }
  SECTION("shorter than the header") {
    write_file(d / "short.bin", std::string(100, 'x'));
    REQUIRE_THROWS_WITH(open(d / "short.bin"), Contains("data.train") && Contains("short.bin") &&
                                                   Contains("100 bytes") && Contains("1024-byte llm.c header") &&
                                                   Contains("looks like a text file"));
  }
  SECTION("bad magic, binary: hints raw formats") {
    write_file(d / "bad.bin", header(12345, 1, 10) + token_bytes<uint16_t>(iota_tokens(10, 0, 50)));
    REQUIRE_THROWS_WITH(open(d / "bad.bin"), Contains("data.train") && Contains("bad.bin") &&
                                                 Contains("bad magic 12345") && Contains("20240520") &&
                                                 Contains("20240801") && Contains("data.format: raw_uint16"));
  }
  SECTION("bad magic, text: hints prepare") {
    std::string text;
    while (text.size() < 3000) text += "The quick brown fox jumps over the lazy dog.\n";
    write_file(d / "corpus.txt", text);
    REQUIRE_THROWS_WITH(open(d / "corpus.txt"),
                        Contains("bad magic") && Contains("looks like a text file") && Contains("trainrun prepare"));
  }
  SECTION("unsupported version") {
    write_file(d / "v3.bin", header(20240520, 3, 1) + token_bytes<uint16_t>({1}));
    REQUIRE_THROWS_WITH(open(d / "v3.bin"), Contains("data.train") && Contains("v3.bin") &&
                                                Contains("unsupported version 3") && Contains("version 1"));
    write_file(d / "v1u32.bin", header(20240801, 1, 1) + token_bytes<uint32_t>({1}));
    REQUIRE_THROWS_WITH(open(d / "v1u32.bin"), Contains("unsupported version 1") && Contains("version 7"));
  }
  SECTION("truncated") {
    write_file(d / "trunc.bin", header(20240520, 1, 100) + token_bytes<uint16_t>(iota_tokens(50, 0, 100)));
    REQUIRE_THROWS_WITH(open(d / "trunc.bin"), Contains("data.train") && Contains("trunc.bin") &&
                                                   Contains("truncated") && Contains("100 tokens") &&
                                                   Contains("expected 1224 bytes") && Contains("has 1124 bytes"));
    write_file(d / "trunc32.bin", header(20240801, 7, 10) + token_bytes<uint32_t>(iota_tokens(9, 0, 100)));
    REQUIRE_THROWS_WITH(open(d / "trunc32.bin"), Contains("expected 1064 bytes") && Contains("has 1060 bytes"));
  }
  SECTION("longer than the header says") {
    write_file(d / "long.bin", header(20240520, 1, 10) + token_bytes<uint16_t>(iota_tokens(11, 0, 100)));
    REQUIRE_THROWS_WITH(open(d / "long.bin"), Contains("long.bin") && Contains("has 1046 bytes") &&
                                                  Contains("expected 1044 bytes"));
  }
  SECTION("negative token count") {
    write_file(d / "neg.bin", header(20240520, 1, -5));
    REQUIRE_THROWS_WITH(open(d / "neg.bin"), Contains("neg.bin") && Contains("negative token count -5"));
  }
  SECTION("raw size not a multiple of the token size") {
    write_file(d / "odd.bin", std::string(7, '\1'));
    REQUIRE_THROWS_WITH(open(d / "odd.bin", "raw_uint16"), Contains("data.train") && Contains("odd.bin") &&
                                                               Contains("7 bytes") && Contains("not a multiple") &&
                                                               Contains("2-byte") && Contains("raw_uint16"));
    write_llmc_shard(d / "llmc.bin", {1, 2, 3}, 1);  // 1030 bytes
    REQUIRE_THROWS_WITH(open(d / "llmc.bin", "raw_uint32"),
                        Contains("1030 bytes") && Contains("4-byte") && Contains("set data.format: llmc"));
  }
  SECTION("empty files") {
    write_file(d / "empty.bin", "");
    REQUIRE_THROWS_WITH(open(d / "empty.bin"), Contains("data.train") && Contains("empty.bin") && Contains("is empty"));
    REQUIRE_THROWS_WITH(open(d / "empty.bin", "raw_uint16"), Contains("empty.bin") && Contains("is empty"));
    write_llmc_shard(d / "zero.bin", {}, 1);
    REQUIRE_THROWS_WITH(open(d / "zero.bin"), Contains("zero.bin") && Contains("header says 0 tokens"));
  }
  SECTION("token id >= vocab_size") {
    write_llmc_shard(d / "a.bin", iota_tokens(10, 0, 256), 1);
    auto bad = iota_tokens(20, 0, 256);
    bad[5] = 300;
    bad[17] = 511;
    write_llmc_shard(d / "b.bin", bad, 1);
    REQUIRE_THROWS_WITH(open(d / "*.bin", "llmc", 256),
                        Contains("data.train") && Contains("b.bin") && Contains("token id 300") &&
                            Contains("token index 5") && Contains("model.vocab_size = 256") &&
                            Contains("largest id in the file: 511") && Contains("at least 512"));
    write_file(d / "r.raw", token_bytes<uint32_t>({1, 2, 70000}));
    REQUIRE_THROWS_WITH(open(d / "r.raw", "raw_uint32", 50257),
                        Contains("token id 70000") && Contains("token index 2") && Contains("50257"));
    // vocab_size <= 0 skips the check but still reports the bound.
    REQUIRE(open(d / "*.bin", "llmc", 0)->vocab_bound() == 512);
  }
  SECTION("unknown format and empty path") {
    REQUIRE_THROWS_WITH(open(d / "x.bin", "npy"), Contains("data.format") && Contains("npy") && Contains("raw_uint32"));
    REQUIRE_THROWS_WITH(open(""), Contains("data.train") && Contains("no path given"));
  }
}

TEST_CASE("data: too little data for one sample is reported with the numbers", "[data][errors]") {
  TempDir d("data");
  write_llmc_shard(d / "train.bin", iota_tokens(16, 0, 256), 1);
  write_llmc_shard(d / "val.bin", iota_tokens(17, 0, 256), 1);

  auto job = job_with(d / "train.bin", d / "val.bin", 256, 16);
  REQUIRE_THROWS_WITH(open_train_source(job), Contains("data.train") && Contains("train.bin") &&
                                                  Contains("holds 16 tokens, fewer than model.seq_len + 1 = 17"));
  // Exactly seq_len + 1 tokens is one sample.
  auto val = open_val_source(job);
  REQUIRE(val);
  REQUIRE(val->num_samples(16) == 1);
  job.model.seq_len = 32;
  REQUIRE_THROWS_WITH(open_val_source(job),
                      Contains("data.val") && Contains("holds 17 tokens, fewer than model.seq_len + 1 = 33"));

  // The check is also callable directly, and read_samples refuses too.
  auto src = open_token_files(d / "train.bin", "llmc", 256, "data.train");
  REQUIRE(src->num_samples(16) == 0);
  REQUIRE_THROWS_WITH(check_source_length(*src, 16, "data.train"), Contains("holds 16 tokens"));
  std::vector<int32_t> in(16), tg(16);
  REQUIRE_THROWS_WITH(src->read_samples(0, 1, 16, in.data(), tg.data()), Contains("fewer than model.seq_len + 1 = 17"));
}

TEST_CASE("data: open_train_source / open_val_source pick the source from the job", "[data]") {
  TempDir d("data");
  write_llmc_shard(d / "train.bin", iota_tokens(100, 0, 256), 1);
  auto job = job_with(d / "train.bin", "", 256, 8);
  REQUIRE(open_train_source(job)->num_samples(8) == 12);
  REQUIRE(open_val_source(job) == nullptr);
  job.data.train = "";
  REQUIRE_THROWS_WITH(open_train_source(job), Contains("data.train") && Contains("not set"));
  job.data.format = "raw_uint16";
  job.data.train = d / "train.bin";  // 1224 bytes is even, so it opens as raw; the header ids exceed 256
  REQUIRE_THROWS_WITH(open_train_source(job), Contains("data.train") && Contains("token id " + std::to_string(20240520 & 0xFFFF)) &&
                                                  Contains("token index 0"));
}

// ---- synthetic ----------------------------------------------------------------

namespace {
SyntheticSpec synth(int vocab, int branching, double conc, uint64_t seed) {
  SyntheticSpec s;
  s.vocab = vocab;
  s.branching = branching;
  s.concentration = conc;
  s.seed = seed;
  return s;
}

// Plug-in estimate of H(next | current) over all (input, target) pairs.
double empirical_conditional_entropy(const TokenSource& src, int V, int64_t first, int B, int T) {
  std::vector<int32_t> in(static_cast<size_t>(B) * T), tg(in.size());
  src.read_samples(first, B, T, in.data(), tg.data());
  std::vector<double> pair(static_cast<size_t>(V) * V, 0.0), row(V, 0.0);
  for (size_t i = 0; i < in.size(); ++i) {
    pair[static_cast<size_t>(in[i]) * V + tg[i]] += 1;
    row[in[i]] += 1;
  }
  double h = 0, n = static_cast<double>(in.size());
  for (int a = 0; a < V; ++a)
    for (int b = 0; b < V; ++b) {
      double c = pair[static_cast<size_t>(a) * V + b];
      if (c > 0) h -= c / n * std::log(c / row[a]);
    }
  return h;
}
}  // namespace

TEST_CASE("data: synthetic source: empirical conditional entropy matches the floor", "[data][synthetic]") {
  for (auto [V, b, conc] : {std::tuple{16, 4, 1.0}, std::tuple{64, 3, 0.5}, std::tuple{8, 8, 2.0},
                             std::tuple{32, 2, 0.02} /* mixes slowly: exact GTH fallback */}) {
    auto src = make_synthetic_source(synth(V, b, conc, 7), 256, 0);
    double H = src->entropy_floor();
    INFO("V=" << V << " b=" << b << " H=" << H);
    REQUIRE(H > 0);
    REQUIRE(H <= std::log(static_cast<double>(b)) + 1e-12);
    double emp = empirical_conditional_entropy(*src, V, 1000, 4096, 64);
    REQUIRE(emp == Approx(H).margin(0.01));
  }
}

TEST_CASE("data: synthetic source: deterministic, random access, splits differ", "[data][synthetic]") {
  const int T = 32, B = 8;
  auto a = make_synthetic_source(synth(0, 4, 1.0, 99), 512, 0);
  auto b = make_synthetic_source(synth(0, 4, 1.0, 99), 512, 0);
  auto val = make_synthetic_source(synth(0, 4, 1.0, 99), 512, 1);
  auto other = make_synthetic_source(synth(0, 4, 1.0, 100), 512, 0);
  REQUIRE(a->vocab_bound() == 512);
  REQUIRE(a->num_samples(T) >= (int64_t(1) << 40));
  REQUIRE(a->entropy_floor() == b->entropy_floor());
  REQUIRE(a->entropy_floor() == val->entropy_floor());  // same chain, other samples
  REQUIRE(a->entropy_floor() != other->entropy_floor());
  REQUIRE_THAT(a->describe(), Contains("synthetic") && Contains("512 states") && Contains("train"));

  std::vector<int32_t> in1(B * T), tg1(B * T), in2(B * T), tg2(B * T), in3(B * T), tg3(B * T);
  a->read_samples(100, B, T, in1.data(), tg1.data());
  b->read_samples(100, B, T, in2.data(), tg2.data());
  REQUIRE(in1 == in2);
  REQUIRE(tg1 == tg2);
  for (int i = 0; i < B * T; ++i) {
    REQUIRE(in1[i] >= 0);
    REQUIRE(in1[i] < 512);
    if (i % T) REQUIRE(in1[i] == tg1[i - 1]);  // targets are the inputs shifted by one
  }
  // Sample 103 alone equals the 4th sample of the batch: a pure function of the index.
  std::vector<int32_t> one_in(T), one_tg(T);
  a->read_samples(103, 1, T, one_in.data(), one_tg.data());
  REQUIRE(std::equal(one_in.begin(), one_in.end(), in1.begin() + 3 * T));
  REQUIRE(std::equal(one_tg.begin(), one_tg.end(), tg1.begin() + 3 * T));
  // A longer T extends the same sample (same per-sample stream).
  std::vector<int32_t> lin(2 * T), ltg(2 * T);
  a->read_samples(103, 1, 2 * T, lin.data(), ltg.data());
  REQUIRE(std::equal(one_in.begin(), one_in.end(), lin.begin()));

  val->read_samples(100, B, T, in3.data(), tg3.data());
  REQUIRE(in3 != in1);
  other->read_samples(100, B, T, in3.data(), tg3.data());
  REQUIRE(in3 != in1);
}

TEST_CASE("data: synthetic source: entropy bounds and edge cases", "[data][synthetic]") {
  // branching 1 is a deterministic cycle.
  auto det = make_synthetic_source(synth(10, 1, 1.0, 1), 256, 0);
  REQUIRE(det->entropy_floor() == Approx(0.0).margin(1e-12));
  std::vector<int32_t> in(20), tg(20);
  det->read_samples(0, 1, 20, in.data(), tg.data());
  REQUIRE(in[10] == in[0]);  // period V
  REQUIRE(in[1] != in[0]);
  // Very uneven weights still give a finite floor and stay in range.
  auto skew = make_synthetic_source(synth(50, 4, 0.05, 3), 64, 0);
  REQUIRE(skew->entropy_floor() >= 0);
  REQUIRE(skew->entropy_floor() < std::log(4.0));
  // Large concentration approaches uniform successors: H near ln(b).
  auto flat = make_synthetic_source(synth(32, 4, 1000.0, 5), 32, 0);
  REQUIRE(flat->entropy_floor() == Approx(std::log(4.0)).margin(0.01));
  // Full branching (dense chain).
  auto dense = make_synthetic_source(synth(6, 6, 1.0, 5), 6, 0);
  REQUIRE(dense->entropy_floor() < std::log(6.0));
}

TEST_CASE("data: synthetic source: invalid settings name the key", "[data][synthetic][errors]") {
  REQUIRE_THROWS_WITH(make_synthetic_source(synth(0, 300, 1.0, 1), 256, 0),
                      Contains("data.synthetic.branching") && Contains("[1, 256]") && Contains("300"));
  REQUIRE_THROWS_WITH(make_synthetic_source(synth(16, 4, 0.0, 1), 256, 0), Contains("data.synthetic.concentration"));
  REQUIRE_THROWS_WITH(make_synthetic_source(synth(512, 4, 1.0, 1), 256, 0),
                      Contains("data.synthetic.vocab") && Contains("512") && Contains("model.vocab_size = 256"));
  REQUIRE_THROWS_WITH(make_synthetic_source(synth(1, 1, 1.0, 1), 256, 0), Contains("at least 2 states"));

  JobSpec job = job_with("", "", 64, 16);
  job.data.format = "synthetic";
  auto tr = open_train_source(job);
  auto va = open_val_source(job);
  REQUIRE(va);
  REQUIRE(tr->vocab_bound() == 64);
  REQUIRE(tr->entropy_floor() > 0);
  REQUIRE_THAT(va->describe(), Contains("val"));
}

// ---- prepare ------------------------------------------------------------------

TEST_CASE("data: prepare: text files and directories to byte shards", "[data][prepare]") {
  TempDir d("prep");
  std::string a, b;
  for (int i = 0; i < 40; ++i) a += "line " + std::to_string(i) + " of the first file\n";
  for (int i = 0; i < 30; ++i) b += "second file, line " + std::to_string(i) + "\n";
  write_file(d / "in/a.txt", a);
  write_file(d / "in/sub/b.txt", b);
  write_file(d / "in/a.dat", std::string("\x01\x02\0\0binary index", 16));
  write_file(d / "in/empty.txt", "");
  fs::create_symlink(d / "in/a.txt", d / "in/a.u8");  // fortunes-style alias: must not duplicate
  write_file(d / "out/train_000042.bin", "stale");

  PrepareOptions opts;
  opts.inputs = {d / "in"};
  opts.output_dir = d / "out";
  opts.val_fraction = 0.1;
  opts.shard_tokens = 500;
  std::string summary = prepare_byte_shards(opts);
  INFO(summary);

  auto split = [&](const std::string& s, std::string& tr, std::string& va) {
    size_t nval = static_cast<size_t>(std::ceil(s.size() * 0.1));
    tr += s.substr(0, s.size() - nval);
    va += s.substr(s.size() - nval);
  };
  std::string tr, va;
  split(a, tr, va);  // sorted: a.txt before sub/b.txt
  split(b, tr, va);
  REQUIRE_THAT(summary, Contains("2 text files") && Contains("1 binary") && Contains("1 duplicate") &&
                            Contains(std::to_string(tr.size()) + " train tokens") &&
                            Contains(std::to_string(va.size()) + " val tokens") && Contains("vocab 256"));
  REQUIRE_FALSE(fs::exists(d / "out/train_000042.bin"));
  REQUIRE(fs::exists(d / "out/train_000000.bin"));
  REQUIRE(fs::exists(d / "out/train_000001.bin"));  // > 500 tokens: several shards
  REQUIRE(fs::exists(d / "out/val_000000.bin"));
  for (auto& e : fs::directory_iterator(d / "out")) REQUIRE(e.path().string().find(".tmp") == std::string::npos);

  auto check_stream = [&](const std::string& pattern, const std::string& expect) {
    auto src = open_token_files(pattern, "llmc", 256, "data.train");
    REQUIRE(src->num_tokens() == static_cast<int64_t>(expect.size()));
    int T = static_cast<int>(expect.size()) - 1;
    std::vector<int32_t> in(T), tg(T);
    src->read_samples(0, 1, T, in.data(), tg.data());
    for (int i = 0; i < T; ++i) REQUIRE(in[i] == static_cast<unsigned char>(expect[i]));
    REQUIRE(tg[T - 1] == static_cast<unsigned char>(expect.back()));
  };
  check_stream(d / "out/train_*.bin", tr);
  check_stream(d / "out/val_*.bin", va);

  // val_fraction 0 writes no val shard (and removes the old one).
  opts.val_fraction = 0;
  opts.inputs = {d / "in/a.txt"};
  REQUIRE_THAT(prepare_byte_shards(opts), Contains("1 text file") && Contains("0 val tokens"));
  REQUIRE_FALSE(fs::exists(d / "out/val_000000.bin"));
  check_stream(d / "out/train_*.bin", a);
}

TEST_CASE("data: prepare: errors", "[data][prepare][errors]") {
  TempDir d("prep");
  write_file(d / "text.txt", "some text\n");
  write_file(d / "bin/x.dat", std::string("\0\0\0\1", 4));
  PrepareOptions opts;
  opts.output_dir = d / "out";

  opts.inputs = {d / "nope.txt"};
  REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--input") && Contains("nope.txt") && Contains("does not exist"));
  opts.inputs = {d / "bin"};
  REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--input") && Contains("no text found") && Contains("1 binary"));
  opts.inputs = {d / "text.txt"};
  for (double f : {-0.1, 0.6}) {
    opts.val_fraction = f;
    REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--val-fraction") && Contains("[0, 0.5]"));
  }
  opts.val_fraction = 0.5;
  opts.output_dir = d / "text.txt/out";  // parent is a file: cannot be created, even as root
  REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--output") && Contains("cannot create") &&
                                                     Contains("text.txt/out"));
  if (::geteuid() != 0) {
    fs::create_directories(d / "ro");
    ::chmod((d / "ro").c_str(), 0555);
    opts.output_dir = d / "ro";
    REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--output") && Contains("not writable"));
  }
  opts.inputs = {};
  REQUIRE_THROWS_WITH(prepare_byte_shards(opts), Contains("--input") && Contains("no input"));
}

TEST_CASE("data: write_llmc_shard rejects what it cannot represent", "[data][errors]") {
  TempDir d("data");
  REQUIRE_THROWS_WITH(write_llmc_shard(d / "a.bin", {1, 70000}, 1),
                      Contains("a.bin") && Contains("70000") && Contains("index 1") && Contains("version 7"));
  REQUIRE_THROWS_WITH(write_llmc_shard(d / "a.bin", {1}, 3), Contains("version 3"));
  REQUIRE_FALSE(fs::exists(d / "a.bin"));
}

TEST_CASE("data: prepare.json beside the shards: read for the vocab check and the document start, bad ones named",
          "[data][errors]") {
  TempDir d("prepjson");
  fs::create_directories(d / "a");
  fs::create_directories(d / "b");
  write_llmc_shard(d / "a/x.bin", iota_tokens(40, 0, 50), 1);
  write_llmc_shard(d / "b/x.bin", iota_tokens(40, 0, 50), 1);
  const std::string both = d / "*/x.bin";
  SECTION("none: no vocab to check, no document start") {
    CHECK(open_token_files(both, "llmc", 50, "data.train")->num_tokens() == 80);
    CHECK(prepared_document_start(both, "data.train") == -1);
  }
  SECTION("the vocab of one directory's tokenizer is checked; the ids of the two agree") {
    write_file(d / "a/prepare.json", "{\"vocab_size\": 64, \"tokenizer\": \"t.json\", \"document_start_id\": 3}");
    write_file(d / "b/prepare.json", "{\"vocab_size\": 50, \"document_start_id\": 3}");
    REQUIRE_THROWS_WITH(open_token_files(both, "llmc", 50, "data.train"),
                        Contains("data.train") && Contains(d / "a") && Contains("'t.json' of 64 ids") &&
                            Contains("model.vocab_size = 50"));
    CHECK(open_token_files(both, "llmc", 64, "data.train")->num_tokens() == 80);
    CHECK(prepared_document_start(both, "data.train") == 3);
  }
  SECTION("two directories prepared with different document starts") {
    write_file(d / "a/prepare.json", "{\"document_start_id\": 3}");
    write_file(d / "b/prepare.json", "{\"document_start_id\": 4}");
    REQUIRE_THROWS_WITH(prepared_document_start(both, "data.train"),
                        Contains("data.train") && Contains(d / "b/prepare.json") && Contains("document_start_id 4") &&
                            Contains(d / "a/prepare.json") && Contains("data.document_separator"));
  }
  SECTION("a prepare.json that is not JSON is refused by both, naming it") {
    write_file(d / "b/prepare.json", "{\"vocab_size\": ");
    for (int which = 0; which < 2; ++which) {
      INFO(which);
      const auto call = [&] {
        if (which == 0) open_token_files(both, "llmc", 50, "data.val");
        else prepared_document_start(both, "data.val");
      };
      REQUIRE_THROWS_WITH(call(), Contains("data.val") && Contains(d / "b/prepare.json") &&
                                      Contains("not valid JSON") && Contains("re-run `trainrun prepare`"));
    }
  }
}

TEST_CASE("data: prepare: the fortunes corpus (when installed)", "[data][prepare]") {
  const std::string dir = "/usr/share/games/fortunes";
  if (!fs::is_directory(dir)) {
    WARN("no " << dir << "; skipped");
    return;
  }
  TempDir d("prep");
  PrepareOptions opts;
  opts.inputs = {dir};
  opts.output_dir = d / "out";
  opts.val_fraction = 0.05;
  std::string summary = prepare_byte_shards(opts);
  INFO(summary);
  REQUIRE_THAT(summary, Contains("binary") && Contains("duplicate"));
  auto tr = open_token_files(d / "out/train_*.bin", "llmc", 256, "data.train");
  auto va = open_token_files(d / "out/val_*.bin", "llmc", 256, "data.val");
  REQUIRE(tr->num_tokens() > 1000000);
  REQUIRE(va->num_tokens() > 10000);
  REQUIRE(tr->vocab_bound() <= 256);
}

// ---- loss masks ---------------------------------------------------------------

TEST_CASE("data: .mask sidecars: masked targets read as -1, count_targets, errors", "[data][mask]") {
  TempDir d("mask");
  auto toks = iota_tokens(41, 5, 300);
  // Two shards of 20 and 21 tokens; the mask spans them as one stream.
  std::vector<uint32_t> a(toks.begin(), toks.begin() + 20), b(toks.begin() + 20, toks.end());
  write_llmc_shard(d / "train_000000.bin", a, 1);
  write_llmc_shard(d / "train_000001.bin", b, 1);
  std::string m(41, '\0');
  for (int i = 0; i < 41; ++i) m[i] = (i % 3 == 0 || i > 35) ? 1 : 0;
  write_file(d / "train_000000.mask", m.substr(0, 20));
  write_file(d / "train_000001.mask", m.substr(20));
  auto src = open_token_files(d / "train_*.bin", "llmc", 300, "data.train");
  REQUIRE(src->has_mask());
  REQUIRE_THAT(src->describe(), Contains("with loss masks"));
  const int T = 8, B = 5;  // 5 samples: all of them, the last spans both shards
  std::vector<int32_t> in(B * T), tg(B * T);
  src->read_samples(0, B, T, in.data(), tg.data());
  int64_t expect = 0;
  for (int s = 0; s < B; ++s)
    for (int t = 0; t < T; ++t) {
      const int pos = s * T + t + 1;  // the target's index in the stream
      REQUIRE(in[s * T + t] == int32_t(toks[pos - 1]));
      REQUIRE(tg[s * T + t] == (m[pos] ? int32_t(toks[pos]) : -1));
      expect += m[pos];
    }
  REQUIRE(src->count_targets(0, B, T) == expect);
  REQUIRE(src->count_targets(5, 1, T) == src->count_targets(0, 1, T));  // wraps like read_samples
  REQUIRE(open_token_files(d / "train_000000.bin", "llmc", 300, "data.train")->count_targets(0, 2, 8) > 0);

  SECTION("without masks: every target counts") {
    auto plain = open_token_files(d / "train_*.bin", "raw_uint16", 0, "data.train");
    REQUIRE_FALSE(plain->has_mask());
    REQUIRE(plain->count_targets(0, 3, 7) == 21);
  }
  SECTION("a mask of the wrong size names both files") {
    write_file(d / "train_000001.mask", m.substr(20, 5));
    REQUIRE_THROWS_WITH(open_token_files(d / "train_*.bin", "llmc", 300, "data.train"),
                        Contains("train_000001.mask") && Contains("5 bytes") && Contains("21 tokens") &&
                            Contains("trainrun prepare"));
  }
  SECTION("some shards with a mask, some without") {
    fs::remove(d / "train_000001.mask");
    REQUIRE_THROWS_WITH(open_token_files(d / "train_*.bin", "llmc", 300, "data.train"),
                        Contains("data.train") && Contains("1 of 2 shards") && Contains("train_000001.bin"));
  }
  SECTION("a mask byte other than 0/1") {
    std::string bad = m.substr(20);
    bad[3] = 7;
    write_file(d / "train_000001.mask", bad);
    REQUIRE_THROWS_WITH(open_token_files(d / "train_*.bin", "llmc", 300, "data.train"),
                        Contains("byte 7") && Contains("index 3"));
  }
}
