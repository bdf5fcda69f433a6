// The Llama ops of the CPU backend (RMSNorm, RoPE and its table, SwiGLU,
// grouped-query attention and its KV-cached form), checked the way
// tests/test_cpu_ops.cpp checks the GPT-2 ops:
//  - forward outputs against the double-precision references
//    (tests/support/reference_ops.h);
//  - backward outputs against central finite differences of the reference
//    forward of L = sum(out * R), R being the `dout` handed to the backward;
//  - the gradient contract of kernels/backend.h with pre-filled gradient
//    buffers (+= comes out as prefill + grad, overwrite as grad);
//  - the determinism the backend promises (GQA backward across runs and
//    thread counts);
// and, in the [hf] cases, against the transformers modules themselves
// (scripts/reference/hf_llama_ops.py through the repo's .venv): the llama3
// rope_scaling frequencies, LlamaRotaryEmbedding's cos/sin, LlamaRMSNorm,
// LlamaMLP and LlamaAttention (RoPE + repeat_kv + causal softmax), so the
// conventions (rotate_half pairing, head grouping, layouts) are HF's and not
// just self-consistent.
//
// Error metric: norm-wise relative error (ref::rel_err). Sizes are odd: N=7,
// C=13, F=13, T=5, HS=6 (HS/2 = 3) with NH/NKV = 6/2, 4/4, 4/1, pos0 > 0.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "kernels/backend.h"
#include "kernels/rope_table.h"
#include "tests/support/device_io.h"
#include "tests/support/op_test_util.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using ref::Vec;
using namespace trainrun::test;
using json = nlohmann::json;

namespace {

// As tests/test_cpu_ops.cpp (helpers shared in tests/support/op_test_util.h):
// fp32 forward against double ~1e-7, analytic fp32 gradients against double FD ~1e-6.
constexpr double kFwdTol = 1e-5;
constexpr double kGradTol = 1e-4;

std::unique_ptr<Backend> make_backend() { return make_cpu_backend(2); }

std::vector<unsigned char> bytes_of(Backend* be, const void* p, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  be->copy_to_host(h.data(), p, bytes);
  be->synchronize();
  return h;
}

// Plain RoPE frequencies straight from the definition, independent of kernels/rope_table.
Vec plain_inv_freq(int HS, double theta) {
  Vec f(HS / 2);
  for (int i = 0; i < HS / 2; ++i) f[i] = std::pow(theta, -2.0 * i / HS);
  return f;
}

Vec slice(const Vec& v, size_t a, size_t b) { return Vec(v.begin() + a, v.begin() + b); }

// The columns [c0, c0 + w) of every row of a (rows, ld) matrix: one part of qkv.
Vec columns(const Vec& m, size_t ld, size_t c0, size_t w) {
  Vec r;
  for (size_t row = 0; row < m.size() / ld; ++row)
    r.insert(r.end(), m.begin() + row * ld + c0, m.begin() + row * ld + c0 + w);
  return r;
}

struct Heads {
  int NH, NKV, HS;
  int ld() const { return (NH + 2 * NKV) * HS; }
};
const Heads kHeadCases[] = {{6, 2, 6}, {4, 4, 6}, {4, 1, 6}};

}  // namespace

// ---- the interface's defaults ----------------------------------------------------------

namespace {
// A backend that implements only what Backend requires: the Llama ops fall
// back to the interface's defaults, which must name the op and the backend.
struct BareBackend final : Backend {
  std::string name() const override { return "bare"; }
  DType act_dtype() const override { return DType::F32; }
  void* alloc(size_t) override { return nullptr; }
  void free(void*) override {}
  void copy_to_device(void*, const void*, size_t) override {}
  void copy_to_host(void*, const void*, size_t) override {}
  void copy_device(void*, const void*, size_t) override {}
  void zero(void*, size_t) override {}
  void synchronize() override {}
  size_t bytes_in_use() const override { return 0; }
  size_t peak_bytes() const override { return 0; }
  void reset_peak() override {}
  void cast_from_f32(void*, const float*, int64_t) override {}
  void cast_to_f32(float*, const void*, int64_t) override {}
  void encoder_forward(void*, const int32_t*, const void*, const void*, int, int, int, const int32_t*) override {}
  void encoder_backward(float*, float*, const void*, const int32_t*, int, int, int, const int32_t*) override {}
  void layernorm_forward(void*, float*, float*, const void*, const void*, const void*, int, int) override {}
  void residual_layernorm_forward(void*, void*, float*, float*, const void*, const void*, const void*, const void*,
                                  int, int) override {}
  void layernorm_backward(void*, float*, float*, const void*, const void*, const void*, const float*, const float*,
                          int, int) override {}
  void matmul_forward(void*, const void*, const void*, const void*, int, int, int) override {}
  void matmul_backward(void*, float*, float*, const void*, const void*, const void*, int, int, int) override {}
  void matmul_gelu_forward(void*, void*, const void*, const void*, const void*, int, int, int) override {}
  void matmul_backward_dgelu(void*, float*, float*, const void*, const void*, const void*, const void*, int, int,
                             int) override {}
  void lm_head_forward(void*, const void*, const void*, int, int, int, int) override {}
  void lm_head_backward(void*, float*, const void*, const void*, const void*, int, int, int, int) override {}
  size_t attention_saved_floats(int, int, int) const override { return 0; }
  void attention_forward(void*, float*, const void*, int, int, int, int, const int32_t*) override {}
  void attention_backward(void*, const void*, const void*, const void*, const float*, int, int, int, int,
                          const int32_t*) override {}
  void attention_kv_forward(void*, void*, void*, const void*, int, int, int, int) override {}
  void gelu_forward(void*, const void*, int64_t) override {}
  void gelu_backward(void*, const void*, const void*, int64_t) override {}
  void residual_forward(void*, const void*, const void*, int64_t) override {}
  void softmax_cross_entropy(float*, void*, const void*, const int32_t*, int, int, int, float, float) override {}
  void sum_squares(float*, const float*, int64_t) override {}
  void sum(float*, const float*, int64_t) override {}
  void scale(float*, float, int64_t) override {}
  void accumulate(float*, const float*, int64_t) override {}
  void adamw_update(float*, void*, const float*, float*, float*, int64_t, float, float, float, float, float, int,
                    float) override {}
};
}  // namespace

