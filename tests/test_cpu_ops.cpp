// Every op of the CPU backend against the double-precision reference
// (tests/support/reference_ops.h):
//  - forward outputs against the reference forward;
//  - backward outputs against central finite differences (in double) of the
//    reference forward of L = sum(out * R), R a fixed random tensor that is
//    also the `dout` handed to the backend's backward;
//  - the gradient contract of kernels/backend.h: every grad buffer is
//    pre-filled with known nonzero values, and the result must be
//    prefill + grad where the contract says "+=" and grad where it says
//    "overwritten" (either mistake is off by O(1), far beyond tolerance);
//  - determinism of the reductions that the backend promises are ordered.
//
// Error metric everywhere: norm-wise relative error ||got - want||_2 /
// ||want||_2 over the whole tensor (ref::rel_err). Element-wise relative
// error is meaningless for entries that are near zero by cancellation.
//
// Sizes are deliberately odd and mutually prime-ish (T=5, C=12 with NH=3 so
// HS=4, N=7, C=13, OC=11, V=37) so that transposed or swapped dimensions
// cannot silently line up.
//
// Device memory is only touched through copy_to_device / copy_to_host and
// the cast ops, so the same file can be pointed at the CUDA backend.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "tests/support/device_io.h"
#include "tests/support/op_test_util.h"
#include "tests/support/reference_ops.h"

using namespace trainrun;
using ref::Tokens;
using ref::Vec;
using namespace trainrun::test;

namespace {

// Forward: fp32 against double, a handful of roundings of O(1) values over
// sums of <= 3C terms -> ~1e-7 expected; 1e-5 leaves room without hiding bugs.
constexpr double kFwdTol = 1e-5;
// Backward: fp32 analytic gradient against double finite differences (whose
// own error is ~1e-10, see ref::central_fd).
constexpr double kGradTol = 1e-4;

std::unique_ptr<Backend> make_backend() { return make_cpu_backend(2); }

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

// Transfers, ActTensor/F32Tensor and check_close: tests/support/op_test_util.h.

bool same_bits(Backend* be, const void* a, const void* b, size_t bytes) {
  std::vector<unsigned char> ha(bytes), hb(bytes);
  be->copy_to_host(ha.data(), a, bytes);
  be->copy_to_host(hb.data(), b, bytes);
  be->synchronize();
  return std::memcmp(ha.data(), hb.data(), bytes) == 0;
}

}  // namespace

TEST_CASE("cpu_ops: memory, copies and casts", "[cpu_ops]") {
  auto be = make_backend();
  const size_t base = be->bytes_in_use();
  {
    DeviceBuffer a(be.get(), 1000), b(be.get(), 1000);
    CHECK(be->bytes_in_use() == base + 2000);
    CHECK(be->peak_bytes() >= base + 2000);
    std::vector<unsigned char> h(1000, 0xAB);
    be->copy_to_host(h.data(), a.get(), 1000);  // alloc() zero-initialises
    CHECK(std::all_of(h.begin(), h.end(), [](unsigned char c) { return c == 0; }));
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<unsigned char>(i * 7 + 1);
    be->copy_to_device(a.get(), h.data(), 1000);
    be->copy_device(b.get(), a.get(), 1000);
    CHECK(same_bits(be.get(), a.get(), b.get(), 1000));
    be->zero(b.get(), 500);
    std::vector<unsigned char> hb(1000);
    be->copy_to_host(hb.data(), b.get(), 1000);
    CHECK(std::all_of(hb.begin(), hb.begin() + 500, [](unsigned char c) { return c == 0; }));
    CHECK(std::memcmp(hb.data() + 500, h.data() + 500, 500) == 0);
    CHECK(reinterpret_cast<uintptr_t>(a.get()) % 64 == 0);
  }
  CHECK(be->bytes_in_use() == base);

  // fp32 -> act dtype -> fp32 is exact on fp32 backends.
  Vec v = randn(37, 1);
  ActTensor t(be.get(), v);
  if (be->act_dtype() == DType::F32) {
    for (size_t i = 0; i < v.size(); ++i) CHECK(t.val[i] == double(float(v[i])));
  }
}

