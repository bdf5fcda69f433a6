// Context parallelism (issue 27), the pieces the networks and the trainer
// use (tests/test_cp_training.cpp tests them in use): the job spec's keys
// and their refusals (and the trainer's), the cp mesh dimension, the
// load-balanced sequence split (rows <-> global positions, document masks
// split with positions restarting per document), and attention across cp
// ranks (ring and all_to_all) against the one-rank attention op, forward
// and backward, on Gloo over threads; a rank that dies inside the ring.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "kernels/backend.h"
#include "parallel/rendezvous/store.h"
#include "parallel/context/all_to_all_attention.h"
#include "parallel/context/ring_attention.h"
#include "parallel/context/sequence_split.h"
#include "tests/support/cp_docs.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Matchers::Contains;

namespace {
const std::string kModel = "model: {n_layer: 1, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16}\n"
                           "data: {format: synthetic}\n";
std::string spec_error(const std::string& yaml) {
  try {
    parse_job_spec(yaml, "job.yaml");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("cp: the job spec's context_parallel and cp_mode, and what they refuse", "[cp][config]") {
  const JobSpec j = parse_job_spec(kModel + "parallel: {context_parallel: 4, cp_mode: all_to_all}\n", "job.yaml");
  CHECK(j.parallel.context_parallel == 4);
  CHECK(j.parallel.cp_mode == "all_to_all");
  CHECK(parse_job_spec(kModel, "job.yaml").parallel.cp_mode == "ring");
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 0}\n"), Contains("parallel.context_parallel"));
  CHECK_THAT(spec_error(kModel + "parallel: {cp_mode: ulysses}\n"), Contains("parallel.cp_mode") && Contains("ring"));
  // T = 16 is not a multiple of 2 x 3: refused (not padded), naming both keys.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 3}\n"),
             Contains("model.seq_len") && Contains("16 is not a multiple of 2 x parallel.context_parallel (6)") &&
                 Contains("does not pad"));
  CHECK(spec_error(kModel + "parallel: {context_parallel: 8}\n") == "");  // 16 = 2 x 8
  // 16 is a multiple of 16 / 2 = 8 chunks' worth but not of 2 x 16 chunks.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 16}\n"),
             Contains("not a multiple of 2 x parallel.context_parallel (32)"));
  // all_to_all needs whole heads per rank: n_head 4 over cp2 x tp4 is not.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 4, cp_mode: all_to_all}\n"),
             Contains("model.n_head") && Contains("4 is not divisible by parallel.context_parallel (2) x "
                                                  "parallel.tensor_parallel (4) = 8"));
  CHECK(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 4, cp_mode: ring}\n") == "");
  CHECK(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 2, cp_mode: all_to_all}\n") == "");
}

TEST_CASE("cp: what context parallelism does not compose with yet is refused at setup by name", "[cp][config]") {
  TempDir dir("cp_refused");
  const std::string model = "{n_layer: 1, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16";
  auto job = [&](const std::string& parallel, const std::string& model_extra) {
    return parse_job_spec("backend: cpu\nmodel: " + model + model_extra + "}\ndata: {format: synthetic}\n" +
                              "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 1, eval_interval: 0, "
                              "warmup_steps: 0}\n"
                              "parallel: {" + parallel + ", timeout_s: 30}\n"
                              "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n",
                          "job.yaml");
  };
  // Adapters train under cp (tests/test_cp_window.cpp); their dropout does not.
  const auto lora = run_ranks_inprocess_outcomes(
      job("context_parallel: 2", ", adapter: {type: lora, rank: 2, dropout: 0.1}"),
      2);
  for (const auto& o : lora)
    CHECK_THAT(o.error, Contains("parallel.context_parallel 2 with model.adapter.dropout 0.1: adapter dropout"));
}

// ---- the sequence split -------------------------------------------------------------