TEST_CASE("llama_ops: a backend without the Llama ops throws an error naming the op and the backend",
          "[cpu_ops][llama]") {
  BareBackend be;
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(be.rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, 1, 1, 1e-5f),
                    Contains("rmsnorm_forward: not implemented by the bare backend"));
  CHECK_THROWS_WITH(be.residual_rmsnorm_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 1e-5f),
                    Contains("residual_rmsnorm_forward: not implemented by the bare backend"));
  CHECK_THROWS_WITH(be.rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1),
                    Contains("rmsnorm_backward: not implemented by the bare backend"));
  CHECK_THROWS_WITH(be.rope_forward(nullptr, nullptr, 1, 1, 1, 1, 2, 0),
                    Contains("rope_forward: not implemented by the bare backend"));
  CHECK_THROWS_WITH(be.rope_backward(nullptr, nullptr, 1, 1, 1, 1, 2, 0),
                    Contains("rope_backward: not implemented by the bare backend"));
  CHECK_THROWS_WITH(be.swiglu_forward(nullptr, nullptr, 1, 1), Contains("swiglu_forward: not implemented"));
  CHECK_THROWS_WITH(be.swiglu_backward(nullptr, nullptr, nullptr, 1, 1), Contains("swiglu_backward: not implemented"));
  CHECK_THROWS_WITH(be.attention_gqa_saved_floats(1, 1, 1), Contains("attention_gqa_saved_floats: not implemented"));
  CHECK_THROWS_WITH(be.attention_gqa_forward(nullptr, nullptr, nullptr, 1, 1, 1, 1, 1),
                    Contains("attention_gqa_forward: not implemented"));
  CHECK_THROWS_WITH(be.attention_gqa_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, 1, 1),
                    Contains("attention_gqa_backward: not implemented"));
  CHECK_THROWS_WITH(be.attention_kv_gqa_forward(nullptr, nullptr, nullptr, nullptr, 0, 1, 1, 1, 1),
                    Contains("attention_kv_gqa_forward: not implemented"));
  CHECK_THROWS_AS(be.rope_forward(nullptr, nullptr, 1, 1, 1, 1, 2, 0), Error);
}

// ---- RMSNorm ------------------------------------------------------------------------------

TEST_CASE("llama_ops: rmsnorm forward and backward (+= into dinp and dweight)", "[cpu_ops][llama]") {
  auto be = make_backend();
  const int N = 7, C = 13;
  const float eps = 1e-5f;
  // Nonzero mean (RMSNorm must not centre), and the last two rows tiny
  // (|x| ~ 1e-3, mean(x^2) ~ 6e-6, comparable to eps) so that where eps
  // enters matters.
  Vec xs = randn(size_t(N) * C, 201, 2.0, 1.5);
  for (int c = 0; c < 2 * C; ++c) xs[size_t(N - 2) * C + c] *= 1e-3;
  ActTensor x(be.get(), xs);
  ActTensor w(be.get(), randn(C, 202, 0.3, 1.0));
  const size_t es = dtype_size(be->act_dtype());
  DeviceBuffer out(be.get(), size_t(N) * C * es), rstd(be.get(), N * 4);
  be->rmsnorm_forward(out.get(), rstd.as<float>(), x.get(), w.get(), N, C, eps);
  Vec rrstd;
  const Vec want = ref::rmsnorm(x.val, w.val, N, C, double(eps), &rrstd);
  check_close("rmsnorm fwd out", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);
  check_close("rmsnorm fwd rstd", download_f32_vec(be.get(), rstd.get(), N), rrstd, kFwdTol);
  const size_t big = size_t(N - 2) * C;  // rows [0, N-2) normal, [N-2, N) tiny
  check_close("rmsnorm fwd out, tiny rows (eps comparable to mean(x^2))",
              slice(download_act_vec(be.get(), out.get(), want.size()), big, want.size()), slice(want, big, want.size()),
              kFwdTol);

  ActTensor R(be.get(), randn(size_t(N) * C, 203));
  ActTensor dinp(be.get(), randn(size_t(N) * C, 204));  // both pre-filled: the contract is +=
  F32Tensor dw(be.get(), randn(C, 205));
  be->rmsnorm_backward(dinp.get(), dw.get(), R.get(), x.get(), w.get(), rstd.as<float>(), N, C);

  Vec xv = x.val, wv = w.val;
  auto L = [&] { return ref::dot(ref::rmsnorm(xv, wv, N, C, double(eps)), R.val); };
  const Vec gx = ref::central_fd(xv, L, 1e-7);  // h below the tiny rows' 1e-3 scale
  const Vec got_dx = minus(download_act_vec(be.get(), dinp.get(), xv.size()), dinp.val);
  check_close("rmsnorm dinp (+=)", got_dx, gx, kGradTol);
  // Each kind of row on its own: the tiny rows' gradients are hundreds of
  // times larger per entry and would hide an error in the normal rows.
  check_close("rmsnorm dinp (+=), tiny rows", slice(got_dx, big, got_dx.size()), slice(gx, big, gx.size()), kGradTol);
  check_close("rmsnorm dinp (+=), normal rows", slice(got_dx, 0, big), slice(gx, 0, big), kGradTol);
  check_close("rmsnorm dweight (+=)", minus(download_f32_vec(be.get(), dw.get(), C), dw.val), ref::central_fd(wv, L),
              kGradTol);
}