TEST_CASE("cpu_ops: encoder forward and backward (+= into dwte, dwpe)", "[cpu_ops]") {
  auto be = make_backend();
  const int B = 2, T = 5, C = 12, V = 37, maxT = 7;  // maxT > T: rows T.. of wpe get no gradient
  Tokens tok = rand_tokens(B * T, V, 11);
  tok[3] = tok[0];  // repeated tokens: the scatter into dwte must add, not store
  tok[7] = tok[0];
  tok[9] = tok[4];
  ActTensor wte(be.get(), randn(size_t(V) * C, 12));
  ActTensor wpe(be.get(), randn(size_t(maxT) * C, 13));
  DeviceBuffer dtok = upload_i32(be.get(), tok);

  DeviceBuffer out(be.get(), size_t(B) * T * C * dtype_size(be->act_dtype()));
  be->encoder_forward(out.get(), dtok.as<int32_t>(), wte.get(), wpe.get(), B, T, C);
  Vec want = ref::encoder(tok, wte.val, wpe.val, B, T, C);
  check_close("encoder fwd", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);

  ActTensor R(be.get(), randn(size_t(B) * T * C, 14));
  F32Tensor dwte(be.get(), randn(size_t(V) * C, 15));  // pre-filled: the contract is +=
  F32Tensor dwpe(be.get(), randn(size_t(maxT) * C, 16));
  be->encoder_backward(dwte.get(), dwpe.get(), R.get(), dtok.as<int32_t>(), B, T, C);

  Vec wte_v = wte.val, wpe_v = wpe.val;
  auto L = [&] { return ref::dot(ref::encoder(tok, wte_v, wpe_v, B, T, C), R.val); };
  check_close("encoder dwte (+=)", minus(download_f32_vec(be.get(), dwte.get(), wte_v.size()), dwte.val),
              ref::central_fd(wte_v, L), kGradTol);
  check_close("encoder dwpe (+=)", minus(download_f32_vec(be.get(), dwpe.get(), wpe_v.size()), dwpe.val),
              ref::central_fd(wpe_v, L), kGradTol);
}

TEST_CASE("cpu_ops: layernorm forward and backward (+= into dinp, dweight, dbias)", "[cpu_ops]") {
  auto be = make_backend();
  const int N = 7, C = 13;
  // Nonzero mean and non-unit spread so that both the centring and the
  // scaling are exercised; weight around 1 and bias nonzero.
  ActTensor x(be.get(), randn(size_t(N) * C, 21, 2.0, 3.0));
  ActTensor w(be.get(), randn(C, 22, 0.3, 1.0));
  ActTensor b(be.get(), randn(C, 23, 0.3));
  const size_t es = dtype_size(be->act_dtype());
  DeviceBuffer out(be.get(), size_t(N) * C * es), mean(be.get(), N * 4), rstd(be.get(), N * 4);
  be->layernorm_forward(out.get(), mean.as<float>(), rstd.as<float>(), x.get(), w.get(), b.get(), N, C);
  Vec rmean, rrstd;
  Vec want = ref::layernorm(x.val, w.val, b.val, N, C, &rmean, &rrstd);
  check_close("layernorm fwd out", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);
  check_close("layernorm fwd mean", download_f32_vec(be.get(), mean.get(), N), rmean, kFwdTol);
  check_close("layernorm fwd rstd", download_f32_vec(be.get(), rstd.get(), N), rrstd, kFwdTol);

  ActTensor R(be.get(), randn(size_t(N) * C, 24));
  ActTensor dinp(be.get(), randn(size_t(N) * C, 25));  // all three pre-filled: contract is +=
  F32Tensor dw(be.get(), randn(C, 26));
  F32Tensor db(be.get(), randn(C, 27));
  be->layernorm_backward(dinp.get(), dw.get(), db.get(), R.get(), x.get(), w.get(), mean.as<float>(),
                         rstd.as<float>(), N, C);

  Vec xv = x.val, wv = w.val, bv = b.val;
  auto L = [&] { return ref::dot(ref::layernorm(xv, wv, bv, N, C), R.val); };
  check_close("layernorm dinp (+=)", minus(download_act_vec(be.get(), dinp.get(), xv.size()), dinp.val),
              ref::central_fd(xv, L), kGradTol);
  check_close("layernorm dweight (+=)", minus(download_f32_vec(be.get(), dw.get(), C), dw.val),
              ref::central_fd(wv, L), kGradTol);
  check_close("layernorm dbias (+=)", minus(download_f32_vec(be.get(), db.get(), C), db.val),
              ref::central_fd(bv, L), kGradTol);
}

