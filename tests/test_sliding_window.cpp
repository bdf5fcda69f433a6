// The sliding window of the attention ops (AttentionOptions::window,
// kernels/backend.h) on the CPU backend, against the definition
// (ref::attention_gqa_masked: query t sees keys max(doc_start, t-W+1) <= j <= t,
// transformers' Mistral rule) and its finite differences:
//  - attention_gqa_forward/backward with T = 150 > W, across causal_head.h's
//    64-row blocks (a window narrower than a block, and one wider), with
//    document masks whose documents are both shorter and longer than W,
//    with soft-capping and a score scale on top;
//  - attention_kv_gqa_forward's ring cache of W rows, fed in pieces longer
//    and shorter than W: its rows equal the windowed full forward's, and the
//    ring holds the last W positions' keys and values.
// The model-level tests (Mistral against transformers) are in test_mistral.cpp.
#include <catch2/catch.hpp>
#include <cstdio>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "tests/support/device_io.h"
#include "tests/support/op_test_util.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using ref::Vec;

namespace {
constexpr double kFwdTol = 1e-5;   // fp32 against double, as test_cpu_llama_ops
constexpr double kGradTol = 1e-4;  // fp32 analytic against double central differences

// doc_start (T) for documents beginning at `starts` (the first is 0).
std::vector<int32_t> doc_starts(int T, const std::vector<int>& starts) {
  std::vector<int32_t> ds(size_t(T), 0);
  for (int s : starts)
    for (int t = s; t < T; ++t) ds[size_t(t)] = s;
  return ds;
}
}  // namespace

TEST_CASE("sliding_window: attention_gqa forward and backward with T > window, document masks, softcap",
          "[cpu_ops][window]") {
  auto be = make_cpu_backend(2);
  const int B = 1, T = 150, NH = 2, NKV = 1, HS = 4, ld = (NH + 2 * NKV) * HS, C = NH * HS;
  struct Case {
    int window;
    std::vector<int> docs;  // document starts (empty: one document)
    double scale, softcap;
  };
  // W 20 < the 64-row block (a block's sgemm starts at key t0 - 19); W 100 > it
  // (a key block is seen up to j1 + 99, inside T); documents of 37 (shorter
  // than the window), 53 and 60 rows, and of 120 (longer than 100) and 30.
  const Case cases[] = {{20, {0, 37, 90}, 0.0, 0.0}, {100, {}, 0.0, 0.0}, {100, {0, 120}, 0.0, 0.0},
                        {7, {0, 37, 90}, 0.3, 1.5}};
  for (const Case& c : cases) {
    INFO("window " << c.window << " docs " << c.docs.size() << " softcap " << c.softcap);
    std::printf(" window %d, %zu documents, softcap %g\n", c.window, c.docs.size(), c.softcap);
    const std::vector<int32_t> ds = doc_starts(T, c.docs);
    const int32_t* doc = c.docs.empty() ? nullptr : ds.data();
    DeviceBuffer ddoc = upload_i32(be.get(), ds);
    AttentionOptions opt;
    opt.window = c.window;
    opt.scale = float(c.scale);
    opt.softcap = float(c.softcap);
    ActTensor qkv(be.get(), randn(size_t(B) * T * ld, 700 + c.window, 1.5));
    ActTensor R(be.get(), randn(size_t(B) * T * C, 710 + c.window));
    DeviceBuffer out(be.get(), size_t(B) * T * C * 4), saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
    ActTensor dqkv(be.get(), randn(qkv.val.size(), 720, 1.0, -3.0));  // pre-filled: must be overwritten
    const int32_t* ddoc_p = doc ? ddoc.as<int32_t>() : nullptr;
    be->attention_gqa_forward(out.get(), saved.as<float>(), qkv.get(), B, T, NH, NKV, HS, ddoc_p, opt);
    be->attention_gqa_backward(dqkv.get(), R.get(), qkv.get(), out.get(), saved.as<float>(), B, T, NH, NKV, HS, ddoc_p,
                               opt);
    auto f = [&](const Vec& x) {
      return ref::attention_gqa_masked(x, B, T, NH, NKV, HS, doc, c.window, c.scale, c.softcap);
    };
    const Vec want = f(qkv.val);
    check_close("windowed attention fwd", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);
    // The window bites: without it the output is another one.
    const Vec unwindowed = ref::attention_gqa_masked(qkv.val, B, T, NH, NKV, HS, doc, 0, c.scale, c.softcap);
    CHECK(ref::rel_err(unwindowed, want) > 0.05);
    Vec x = qkv.val;
    const Vec g = ref::central_fd(x, [&] { return ref::dot(f(x), R.val); });
    check_close("windowed attention dqkv (vs FD)", download_act_vec(be.get(), dqkv.get(), g.size()), g, kGradTol);
  }
}