TEST_CASE("llama_ops: fused residual + rmsnorm equals the two ops, and rmsnorm_backward is bit-reproducible",
          "[cpu_ops][llama]") {
  auto be = make_backend();
  const float eps = 1e-6f;
  for (auto [N, C] : {std::pair<int, int>{1, 1}, {7, 13}, {19, 111}, {5, 768}}) {
    const size_t n = size_t(N) * C, es = dtype_size(be->act_dtype());
    ActTensor a(be.get(), randn(n, 211, 2.0, 1.0)), b(be.get(), randn(n, 212, 0.5, -2.0));
    ActTensor w(be.get(), randn(C, 213, 0.3, 1.0));
    DeviceBuffer res(be.get(), n * es), out(be.get(), n * es), rstd(be.get(), N * 4);
    be->residual_rmsnorm_forward(res.get(), out.get(), rstd.as<float>(), a.get(), b.get(), w.get(), N, C, eps);
    DeviceBuffer res2(be.get(), n * es), out2(be.get(), n * es), rstd2(be.get(), N * 4);
    be->residual_forward(res2.get(), a.get(), b.get(), int64_t(n));
    be->rmsnorm_forward(out2.get(), rstd2.as<float>(), res2.get(), w.get(), N, C, eps);
    CHECK(download_act_vec(be.get(), res.get(), n) == download_act_vec(be.get(), res2.get(), n));
    CHECK(download_act_vec(be.get(), out.get(), n) == download_act_vec(be.get(), out2.get(), n));
    CHECK(download_f32_vec(be.get(), rstd.get(), N) == download_f32_vec(be.get(), rstd2.get(), N));
    Vec sum(n);
    for (size_t i = 0; i < n; ++i) sum[i] = a.val[i] + b.val[i];
    check_close("fused residual (rmsnorm)", download_act_vec(be.get(), res.get(), n), sum, kFwdTol);
    check_close("fused rmsnorm out", download_act_vec(be.get(), out.get(), n), ref::rmsnorm(sum, w.val, N, C, eps),
                kFwdTol);

    // Two backward runs from identical (zero) starting buffers: identical bits.
    ActTensor dout(be.get(), randn(n, 214));
    DeviceBuffer dx1(be.get(), n * es), dx2(be.get(), n * es), dw1(be.get(), C * 4), dw2(be.get(), C * 4);
    be->rmsnorm_backward(dx1.get(), dw1.as<float>(), dout.get(), res.get(), w.get(), rstd.as<float>(), N, C);
    be->rmsnorm_backward(dx2.get(), dw2.as<float>(), dout.get(), res.get(), w.get(), rstd.as<float>(), N, C);
    CHECK(bytes_of(be.get(), dx1.get(), dx1.bytes()) == bytes_of(be.get(), dx2.get(), dx2.bytes()));
    CHECK(bytes_of(be.get(), dw1.get(), dw1.bytes()) == bytes_of(be.get(), dw2.get(), dw2.bytes()));
  }
}

// ---- RoPE -------------------------------------------------------------------------------------

TEST_CASE("llama_ops: rope_table is (maxT, HS/2, 2) cos|sin of p * theta^(-2i/HS)", "[cpu_ops][llama]") {
  const int maxT = 37, HS = 6;
  const double theta = 10000.0;
  const std::vector<float> t = rope_table(maxT, HS, theta, nullptr);
  REQUIRE(t.size() == size_t(maxT) * HS);
  const Vec f = plain_inv_freq(HS, theta);
  const std::vector<double> got_f = rope_inv_freq(HS, theta, nullptr);
  for (int i = 0; i < HS / 2; ++i) CHECK(std::abs(got_f[i] - f[i]) <= 1e-15 * f[i]);
  double worst = 0.0;
  for (int p = 0; p < maxT; ++p)
    for (int i = 0; i < HS / 2; ++i) {
      // fp32 entries of values in [-1, 1]: within half an fp32 ulp of 1 (6e-8) of the double value.
      worst = std::max(worst, std::abs(t[(size_t(p) * HS / 2 + i) * 2] - std::cos(p * f[i])));
      worst = std::max(worst, std::abs(t[(size_t(p) * HS / 2 + i) * 2 + 1] - std::sin(p * f[i])));
    }
  std::printf("  rope_table max |entry - double| %.3e\n", worst);
  CHECK(worst <= 6e-8);

  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(rope_table(8, 5, theta, nullptr), Contains("head size 5 must be even"));
  CHECK_THROWS_WITH(rope_table(0, 6, theta, nullptr), Contains("table length 0"));
  RopeScaling bad;
  bad.high_freq_factor = bad.low_freq_factor;
  CHECK_THROWS_WITH(rope_table(8, 6, theta, &bad), Contains("low_freq_factor"));
}