TEST_CASE("cpu_ops: linear + GELU forward and the fused dGELU backward", "[cpu_ops]") {
  auto be = make_backend();
  const int N = 6, C = 11, OC = 16;
  const size_t es = dtype_size(be->act_dtype());
  ActTensor x(be.get(), randn(size_t(N) * C, 101)), w(be.get(), randn(size_t(OC) * C, 102, 0.4));
  ActTensor bias(be.get(), randn(OC, 103, 0.5));
  DeviceBuffer out(be.get(), size_t(N) * OC * es), pre(be.get(), size_t(N) * OC * es);
  be->matmul_gelu_forward(out.get(), pre.get(), x.get(), w.get(), bias.get(), N, C, OC);
  const Vec want_pre = ref::linear(x.val, w.val, bias.val, N, C, OC);
  check_close("linear+gelu pre", download_act_vec(be.get(), pre.get(), want_pre.size()), want_pre, kFwdTol);
  check_close("linear+gelu out", download_act_vec(be.get(), out.get(), want_pre.size()), ref::gelu(want_pre), kFwdTol);

  // Backward of y = gelu(h) @ W2^T + b2 w.r.t. h, W2, b2, with h = pre.
  const int OC2 = 5;
  ActTensor h(be.get(), randn(size_t(N) * OC, 104, 1.5));
  ActTensor w2(be.get(), randn(size_t(OC2) * OC, 105, 0.4)), b2(be.get(), randn(OC2, 106));
  ActTensor R(be.get(), randn(size_t(N) * OC2, 107));
  DeviceBuffer gh(be.get(), size_t(N) * OC * es);
  ActTensor g_in(be.get(), ref::gelu(h.val));  // the layer's input, gelu(h), as the model keeps it
  ActTensor dh(be.get(), randn(size_t(N) * OC, 108));  // pre-filled: must be overwritten
  F32Tensor dw2(be.get(), randn(size_t(OC2) * OC, 109)), db2(be.get(), randn(OC2, 110));  // +=
  be->matmul_backward_dgelu(dh.get(), dw2.get(), db2.get(), R.get(), g_in.get(), w2.get(), h.get(), N, OC, OC2);
  Vec hv = h.val, wv = w2.val, bv = b2.val;
  auto L = [&] { return ref::dot(ref::linear(ref::gelu(hv), wv, bv, N, OC, OC2), R.val); };
  check_close("dgelu dinp (overwrite)", download_act_vec(be.get(), dh.get(), hv.size()), ref::central_fd(hv, L),
              kGradTol);
  check_close("dgelu dweight (+=)", minus(download_f32_vec(be.get(), dw2.get(), wv.size()), dw2.val),
              ref::central_fd(wv, L), kGradTol);
  check_close("dgelu dbias (+=)", minus(download_f32_vec(be.get(), db2.get(), OC2), db2.val), ref::central_fd(bv, L),
              kGradTol);
}

TEST_CASE("cpu_ops: fused residual + layernorm forward equals the two ops", "[cpu_ops]") {
  auto be = make_backend();
  for (auto [N, C] : {std::pair<int, int>{1, 1}, {7, 13}, {19, 111}, {5, 768}}) {
    const size_t n = size_t(N) * C, es = dtype_size(be->act_dtype());
    ActTensor a(be.get(), randn(n, 31, 2.0, 1.0)), b(be.get(), randn(n, 32, 0.5, -2.0));
    ActTensor w(be.get(), randn(C, 33, 0.3, 1.0)), bias(be.get(), randn(C, 34, 0.3));
    DeviceBuffer res(be.get(), n * es), out(be.get(), n * es), mean(be.get(), N * 4), rstd(be.get(), N * 4);
    be->residual_layernorm_forward(res.get(), out.get(), mean.as<float>(), rstd.as<float>(), a.get(), b.get(),
                                   w.get(), bias.get(), N, C);
    // Reference: the two separate ops (bit-identical on the CPU) ...
    DeviceBuffer res2(be.get(), n * es), out2(be.get(), n * es), mean2(be.get(), N * 4), rstd2(be.get(), N * 4);
    be->residual_forward(res2.get(), a.get(), b.get(), int64_t(n));
    be->layernorm_forward(out2.get(), mean2.as<float>(), rstd2.as<float>(), res2.get(), w.get(), bias.get(), N, C);
    CHECK(download_act_vec(be.get(), res.get(), n) == download_act_vec(be.get(), res2.get(), n));
    CHECK(download_act_vec(be.get(), out.get(), n) == download_act_vec(be.get(), out2.get(), n));
    CHECK(download_f32_vec(be.get(), mean.get(), N) == download_f32_vec(be.get(), mean2.get(), N));
    CHECK(download_f32_vec(be.get(), rstd.get(), N) == download_f32_vec(be.get(), rstd2.get(), N));
    // ... and the double-precision definition.
    Vec sum(n);
    for (size_t i = 0; i < n; ++i) sum[i] = a.val[i] + b.val[i];
    check_close("fused residual", download_act_vec(be.get(), res.get(), n), sum, kFwdTol);
    Vec rmean, rrstd;
    Vec want = ref::layernorm(sum, w.val, bias.val, N, C, &rmean, &rrstd);
    check_close("fused layernorm out", download_act_vec(be.get(), out.get(), n), want, kFwdTol);
    check_close("fused layernorm mean", download_f32_vec(be.get(), mean.get(), N), rmean, kFwdTol);
  }
}