TEST_CASE("cp: the load-balanced split maps rows to positions and back, and round-trips", "[cp]") {
  const int T = 24, B = 2;
  for (int cp : {1, 2, 3, 4}) {
    if (T % (2 * cp)) continue;
    std::vector<int> seen(T, 0);
    std::vector<std::vector<float>> locals;
    std::vector<float> global(size_t(B) * T * 3);
    for (size_t i = 0; i < global.size(); ++i) global[i] = float(i);
    for (int r = 0; r < cp; ++r) {
      const SequenceSplit s(T, cp, r);
      REQUIRE(s.local_rows() == T / cp);
      for (int l = 0; l < s.local_rows(); ++l) {
        const int p = s.global_pos(l);
        CHECK(s.local_row(p) == l);
        CHECK(s.owner(p) == r);
        seen[size_t(p)]++;
      }
      // Rank r holds chunks r and 2cp-1-r.
      CHECK(s.global_pos(0) == r * s.chunk());
      CHECK(s.global_pos(s.chunk()) == (2 * cp - 1 - r) * s.chunk());
      locals.emplace_back(size_t(B) * s.local_rows() * 3);
      split_rows(global.data(), locals.back().data(), B, 3 * sizeof(float), s);
      CHECK(locals.back()[3 * size_t(s.local_rows())] == global[3 * size_t(T) + 3 * size_t(r * s.chunk())]);  // b = 1
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    std::vector<const void*> ptrs;
    for (auto& l : locals) ptrs.push_back(l.data());
    std::vector<float> back(global.size(), -1);
    merge_rows(ptrs, back.data(), B, 3 * sizeof(float), T, cp);
    CHECK(back == global);
  }
  CHECK_THROWS_WITH(SequenceSplit(20, 3, 0), Contains("20 is not a multiple of 2 x cp = 6"));
}

TEST_CASE("cp: a split document mask keeps global starts and restarts positions per document", "[cp]") {
  // T 16 at cp2 (chunks of 4: rank 0 holds 0-3 and 12-15, rank 1 4-11).
  // Documents [0,6) [6,8) [8,16): the first crosses a chunk edge, the third
  // starts exactly on one and spans two chunks held by different ranks.
  std::vector<int32_t> doc(16);
  for (int t = 0; t < 16; ++t) doc[size_t(t)] = t < 6 ? 0 : t < 8 ? 6 : 8;
  const LocalDocumentMask r0 = split_document_mask(doc.data(), 1, SequenceSplit(16, 2, 0));
  const LocalDocumentMask r1 = split_document_mask(doc.data(), 1, SequenceSplit(16, 2, 1));
  CHECK(r0.doc_start == std::vector<int32_t>{0, 0, 0, 0, 8, 8, 8, 8});
  CHECK(r0.pos == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});  // rows 12-15: positions 4-7 of the third
  CHECK(r1.doc_start == std::vector<int32_t>{0, 0, 6, 6, 8, 8, 8, 8});
  CHECK(r1.pos == std::vector<int32_t>{4, 5, 0, 1, 0, 1, 2, 3});
  // Without documents: positions are global.
  CHECK(split_document_mask(nullptr, 1, SequenceSplit(16, 2, 1)).pos == std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11});
}

// ---- Communicator::all_to_all (the exchange all_to_all attention uses) -----------------

namespace {
// Rank r's block for rank j: 5 bytes of (r, j, k).
std::vector<uint8_t> a2a_input(int r, int W) {
  std::vector<uint8_t> v;
  for (int j = 0; j < W; ++j)
    for (int k = 0; k < 5; ++k) v.push_back(uint8_t(r * 64 + j * 8 + k));
  return v;
}
void check_a2a(Communicator& c) {
  const int W = c.world_size(), r = c.rank();
  const std::vector<uint8_t> in = a2a_input(r, W);
  std::vector<uint8_t> out(in.size(), 0xee);
  c.all_to_all(out.data(), in.data(), 5);
  for (int i = 0; i < W; ++i)
    for (int k = 0; k < 5; ++k)
      if (out[size_t(i * 5 + k)] != uint8_t(i * 64 + r * 8 + k))
        throw std::runtime_error("all_to_all: rank " + std::to_string(r) + " got a wrong byte from rank " +
                                 std::to_string(i));
}
}  // namespace

TEST_CASE("cp: all_to_all sends block j to rank j on Gloo, the single rank and the shared-memory pair", "[cp]") {
  for (int W : {2, 3, 4}) {
    INFO("gloo W " << W);
    for (const auto& e : run_gloo_group(W, "a2a", std::chrono::seconds(30), check_a2a)) CHECK(e == "");
  }
  check_a2a(*make_single_communicator());
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<std::string> errors(2);
  std::vector<std::thread> pair;
  for (int r = 0; r < 2; ++r)
    pair.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", server.port(), secret, std::chrono::seconds(30));
        check_a2a(*make_shm_communicator(*store, "shm_a2a", r, std::chrono::seconds(30)));
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : pair) t.join();
  CHECK(errors == std::vector<std::string>{"", ""});
}

// ---- attention across ranks against the one-rank op ------------------------------------