TEST_CASE("llama_ops: rope forward and backward on q and k heads, v untouched", "[cpu_ops][llama]") {
  auto be = make_backend();
  const int B = 2, T = 5, maxT = 16;
  // theta 100 (not Llama's 5e5): with HS = 6 the frequencies are 1, 0.22 and
  // 0.046, so every pair turns by a sizeable angle over positions 0..7.
  const double theta = 100.0;
  for (const Heads& hd : kHeadCases) {
    for (int pos0 : {0, 3}) {
      const int HS = hd.HS, ld = hd.ld();
      INFO("NH " << hd.NH << " NKV " << hd.NKV << " HS " << HS << " pos0 " << pos0);
      std::printf(" rope: NH %d NKV %d HS %d pos0 %d\n", hd.NH, hd.NKV, HS, pos0);
      const std::vector<float> tab = rope_table(maxT, HS, theta, nullptr);
      DeviceBuffer dtab = test::upload_f32(be.get(), tab);
      const Vec f = plain_inv_freq(HS, theta);
      const size_t n = size_t(B) * T * ld;
      const size_t vcol = size_t(hd.NH + hd.NKV) * HS, vw = size_t(hd.NKV) * HS;

      ActTensor qkv(be.get(), randn(n, 221 + pos0));
      ActTensor y(be.get(), qkv.val);  // rotated in place
      be->rope_forward(y.get(), dtab.as<float>(), B, T, hd.NH, hd.NKV, HS, pos0);
      const Vec got = download_act_vec(be.get(), y.get(), n);
      const Vec want = ref::rope(qkv.val, f, B, T, hd.NH, hd.NKV, HS, pos0);
      check_close("rope fwd q", columns(got, ld, 0, size_t(hd.NH) * HS), columns(want, ld, 0, size_t(hd.NH) * HS),
                  kFwdTol);
      check_close("rope fwd k", columns(got, ld, size_t(hd.NH) * HS, vw), columns(want, ld, size_t(hd.NH) * HS, vw),
                  kFwdTol);
      CHECK(columns(got, ld, vcol, vw) == columns(qkv.val, ld, vcol, vw));  // v: the very same bits

      // Backward in place on dqkv = R: the gradient of L = sum(rope(qkv) * R).
      ActTensor R(be.get(), randn(n, 231 + pos0));
      ActTensor d(be.get(), R.val);
      be->rope_backward(d.get(), dtab.as<float>(), B, T, hd.NH, hd.NKV, HS, pos0);
      Vec qv = qkv.val;
      const Vec g = ref::central_fd(qv, [&] { return ref::dot(ref::rope(qv, f, B, T, hd.NH, hd.NKV, HS, pos0), R.val); });
      const Vec dgot = download_act_vec(be.get(), d.get(), n);
      check_close("rope dq,dk (in place)", columns(dgot, ld, 0, vcol), columns(g, ld, 0, vcol), kGradTol);
      CHECK(columns(dgot, ld, vcol, vw) == columns(R.val, ld, vcol, vw));  // dv passes through untouched

      // A rotation's transpose is its inverse: backward(forward(x)) = x.
      be->rope_backward(y.get(), dtab.as<float>(), B, T, hd.NH, hd.NKV, HS, pos0);
      check_close("rope backward(forward(x)) = x", download_act_vec(be.get(), y.get(), n), qkv.val, 1e-6);
    }
  }
  auto raw = make_backend();
  CHECK_THROWS_WITH(raw->rope_forward(nullptr, nullptr, 1, 1, 1, 1, 5, 0), Catch::Matchers::Contains("must be even"));
}

// ---- SwiGLU -------------------------------------------------------------------------------------

TEST_CASE("llama_ops: swiglu forward and backward (dinp overwritten, may alias inp)", "[cpu_ops][llama]") {
  auto be = make_backend();
  const int N = 7, F = 13;
  // std 3 gates reach both tails of the sigmoid; the up half is around 0.
  Vec in = randn(size_t(N) * 2 * F, 241, 3.0);
  in[0] = 40.0;   // silu saturates to x: sigma = 1 exactly in fp32
  in[1] = -40.0;  // and to 0 (e^40 stays finite: no inf/inf)
  in[2] = 100.0;  // beyond fastmath::exp's clamp
  in[3] = -100.0;
  ActTensor x(be.get(), in);
  ActTensor out(be.get(), randn(size_t(N) * F, 242));  // junk that must be replaced
  be->swiglu_forward(out.get(), x.get(), N, F);
  const Vec want = ref::swiglu(x.val, N, F);
  const Vec got = download_act_vec(be.get(), out.get(), want.size());
  check_close("swiglu fwd", got, want, kFwdTol);
  for (double v : got) REQUIRE(std::isfinite(v));

  ActTensor R(be.get(), randn(size_t(N) * F, 243));
  Vec xv = x.val;
  const Vec g = ref::central_fd(xv, [&] { return ref::dot(ref::swiglu(xv, N, F), R.val); });
  ActTensor dinp(be.get(), randn(xv.size(), 244, 1.0, 4.0));  // pre-filled: must be overwritten
  be->swiglu_backward(dinp.get(), R.get(), x.get(), N, F);
  const Vec dg = download_act_vec(be.get(), dinp.get(), xv.size());
  check_close("swiglu dinp (overwrite)", dg, g, kGradTol);
  check_close("swiglu dgate", columns(dg, 2 * F, 0, F), columns(g, 2 * F, 0, F), kGradTol);
  check_close("swiglu dup", columns(dg, 2 * F, F, F), columns(g, 2 * F, F, F), kGradTol);

  ActTensor inplace(be.get(), x.val);  // dinp == inp
  be->swiglu_backward(inplace.get(), R.get(), inplace.get(), N, F);
  CHECK(download_act_vec(be.get(), inplace.get(), xv.size()) == dg);
}

// ---- grouped-query attention --------------------------------------------------------------------