TEST_CASE("cpu_ops: matmul forward and backward (dinp overwritten, dweight/dbias +=)", "[cpu_ops]") {
  auto be = make_backend();
  const int N = 7, C = 13, OC = 11;
  const size_t es = dtype_size(be->act_dtype());
  ActTensor x(be.get(), randn(size_t(N) * C, 31));
  ActTensor W(be.get(), randn(size_t(OC) * C, 32, 0.5));
  ActTensor bias(be.get(), randn(OC, 33));
  DeviceBuffer out(be.get(), size_t(N) * OC * es);

  SECTION("forward with and without bias") {
    be->matmul_forward(out.get(), x.get(), W.get(), bias.get(), N, C, OC);
    Vec want = ref::linear(x.val, W.val, bias.val, N, C, OC);
    check_close("matmul fwd (bias)", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);
    // Without bias the output must not keep anything from before: fill it first.
    ActTensor junk(be.get(), randn(size_t(N) * OC, 34));
    be->matmul_forward(junk.get(), x.get(), W.get(), nullptr, N, C, OC);
    want = ref::linear(x.val, W.val, Vec(), N, C, OC);
    check_close("matmul fwd (no bias, over junk)", download_act_vec(be.get(), junk.get(), want.size()), want,
                kFwdTol);
  }

  SECTION("backward") {
    ActTensor R(be.get(), randn(size_t(N) * OC, 35));
    ActTensor dinp(be.get(), randn(size_t(N) * C, 36, 1.0, 5.0));  // pre-filled: must be overwritten
    F32Tensor dW(be.get(), randn(size_t(OC) * C, 37));             // pre-filled: +=
    F32Tensor db(be.get(), randn(OC, 38));                         // pre-filled: +=
    be->matmul_backward(dinp.get(), dW.get(), db.get(), R.get(), x.get(), W.get(), N, C, OC);

    Vec xv = x.val, Wv = W.val, bv = bias.val;
    auto L = [&] { return ref::dot(ref::linear(xv, Wv, bv, N, C, OC), R.val); };
    const Vec gW = ref::central_fd(Wv, L);
    check_close("matmul dinp (overwrite)", download_act_vec(be.get(), dinp.get(), xv.size()),
                ref::central_fd(xv, L), kGradTol);
    check_close("matmul dweight (+=)", minus(download_f32_vec(be.get(), dW.get(), Wv.size()), dW.val), gW,
                kGradTol);
    check_close("matmul dbias (+=)", minus(download_f32_vec(be.get(), db.get(), OC), db.val),
                ref::central_fd(bv, L), kGradTol);

    // Null dinp and dbias are skipped; dweight still accumulates.
    F32Tensor dW2(be.get(), randn(size_t(OC) * C, 39));
    be->matmul_backward(nullptr, dW2.get(), nullptr, R.get(), x.get(), W.get(), N, C, OC);
    check_close("matmul dweight (+=, null dinp/dbias)",
                minus(download_f32_vec(be.get(), dW2.get(), Wv.size()), dW2.val), gW, kGradTol);
  }
}

TEST_CASE("cpu_ops: matmul backward with OC = 0 (an all-padding vocab shard) zeroes dinp and touches nothing else",
          "[cpu_ops][tp]") {
  auto be = make_backend();
  const int N = 5, C = 7;
  ActTensor x(be.get(), randn(size_t(N) * C, 41));
  ActTensor dinp(be.get(), randn(size_t(N) * C, 42, 1.0, 5.0));  // pre-filled: must be overwritten with 0
  // OC = 0: dout, weight, dweight and dbias have no elements; one float
  // each, to see that nothing is written there.
  F32Tensor dW(be.get(), Vec{3.0f}), db(be.get(), Vec{4.0f});
  ActTensor dout(be.get(), Vec{5.0f}), W(be.get(), Vec{6.0f});
  be->matmul_backward(dinp.get(), dW.get(), db.get(), dout.get(), x.get(), W.get(), N, C, 0);
  CHECK(download_act_vec(be.get(), dinp.get(), size_t(N) * C) == Vec(size_t(N) * C, 0.0f));
  CHECK(download_f32_vec(be.get(), dW.get(), 1) == Vec{3.0f});
  CHECK(download_f32_vec(be.get(), db.get(), 1) == Vec{4.0f});
  // The fused dGELU variant (the MLP's) likewise: 0 * gelu'(pre) = 0.
  ActTensor dinp2(be.get(), randn(size_t(N) * C, 43, 1.0, 5.0));
  be->matmul_backward_dgelu(dinp2.get(), dW.get(), nullptr, dout.get(), x.get(), W.get(), x.get(), N, C, 0);
  CHECK(download_act_vec(be.get(), dinp2.get(), size_t(N) * C) == Vec(size_t(N) * C, 0.0f));
}

TEST_CASE("cpu_ops: attention forward and backward (dqkv overwritten)", "[cpu_ops]") {
  auto be = make_backend();
  const int B = 2, T = 5, C = 12, NH = 3;
  const size_t es = dtype_size(be->act_dtype());
  // std 1 for q and k gives scores of std ~1 after the 1/sqrt(HS) scaling:
  // softmax rows far from uniform and far from one-hot.
  ActTensor qkv(be.get(), randn(size_t(B) * T * 3 * C, 41));
  DeviceBuffer out(be.get(), size_t(B) * T * C * es);
  DeviceBuffer saved(be.get(), be->attention_saved_floats(B, T, NH) * 4);
  be->attention_forward(out.get(), saved.as<float>(), qkv.get(), B, T, C, NH);
  Vec want = ref::attention(qkv.val, B, T, C, NH);
  check_close("attention fwd", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);

  ActTensor R(be.get(), randn(size_t(B) * T * C, 42));
  ActTensor dqkv(be.get(), randn(qkv.val.size(), 43, 1.0, -3.0));  // pre-filled: must be overwritten
  be->attention_backward(dqkv.get(), R.get(), qkv.get(), out.get(), saved.as<float>(), B, T, C, NH);
  Vec qv = qkv.val;
  auto L = [&] { return ref::dot(ref::attention(qv, B, T, C, NH), R.val); };
  const Vec g = ref::central_fd(qv, L);
  const Vec got = download_act_vec(be.get(), dqkv.get(), qv.size());
  check_close("attention dqkv (overwrite)", got, g, kGradTol);
  // Per part, so a bug confined to dq, dk or dv is named (dk is the smallest).
  for (int part = 0; part < 3; ++part) {
    Vec gp, wp;
    for (int bt = 0; bt < B * T; ++bt)
      for (int c = 0; c < C; ++c) {
        gp.push_back(got[size_t(bt) * 3 * C + part * C + c]);
        wp.push_back(g[size_t(bt) * 3 * C + part * C + c]);
      }
    check_close(std::string("attention d") + "qkv"[part], gp, wp, kGradTol);
  }
}