TEST_CASE("sliding_window: attention_kv_gqa_forward keeps a ring of W rows and equals the windowed forward",
          "[cpu_ops][window]") {
  auto be = make_cpu_backend(2);
  const int T = 20, W = 5, NH = 4, NKV = 2, HS = 6, ld = (NH + 2 * NKV) * HS, C = NH * HS, KV = NKV * HS;
  AttentionOptions opt;
  opt.window = W;
  opt.softcap = 2.0f;  // as Gemma 2's local layers: both options in one call
  const Vec raw = randn(size_t(T) * ld, 801, 1.5);
  ActTensor full(be.get(), raw);
  DeviceBuffer out_full(be.get(), size_t(T) * C * 4), saved(be.get(), be->attention_gqa_saved_floats(1, T, NH) * 4);
  be->attention_gqa_forward(out_full.get(), saved.as<float>(), full.get(), 1, T, NH, NKV, HS, nullptr, opt);
  const Vec want = download_act_vec(be.get(), out_full.get(), size_t(T) * C);
  CHECK(ref::rel_err(want, ref::attention_gqa_masked(full.val, 1, T, NH, NKV, HS, nullptr, W, 0, 2.0)) <= kFwdTol);

  DeviceBuffer kc(be.get(), size_t(W) * KV * 4), vc(be.get(), size_t(W) * KV * 4);  // the ring: W rows, no more
  DeviceBuffer out(be.get(), size_t(T) * C * 4);
  Vec got;
  // A prefill longer than the ring (7 > 5), single tokens, a piece that wraps, one of exactly W.
  for (const auto& [pos, n] : std::vector<std::pair<int, int>>{{0, 7}, {7, 1}, {8, 3}, {11, 1}, {12, 5}, {17, 3}}) {
    ActTensor piece(be.get(), Vec(raw.begin() + size_t(pos) * ld, raw.begin() + size_t(pos + n) * ld));
    be->attention_kv_gqa_forward(out.get(), kc.get(), vc.get(), piece.get(), pos, n, NH, NKV, HS, opt);
    const Vec rows = download_act_vec(be.get(), out.get(), size_t(n) * C);
    got.insert(got.end(), rows.begin(), rows.end());
  }
  check_close("ring-cached rows vs windowed forward", got, want, kFwdTol);
  // Row p % W holds position p's k and v for the last W positions.
  const Vec k = download_act_vec(be.get(), kc.get(), size_t(W) * KV), v = download_act_vec(be.get(), vc.get(), size_t(W) * KV);
  for (int p = T - W; p < T; ++p)
    for (int i = 0; i < KV; ++i) {
      INFO("position " << p << " column " << i);
      REQUIRE(k[size_t(p % W) * KV + i] == full.val[size_t(p) * ld + C + i]);
      REQUIRE(v[size_t(p % W) * KV + i] == full.val[size_t(p) * ld + C + KV + i]);
    }
}

TEST_CASE("sliding_window: a negative window is refused by name", "[cpu_ops][window]") {
  auto be = make_cpu_backend(1);
  AttentionOptions opt;
  opt.window = -3;
  CHECK_THROWS_WITH(be->attention_gqa_forward(nullptr, nullptr, nullptr, 1, 1, 1, 1, 1, nullptr, opt),
                    Catch::Matchers::Contains("attention_gqa_forward: sliding window -3 must be >= 0"));
  CHECK_THROWS_WITH(be->attention_kv_gqa_forward(nullptr, nullptr, nullptr, nullptr, 0, 1, 1, 1, 1, opt),
                    Catch::Matchers::Contains("attention_kv_gqa_forward: sliding window -3 must be >= 0"));
}

// The block ops (context parallelism's) compute the window, soft-cap and
// scale (tests/test_context_parallel.cpp against this file's op); a
// negative one is refused by name.
TEST_CASE("sliding_window: the attention_block ops refuse a negative window or soft-cap by name", "[cpu_ops][window][cp]") {
  auto be = make_cpu_backend(1);
  AttentionBlock a;
  a.B = 1, a.Tq = 1, a.Tk = 1, a.NH = 1, a.NKV = 1, a.HS = 2;
  a.window = -4;
  std::vector<float> q(2, 1.f), o(2), lse(1), dq(2), dk(2), dv(2);
  a.q = a.k = a.v = q.data();
  a.q_ld = a.kv_ld = a.o_ld = 2;
  const auto msg = Catch::Matchers::Contains("window -4, softcap 0 and scale 0 must be >= 0");
  CHECK_THROWS_WITH(be->attention_block_forward(o.data(), lse.data(), a), msg);
  CHECK_THROWS_WITH(be->attention_block_backward(dq.data(), dk.data(), dv.data(), o.data(), o.data(), lse.data(), a),
                    msg);
  a.window = 0, a.softcap = -1.f;
  CHECK_THROWS_WITH(be->attention_block_forward(o.data(), lse.data(), a),
                    Catch::Matchers::Contains("attention_block_forward: window 0, softcap -1"));
}