TEST_CASE("llama_ops: attention_gqa forward and backward (dqkv overwritten)", "[cpu_ops][llama]") {
  auto be = make_backend();
  const int B = 2, T = 5;
  for (const Heads& hd : kHeadCases) {
    const int NH = hd.NH, NKV = hd.NKV, HS = hd.HS, ld = hd.ld(), C = NH * HS;
    INFO("NH " << NH << " NKV " << NKV << " HS " << HS);
    std::printf(" attention_gqa: NH %d NKV %d HS %d\n", NH, NKV, HS);
    const size_t es = dtype_size(be->act_dtype());
    ActTensor qkv(be.get(), randn(size_t(B) * T * ld, 251 + NKV));
    DeviceBuffer out(be.get(), size_t(B) * T * C * es);
    DeviceBuffer saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
    be->attention_gqa_forward(out.get(), saved.as<float>(), qkv.get(), B, T, NH, NKV, HS);
    const Vec want = ref::attention_gqa(qkv.val, B, T, NH, NKV, HS);
    check_close("attention_gqa fwd", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);

    ActTensor R(be.get(), randn(size_t(B) * T * C, 261 + NKV));
    ActTensor dqkv(be.get(), randn(qkv.val.size(), 271, 1.0, -3.0));  // pre-filled: must be overwritten
    be->attention_gqa_backward(dqkv.get(), R.get(), qkv.get(), out.get(), saved.as<float>(), B, T, NH, NKV, HS);
    Vec qv = qkv.val;
    const Vec g = ref::central_fd(qv, [&] { return ref::dot(ref::attention_gqa(qv, B, T, NH, NKV, HS), R.val); });
    const Vec got = download_act_vec(be.get(), dqkv.get(), qv.size());
    check_close("attention_gqa dqkv (overwrite)", got, g, kGradTol);
    // Per part: dk and dv are the group sums.
    const size_t qw = size_t(C), kw = size_t(NKV) * HS;
    check_close("attention_gqa dq", columns(got, ld, 0, qw), columns(g, ld, 0, qw), kGradTol);
    check_close("attention_gqa dk (summed over the group)", columns(got, ld, qw, kw), columns(g, ld, qw, kw), kGradTol);
    check_close("attention_gqa dv (summed over the group)", columns(got, ld, qw + kw, kw), columns(g, ld, qw + kw, kw),
                kGradTol);
  }
  CHECK_THROWS_WITH(be->attention_gqa_forward(nullptr, nullptr, nullptr, 1, 1, 6, 4, 2),
                    Catch::Matchers::Contains("num_key_value_heads 4 must divide num_attention_heads 6"));
}

// kernels/cpu/causal_head.h takes the queries 64 rows at a time and skips the
// keys after each block: at T = 150 (blocks 64, 64, 22) the block edges, the
// short last block and the key-block sums of dk/dv (queries t >= j0) are all
// crossed, which T <= 64 above never does. Both attention ops, against the
// double reference and its finite differences (2 heads, HS 4, so that the
// FD over all 150 x 16 inputs stays ~1 s).
TEST_CASE("llama_ops: causal attention across several row blocks (T = 150), GQA and multi-head",
          "[cpu_ops][llama]") {
  auto be = make_backend();
  const int B = 1, T = 150, NH = 2, HS = 4, C = NH * HS;
  const size_t es = dtype_size(be->act_dtype());
  for (const int NKV : {1, 2}) {
    INFO("NKV " << NKV);
    const int ld = (NH + 2 * NKV) * HS;
    ActTensor qkv(be.get(), randn(size_t(B) * T * ld, 611 + NKV));
    ActTensor R(be.get(), randn(size_t(B) * T * C, 621 + NKV));
    DeviceBuffer out(be.get(), size_t(B) * T * C * es), saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
    ActTensor dqkv(be.get(), randn(qkv.val.size(), 631, 1.0, -3.0));  // pre-filled: must be overwritten
    if (NKV == NH) {  // the multi-head op (q | k | v, C each): the same layout
      be->attention_forward(out.get(), saved.as<float>(), qkv.get(), B, T, C, NH);
      be->attention_backward(dqkv.get(), R.get(), qkv.get(), out.get(), saved.as<float>(), B, T, C, NH);
    } else {
      be->attention_gqa_forward(out.get(), saved.as<float>(), qkv.get(), B, T, NH, NKV, HS);
      be->attention_gqa_backward(dqkv.get(), R.get(), qkv.get(), out.get(), saved.as<float>(), B, T, NH, NKV, HS);
    }
    const Vec want = ref::attention_gqa(qkv.val, B, T, NH, NKV, HS);
    check_close("attention fwd, T 150", download_act_vec(be.get(), out.get(), want.size()), want, kFwdTol);
    Vec qv = qkv.val;
    const Vec g = ref::central_fd(qv, [&] { return ref::dot(ref::attention_gqa(qv, B, T, NH, NKV, HS), R.val); });
    const Vec got = download_act_vec(be.get(), dqkv.get(), qv.size());
    const size_t qw = size_t(C), kw = size_t(NKV) * HS;
    check_close("attention dq, T 150", columns(got, ld, 0, qw), columns(g, ld, 0, qw), kGradTol);
    check_close("attention dk, T 150", columns(got, ld, qw, kw), columns(g, ld, qw, kw), kGradTol);
    check_close("attention dv, T 150", columns(got, ld, qw + kw, kw), columns(g, ld, qw + kw, kw), kGradTol);
  }
}