TEST_CASE("cpu_ops: attention_kv_forward appends to the cache and matches causal attention", "[cpu_ops]") {
  auto be = make_backend();
  // One sequence of T tokens fed as a prefill of P, then Tq-sized pieces and
  // single tokens; every piece's rows must equal the full causal attention's
  // rows at those positions, and the cache must hold every token's k and v.
  const int T = 11, C = 12, NH = 3, cap = 13;
  const size_t es = dtype_size(be->act_dtype());
  ActTensor qkv(be.get(), randn(size_t(T) * 3 * C, 61));
  const Vec want = ref::attention(qkv.val, 1, T, C, NH);
  DeviceBuffer kc(be.get(), size_t(cap) * C * es), vc(be.get(), size_t(cap) * C * es);
  DeviceBuffer out(be.get(), size_t(T) * C * es);
  Vec got;
  for (const auto& [pos, n] : std::vector<std::pair<int, int>>{{0, 4}, {4, 1}, {5, 3}, {8, 1}, {9, 2}}) {
    const char* q = static_cast<const char*>(qkv.get()) + size_t(pos) * 3 * C * es;
    be->attention_kv_forward(out.get(), kc.get(), vc.get(), q, pos, n, C, NH);
    const Vec rows = download_act_vec(be.get(), out.get(), size_t(n) * C);
    got.insert(got.end(), rows.begin(), rows.end());
  }
  check_close("attention_kv_forward rows", got, want, kFwdTol);
  const Vec k = download_act_vec(be.get(), kc.get(), size_t(T) * C), v = download_act_vec(be.get(), vc.get(), size_t(T) * C);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      INFO("position " << t << " channel " << c);
      REQUIRE(float(k[size_t(t) * C + c]) == float(qkv.val[size_t(t) * 3 * C + C + c]));
      REQUIRE(float(v[size_t(t) * C + c]) == float(qkv.val[size_t(t) * 3 * C + 2 * C + c]));
    }
}

TEST_CASE("cpu_ops: gelu forward and backward (overwrite, dinp may alias dout)", "[cpu_ops]") {
  auto be = make_backend();
  const int n = 61;
  // std 2.5 reaches the tails where tanh saturates and the cubic term matters.
  ActTensor x(be.get(), randn(n, 51, 2.5));
  DeviceBuffer out(be.get(), n * dtype_size(be->act_dtype()));
  be->gelu_forward(out.get(), x.get(), n);
  Vec want = ref::gelu(x.val);
  check_close("gelu fwd", download_act_vec(be.get(), out.get(), n), want, kFwdTol);

  ActTensor R(be.get(), randn(n, 52));
  Vec xv = x.val;
  const Vec g = ref::central_fd(xv, [&] { return ref::dot(ref::gelu(xv), R.val); });

  ActTensor dinp(be.get(), randn(n, 53, 1.0, 4.0));  // pre-filled: must be overwritten
  be->gelu_backward(dinp.get(), x.get(), R.get(), n);
  check_close("gelu dinp (overwrite)", download_act_vec(be.get(), dinp.get(), n), g, kGradTol);

  ActTensor inplace(be.get(), R.val);  // dinp == dout
  be->gelu_backward(inplace.get(), x.get(), inplace.get(), n);
  check_close("gelu dinp (aliasing dout)", download_act_vec(be.get(), inplace.get(), n), g, kGradTol);
}

TEST_CASE("cpu_ops: residual forward", "[cpu_ops]") {
  auto be = make_backend();
  const int n = 61;
  ActTensor a(be.get(), randn(n, 61)), b(be.get(), randn(n, 62));
  ActTensor out(be.get(), randn(n, 63));  // junk that must be replaced
  be->residual_forward(out.get(), a.get(), b.get(), n);
  check_close("residual fwd", download_act_vec(be.get(), out.get(), n), ref::residual(a.val, b.val), kFwdTol);
  // Gradient: residual has no backward op — d(a+b)/da = d(a+b)/db = dout, so
  // the model passes dout on to both branches (exercised by test_model_grad).
}