namespace {

struct AttnCase {
  int B = 2, T = 32, NH = 4, NKV = 2, HS = 8;
  std::vector<int32_t> doc_start;  // (B,T) or empty
  AttentionOptions opt;            // window, soft-cap, scale (Mistral, Gemma 2)
};

std::vector<int32_t> make_docs(int B, int T, uint64_t seed) { return make_cp_docs(B, T, seed); }

struct Reference {
  std::vector<float> qkv, dout, out, dqkv;
};

// The one-rank op (attention_gqa_forward / _backward) on the whole sequence.
Reference one_rank(const AttnCase& c, uint64_t seed) {
  auto be = make_cpu_backend(1);
  const int ld = (c.NH + 2 * c.NKV) * c.HS, C = c.NH * c.HS;
  Reference r;
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  r.qkv.resize(size_t(c.B) * c.T * ld);
  r.dout.resize(size_t(c.B) * c.T * C);
  for (auto& x : r.qkv) x = nd(gen);
  for (auto& x : r.dout) x = nd(gen);
  DeviceBuffer qkv = upload_f32(be.get(), r.qkv), dout = upload_f32(be.get(), r.dout);
  DeviceBuffer out(be.get(), r.dout.size() * 4), dqkv(be.get(), r.qkv.size() * 4);
  DeviceBuffer saved(be.get(), be->attention_gqa_saved_floats(c.B, c.T, c.NH) * 4);
  DeviceBuffer docs(be.get(), std::max<size_t>(4, c.doc_start.size() * 4));
  const int32_t* dp = nullptr;
  if (!c.doc_start.empty()) {
    be->copy_to_device(docs.get(), c.doc_start.data(), c.doc_start.size() * 4);
    dp = docs.as<int32_t>();
  }
  be->attention_gqa_forward(out.get(), saved.as<float>(), qkv.get(), c.B, c.T, c.NH, c.NKV, c.HS, dp, c.opt);
  be->attention_gqa_backward(dqkv.get(), dout.get(), qkv.get(), out.get(), saved.as<float>(), c.B, c.T, c.NH, c.NKV,
                             c.HS, dp, c.opt);
  r.out = download_f32(be.get(), out.get(), r.dout.size());
  r.dqkv = download_f32(be.get(), dqkv.get(), r.qkv.size());
  return r;
}

// max |got - ref| / max |ref|
double max_rel(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

struct CpResult {
  std::vector<float> out, dqkv;   // merged back into global order
  std::vector<RingStats> stats;   // per rank (ring only)
  std::vector<std::string> errors;
};

// Runs the cp attention on `cp` ranks (threads, Gloo) and merges the rows.
CpResult run_cp(const AttnCase& c, const Reference& ref, int cp, const std::string& mode,
                std::chrono::milliseconds timeout = std::chrono::seconds(30), int dead_rank = -1) {
  const int ld = (c.NH + 2 * c.NKV) * c.HS, C = c.NH * c.HS;
  std::vector<std::vector<float>> outs(static_cast<size_t>(cp)), dqkvs(static_cast<size_t>(cp));
  CpResult res;
  res.stats.resize(size_t(cp));
  res.errors = run_gloo_group(cp, "cp0", timeout, [&](Communicator& comm) {
    const int r = comm.rank();
    if (r == dead_rank) {  // stops answering inside the ring, holding its connections
      std::this_thread::sleep_for(timeout * 3);
      return;
    }
    auto be = make_cpu_backend(1);
    const SequenceSplit split(c.T, cp, r);
    const int Tl = split.local_rows();
    std::vector<float> q_local(size_t(c.B) * Tl * ld), dout_local(size_t(c.B) * Tl * C);
    split_rows(ref.qkv.data(), q_local.data(), c.B, ld * sizeof(float), split);
    split_rows(ref.dout.data(), dout_local.data(), c.B, C * sizeof(float), split);
    DeviceBuffer qkv = upload_f32(be.get(), q_local), dout = upload_f32(be.get(), dout_local);
    DeviceBuffer out(be.get(), dout_local.size() * 4), dqkv(be.get(), q_local.size() * 4);
    DeviceBuffer lse(be.get(), size_t(c.B) * c.NH * Tl * 4);
    const CpAttentionShape shape{c.B, c.T, c.NH, c.NKV, c.HS};
    const int32_t* docs = c.doc_start.empty() ? nullptr : c.doc_start.data();
    if (mode == "ring") {
      RingAttention ring(*be, comm, shape, docs);
      ring.forward(out.get(), lse.as<float>(), qkv.get(), c.opt);
      ring.backward(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.as<float>(), c.opt);
      res.stats[size_t(r)] = ring.stats();
    } else {
      AllToAllAttention a2a(*be, comm, shape, docs);
      a2a.forward(out.get(), lse.as<float>(), qkv.get(), c.opt);
      a2a.backward(dqkv.get(), dout.get(), qkv.get(), out.get(), lse.as<float>(), c.opt);
    }
    outs[size_t(r)] = download_f32(be.get(), out.get(), dout_local.size());
    dqkvs[size_t(r)] = download_f32(be.get(), dqkv.get(), q_local.size());
  });
  for (const auto& e : res.errors)
    if (!e.empty()) return res;
  std::vector<const void*> po, pd;
  for (int r = 0; r < cp; ++r) po.push_back(outs[size_t(r)].data()), pd.push_back(dqkvs[size_t(r)].data());
  res.out.resize(ref.out.size());
  res.dqkv.resize(ref.dqkv.size());
  merge_rows(po, res.out.data(), c.B, C * sizeof(float), c.T, cp);
  merge_rows(pd, res.dqkv.data(), c.B, ld * sizeof(float), c.T, cp);
  return res;
}

void check_against_one_rank(const std::string& mode) {
  struct Shape {
    int NH, NKV;
    bool docs;
  };
  for (const Shape sh : {Shape{4, 2, false}, Shape{4, 2, true}, Shape{4, 4, true}, Shape{4, 1, true}}) {
    AttnCase c;
    c.NH = sh.NH, c.NKV = sh.NKV;
    if (sh.docs) c.doc_start = make_docs(c.B, c.T, 7);
    const Reference ref = one_rank(c, 11);
    for (int cp : {2, 4}) {
      INFO(mode << " cp" << cp << " NH " << c.NH << " NKV " << c.NKV << (sh.docs ? " documents" : " causal"));
      const CpResult r = run_cp(c, ref, cp, mode);
      for (const auto& e : r.errors) REQUIRE(e == "");
      const double e_out = max_rel(r.out, ref.out), e_grad = max_rel(r.dqkv, ref.dqkv);
      INFO(mode << " cp" << cp << " NKV " << c.NKV << (sh.docs ? " docs" : " causal") << ": out max rel err "
                << e_out << ", dqkv " << e_grad);
      CHECK(e_out <= 1e-5);
      CHECK(e_grad <= 1e-5);
    }
  }
}

}  // namespace

TEST_CASE("cp: ring attention at cp2 and cp4 equals the one-rank op, forward and backward", "[cp][ring]") {
  check_against_one_rank("ring");
}

TEST_CASE("cp: all_to_all attention at cp2 and cp4 equals the one-rank op, forward and backward (KV heads split "
          "or replicated)", "[cp][all_to_all]") {
  check_against_one_rank("all_to_all");
}

TEST_CASE("cp: all_to_all refuses heads that do not split, naming what works", "[cp][all_to_all]") {
  AttnCase c;
  c.NH = 6, c.NKV = 6;  // 6 query heads over 4 ranks
  CHECK_THAT(run_cp(c, one_rank(c, 2), 4, "all_to_all").errors[0],
             Contains("6 attention heads do not split over cp 4") && Contains("cp_mode: ring"));
  c.NH = 12, c.NKV = 3;  // 3 KV heads over 2 ranks: neither split nor whole replicas
  CHECK_THAT(run_cp(c, one_rank(c, 2), 2, "all_to_all").errors[1],
             Contains("3 key/value heads over cp 2 ranks") && Contains("cp_mode: ring"));
}

TEST_CASE("cp: the ring's causal work is even, and blocks nobody may see are neither computed nor sent",
          "[cp][ring]") {
  AttnCase c;
  const Reference causal = one_rank(c, 3);
  const CpResult r = run_cp(c, causal, 4, "ring");
  for (const auto& e : r.errors) REQUIRE(e == "");
  for (const RingStats& s : r.stats) {
    CHECK(s.blocks_computed == 2 * 4 + 1);  // (i + 1) + (2N - i) chunk pairs on every rank
    CHECK(s.blocks_skipped == 4 * 4 - 9);
    CHECK(s.sends == 3);                    // every block goes all the way round
  }
  // Every document inside one chunk (chunk edges = document edges): each
  // rank needs only its own keys, so nothing travels and only the two
  // diagonal pairs are computed; the result is still the one-rank op's.
  c.doc_start.assign(size_t(c.B) * c.T, 0);
  for (int i = 0; i < c.B * c.T; ++i) c.doc_start[size_t(i)] = (i % c.T) / 4 * 4;  // T 32, cp4: chunks of 4
  const Reference docs = one_rank(c, 3);
  const CpResult d = run_cp(c, docs, 4, "ring");
  for (const auto& e : d.errors) REQUIRE(e == "");
  for (const RingStats& s : d.stats) {
    CHECK(s.blocks_computed == 2);
    CHECK(s.sends == 0);
    CHECK(s.sends_skipped == 1);  // its own block, at the first step; none arrive after
  }
  CHECK(max_rel(d.out, docs.out) <= 1e-5);
  CHECK(max_rel(d.dqkv, docs.dqkv) <= 1e-5);
}

// The sliding window (Mistral; Gemma 2's local layers) and Gemma 2's
// soft-cap and query scale inside the block ops, ring and all_to_all, with
// documents. T 32: the chunks are 8 rows at cp2 and 4 at cp4, so window 3
// is shorter than a chunk at both, 12 longer than both (and shorter than T).
TEST_CASE("cp: ring and all_to_all with a sliding window (shorter and longer than a chunk), soft-cap and query "
          "scale equal the one-rank op, and the ring skips the blocks outside the window", "[cp][window]") {
  struct Opt { int window; float softcap, scale; bool docs; };
  double worst = 0;
  for (const Opt o : {Opt{3, 0.f, 0.f, true}, Opt{12, 0.f, 0.f, true}, Opt{5, 1.5f, 0.2f, true},
                      Opt{0, 1.5f, 0.2f, false}}) {
    AttnCase c;
    c.opt.window = o.window, c.opt.softcap = o.softcap, c.opt.scale = o.scale;
    if (o.docs) c.doc_start = make_docs(c.B, c.T, 7);
    const Reference ref = one_rank(c, 11);
    AttnCase plain = c;
    plain.opt = AttentionOptions{};
    const Reference unmodified = one_rank(plain, 11);
    CHECK(max_rel(unmodified.out, ref.out) > 1e-2);  // the options bite: without them the output differs
    for (const char* mode : {"ring", "all_to_all"})
      for (int cp : {2, 4}) {
        const CpResult r = run_cp(c, ref, cp, mode);
        for (const auto& e : r.errors) REQUIRE(e == "");
        const double e_out = max_rel(r.out, ref.out), e_grad = max_rel(r.dqkv, ref.dqkv);
        INFO(mode << " cp" << cp << " window " << o.window << " softcap " << o.softcap << " scale " << o.scale
                  << ": out max rel err " << e_out << ", dqkv " << e_grad);
        CHECK(e_out <= 1e-5);
        CHECK(e_grad <= 1e-5);
        worst = std::max({worst, e_out, e_grad});
      }
  }
  WARN("window / soft-cap / scale under cp: worst max rel err " << worst);
  // Skipping, window 3 at cp4 without documents (chunks of 4): query chunk
  // q sees key chunks q and q-1 only, 1 + 7 x 2 = 15 pairs over the ranks
  // (36 without the window); of the ring's 12 forward sends, rank 0's
  // block is needed by rank 1 alone, so rank 1 keeps it: 10 sends.
  AttnCase w;
  w.opt.window = 3;
  const Reference wref = one_rank(w, 5);
  const CpResult r = run_cp(w, wref, 4, "ring");
  for (const auto& e : r.errors) REQUIRE(e == "");
  int computed = 0, sends = 0, kept = 0;
  for (const RingStats& s : r.stats) computed += s.blocks_computed, sends += s.sends, kept += s.sends_skipped;
  CHECK(computed == 15);
  CHECK(r.stats[0].blocks_computed == 3);  // chunks 0 (itself) and 7 (7, 6)
  CHECK(sends == 10);
  CHECK(kept == 1);
  CHECK(max_rel(r.out, wref.out) <= 1e-5);
  CHECK(max_rel(r.dqkv, wref.dqkv) <= 1e-5);
}

TEST_CASE("cp: a rank that stops inside the ring makes the others fail with a timeout naming the cp group",
          "[cp][ring][fault]") {
  AttnCase c;
  const Reference ref = one_rank(c, 5);
  const auto t0 = std::chrono::steady_clock::now();
  const CpResult r = run_cp(c, ref, 4, "ring", std::chrono::milliseconds(1500), /*dead_rank=*/2);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 15);
  for (int rank : {0, 1, 3}) {
    INFO("rank " << rank << ": " << r.errors[size_t(rank)]);
    CHECK_THAT(r.errors[size_t(rank)], Contains("ring attention forward (cp group cp0, cp rank " +
                                                std::to_string(rank) + " of 4, ring step"));
    CHECK_THAT(r.errors[size_t(rank)], Contains("timed out") || Contains("closed"));
  }
  CHECK(r.errors[2] == "");
}