TEST_CASE("llama_ops: attention_gqa with NKV == NH is attention_forward/backward bit for bit", "[cpu_ops][llama]") {
  auto be = make_backend();
  const int B = 2, T = 7, NH = 3, HS = 6, C = NH * HS;
  const size_t es = dtype_size(be->act_dtype());
  ActTensor qkv(be.get(), randn(size_t(B) * T * 3 * C, 281));
  ActTensor dout(be.get(), randn(size_t(B) * T * C, 282));
  DeviceBuffer o1(be.get(), size_t(B) * T * C * es), o2(be.get(), size_t(B) * T * C * es);
  REQUIRE(be->attention_gqa_saved_floats(B, T, NH) == be->attention_saved_floats(B, T, NH));
  DeviceBuffer s1(be.get(), be->attention_saved_floats(B, T, NH) * 4), s2(be.get(), s1.bytes());
  be->attention_forward(o1.get(), s1.as<float>(), qkv.get(), B, T, C, NH);
  be->attention_gqa_forward(o2.get(), s2.as<float>(), qkv.get(), B, T, NH, NH, HS);
  CHECK(bytes_of(be.get(), o1.get(), o1.bytes()) == bytes_of(be.get(), o2.get(), o2.bytes()));
  CHECK(bytes_of(be.get(), s1.get(), s1.bytes()) == bytes_of(be.get(), s2.get(), s2.bytes()));
  DeviceBuffer d1(be.get(), size_t(B) * T * 3 * C * es), d2(be.get(), d1.bytes());
  be->attention_backward(d1.get(), dout.get(), qkv.get(), o1.get(), s1.as<float>(), B, T, C, NH);
  be->attention_gqa_backward(d2.get(), dout.get(), qkv.get(), o2.get(), s2.as<float>(), B, T, NH, NH, HS);
  CHECK(bytes_of(be.get(), d1.get(), d1.bytes()) == bytes_of(be.get(), d2.get(), d2.bytes()));
}

TEST_CASE("llama_ops: attention_gqa_backward is bit-reproducible across runs and thread counts", "[cpu_ops][llama]") {
  // Large enough that every thread owns several (b, kv-group) items and each
  // group sums R = 4 query heads into its dk, dv.
  const int B = 3, T = 33, NH = 8, NKV = 2, HS = 16, ld = (NH + 2 * NKV) * HS, C = NH * HS;
  const Vec qkv_v = randn(size_t(B) * T * ld, 291), dout_v = randn(size_t(B) * T * C, 292);
  // Each backend is used to the end before the next is made: the thread
  // count is process-wide OpenMP/OpenBLAS state that the constructor sets.
  auto run = [&](int threads, int repeats) {
    auto be = make_cpu_backend(threads);
    const size_t es = dtype_size(be->act_dtype());
    ActTensor qkv(be.get(), qkv_v), dout(be.get(), dout_v);
    DeviceBuffer out(be.get(), size_t(B) * T * C * es), saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
    be->attention_gqa_forward(out.get(), saved.as<float>(), qkv.get(), B, T, NH, NKV, HS);
    std::vector<std::vector<unsigned char>> res{bytes_of(be.get(), out.get(), out.bytes())};
    for (int r = 0; r < repeats; ++r) {
      ActTensor d(be.get(), randn(qkv_v.size(), 293 + r));  // different junk each time: all overwritten
      be->attention_gqa_backward(d.get(), dout.get(), qkv.get(), out.get(), saved.as<float>(), B, T, NH, NKV, HS);
      res.push_back(bytes_of(be.get(), d.get(), d.buf.bytes()));
    }
    return res;
  };
  const auto two = run(2, 2);
  CHECK(two[1] == two[2]);  // run to run
  const auto one = run(1, 1);
  const auto three = run(3, 1);
  CHECK(one[0] == two[0]);  // forward
  CHECK(one[1] == two[1]);  // backward, 1 vs 2 threads
  CHECK(three[0] == two[0]);
  CHECK(three[1] == two[1]);
}

TEST_CASE("llama_ops: rope + attention_kv_gqa_forward in pieces match rope + attention_gqa_forward",
          "[cpu_ops][llama]") {
  auto be = make_backend();
  // One sequence of T tokens: a prefill of 4, then pieces and single tokens.
  // Each piece is rotated at its own positions (rope_forward with pos0 = pos)
  // and attends through the cache; its rows must equal the full sequence's
  // (rotated from 0, attended at once), and the cache must hold every
  // token's rotated k and raw v.
  const int T = 11, cap = 13;
  const double theta = 500000.0;
  RopeScaling llama31;
  for (const Heads& hd : kHeadCases) {
    const int NH = hd.NH, NKV = hd.NKV, HS = hd.HS, ld = hd.ld(), C = NH * HS, KV = NKV * HS;
    INFO("NH " << NH << " NKV " << NKV << " HS " << HS);
    const size_t es = dtype_size(be->act_dtype());
    DeviceBuffer tab = test::upload_f32(be.get(), rope_table(cap, HS, theta, &llama31));
    const Vec raw = randn(size_t(T) * ld, 301 + NKV);
    ActTensor full(be.get(), raw);
    be->rope_forward(full.get(), tab.as<float>(), 1, T, NH, NKV, HS, 0);
    const Vec rotated = download_act_vec(be.get(), full.get(), raw.size());
    DeviceBuffer out_full(be.get(), size_t(T) * C * es), saved(be.get(), be->attention_gqa_saved_floats(1, T, NH) * 4);
    be->attention_gqa_forward(out_full.get(), saved.as<float>(), full.get(), 1, T, NH, NKV, HS);
    const Vec want = download_act_vec(be.get(), out_full.get(), size_t(T) * C);

    DeviceBuffer kc(be.get(), size_t(cap) * KV * es), vc(be.get(), size_t(cap) * KV * es);
    DeviceBuffer out(be.get(), size_t(T) * C * es);
    Vec got, got_rot;
    for (const auto& [pos, n] : std::vector<std::pair<int, int>>{{0, 4}, {4, 1}, {5, 3}, {8, 1}, {9, 2}}) {
      ActTensor piece(be.get(), Vec(raw.begin() + size_t(pos) * ld, raw.begin() + size_t(pos + n) * ld));
      be->rope_forward(piece.get(), tab.as<float>(), 1, n, NH, NKV, HS, pos);
      const Vec pr = download_act_vec(be.get(), piece.get(), size_t(n) * ld);
      got_rot.insert(got_rot.end(), pr.begin(), pr.end());
      be->attention_kv_gqa_forward(out.get(), kc.get(), vc.get(), piece.get(), pos, n, NH, NKV, HS);
      const Vec rows = download_act_vec(be.get(), out.get(), size_t(n) * C);
      got.insert(got.end(), rows.begin(), rows.end());
    }
    CHECK(got_rot == rotated);  // rotating at pos0 = pos is rotating the whole sequence
    check_close("attention_kv_gqa_forward rows", got, want, kFwdTol);
    const Vec k = download_act_vec(be.get(), kc.get(), size_t(T) * KV), v = download_act_vec(be.get(), vc.get(), size_t(T) * KV);
    CHECK(k == columns(rotated, ld, C, KV));
    CHECK(v == columns(rotated, ld, C + KV, KV));
  }
}