TEST_CASE("cpu_ops: softmax cross-entropy losses and dlogits", "[cpu_ops]") {
  auto be = make_backend();
  const int N = 7, V = 37;
  const float scale = 0.37f;  // dloss_scale != 1
  Vec z = randn(size_t(N) * V, 71, 2.0);
  // Row 2 shifted by +100: exp() of the raw logits would overflow fp32, so
  // this row only comes out right with a max-subtracted softmax.
  for (int v = 0; v < V; ++v) z[2 * V + v] += 100.0;
  Tokens tgt = rand_tokens(N, V, 72);
  tgt[4] = -1;  // ignored: loss 0 and zero gradient row
  DeviceBuffer dtgt = upload_i32(be.get(), tgt);
  ActTensor logits(be.get(), z);
  const Vec want_loss = ref::cross_entropy(logits.val, tgt, N, V);

  Vec zv = logits.val;
  const Vec g = ref::central_fd(zv, [&] {
    Vec l = ref::cross_entropy(zv, tgt, N, V);
    double s = 0.0;
    for (double x : l) s += double(scale) * x;
    return s;
  });

  SECTION("losses only: logits untouched") {
    DeviceBuffer losses(be.get(), N * 4);
    be->softmax_cross_entropy(losses.as<float>(), nullptr, logits.get(), dtgt.as<int32_t>(), N, V, V, scale);
    Vec got = download_f32_vec(be.get(), losses.get(), N);
    check_close("xent losses", got, want_loss, kFwdTol);
    CHECK(got[4] == 0.0);
    CHECK(download_act_vec(be.get(), logits.get(), zv.size()) == logits.val);
  }
  SECTION("separate dlogits buffer (overwritten)") {
    F32Tensor losses(be.get(), randn(N, 73));  // junk
    ActTensor dlogits(be.get(), randn(zv.size(), 74, 1.0, 2.0));
    be->softmax_cross_entropy(losses.get(), dlogits.get(), logits.get(), dtgt.as<int32_t>(), N, V, V, scale);
    check_close("xent losses (with dlogits)", download_f32_vec(be.get(), losses.get(), N), want_loss, kFwdTol);
    Vec got = download_act_vec(be.get(), dlogits.get(), zv.size());
    check_close("xent dlogits (scale 0.37)", got, g, kGradTol);
    for (int v = 0; v < V; ++v) CHECK(got[4 * V + v] == 0.0);
    CHECK(download_act_vec(be.get(), logits.get(), zv.size()) == logits.val);
  }
  SECTION("dlogits aliasing logits") {
    F32Tensor losses(be.get(), randn(N, 75));
    ActTensor inplace(be.get(), logits.val);
    be->softmax_cross_entropy(losses.get(), inplace.get(), inplace.get(), dtgt.as<int32_t>(), N, V, V, scale);
    check_close("xent losses (aliased)", download_f32_vec(be.get(), losses.get(), N), want_loss, kFwdTol);
    Vec got = download_act_vec(be.get(), inplace.get(), zv.size());
    check_close("xent dlogits (aliased)", got, g, kGradTol);
    for (int v = 0; v < V; ++v) CHECK(got[4 * V + v] == 0.0);
  }
  SECTION("rows padded to ldv > V: same values, pad columns untouched") {
    const int ldv = V + 5;
    Vec zp(size_t(N) * ldv, 12345.0);  // the pad holds a sentinel that must survive
    for (int n = 0; n < N; ++n)
      for (int v = 0; v < V; ++v) zp[size_t(n) * ldv + v] = logits.val[size_t(n) * V + v];
    ActTensor padded(be.get(), zp);
    F32Tensor losses(be.get(), randn(N, 76));
    be->softmax_cross_entropy(losses.get(), padded.get(), padded.get(), dtgt.as<int32_t>(), N, V, ldv, scale);
    check_close("xent losses (padded rows)", download_f32_vec(be.get(), losses.get(), N), want_loss, kFwdTol);
    Vec got = download_act_vec(be.get(), padded.get(), zp.size());
    Vec body;
    for (int n = 0; n < N; ++n) {
      for (int v = 0; v < V; ++v) body.push_back(got[size_t(n) * ldv + v]);
      for (int v = V; v < ldv; ++v) CHECK(got[size_t(n) * ldv + v] == 12345.0);
    }
    check_close("xent dlogits (padded rows)", body, g, kGradTol);
  }
}