// ---- against transformers ---------------------------------------------------------------------------

namespace {
using test::hf_python;

json hf_llama_ops(const json& request) {
  test::TempDir dir("hf_llama_ops");
  test::write_file(dir / "in.json", request.dump());
  const test::RunResult r = test::run_command("'" + hf_python() + "' '" + test::source_dir() +
                                              "/scripts/reference/hf_llama_ops.py' '" + (dir / "in.json") + "' '" +
                                              (dir / "out.json") + "'");
  INFO("hf_llama_ops.py stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  return json::parse(test::read_file(dir / "out.json"));
}

json scaling_json(const RopeScaling* s) {
  if (!s) return nullptr;
  return {{"factor", s->factor},
          {"low_freq_factor", s->low_freq_factor},
          {"high_freq_factor", s->high_freq_factor},
          {"original_max_position_embeddings", s->original_max_position_embeddings}};
}

Vec as_vec(const json& j) { return j.get<Vec>(); }
}  // namespace

TEST_CASE("llama_ops [hf]: RoPE frequencies and tables, RMSNorm, MLP and attention equal transformers'",
          "[cpu_ops][llama][hf]") {
  auto be = make_backend();
  const size_t es = dtype_size(be->act_dtype());
  // Llama 3.1 8B's rope (head_dim 128, theta 5e5, factor 8 over 8192) and
  // Llama 3.2 1B's (head_dim 64, factor 32), plus the plain one.
  // The small shapes' rope: HS = 6 (odd half), theta 1e4, and an original
  // context of 256 so that its wavelengths 6.3, 135 and 2920 fall into the
  // three llama3 bands (< 256/4 kept, > 256/1 divided, between: blended).
  RopeScaling llama31, llama32, small;
  llama32.factor = 32.0;
  small.factor = 4.0;
  small.original_max_position_embeddings = 256;
  struct Freq {
    int HS;
    double theta;
    const RopeScaling* s;
  };
  const Freq freqs[] = {
      {128, 500000.0, &llama31}, {64, 500000.0, &llama32}, {6, 10000.0, &small}, {6, 10000.0, nullptr}};

  const int N = 7, C = 13, I = 11, B = 2, T = 5, NH = 6, NKV = 2, HS = 6, CA = NH * HS, pos0 = 3, tabT = 64;
  const Vec xn = randn(size_t(N) * C, 311, 1.5, 0.5), wn = randn(C, 312, 0.3, 1.0);
  const Vec xm = randn(size_t(N) * C, 313), gate = randn(size_t(I) * C, 314, 0.4), up = randn(size_t(I) * C, 315, 0.4),
            down = randn(size_t(C) * I, 316, 0.4);
  const Vec xa = randn(size_t(B) * T * CA, 317), wq = randn(size_t(CA) * CA, 318, 0.3),
            wk = randn(size_t(NKV) * HS * CA, 319, 0.3), wv = randn(size_t(NKV) * HS * CA, 320, 0.3),
            wo = randn(size_t(CA) * CA, 321, 0.3);

  json req;
  for (const Freq& f : freqs)
    req["inv_freq"].push_back(json{{"head_dim", f.HS}, {"theta", f.theta}, {"rope_scaling", scaling_json(f.s)}});
  req["cos_sin"] = json{{"head_dim", HS}, {"theta", 10000.0}, {"rope_scaling", scaling_json(&small)}, {"max_position", tabT}};
  req["rmsnorm"] = json{{"N", N}, {"C", C}, {"eps", 1e-5}, {"x", xn}, {"weight", wn}};
  req["mlp"] = json{{"N", N}, {"hidden", C}, {"intermediate", I}, {"x", xm}, {"gate", gate}, {"up", up}, {"down", down}};
  req["attention"] = json{{"B", B},   {"T", T},   {"NH", NH},          {"NKV", NKV},
                          {"HS", HS}, {"pos0", pos0}, {"theta", 10000.0}, {"rope_scaling", scaling_json(&small)},
                          {"x", xa},  {"q", wq},  {"k", wk},           {"v", wv},  {"o", wo}};
  const json hf = hf_llama_ops(req);

  SECTION("llama3 inv_freq: every band hit, values equal transformers' (fp32) to 1e-6") {
    for (size_t c = 0; c < std::size(freqs); ++c) {
      const Freq& f = freqs[c];
      INFO("HS " << f.HS << " scaling " << (f.s ? f.s->factor : 0.0));
      const std::vector<double> mine = rope_inv_freq(f.HS, f.theta, f.s);
      const Vec theirs = as_vec(hf["inv_freq"][c]);
      REQUIRE(theirs.size() == mine.size());
      double worst = 0.0;
      for (size_t i = 0; i < mine.size(); ++i) worst = std::max(worst, std::abs(mine[i] - theirs[i]) / theirs[i]);
      std::printf("  inv_freq HS %d: max elementwise rel diff to HF %.3e\n", f.HS, worst);
      // HF's values are fp32 (pow in float): a few ulp of 6e-8.
      CHECK(worst <= 1e-6);
      if (f.s) {  // kept, divided by factor, and blended: all three must occur
        const Vec plain = plain_inv_freq(f.HS, f.theta);
        int kept = 0, divided = 0, blended = 0;
        for (size_t i = 0; i < mine.size(); ++i) {
          const double r = mine[i] / plain[i];
          if (std::abs(r - 1.0) < 1e-12) ++kept;
          else if (std::abs(r * f.s->factor - 1.0) < 1e-12) ++divided;
          else if (r < 1.0 && r > 1.0 / f.s->factor) ++blended;
        }
        CHECK(kept > 0);
        CHECK(divided > 0);
        CHECK(blended > 0);
        CHECK(kept + divided + blended == int(mine.size()));
      }
    }
  }

  SECTION("rope_table equals LlamaRotaryEmbedding's cos/sin (fp32 angles) at positions 0..63") {
    const std::vector<float> tab = rope_table(tabT, HS, 10000.0, &small);
    const Vec cos_hf = as_vec(hf["cos_sin"]["cos"]), sin_hf = as_vec(hf["cos_sin"]["sin"]);
    double worst = 0.0;
    for (int p = 0; p < tabT; ++p)
      for (int d = 0; d < HS; ++d) {  // HF repeats the HS/2 angles over both halves
        const size_t e = (size_t(p) * HS / 2 + d % (HS / 2)) * 2;
        worst = std::max(worst, std::abs(tab[e] - cos_hf[size_t(p) * HS + d]));
        worst = std::max(worst, std::abs(tab[e + 1] - sin_hf[size_t(p) * HS + d]));
      }
    std::printf("  rope_table vs HF cos/sin: max abs diff %.3e\n", worst);
    // HF's fp32 angle p * f carries ~p * f * 2^-23 of error: <= 8e-6 at p = 63, f <= 1.
    CHECK(worst <= 2e-5);
  }

  SECTION("rmsnorm_forward equals LlamaRMSNorm") {
    ActTensor x(be.get(), xn), w(be.get(), wn);
    DeviceBuffer out(be.get(), xn.size() * es), rstd(be.get(), N * 4);
    be->rmsnorm_forward(out.get(), rstd.as<float>(), x.get(), w.get(), N, C, 1e-5f);
    check_close("rmsnorm vs LlamaRMSNorm", download_act_vec(be.get(), out.get(), xn.size()), as_vec(hf["rmsnorm"]),
                kFwdTol);
  }

  SECTION("fused gate|up matmul + swiglu + down matmul equals LlamaMLP") {
    Vec gate_up = gate;  // (2I, C): gate rows, then up rows -> (N, 2I) = gate | up per row
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    ActTensor x(be.get(), xm), wgu(be.get(), gate_up), wd(be.get(), down);
    DeviceBuffer gu(be.get(), size_t(N) * 2 * I * es), act(be.get(), size_t(N) * I * es), y(be.get(), xm.size() * es);
    be->matmul_forward(gu.get(), x.get(), wgu.get(), nullptr, N, C, 2 * I);
    be->swiglu_forward(act.get(), gu.get(), N, I);
    be->matmul_forward(y.get(), act.get(), wd.get(), nullptr, N, I, C);
    check_close("mlp vs LlamaMLP", download_act_vec(be.get(), y.get(), xm.size()), as_vec(hf["mlp"]), kFwdTol);
  }

  SECTION("fused qkv matmul + rope + attention_gqa + o matmul equals LlamaAttention (pos0 = 3)") {
    Vec wqkv = wq;  // ((NH + 2 NKV) HS, C): q rows | k rows | v rows, as qkv's columns
    wqkv.insert(wqkv.end(), wk.begin(), wk.end());
    wqkv.insert(wqkv.end(), wv.begin(), wv.end());
    const int ld = (NH + 2 * NKV) * HS;
    ActTensor x(be.get(), xa), W(be.get(), wqkv), Wo(be.get(), wo);
    DeviceBuffer tab = test::upload_f32(be.get(), rope_table(pos0 + T, HS, 10000.0, &small));
    DeviceBuffer qkv(be.get(), size_t(B) * T * ld * es), att(be.get(), xa.size() * es), y(be.get(), xa.size() * es);
    DeviceBuffer saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
    be->matmul_forward(qkv.get(), x.get(), W.get(), nullptr, B * T, CA, ld);
    be->rope_forward(qkv.get(), tab.as<float>(), B, T, NH, NKV, HS, pos0);
    be->attention_gqa_forward(att.get(), saved.as<float>(), qkv.get(), B, T, NH, NKV, HS);
    be->matmul_forward(y.get(), att.get(), Wo.get(), nullptr, B * T, CA, CA);
    check_close("attention block vs LlamaAttention", download_act_vec(be.get(), y.get(), xa.size()),
                as_vec(hf["attention"]), kFwdTol);
  }
}