TEST_CASE("cpu_ops: lm head over padded logits rows equals the plain matmul", "[cpu_ops]") {
  auto be = make_backend();
  const int N = 9, C = 13, V = 37, ldv = 48;
  ActTensor x(be.get(), randn(size_t(N) * C, 91)), wte(be.get(), randn(size_t(V) * C, 92, 0.5));
  const size_t es = dtype_size(be->act_dtype());
  // Forward: the V columns equal matmul_forward's; the pad keeps its sentinel.
  ActTensor logits(be.get(), Vec(size_t(N) * ldv, -777.0));
  DeviceBuffer plain(be.get(), size_t(N) * V * es);
  be->lm_head_forward(logits.get(), x.get(), wte.get(), N, C, V, ldv);
  be->matmul_forward(plain.get(), x.get(), wte.get(), nullptr, N, C, V);
  const Vec got = download_act_vec(be.get(), logits.get(), size_t(N) * ldv);
  const Vec want = download_act_vec(be.get(), plain.get(), size_t(N) * V);
  Vec body;
  for (int n = 0; n < N; ++n) {
    for (int v = 0; v < V; ++v) body.push_back(got[size_t(n) * ldv + v]);
    for (int v = V; v < ldv; ++v) CHECK(got[size_t(n) * ldv + v] == -777.0);
  }
  check_close("lm head forward (padded rows)", body, want, 1e-6);
  // Backward: NaN in the pad columns must never reach dinp or dwte.
  Vec dl = randn(size_t(N) * ldv, 93);
  Vec dl_plain;
  for (int n = 0; n < N; ++n) {
    for (int v = 0; v < V; ++v) dl_plain.push_back(dl[size_t(n) * ldv + v]);
    for (int v = V; v < ldv; ++v) dl[size_t(n) * ldv + v] = NAN;
  }
  ActTensor dlog(be.get(), dl), dlog_plain(be.get(), dl_plain);
  DeviceBuffer dinp(be.get(), size_t(N) * C * es), dinp2(be.get(), size_t(N) * C * es);
  F32Tensor dw(be.get(), randn(size_t(V) * C, 94)), dw2(be.get(), dw.val);  // += : pre-filled
  be->lm_head_backward(dinp.get(), dw.get(), dlog.get(), x.get(), wte.get(), N, C, V, ldv);
  be->matmul_backward(dinp2.get(), dw2.get(), nullptr, dlog_plain.get(), x.get(), wte.get(), N, C, V);
  check_close("lm head dinp (padded rows)", download_act_vec(be.get(), dinp.get(), size_t(N) * C),
              download_act_vec(be.get(), dinp2.get(), size_t(N) * C), 1e-6);
  check_close("lm head dwte += (padded rows)", download_f32_vec(be.get(), dw.get(), size_t(V) * C),
              download_f32_vec(be.get(), dw2.get(), size_t(V) * C), 1e-6);
}

TEST_CASE("cpu_ops: sum_squares and sum accumulate into their output, and scale", "[cpu_ops]") {
  auto be = make_backend();
  const int n = 10007;
  F32Tensor x(be.get(), randn(n, 81));
  F32Tensor out(be.get(), Vec{1.5});  // +=: the running total of the other ranges
  be->sum_squares(out.get(), x.get(), n);
  double want = 1.5;
  for (double v : x.val) want += v * v;
  // fp32 result of a double-accumulated sum: one final rounding (~6e-8).
  check_close("sum_squares", download_f32_vec(be.get(), out.get(), 1), Vec{want}, 1e-6);

  // sum: the trainer's on-device loss total; += across micro-batches.
  F32Tensor total(be.get(), Vec{-2.25});
  be->sum(total.get(), x.get(), n);
  be->sum(total.get(), x.get(), 17);
  double want_sum = -2.25;
  for (double v : x.val) want_sum += v;
  for (int i = 0; i < 17; ++i) want_sum += x.val[i];
  CHECK(std::abs(download_f32_vec(be.get(), total.get(), 1)[0] - want_sum) < 1e-4);

  F32Tensor y(be.get(), randn(61, 82));
  be->scale(y.get(), -0.3f, 61);
  Vec wy(61);
  for (int i = 0; i < 61; ++i) wy[i] = y.val[i] * double(-0.3f);
  check_close("scale", download_f32_vec(be.get(), y.get(), 61), wy, 1e-7);
}

namespace {
struct AdamArgs {
  float lr, beta1, beta2, eps, wd, grad_scale;
  int step;
};
// The AdamW step written out from its definition (Loshchilov & Hutter), in
// double: decoupled weight decay on the old weights, bias-corrected moments.
void adamw_ref(Vec& w, Vec& m, Vec& v, const Vec& grad, const AdamArgs& a) {
  const double bc1 = 1.0 - std::pow(double(a.beta1), a.step);
  const double bc2 = 1.0 - std::pow(double(a.beta2), a.step);
  for (size_t i = 0; i < w.size(); ++i) {
    const double g = grad[i] * double(a.grad_scale);
    m[i] = double(a.beta1) * m[i] + (1.0 - double(a.beta1)) * g;
    v[i] = double(a.beta2) * v[i] + (1.0 - double(a.beta2)) * g * g;
    const double mhat = m[i] / bc1, vhat = v[i] / bc2;
    w[i] -= double(a.lr) * (mhat / (std::sqrt(vhat) + double(a.eps)) + double(a.wd) * w[i]);
  }
}
}  // namespace

TEST_CASE("cpu_ops: adamw_update against a double AdamW step", "[cpu_ops]") {
  auto be = make_backend();
  const int n = 101;
  struct Case {
    const char* name;
    AdamArgs a;
    bool fresh;      // m = v = 0 (first step)
    bool aliased;    // param == master (allowed on fp32 backends)
  };
  // A large lr so the update is big next to the fp32 rounding of w itself;
  // the weight update (w_new - w_old) is what gets compared.
  const Case cases[] = {
      {"step 1, fresh moments", {0.05f, 0.9f, 0.999f, 1e-8f, 0.1f, 1.0f, 1}, true, false},
      {"step 7, clipped grads, separate param", {0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 7}, false, false},
      {"step 7, param aliasing master", {0.05f, 0.8f, 0.95f, 1e-6f, 0.0f, 0.25f, 7}, false, true},
  };
  for (const Case& c : cases) {
    if (c.aliased && be->act_dtype() != DType::F32) continue;
    INFO(c.name);
    std::printf(" adamw: %s\n", c.name);
    F32Tensor master(be.get(), randn(n, 91));
    F32Tensor grad(be.get(), randn(n, 92));
    Vec m0 = c.fresh ? Vec(n, 0.0) : randn(n, 93, 0.1);
    Vec v0(n, 0.0);
    if (!c.fresh) {
      Vec r = randn(n, 94);
      for (int i = 0; i < n; ++i) v0[i] = 0.01 * (0.1 + r[i] * r[i]);
    }
    F32Tensor m(be.get(), m0), v(be.get(), v0);
    DeviceBuffer param_buf(be.get(), n * dtype_size(be->act_dtype()));
    void* param = c.aliased ? static_cast<void*>(master.get()) : param_buf.get();
    be->adamw_update(master.get(), param, grad.get(), m.get(), v.get(), n, c.a.lr, c.a.beta1, c.a.beta2,
                     c.a.eps, c.a.wd, c.a.step, c.a.grad_scale);

    Vec w = master.val, mr = m.val, vr = v.val;
    adamw_ref(w, mr, vr, grad.val, c.a);
    const Vec w_new = download_f32_vec(be.get(), master.get(), n);
    check_close("adamw m", download_f32_vec(be.get(), m.get(), n), mr, 1e-6);
    check_close("adamw v", download_f32_vec(be.get(), v.get(), n), vr, 1e-6);
    check_close("adamw weight update", minus(w_new, master.val), minus(w, master.val), kFwdTol);
    check_close("adamw weights", w_new, w, 1e-6);
    if (!c.aliased) {
      // param receives the new weights in the act dtype.
      Vec expect(n);
      {
        ActTensor cast(be.get(), w_new);
        expect = cast.val;
      }
      CHECK(download_act_vec(be.get(), param, n) == expect);
    }
  }
}

TEST_CASE("cpu_ops: attention_backward and layernorm_backward are bit-reproducible", "[cpu_ops]") {
  auto be = make_backend();
  // Large enough that every thread gets work and the reductions are split.
  const int B = 3, T = 33, C = 48, NH = 4, N = B * T;
  const size_t es = dtype_size(be->act_dtype());

  ActTensor qkv(be.get(), randn(size_t(N) * 3 * C, 101));
  ActTensor dout(be.get(), randn(size_t(N) * C, 102));
  DeviceBuffer out(be.get(), size_t(N) * C * es);
  DeviceBuffer saved(be.get(), be->attention_saved_floats(B, T, NH) * 4);
  be->attention_forward(out.get(), saved.as<float>(), qkv.get(), B, T, C, NH);
  DeviceBuffer d1(be.get(), size_t(N) * 3 * C * es), d2(be.get(), size_t(N) * 3 * C * es);
  be->attention_backward(d1.get(), dout.get(), qkv.get(), out.get(), saved.as<float>(), B, T, C, NH);
  be->attention_backward(d2.get(), dout.get(), qkv.get(), out.get(), saved.as<float>(), B, T, C, NH);
  CHECK(same_bits(be.get(), d1.get(), d2.get(), d1.bytes()));

  ActTensor x(be.get(), randn(size_t(N) * C, 103, 1.5, 0.5));
  ActTensor w(be.get(), randn(C, 104, 0.2, 1.0));
  ActTensor b(be.get(), randn(C, 105, 0.2));
  DeviceBuffer y(be.get(), size_t(N) * C * es), mean(be.get(), N * 4), rstd(be.get(), N * 4);
  be->layernorm_forward(y.get(), mean.as<float>(), rstd.as<float>(), x.get(), w.get(), b.get(), N, C);
  // Identical starting contents (zero) in both runs, since the op accumulates.
  DeviceBuffer dx1(be.get(), size_t(N) * C * es), dx2(be.get(), size_t(N) * C * es);
  DeviceBuffer dw1(be.get(), C * 4), dw2(be.get(), C * 4), db1(be.get(), C * 4), db2(be.get(), C * 4);
  be->layernorm_backward(dx1.get(), dw1.as<float>(), db1.as<float>(), dout.get(), x.get(), w.get(),
                         mean.as<float>(), rstd.as<float>(), N, C);
  be->layernorm_backward(dx2.get(), dw2.as<float>(), db2.as<float>(), dout.get(), x.get(), w.get(),
                         mean.as<float>(), rstd.as<float>(), N, C);
  CHECK(same_bits(be.get(), dx1.get(), dx2.get(), dx1.bytes()));
  CHECK(same_bits(be.get(), dw1.get(), dw2.get(), dw1.bytes()));
  CHECK(same_bits(be.get(), db1.get(), db2.get(), db1.bytes()));
}
