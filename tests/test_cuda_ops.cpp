// Every op of the CUDA backend against the CPU backend (the project's
// numerical reference), on fresh random inputs (never zeros) at odd sizes
// (1, 19, 111, 500, and sizes that cross the kernels' tiles and vector
// widths), plus the cuBLASLt wrapper's epilogues, the NCCL communicator and a
// 20-step training run.
//
// Method: inputs are drawn in fp32, uploaded to the CUDA backend (bf16
// activations: rounded there) and read back, so both backends see exactly the
// same values; the differences left are the CUDA backend's own roundings.
// Outputs on the GPU are poisoned with NaN first, so an element the kernel
// does not write fails the check. Gradients that the contract accumulates
// (+=) are pre-filled with random values on both sides.
// Metric: norm-wise relative error ||gpu - cpu|| / ||cpu|| (any non-finite
// element: infinity). Tolerances, and why:
//   kF32    fp32 outputs from identical inputs: only summation order and
//           fast-math intrinsics differ -> ~1e-6; 1e-4 leaves room.
//   kBf16   one bf16 rounding of the output (2^-9 relative per element,
//           ~3e-3 norm-wise); 1e-2 leaves room.
//   kAttn   attention rounds the probabilities P (forward) and P, dS
//           (backward) to bf16 before the tensor-core products, on top of
//           the output rounding: 2e-2 forward, 3e-2 backward.
//   kLoss   20 training steps in bf16 against fp32: the loss curves may
//           drift apart by a few parts in 100 after the initial loss.
//
// Without a usable GPU (no driver, no device, a CPU-only build) every test
// prints "SKIPPED: no usable GPU: <reason>" and returns without assertions;
// CTest reports those as skipped, not passed (SKIP_REGULAR_EXPRESSION in
// CMakeLists.txt). On a GPU machine they run for real (scripts/gpu-check.sh).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/model/adapter/nf4.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/rope_table.h"
#include "parallel/comm/communicator.h"
#include "parallel/pipeline/links.h"
#include "tests/support/cuda_compare.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::cuda_cmp;  // Pair, Twin, check_close, the tolerances (tests/support/cuda_compare.h)

TEST_CASE("cuda: memory, copies and casts", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  Backend* be = p.gpu.get();
  CHECK(be->act_dtype() == DType::BF16);
  const size_t base = be->bytes_in_use();
  {
    DeviceBuffer a(be, 1001), b(be, 1001);
    CHECK(be->bytes_in_use() == base + 2002);
    CHECK(reinterpret_cast<uintptr_t>(a.get()) % 64 == 0);
    std::vector<unsigned char> h(1001, 0xAB);
    be->copy_to_host(h.data(), a.get(), 1001);  // alloc() zero-initialises
    CHECK(std::all_of(h.begin(), h.end(), [](unsigned char c) { return c == 0; }));
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<unsigned char>(i * 7 + 1);
    be->copy_to_device(a.get(), h.data(), 1001);
    be->copy_device(b.get(), a.get(), 1001);
    be->zero(b.get(), 500);
    std::vector<unsigned char> hb(1001);
    be->copy_to_host(hb.data(), b.get(), 1001);
    CHECK(std::all_of(hb.begin(), hb.begin() + 500, [](unsigned char c) { return c == 0; }));
    CHECK(std::memcmp(hb.data() + 500, h.data() + 500, 501) == 0);
  }
  CHECK(be->bytes_in_use() == base);
  // fp32 -> bf16 rounds to nearest even; bf16 -> fp32 is exact. Checked on
  // values with known roundings, at aligned and unaligned addresses.
  for (size_t off : {size_t(0), size_t(1), size_t(3)}) {
    const Vec v = {1.0f, 1.00390625f /* halfway 1 and 1+2^-7: even -> 1 */, 1.01171875f /* halfway: -> 1.015625 */,
                   -2.5f, 3.0e-3f, 65504.0f, 1.0e-30f, 0.333333343f, 7.0f, -0.0f, 123.456f};
    DeviceBuffer src = upload_f32(be, v);
    DeviceBuffer act(be, (v.size() + off) * 2);
    void* dst = act.as<char>() + off * 2;
    be->cast_from_f32(dst, src.as<float>(), int64_t(v.size()));
    Vec back = download_act(be, dst, v.size());
    CHECK(back[0] == 1.0f);
    CHECK(back[1] == 1.0f);
    CHECK(back[2] == 1.015625f);
    CHECK(back[3] == -2.5f);
    CHECK(back[8] == 7.0f);
    for (size_t i = 0; i < v.size(); ++i) CHECK(std::fabs(back[i] - v[i]) <= std::fabs(v[i]) * 0.0040f);
  }
  // A long cast (vector path + tail) round-trips within one bf16 rounding.
  const Vec big = randn(4099, 3);
  DeviceBuffer src = upload_f32(be, big);
  DeviceBuffer act(be, big.size() * 2);
  be->cast_from_f32(act.get(), src.as<float>(), int64_t(big.size()));
  check_close("cast fp32 -> bf16 -> fp32 (n=4099)", download_act(be, act.get(), big.size()), big, kBf16);
}

// Backend::copy_to_host_chunks (parallel.offload's gradient copies): on
// the copy stream through two pinned 4 MiB landing buffers, after `ready`
// (a point on the compute stream here; the offload path passes the
// reduce-scatter's own event) or, when null, after the compute stream's
// work so far. The chunks must hold what the compute stream wrote just
// before: a scale() enqueued right before the copy. Not yet run on a GPU (2026-12-03).
TEST_CASE("cuda: chunked device->host copy waits for its ready point, in order, every byte once", "[cuda][offload]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  Backend* be = p.gpu.get();
  const size_t n = (size_t(9) << 20) / 4 + 3;  // 2 whole chunks, a part, and a tail of 12 bytes
  const Vec v = randn(n, 41);
  for (bool with_ready : {false, true}) {
    INFO((with_ready ? "ready: a compute-stream point" : "ready: null"));
    DeviceBuffer d = upload_f32(be, v);
    be->scale(d.as<float>(), 2.0f, int64_t(n));  // enqueued; the copy must see it
    const std::shared_ptr<void> ready = with_ready ? be->time_mark() : nullptr;
    Vec got(n, 0.0f);
    std::vector<std::pair<size_t, size_t>> calls;
    be->copy_to_host_chunks(d.get(), n * 4, ready, [&](const void* chunk, size_t off, size_t bytes) {
      calls.push_back({off, bytes});
      std::memcpy(reinterpret_cast<char*>(got.data()) + off, chunk, bytes);
    });
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += got[i] != 2.0f * v[i];
    CHECK(bad == 0);
    const size_t mib4 = size_t(4) << 20;
    CHECK(calls == std::vector<std::pair<size_t, size_t>>{{0, mib4}, {mib4, mib4}, {2 * mib4, n * 4 - 2 * mib4}});
  }
}

TEST_CASE("cuda: encoder forward and backward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int B, T, C, V, maxT; };
  for (S s : {S{1, 1, 1, 5, 1}, S{2, 19, 111, 37, 23}, S{3, 64, 64, 500, 64}, S{2, 111, 19, 3, 128}}) {
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"C", s.C}, {"V", s.V}});
    auto tok = rand_tokens(size_t(s.B) * s.T, s.V, 11 + s.C);
    Tok tk(p, tok);
    Twin wte(p, randn(size_t(s.V) * s.C, 12), true), wpe(p, randn(size_t(s.maxT) * s.C, 13), true);
    const size_t n = size_t(s.B) * s.T * s.C;
    Twin out = out_twin(p, n, true);
    p.cpu->encoder_forward(out.c(), tk.cp(), wte.c(), wpe.c(), s.B, s.T, s.C);
    p.gpu->encoder_forward(out.g(), tk.gp(), wte.g(), wpe.g(), s.B, s.T, s.C);
    check_close("encoder fwd " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);

    Twin dout(p, randn(n, 14), true);
    Twin dwte(p, randn(size_t(s.V) * s.C, 15), false), dwpe(p, randn(size_t(s.maxT) * s.C, 16), false);
    p.cpu->encoder_backward(dwte.cf(), dwpe.cf(), dout.c(), tk.cp(), s.B, s.T, s.C);
    p.gpu->encoder_backward(dwte.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    const Vec g1 = dwte.read_gpu(p);
    check_close("encoder dwte (+=) " + sh, g1, dwte.read_cpu(p), kF32);
    check_close("encoder dwpe (+=) " + sh, dwpe.read_gpu(p), dwpe.read_cpu(p), kF32);
    // Deterministic: the same call again adds exactly the same bits.
    Twin dwte2(p, Vec(size_t(s.V) * s.C, 0.0f), false), dwte3(p, Vec(size_t(s.V) * s.C, 0.0f), false);
    p.gpu->encoder_backward(dwte2.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    p.gpu->encoder_backward(dwte3.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    const Vec a = dwte2.read_gpu(p), b = dwte3.read_gpu(p);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
  }
}

TEST_CASE("cuda: encoder backward with a hot token (long runs split over blocks)", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  // A hot token (padding, a frequent word) makes one long run of equal
  // sorted tokens: 70% of B*T here, so it crosses many 128-row chunks and
  // is summed by several blocks plus the second pass; the other tokens'
  // short runs also cross chunk boundaries now and then. hot = 0, a middle
  // and the last token put the long run first, inside and last in the
  // sorted order; 100% hot with N a multiple of 128 ends it exactly at N.
  struct S { int B, T, C, V, hot; double frac; };
  for (S s : {S{3, 700, 4096, 50, 0, 0.7}, S{3, 700, 4096, 50, 23, 0.7}, S{3, 700, 4096, 50, 49, 0.7},
              S{2, 128, 4096, 3, 1, 1.0}, S{4, 333, 111, 7, 3, 0.7}}) {
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"C", s.C}, {"V", s.V}, {"hot", s.hot}}) + " " +
                           std::to_string(int(s.frac * 100)) + "%";
    const size_t N = size_t(s.B) * s.T;
    auto tok = rand_tokens(N, s.V, 17 + s.hot);
    std::mt19937_64 gen(99 + s.hot);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    size_t nhot = 0;
    for (auto& t : tok)
      if (u(gen) < s.frac) t = s.hot;
    for (auto t : tok) nhot += t == s.hot;
    INFO(sh << ": " << nhot << " of " << N << " tokens are the hot one");
    Tok tk(p, tok);
    const size_t n = N * size_t(s.C);
    Twin dout(p, randn(n, 18), true);
    Twin dwte(p, randn(size_t(s.V) * s.C, 19), false), dwpe(p, randn(size_t(s.T) * s.C, 20), false);
    p.cpu->encoder_backward(dwte.cf(), dwpe.cf(), dout.c(), tk.cp(), s.B, s.T, s.C);
    p.gpu->encoder_backward(dwte.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    const Vec got = dwte.read_gpu(p), want = dwte.read_cpu(p);
    check_close("encoder dwte (+=) " + sh, got, want, kF32);
    // The hot row alone: its norm is ~sqrt(nhot) times the others', so a
    // wrong chunk there would still show in the whole-matrix error, but say so.
    const Vec hot_got(got.begin() + size_t(s.hot) * s.C, got.begin() + size_t(s.hot + 1) * s.C);
    const Vec hot_want(want.begin() + size_t(s.hot) * s.C, want.begin() + size_t(s.hot + 1) * s.C);
    check_close("encoder dwte hot row " + sh, hot_got, hot_want, kF32);
    check_close("encoder dwpe (+=) " + sh, dwpe.read_gpu(p), dwpe.read_cpu(p), kF32);
    // Deterministic: the same call again adds exactly the same bits.
    Twin a(p, Vec(size_t(s.V) * s.C, 0.0f), false), b(p, Vec(size_t(s.V) * s.C, 0.0f), false);
    p.gpu->encoder_backward(a.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    p.gpu->encoder_backward(b.gf(), dwpe.gf(), dout.g(), tk.gp(), s.B, s.T, s.C);
    const Vec ra = a.read_gpu(p), rb = b.read_gpu(p);
    CHECK(std::memcmp(ra.data(), rb.data(), ra.size() * 4) == 0);
  }
}

TEST_CASE("cuda: layernorm forward and backward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; };
  for (S s : {S{1, 1}, S{19, 111}, S{111, 19}, S{500, 64}, S{37, 768}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}});
    const size_t n = size_t(s.N) * s.C;
    Twin x(p, randn(n, 21, 2.0f, 0.5f), true), w(p, randn(s.C, 22, 0.5f, 1.0f), true), b(p, randn(s.C, 23), true);
    Twin out = out_twin(p, n, true), mean = out_twin(p, s.N, false), rstd = out_twin(p, s.N, false);
    p.cpu->layernorm_forward(out.c(), mean.cf(), rstd.cf(), x.c(), w.c(), b.c(), s.N, s.C);
    p.gpu->layernorm_forward(out.g(), mean.gf(), rstd.gf(), x.g(), w.g(), b.g(), s.N, s.C);
    check_close("layernorm out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    check_close("layernorm mean " + sh, mean.read_gpu(p), mean.read_cpu(p), kF32);
    check_close("layernorm rstd " + sh, rstd.read_gpu(p), rstd.read_cpu(p), kF32);

    // Backward from the CPU's statistics on both sides (so only the op differs).
    Twin m2(p, mean.read_cpu(p), false), r2(p, rstd.read_cpu(p), false);
    Twin dout(p, randn(n, 24), true);
    Twin dinp(p, randn(n, 25), true);  // += : pre-filled
    Twin dw(p, randn(s.C, 26), false), db(p, randn(s.C, 27), false);
    p.cpu->layernorm_backward(dinp.c(), dw.cf(), db.cf(), dout.c(), x.c(), w.c(), m2.cf(), r2.cf(), s.N, s.C);
    p.gpu->layernorm_backward(dinp.g(), dw.gf(), db.gf(), dout.g(), x.g(), w.g(), m2.gf(), r2.gf(), s.N, s.C);
    check_close("layernorm dinp (+=) " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
    check_close("layernorm dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
    check_close("layernorm dbias (+=) " + sh, db.read_gpu(p), db.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: layernorm backward at large C and many rows (team and grid plans)", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  // C picks the team count (8 warps as 8, 4, 2 or 1 teams) and, from 6143
  // up, shared memory above 48 KiB (the opt-in attribute): 770 and 1000 take
  // 4 teams, 3000 two, 4096 and 8192 one (32 and 64 KiB). The offset makes
  // every pointer unaligned: the scalar kernel at the same plans. The large
  // N exceed the grid (SMs x occupancy x teams), so blocks take several rows
  // per team and, at N = 5000, C = 770, some teams idle in the last round.
  struct S { int N, C; size_t off; };
  for (S s : {S{7, 4096, 0}, S{37, 4096, 0}, S{19, 4096, 1}, S{5, 8192, 0}, S{3, 8192, 1}, S{19, 3000, 0},
              S{19, 1000, 0}, S{23, 770, 0}, S{2000, 4096, 0}, S{5000, 770, 0}, S{20000, 64, 0}, S{20000, 64, 1}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}}) + (s.off ? " unaligned" : "");
    const size_t n = size_t(s.N) * s.C;
    Twin x(p, randn(n, 121, 2.0f, 0.5f), true, s.off), w(p, randn(s.C, 122, 0.5f, 1.0f), true, s.off);
    Twin b(p, randn(s.C, 123), true, s.off);
    Twin out = out_twin(p, n, true, s.off), mean = out_twin(p, s.N, false), rstd = out_twin(p, s.N, false);
    p.cpu->layernorm_forward(out.c(), mean.cf(), rstd.cf(), x.c(), w.c(), b.c(), s.N, s.C);
    p.gpu->layernorm_forward(out.g(), mean.gf(), rstd.gf(), x.g(), w.g(), b.g(), s.N, s.C);
    check_close("layernorm out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    Twin m2(p, mean.read_cpu(p), false), r2(p, rstd.read_cpu(p), false);
    Twin dout(p, randn(n, 124), true, s.off);
    Twin dinp(p, randn(n, 125), true, s.off);  // += : pre-filled
    Twin dw(p, randn(s.C, 126), false), db(p, randn(s.C, 127), false);
    p.cpu->layernorm_backward(dinp.c(), dw.cf(), db.cf(), dout.c(), x.c(), w.c(), m2.cf(), r2.cf(), s.N, s.C);
    p.gpu->layernorm_backward(dinp.g(), dw.gf(), db.gf(), dout.g(), x.g(), w.g(), m2.gf(), r2.gf(), s.N, s.C);
    check_close("layernorm dinp (+=) " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
    check_close("layernorm dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
    check_close("layernorm dbias (+=) " + sh, db.read_gpu(p), db.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: fused residual + layernorm forward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; size_t off; };
  for (S s : {S{1, 1, 0}, S{19, 111, 0}, S{111, 19, 1}, S{500, 64, 0}, S{37, 768, 0}, S{37, 768, 1}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}}) + (s.off ? " unaligned" : "");
    const size_t n = size_t(s.N) * s.C;
    Twin a(p, randn(n, 61, 2.0f, 0.5f), true, s.off), b(p, randn(n, 62, 0.5f, -1.0f), true, s.off);
    Twin w(p, randn(s.C, 63, 0.5f, 1.0f), true), bias(p, randn(s.C, 64), true);
    Twin res = out_twin(p, n, true, s.off), out = out_twin(p, n, true, s.off);
    Twin mean = out_twin(p, s.N, false), rstd = out_twin(p, s.N, false);
    p.cpu->residual_layernorm_forward(res.c(), out.c(), mean.cf(), rstd.cf(), a.c(), b.c(), w.c(), bias.c(), s.N,
                                      s.C);
    p.gpu->residual_layernorm_forward(res.g(), out.g(), mean.gf(), rstd.gf(), a.g(), b.g(), w.g(), bias.g(), s.N,
                                      s.C);
    check_close("fused residual " + sh, res.read_gpu(p), res.read_cpu(p), kBf16);
    check_close("fused layernorm out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    check_close("fused layernorm mean " + sh, mean.read_gpu(p), mean.read_cpu(p), kBf16);
    check_close("fused layernorm rstd " + sh, rstd.read_gpu(p), rstd.read_cpu(p), kBf16);
    // On the GPU the fused op must equal residual_forward + layernorm_forward
    // bit for bit: both round the sum to bf16 and normalise the rounded row.
    Twin res2 = out_twin(p, n, true, s.off), out2 = out_twin(p, n, true, s.off);
    Twin mean2 = out_twin(p, s.N, false), rstd2 = out_twin(p, s.N, false);
    p.gpu->residual_forward(res2.g(), a.g(), b.g(), int64_t(n));
    p.gpu->layernorm_forward(out2.g(), mean2.gf(), rstd2.gf(), res2.g(), w.g(), bias.g(), s.N, s.C);
    CHECK(res.read_gpu(p) == res2.read_gpu(p));
    CHECK(out.read_gpu(p) == out2.read_gpu(p));
    CHECK(mean.read_gpu(p) == mean2.read_gpu(p));
    CHECK(rstd.read_gpu(p) == rstd2.read_gpu(p));
  }
}

namespace {
void check_matmul(Pair& p, int N, int C, int OC, bool bias, size_t offset, const std::string& tag) {
  const std::string sh = tag + shape({{"N", N}, {"C", C}, {"OC", OC}}) + (bias ? " bias" : "") +
                         (offset ? " unaligned" : "");
  Twin x(p, randn(size_t(N) * C, 31), true, offset), w(p, randn(size_t(OC) * C, 32, 0.2f), true, offset);
  Twin bi(p, randn(OC, 33), true, offset);
  Twin out = out_twin(p, size_t(N) * OC, true, offset);
  p.cpu->matmul_forward(out.c(), x.c(), w.c(), bias ? bi.c() : nullptr, N, C, OC);
  p.gpu->matmul_forward(out.g(), x.g(), w.g(), bias ? bi.g() : nullptr, N, C, OC);
  check_close("matmul out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);

  Twin dout(p, randn(size_t(N) * OC, 34), true, offset);
  Twin dinp = out_twin(p, size_t(N) * C, true, offset);
  Twin dw(p, randn(size_t(OC) * C, 35), false, offset), db(p, randn(OC, 36), false, offset);
  p.cpu->matmul_backward(dinp.c(), dw.cf(), bias ? db.cf() : nullptr, dout.c(), x.c(), w.c(), N, C, OC);
  p.gpu->matmul_backward(dinp.g(), dw.gf(), bias ? db.gf() : nullptr, dout.g(), x.g(), w.g(), N, C, OC);
  check_close("matmul dinp " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
  check_close("matmul dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
  if (bias) check_close("matmul dbias (+=) " + sh, db.read_gpu(p), db.read_cpu(p), kF32);
  // dinp == null: only the parameter gradients.
  p.gpu->matmul_backward(nullptr, dw.gf(), nullptr, dout.g(), x.g(), w.g(), N, C, OC);
}
}  // namespace

TEST_CASE("cuda: linear + GELU epilogue forward and dGELU backward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C, OC; };
  // OC % 8 != 0 (111, 19) takes the unfused fallback; the others the epilogues.
  for (S s : {S{1, 8, 16}, S{19, 64, 111}, S{37, 19, 64}, S{500, 768, 3072}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}, {"OC", s.OC}});
    const size_t nc = size_t(s.N) * s.C, no = size_t(s.N) * s.OC;
    Twin x(p, randn(nc, 111), true), w(p, randn(size_t(s.OC) * s.C, 112, 0.2f), true), b(p, randn(s.OC, 113), true);
    Twin out = out_twin(p, no, true), pre = out_twin(p, no, true);
    p.cpu->matmul_gelu_forward(out.c(), pre.c(), x.c(), w.c(), b.c(), s.N, s.C, s.OC);
    p.gpu->matmul_gelu_forward(out.g(), pre.g(), x.g(), w.g(), b.g(), s.N, s.C, s.OC);
    check_close("linear+gelu pre " + sh, pre.read_gpu(p), pre.read_cpu(p), kBf16);
    check_close("linear+gelu out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    // Backward of a next layer (OC -> C) whose input was gelu(h): fresh
    // inputs that both sides hold identically (bf16-rounded).
    Vec hv = randn(no, 118, 1.5f), gv(no);
    for (size_t i = 0; i < no; ++i)
      gv[i] = 0.5f * hv[i] * (1.0f + std::tanh(0.7978845608f * (hv[i] + 0.044715f * hv[i] * hv[i] * hv[i])));
    Twin h(p, hv, true), g_in(p, gv, true);
    Twin dout(p, randn(nc, 114), true);
    Twin dpre = out_twin(p, no, true);
    Twin dw(p, randn(size_t(s.C) * s.OC, 115), false), db(p, randn(s.C, 116), false);
    Twin w2(p, randn(size_t(s.C) * s.OC, 117, 0.2f), true);
    p.cpu->matmul_backward_dgelu(dpre.c(), dw.cf(), db.cf(), dout.c(), g_in.c(), w2.c(), h.c(), s.N, s.OC, s.C);
    p.gpu->matmul_backward_dgelu(dpre.g(), dw.gf(), db.gf(), dout.g(), g_in.g(), w2.g(), h.g(), s.N, s.OC, s.C);
    check_close("dgelu dinp " + sh, dpre.read_gpu(p), dpre.read_cpu(p), kBf16);
    check_close("dgelu dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
    check_close("dgelu dbias (+=) " + sh, db.read_gpu(p), db.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: matmul forward and backward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C, OC; };
  for (S s : {S{1, 1, 1}, S{19, 111, 37}, S{111, 64, 500}, S{128, 768, 2304}, S{7, 19, 111}})
    for (bool bias : {false, true}) check_matmul(p, s.N, s.C, s.OC, bias, 0, "");
  check_matmul(p, 19, 37, 111, true, 1, "");  // pointers only 2-byte (bf16) / 4-byte (fp32) aligned
  // The dbias through cuBLASLt's BGRADB epilogue instead of our kernel.
  setenv("TRAINRUN_CUDA_GEMM_BGRAD", "1", 1);
  Pair q;
  unsetenv("TRAINRUN_CUDA_GEMM_BGRAD");
  for (S s : {S{19, 111, 37}, S{128, 768, 2304}}) check_matmul(q, s.N, s.C, s.OC, true, 0, "bgrad-epilogue ");
}

TEST_CASE("cuda: matmul backward with OC = 0 (an all-padding vocab shard) zeroes dinp", "[cuda][tp]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  const int N = 19, C = 37;
  Twin x(p, randn(size_t(N) * C, 61), true), dout(p, Vec{1.0f}, true), w(p, Vec{1.0f}, true);
  Twin dw(p, Vec{3.0f}, false), db(p, Vec{4.0f}, false);
  for (bool gelu : {false, true}) {
    Twin dinp = out_twin(p, size_t(N) * C, true);  // poisoned: must be overwritten
    if (gelu)
      p.gpu->matmul_backward_dgelu(dinp.g(), dw.gf(), db.gf(), dout.g(), x.g(), w.g(), x.g(), N, C, 0);
    else
      p.gpu->matmul_backward(dinp.g(), dw.gf(), db.gf(), dout.g(), x.g(), w.g(), N, C, 0);
    INFO((gelu ? "matmul_backward_dgelu" : "matmul_backward"));
    CHECK(dinp.read_gpu(p) == Vec(size_t(N) * C, 0.0f));
    CHECK(dw.read_gpu(p) == Vec{3.0f});
    CHECK(db.read_gpu(p) == Vec{4.0f});
  }
}

TEST_CASE("cuda: gemm wrapper epilogues against a host reference", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  for (const auto& row : run_gemm_epilogue_check(0)) {
    if (!row.supported) {
      WARN("gemm " << row.name << ": cuBLASLt has no algorithm for it here (not used by the backend by default)");
      continue;
    }
    std::printf("  gemm %-53s rel err %.3e (tol %.0e)\n", row.name.c_str(), row.rel_err, row.tol);
    INFO("gemm " << row.name << ": relative error " << row.rel_err);
    CHECK(row.rel_err <= row.tol);
  }
}

TEST_CASE("cuda: attention forward and backward", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int B, T, C, NH; };
  // HS = 16, 19 (padded to 32), 64 (tiles crossed at T=130), 128, 40; T = 1 and odd.
  for (S s : {S{1, 1, 16, 1}, S{2, 19, 38, 2}, S{1, 111, 64, 1}, S{2, 130, 192, 3}, S{1, 70, 256, 2}, S{3, 65, 80, 2}}) {
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"C", s.C}, {"NH", s.NH}});
    const size_t nqkv = size_t(s.B) * s.T * 3 * s.C, nout = size_t(s.B) * s.T * s.C;
    Twin qkv(p, randn(nqkv, 41), true);
    Twin out = out_twin(p, nout, true);
    DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_saved_floats(s.B, s.T, s.NH) * 4);
    DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_saved_floats(s.B, s.T, s.NH) * 4);
    CHECK(p.gpu->attention_saved_floats(s.B, s.T, s.NH) == size_t(s.B) * s.NH * s.T);  // no T x T state
    p.cpu->attention_forward(out.c(), csaved.as<float>(), qkv.c(), s.B, s.T, s.C, s.NH);
    p.gpu->attention_forward(out.g(), gsaved.as<float>(), qkv.g(), s.B, s.T, s.C, s.NH);
    check_close("attention out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);

    Twin dout(p, randn(nout, 42), true);
    Twin dqkv = out_twin(p, nqkv, true);
    p.cpu->attention_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), s.B, s.T, s.C, s.NH);
    p.gpu->attention_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, s.C, s.NH);
    check_close("attention dqkv " + sh, dqkv.read_gpu(p), dqkv.read_cpu(p), kAttnBwd);
  }
  // A head size above the supported 128 is a clear error, not a wrong answer.
  DeviceBuffer q(p.gpu.get(), 3 * 256 * 2), o(p.gpu.get(), 256 * 2), l(p.gpu.get(), 4);
  CHECK_THROWS_AS(p.gpu->attention_forward(o.get(), l.as<float>(), q.get(), 1, 1, 256, 1), Error);
}

namespace {
// One attention_kv_forward call on both backends from the same caches
// (rows [0, pos) filled; rows from pos on are NaN on the GPU, so a row read
// before it is written, or past the causal edge, shows up as NaN).
void check_attention_kv(Pair& p, Twin& kc, Twin& vc, int pos, int Tq, int C, int NH, uint64_t seed,
                        const std::string& tag) {
  const std::string sh = tag + shape({{"C", C}, {"NH", NH}, {"HS", C / NH}, {"pos", pos}, {"Tq", Tq}});
  Twin qkv(p, randn(size_t(Tq) * 3 * C, seed), true);
  Twin out = out_twin(p, size_t(Tq) * C, true);
  p.cpu->attention_kv_forward(out.c(), kc.c(), vc.c(), qkv.c(), pos, Tq, C, NH);
  p.gpu->attention_kv_forward(out.g(), kc.g(), vc.g(), qkv.g(), pos, Tq, C, NH);
  // P stays fp32 (no bf16 rounding before the product, unlike the training
  // kernel): only the output's rounding differs.
  check_close("attention kv out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
  // Rows [pos, pos+Tq) now hold the new k, v (exact copies); the rest is untouched.
  const size_t written = size_t(pos + Tq) * C;
  for (Twin* t : {&kc, &vc}) {
    const Vec g = t->read_gpu(p), c = t->read_cpu(p);
    CHECK(Vec(g.begin(), g.begin() + written) == Vec(c.begin(), c.begin() + written));
    CHECK(std::all_of(g.begin() + written, g.end(), [](float v) { return std::isnan(v); }));
  }
}

// Caches of maxT rows: random rows [0, pos) on both sides, NaN from pos on (GPU).
Twin kv_cache(Pair& p, int maxT, int pos, int C, uint64_t seed) {
  Twin t(p, randn(size_t(maxT) * C, seed), true);
  const size_t es = dtype_size(p.gpu->act_dtype());
  std::vector<unsigned char> nan(size_t(maxT - pos) * C * es, 0xFF);
  p.gpu->copy_to_device(t.gbuf.as<char>() + size_t(pos) * C * es, nan.data(), nan.size());
  return t;
}
}  // namespace

TEST_CASE("cuda: attention with a KV cache (prefill and decode)", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int C, NH, maxT, pos, Tq; };
  // HS 16, 19 (scalar key loads), 64, 128, 40, 200 (8 dims per lane);
  // pos 0 and > 0; Tq 1 (8 key splits), 2 (4), 3 (2), odd, and a prefill
  // longer than 1024; decode over long caches (GPT-2's shape at pos 2047).
  for (S s : {S{16, 1, 8, 0, 1}, S{38, 2, 64, 0, 19}, S{38, 2, 64, 23, 1}, S{38, 2, 64, 40, 2}, S{200, 1, 80, 33, 3},
              S{192, 3, 1100, 0, 1030}, S{192, 3, 1600, 1500, 1}, S{256, 2, 300, 100, 37}, S{80, 2, 200, 77, 5},
              S{768, 12, 2048, 2047, 1}, S{64, 4, 40, 0, 40}}) {
    Twin kc = kv_cache(p, s.maxT, s.pos, s.C, 131), vc = kv_cache(p, s.maxT, s.pos, s.C, 132);
    check_attention_kv(p, kc, vc, s.pos, s.Tq, s.C, s.NH, 133, "");
  }
  // A prompt then token-by-token decoding, each backend on its own caches
  // (the GPU's written by its own earlier calls).
  {
    const int C = 192, NH = 3, maxT = 80, prompt = 50;
    Twin kc = kv_cache(p, maxT, 0, C, 141), vc = kv_cache(p, maxT, 0, C, 142);
    check_attention_kv(p, kc, vc, 0, prompt, C, NH, 143, "prefill ");
    for (int pos = prompt; pos < prompt + 5; ++pos) check_attention_kv(p, kc, vc, pos, 1, C, NH, 144 + pos, "decode ");
  }
  // A head size above the supported 256 is a clear error, before anything is written.
  DeviceBuffer q(p.gpu.get(), 3 * 512 * 2), o(p.gpu.get(), 512 * 2), k(p.gpu.get(), 512 * 2), v(p.gpu.get(), 512 * 2);
  CHECK_THROWS_AS(p.gpu->attention_kv_forward(o.get(), k.get(), v.get(), q.get(), 0, 1, 512, 1), Error);
}

TEST_CASE("cuda: gelu and residual", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  for (size_t n : {size_t(1), size_t(19), size_t(111), size_t(500), size_t(4099)}) {
    for (size_t off : {size_t(0), size_t(1)}) {
      const std::string sh = "n=" + std::to_string(n) + (off ? " unaligned" : "");
      Twin x(p, randn(n, 51, 2.0f), true, off);
      Twin y = out_twin(p, n, true, off);
      p.cpu->gelu_forward(y.c(), x.c(), int64_t(n));
      p.gpu->gelu_forward(y.g(), x.g(), int64_t(n));
      check_close("gelu fwd " + sh, y.read_gpu(p), y.read_cpu(p), kBf16);
      Twin dout(p, randn(n, 52), true, off);
      Twin dx = out_twin(p, n, true, off);
      p.cpu->gelu_backward(dx.c(), x.c(), dout.c(), int64_t(n));
      p.gpu->gelu_backward(dx.g(), x.g(), dout.g(), int64_t(n));
      check_close("gelu bwd " + sh, dx.read_gpu(p), dx.read_cpu(p), kBf16);
      // In place: dinp aliases dout.
      p.gpu->gelu_backward(dout.g(), x.g(), dout.g(), int64_t(n));
      check_close("gelu bwd in place " + sh, dout.read_gpu(p), dx.read_cpu(p), kBf16);
      Twin a(p, randn(n, 53), true, off), b(p, randn(n, 54), true, off);
      Twin r = out_twin(p, n, true, off);
      p.cpu->residual_forward(r.c(), a.c(), b.c(), int64_t(n));
      p.gpu->residual_forward(r.g(), a.g(), b.g(), int64_t(n));
      check_close("residual " + sh, r.read_gpu(p), r.read_cpu(p), kBf16);
    }
  }
}

// ---- Llama ops: RMSNorm, RoPE, SwiGLU, grouped-query attention --------------------------------------
// Tolerances as above. Two more kinds of check: bit-for-bit equalities the
// kernels promise (HF's RMSNorm rounding, RoPE pieces vs the whole sequence,
// the GQA entry points with NKV == NH vs the multi-head ones, run-to-run
// reproducibility), and exact copies (v columns RoPE must not touch, cache rows).

namespace {
// Round to nearest even to bf16, on the host (finite values): what
// __float2bfloat16_rn does on the device.
float bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}
bool same_bits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}
// Columns [c0, c0 + w) of every ld-wide row.
Vec columns(const Vec& x, size_t ld, size_t c0, size_t w) {
  Vec r;
  for (size_t row = 0; row < x.size() / ld; ++row)
    r.insert(r.end(), x.begin() + row * ld + c0, x.begin() + row * ld + c0 + w);
  return r;
}
Vec rows(const Vec& x, size_t ld, size_t r0, size_t n) { return Vec(x.begin() + r0 * ld, x.begin() + (r0 + n) * ld); }
// The CPU side of a twin set to `v` (e.g. what the GPU computed), so the
// next op on both backends starts from the very same values.
void set_cpu(Pair& p, Twin& t, const Vec& v) {
  REQUIRE(v.size() == t.n);
  p.cpu->copy_to_device(t.c(), v.data(), v.size() * 4);
  t.val = v;
}
// The (maxT, HS/2, 2) fp32 RoPE table on both backends (theta 5e5, Llama 3's).
struct RopeTab {
  DeviceBuffer c, g;
  RopeTab(Pair& p, int maxT, int HS, const RopeScaling* scaling) {
    const std::vector<float> t = rope_table(maxT, HS, 500000.0, scaling);
    c = upload_f32(p.cpu.get(), t);
    g = upload_f32(p.gpu.get(), t);
  }
  const float* cp() const { return c.as<float>(); }
  const float* gp() const { return g.as<float>(); }
};
}  // namespace

TEST_CASE("cuda: rmsnorm forward (HF's bf16 rounding) and backward (+=)", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; size_t off; float eps; };
  // C = 13 (scalar path), 768, 1000, 2048, 4096, 8192 (16-byte packs; the
  // backward's 8, 8, 4, 2 and 1 teams of warps); N = 7, 19, 111 and 2000
  // (several rows per team); pointers off 16-byte alignment (scalar path at
  // C = 4096); eps 1e-5 and 1e-6.
  for (S s : {S{7, 13, 0, 1e-5f}, S{19, 768, 0, 1e-6f}, S{111, 2048, 0, 1e-5f}, S{7, 4096, 0, 1e-5f},
              S{19, 4096, 1, 1e-6f}, S{111, 13, 1, 1e-5f}, S{2000, 2048, 0, 1e-5f}, S{5, 8192, 0, 1e-5f},
              S{19, 1000, 0, 1e-6f}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}}) + (s.off ? " unaligned" : "");
    const size_t n = size_t(s.N) * s.C;
    Twin x(p, randn(n, 151, 2.0f, 0.5f), true, s.off), w(p, randn(s.C, 152, 0.5f, 1.0f), true, s.off);
    Twin out = out_twin(p, n, true, s.off), rstd = out_twin(p, s.N, false);
    p.cpu->rmsnorm_forward(out.c(), rstd.cf(), x.c(), w.c(), s.N, s.C, s.eps);
    p.gpu->rmsnorm_forward(out.g(), rstd.gf(), x.g(), w.g(), s.N, s.C, s.eps);
    const Vec og = out.read_gpu(p), rg = rstd.read_gpu(p);
    // The GPU rounds x*rstd to bf16 before the weight (HF) and the product
    // again: two roundings against the CPU's fp32, still within kBf16.
    check_close("rmsnorm out " + sh, og, out.read_cpu(p), kBf16);
    check_close("rmsnorm rstd " + sh, rg, rstd.read_cpu(p), kF32);
    // HF's LlamaRMSNorm with bf16 activations is weight * bf16(x * rstd),
    // rounded to bf16: with the GPU's rstd that is the GPU's output bit for bit.
    Vec hf(n);
    for (int r = 0; r < s.N; ++r)
      for (int c = 0; c < s.C; ++c) {
        const size_t i = size_t(r) * s.C + c;
        hf[i] = bf16_round(bf16_round(x.val[i] * rg[r]) * w.val[c]);
      }
    CHECK(same_bits(og, hf));

    Twin r2(p, rstd.read_cpu(p), false);  // both sides normalise with the same rstd
    Twin dout(p, randn(n, 153), true, s.off);
    Twin dinp(p, randn(n, 154), true, s.off);  // += : pre-filled on both sides
    Twin dw(p, randn(s.C, 155), false);
    p.cpu->rmsnorm_backward(dinp.c(), dw.cf(), dout.c(), x.c(), w.c(), r2.cf(), s.N, s.C);
    p.gpu->rmsnorm_backward(dinp.g(), dw.gf(), dout.g(), x.g(), w.g(), r2.gf(), s.N, s.C);
    check_close("rmsnorm dinp (+=) " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
    check_close("rmsnorm dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
    // dweight's block partials are summed in a fixed order: the same bits twice.
    Twin dw1(p, Vec(s.C, 0.0f), false), dw2(p, Vec(s.C, 0.0f), false);
    Twin dx1(p, Vec(n, 0.0f), true, s.off), dx2(p, Vec(n, 0.0f), true, s.off);
    p.gpu->rmsnorm_backward(dx1.g(), dw1.gf(), dout.g(), x.g(), w.g(), r2.gf(), s.N, s.C);
    p.gpu->rmsnorm_backward(dx2.g(), dw2.gf(), dout.g(), x.g(), w.g(), r2.gf(), s.N, s.C);
    CHECK(same_bits(dw1.read_gpu(p), dw2.read_gpu(p)));
    CHECK(same_bits(dx1.read_gpu(p), dx2.read_gpu(p)));
  }
}

// qk-norm (Qwen3, kernels/cuda/qk_norm.cu; not yet run on a GPU when written):
// against the CPU op on the same bf16-representable inputs.
TEST_CASE("cuda: qk_norm forward (HF's bf16 rounding) and backward (dq|dk in place, dw +=)", "[cuda][qwen3]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, NH, NKV, HS; };
  // HS 128 (every Qwen3), 64, 6 (lanes without a channel), 256 (the most
  // the kernel holds); GQA 8:1, 2:1, 1:1; N large enough for several
  // backward blocks per SM.
  for (S s : {S{7, 16, 2, 128}, S{19, 4, 2, 64}, S{3, 4, 4, 6}, S{5, 8, 1, 256}, S{2000, 4, 2, 128}}) {
    const std::string sh = shape({{"N", s.N}, {"NH", s.NH}, {"NKV", s.NKV}, {"HS", s.HS}});
    const size_t W = size_t(s.NH + 2 * s.NKV) * s.HS, n = size_t(s.N) * W, np = size_t(s.N) * (s.NH + s.NKV) * s.HS;
    const Vec x0 = randn(n, 161, 2.0f, 0.5f);
    Twin qkv(p, x0, true), wq(p, randn(s.HS, 162, 0.5f, 1.0f), true), wk(p, randn(s.HS, 163, 0.5f, 1.0f), true);
    Twin pre = out_twin(p, np, true), rstd = out_twin(p, size_t(s.N) * (s.NH + s.NKV), false);
    const float eps = 1e-6f;
    p.cpu->qk_norm_forward(qkv.c(), pre.c(), rstd.cf(), wq.c(), wk.c(), s.N, s.NH, s.NKV, s.HS, eps);
    p.gpu->qk_norm_forward(qkv.g(), pre.g(), rstd.gf(), wq.g(), wk.g(), s.N, s.NH, s.NKV, s.HS, eps);
    check_close("qk_norm out " + sh, qkv.read_gpu(p), qkv.read_cpu(p), kBf16);
    check_close("qk_norm rstd " + sh, rstd.read_gpu(p), rstd.read_cpu(p), kF32);
    CHECK(same_bits(pre.read_gpu(p), pre.read_cpu(p)));  // the input, copied

    Twin r2(p, rstd.read_cpu(p), false);  // both sides with the same statistics
    const Vec dy = randn(n, 164);
    Twin d(p, dy, true), dwq(p, randn(s.HS, 165), false), dwk(p, randn(s.HS, 166), false);
    p.cpu->qk_norm_backward(d.c(), dwq.cf(), dwk.cf(), pre.c(), wq.c(), wk.c(), r2.cf(), s.N, s.NH, s.NKV, s.HS);
    p.gpu->qk_norm_backward(d.g(), dwq.gf(), dwk.gf(), pre.g(), wq.g(), wk.g(), r2.gf(), s.N, s.NH, s.NKV, s.HS);
    check_close("qk_norm dq|dk " + sh, d.read_gpu(p), d.read_cpu(p), kBf16);
    check_close("qk_norm dwq (+=) " + sh, dwq.read_gpu(p), dwq.read_cpu(p), kF32);
    check_close("qk_norm dwk (+=) " + sh, dwk.read_gpu(p), dwk.read_cpu(p), kF32);
    // dv untouched.
    const Vec dg = d.read_gpu(p);
    for (int r = 0; r < s.N; ++r)
      for (size_t c = size_t(s.NH + s.NKV) * s.HS; c < W; ++c) CHECK(dg[size_t(r) * W + c] == bf16_round(dy[size_t(r) * W + c]));
    // The weight gradient is summed in a fixed order: the same bits twice.
    Twin a1(p, Vec(s.HS, 0.0f), false), a2(p, Vec(s.HS, 0.0f), false), b1(p, Vec(s.HS, 0.0f), false),
        b2(p, Vec(s.HS, 0.0f), false), d1(p, dy, true), d2(p, dy, true);
    p.gpu->qk_norm_backward(d1.g(), a1.gf(), b1.gf(), pre.g(), wq.g(), wk.g(), r2.gf(), s.N, s.NH, s.NKV, s.HS);
    p.gpu->qk_norm_backward(d2.g(), a2.gf(), b2.gf(), pre.g(), wq.g(), wk.g(), r2.gf(), s.N, s.NH, s.NKV, s.HS);
    CHECK(same_bits(a1.read_gpu(p), a2.read_gpu(p)));
    CHECK(same_bits(b1.read_gpu(p), b2.read_gpu(p)));
  }
}

TEST_CASE("cuda: fused residual + rmsnorm forward", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; size_t off; };
  for (S s : {S{1, 1, 0}, S{19, 111, 1}, S{7, 2048, 0}, S{37, 4096, 1}, S{111, 13, 0}, S{19, 768, 0}}) {
    const std::string sh = shape({{"N", s.N}, {"C", s.C}}) + (s.off ? " unaligned" : "");
    const size_t n = size_t(s.N) * s.C;
    const float eps = 1e-5f;
    Twin a(p, randn(n, 161, 2.0f, 0.5f), true, s.off), b(p, randn(n, 162, 0.5f, -1.0f), true, s.off);
    Twin w(p, randn(s.C, 163, 0.5f, 1.0f), true);
    Twin res = out_twin(p, n, true, s.off), out = out_twin(p, n, true, s.off), rstd = out_twin(p, s.N, false);
    p.cpu->residual_rmsnorm_forward(res.c(), out.c(), rstd.cf(), a.c(), b.c(), w.c(), s.N, s.C, eps);
    p.gpu->residual_rmsnorm_forward(res.g(), out.g(), rstd.gf(), a.g(), b.g(), w.g(), s.N, s.C, eps);
    check_close("fused residual " + sh, res.read_gpu(p), res.read_cpu(p), kBf16);
    check_close("fused rmsnorm out " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    // The GPU's statistic is over the bf16-rounded sum (what an unfused
    // rmsnorm would read back), the CPU's over the fp32 sum.
    check_close("fused rmsnorm rstd " + sh, rstd.read_gpu(p), rstd.read_cpu(p), kBf16);
    // Bit for bit residual_forward + rmsnorm_forward on the GPU.
    Twin res2 = out_twin(p, n, true, s.off), out2 = out_twin(p, n, true, s.off), rstd2 = out_twin(p, s.N, false);
    p.gpu->residual_forward(res2.g(), a.g(), b.g(), int64_t(n));
    p.gpu->rmsnorm_forward(out2.g(), rstd2.gf(), res2.g(), w.g(), s.N, s.C, eps);
    CHECK(same_bits(res.read_gpu(p), res2.read_gpu(p)));
    CHECK(same_bits(out.read_gpu(p), out2.read_gpu(p)));
    CHECK(same_bits(rstd.read_gpu(p), rstd2.read_gpu(p)));
  }
}

TEST_CASE("cuda: rope forward and backward in place on the q and k heads", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  RopeScaling llama31;
  struct S { int B, T, NH, NKV, HS, pos0; bool scaled; size_t off; };
  // HS 64 and 128 (HS/2 % 8 == 0: 8 pairs per thread), 6 and 38 (HS/2 = 3,
  // 19: one pair per thread); NH/NKV 8/2, 32/8, 6/6, 4/1; pos0 0 and > 0;
  // llama3 rope_scaling and plain; an unaligned qkv (scalar path at HS 64);
  // T = 1030.
  for (S s : {S{2, 19, 8, 2, 64, 0, false, 0}, S{1, 111, 32, 8, 64, 5, true, 0}, S{3, 7, 6, 6, 128, 1000, true, 0},
              S{2, 19, 4, 1, 6, 3, false, 0}, S{1, 1030, 8, 2, 128, 0, true, 0}, S{2, 19, 8, 2, 64, 7, false, 1},
              S{1, 13, 6, 6, 38, 2, false, 0}}) {
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"NH", s.NH}, {"NKV", s.NKV}, {"HS", s.HS},
                                  {"pos0", s.pos0}}) + (s.scaled ? " llama3" : "") + (s.off ? " unaligned" : "");
    const size_t ld = size_t(s.NH + 2 * s.NKV) * s.HS, n = size_t(s.B) * s.T * ld;
    const size_t qk = size_t(s.NH + s.NKV) * s.HS, vw = size_t(s.NKV) * s.HS;  // rotated columns | v columns
    RopeTab tab(p, s.pos0 + s.T + 3, s.HS, s.scaled ? &llama31 : nullptr);
    Twin qkv(p, randn(n, 171), true, s.off);
    p.cpu->rope_forward(qkv.c(), tab.cp(), s.B, s.T, s.NH, s.NKV, s.HS, s.pos0);
    p.gpu->rope_forward(qkv.g(), tab.gp(), s.B, s.T, s.NH, s.NKV, s.HS, s.pos0);
    const Vec got = qkv.read_gpu(p), want = qkv.read_cpu(p);
    check_close("rope fwd q|k " + sh, columns(got, ld, 0, qk), columns(want, ld, 0, qk), kBf16);
    CHECK(same_bits(columns(got, ld, qk, vw), columns(qkv.val, ld, qk, vw)));  // v: not touched

    Twin d(p, randn(n, 172), true, s.off);
    p.cpu->rope_backward(d.c(), tab.cp(), s.B, s.T, s.NH, s.NKV, s.HS, s.pos0);
    p.gpu->rope_backward(d.g(), tab.gp(), s.B, s.T, s.NH, s.NKV, s.HS, s.pos0);
    const Vec dgot = d.read_gpu(p);
    check_close("rope bwd dq|dk " + sh, columns(dgot, ld, 0, qk), columns(d.read_cpu(p), ld, 0, qk), kBf16);
    CHECK(same_bits(columns(dgot, ld, qk, vw), columns(d.val, ld, qk, vw)));  // dv passes through

    // The backward is the forward's inverse (a rotation's transpose): two
    // bf16 roundings away from the input.
    p.gpu->rope_backward(qkv.g(), tab.gp(), s.B, s.T, s.NH, s.NKV, s.HS, s.pos0);
    check_close("rope bwd(fwd(x)) = x " + sh, qkv.read_gpu(p), qkv.val, kBf16);
  }
  // Rows rotated in pieces at pos0 = their first position are the rows of
  // the whole sequence rotated from 0, bit for bit, on the vector path
  // (HS 64) and the scalar one (HS 38), and an unaligned copy (scalar path)
  // gives the vector path's bits.
  for (int HS : {64, 38}) {
    const int T = 37, NH = 8, NKV = 2;
    const size_t ld = size_t(NH + 2 * NKV) * HS;
    RopeTab tab(p, T, HS, &llama31);
    const Vec raw = randn(size_t(T) * ld, 173);
    Twin full(p, raw, true), full_unaligned(p, raw, true, 1);
    p.gpu->rope_forward(full.g(), tab.gp(), 1, T, NH, NKV, HS, 0);
    p.gpu->rope_forward(full_unaligned.g(), tab.gp(), 1, T, NH, NKV, HS, 0);
    const Vec whole = full.read_gpu(p);
    CHECK(same_bits(full_unaligned.read_gpu(p), whole));
    Vec pieces;
    for (const auto& [pos, len] : std::vector<std::pair<int, int>>{{0, 10}, {10, 1}, {11, 20}, {31, 6}}) {
      Twin piece(p, rows(full.val, ld, pos, len), true);
      p.gpu->rope_forward(piece.g(), tab.gp(), 1, len, NH, NKV, HS, pos);
      const Vec r = piece.read_gpu(p);
      pieces.insert(pieces.end(), r.begin(), r.end());
    }
    INFO("HS " << HS);
    CHECK(same_bits(pieces, whole));
  }
  CHECK_THROWS_WITH(p.gpu->rope_forward(nullptr, nullptr, 1, 1, 1, 1, 5, 0), Catch::Matchers::Contains("head size 5"));
  CHECK_THROWS_WITH(p.gpu->rope_backward(nullptr, nullptr, 1, 1, 1, 1, 4, -1), Catch::Matchers::Contains("pos0 -1"));
}

TEST_CASE("cuda: swiglu forward and backward (dinp overwritten, may alias inp)", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, F; size_t off; };
  // F = 13 (scalar), 8 (one pack), 768, 2048, 8192 (packs); N = 1, 7, 19,
  // 111; unaligned pointers (scalar path at F = 8192).
  for (S s : {S{7, 13, 0}, S{1, 8, 0}, S{19, 768, 0}, S{111, 2048, 0}, S{7, 8192, 0}, S{19, 8192, 1},
              S{111, 13, 1}}) {
    const std::string sh = shape({{"N", s.N}, {"F", s.F}}) + (s.off ? " unaligned" : "");
    const size_t nin = size_t(s.N) * 2 * s.F, nout = size_t(s.N) * s.F;
    // std 3 gates reach both tails of the sigmoid; +-40 and +-100 saturate it
    // (e^100 overflows __expf to inf: sigma must come out 0, not NaN).
    Vec in = randn(nin, 181, 3.0f);
    in[0] = 40.0f;
    in[1] = -40.0f;
    in[2] = 100.0f;
    in[3] = -100.0f;
    Twin x(p, in, true, s.off);
    Twin out = out_twin(p, nout, true, s.off);
    p.cpu->swiglu_forward(out.c(), x.c(), s.N, s.F);
    p.gpu->swiglu_forward(out.g(), x.g(), s.N, s.F);
    check_close("swiglu fwd " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);

    Twin dout(p, randn(nout, 182), true, s.off);
    Twin dinp = out_twin(p, nin, true, s.off);  // overwritten: poisoned first
    p.cpu->swiglu_backward(dinp.c(), dout.c(), x.c(), s.N, s.F);
    p.gpu->swiglu_backward(dinp.g(), dout.g(), x.g(), s.N, s.F);
    const Vec dg = dinp.read_gpu(p), dc = dinp.read_cpu(p);
    check_close("swiglu dinp " + sh, dg, dc, kBf16);
    check_close("swiglu dgate " + sh, columns(dg, 2 * s.F, 0, s.F), columns(dc, 2 * s.F, 0, s.F), kBf16);
    check_close("swiglu dup " + sh, columns(dg, 2 * s.F, s.F, s.F), columns(dc, 2 * s.F, s.F, s.F), kBf16);
    // In place (dinp == inp), as the model calls it: the same bits.
    p.gpu->swiglu_backward(x.g(), dout.g(), x.g(), s.N, s.F);
    CHECK(same_bits(x.read_gpu(p), dg));
  }
}

namespace {
struct Gqa {
  int NH, NKV, HS;
  size_t ld() const { return size_t(NH + 2 * NKV) * HS; }
  size_t C() const { return size_t(NH) * HS; }
  size_t KV() const { return size_t(NKV) * HS; }
};
}  // namespace

TEST_CASE("cuda: grouped-query attention forward and backward", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int B, T; Gqa h; };
  // NH/NKV 8/2, 32/8, 6/6, 4/1; HS 64, 128, 19 (padded to 32, scalar
  // loads), 40; T = 1, odd, crossing the 64-row tiles, 1030.
  for (S s : {S{2, 19, {8, 2, 64}}, S{1, 130, {32, 8, 64}}, S{2, 65, {6, 6, 19}}, S{3, 70, {4, 1, 128}},
              S{1, 1, {4, 1, 64}}, S{1, 1030, {8, 2, 128}}, S{2, 33, {4, 1, 40}}, S{2, 257, {32, 8, 64}}}) {
    const Gqa& h = s.h;
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}});
    const size_t nqkv = size_t(s.B) * s.T * h.ld(), nout = size_t(s.B) * s.T * h.C();
    Twin qkv(p, randn(nqkv, 191), true);
    Twin out = out_twin(p, nout, true);
    CHECK(p.gpu->attention_gqa_saved_floats(s.B, s.T, h.NH) == size_t(s.B) * h.NH * s.T);  // the lse only
    DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
    DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
    p.cpu->attention_gqa_forward(out.c(), csaved.as<float>(), qkv.c(), s.B, s.T, h.NH, h.NKV, h.HS);
    p.gpu->attention_gqa_forward(out.g(), gsaved.as<float>(), qkv.g(), s.B, s.T, h.NH, h.NKV, h.HS);
    check_close("attention_gqa out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);

    Twin dout(p, randn(nout, 192), true);
    Twin dqkv = out_twin(p, nqkv, true);  // overwritten: poisoned first
    p.cpu->attention_gqa_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                  h.HS);
    p.gpu->attention_gqa_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                  h.HS);
    const Vec dg = dqkv.read_gpu(p), dc = dqkv.read_cpu(p);
    check_close("attention_gqa dqkv " + sh, dg, dc, kAttnBwd);
    check_close("attention_gqa dq " + sh, columns(dg, h.ld(), 0, h.C()), columns(dc, h.ld(), 0, h.C()), kAttnBwd);
    check_close("attention_gqa dk (group sum) " + sh, columns(dg, h.ld(), h.C(), h.KV()),
                columns(dc, h.ld(), h.C(), h.KV()), kAttnBwd);
    check_close("attention_gqa dv (group sum) " + sh, columns(dg, h.ld(), h.C() + h.KV(), h.KV()),
                columns(dc, h.ld(), h.C() + h.KV(), h.KV()), kAttnBwd);
    // dk/dv sum the group in a fixed order (no atomics): the same bits again.
    Twin dqkv2 = out_twin(p, nqkv, true);
    p.gpu->attention_gqa_backward(dqkv2.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                  h.HS);
    CHECK(same_bits(dqkv2.read_gpu(p), dg));
  }
  DeviceBuffer q(p.gpu.get(), 4096), o(p.gpu.get(), 4096), l(p.gpu.get(), 64);
  CHECK_THROWS_WITH(p.gpu->attention_gqa_forward(o.get(), l.as<float>(), q.get(), 1, 1, 6, 4, 2),
                    Catch::Matchers::Contains("num_key_value_heads 4 must divide num_attention_heads 6"));
  CHECK_THROWS_WITH(p.gpu->attention_gqa_backward(q.get(), o.get(), q.get(), o.get(), l.as<float>(), 1, 1, 6, 4, 2),
                    Catch::Matchers::Contains("num_key_value_heads 4"));
  // A head size above the supported 128 is a clear error, not a wrong answer.
  CHECK_THROWS_WITH(p.gpu->attention_gqa_forward(o.get(), l.as<float>(), q.get(), 1, 1, 2, 1, 256),
                    Catch::Matchers::Contains("head size 256 (head_dim)"));
}

// The dk/dv kernel's query splits (attention.cuh): each key tile's (query
// head, query tile) list cut into S runs on S blocks, fp32 partials summed
// in a fixed order. Forced through TRAINRUN_CUDA_ATTN_DKV_SPLITS (read by
// the backend's constructor): S = 2, 3 and 7 against the CPU backend, bit
// for bit across runs, dq untouched (its kernel does not change), and dk/dv
// within a bf16 rounding of S = 1; splits larger than a tile's list leave
// blocks with no pairs, which must write zero partials. Not yet run on a
// GPU (2026-12-03).
TEST_CASE("cuda: attention dk/dv split over query ranges matches the CPU and is deterministic", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  struct S { int B, T; Gqa h; };
  for (S s : {S{1, 200, {4, 1, 128}}, S{2, 130, {8, 2, 64}}, S{1, 70, {6, 6, 19}}}) {
    const Gqa& h = s.h;
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}});
    const size_t nqkv = size_t(s.B) * s.T * h.ld(), nout = size_t(s.B) * s.T * h.C();
    Vec ref_dq, ref_dkv;
    for (int splits : {1, 2, 3, 7}) {
      ::setenv("TRAINRUN_CUDA_ATTN_DKV_SPLITS", std::to_string(splits).c_str(), 1);
      Pair p;
      ::unsetenv("TRAINRUN_CUDA_ATTN_DKV_SPLITS");
      Twin qkv(p, randn(nqkv, 391), true);
      Twin out = out_twin(p, nout, true);
      DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
      DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
      p.cpu->attention_gqa_forward(out.c(), csaved.as<float>(), qkv.c(), s.B, s.T, h.NH, h.NKV, h.HS);
      p.gpu->attention_gqa_forward(out.g(), gsaved.as<float>(), qkv.g(), s.B, s.T, h.NH, h.NKV, h.HS);
      Twin dout(p, randn(nout, 392), true);
      Twin dqkv = out_twin(p, nqkv, true);
      p.cpu->attention_gqa_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                    h.HS);
      p.gpu->attention_gqa_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                    h.HS);
      const Vec dg = dqkv.read_gpu(p), dc = dqkv.read_cpu(p);
      const std::string tag = sh + " splits " + std::to_string(splits);
      check_close("attention_gqa dqkv " + tag, dg, dc, kAttnBwd);
      const Vec dq = columns(dg, h.ld(), 0, h.C()), dkv = columns(dg, h.ld(), h.C(), 2 * h.KV());
      Twin again = out_twin(p, nqkv, true);
      p.gpu->attention_gqa_backward(again.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                    h.HS);
      CHECK(same_bits(again.read_gpu(p), dg));
      if (splits == 1) {
        ref_dq = dq;
        ref_dkv = dkv;
      } else {
        CHECK(same_bits(dq, ref_dq));
        check_close("dk|dv split vs unsplit " + tag, dkv, ref_dkv, kBf16);
      }
    }
  }
}

// The shapes of wide models (scripts/gpu-check.sh step ops_wide): GEMMs at
// C = 4096 and 8192, and grouped-query attention with HS = 128, T > 1030
// and one KV head (what a TP rank of a 70B model holds at tp8), checked
// against the CPU backend, not only timed. Not yet run on a GPU (2026-12-03).
TEST_CASE("cuda: wide shapes (C 4096/8192, HS 128, T > 1030, one KV head) match the CPU backend", "[cuda][wide]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  check_matmul(p, 19, 4096, 1031, true, 0, "wide ");
  check_matmul(p, 33, 8192, 257, false, 0, "wide ");
  struct S { int B, T; Gqa h; };
  for (S s : {S{1, 1031, {8, 1, 128}}, S{1, 1100, {4, 1, 128}}}) {
    const Gqa& h = s.h;
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}});
    const size_t nqkv = size_t(s.B) * s.T * h.ld(), nout = size_t(s.B) * s.T * h.C();
    Twin qkv(p, randn(nqkv, 291), true);
    Twin out = out_twin(p, nout, true);
    DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
    DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_gqa_saved_floats(s.B, s.T, h.NH) * 4);
    p.cpu->attention_gqa_forward(out.c(), csaved.as<float>(), qkv.c(), s.B, s.T, h.NH, h.NKV, h.HS);
    p.gpu->attention_gqa_forward(out.g(), gsaved.as<float>(), qkv.g(), s.B, s.T, h.NH, h.NKV, h.HS);
    check_close("wide attention_gqa out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);
    Twin dout(p, randn(nout, 292), true);
    Twin dqkv = out_twin(p, nqkv, true);
    p.cpu->attention_gqa_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                  h.HS);
    p.gpu->attention_gqa_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), s.B, s.T, h.NH, h.NKV,
                                  h.HS);
    check_close("wide attention_gqa dqkv " + sh, dqkv.read_gpu(p), dqkv.read_cpu(p), kAttnBwd);
  }
}

// data.document_mask on the GPU against the CPU backend (itself checked
// against per-document runs and finite differences, tests/test_document_mask.cpp):
// attention (MHA and GQA, forward + backward), RoPE and the encoder with
// positions restarting per document. Documents of length 1, at positions 0
// and T-1, on and off the 64-row tiles, one spanning a whole sequence.
TEST_CASE("cuda: document-masked attention, RoPE and encoder match the CPU backend", "[cuda][llama][docmask]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  const int T = 200, B = 3;
  const std::vector<std::vector<int>> starts = {{0, 1, 2, 3, 64, 65, 130, 199}, {}, {63, 64, 128, 129}};
  std::vector<int32_t> ds(size_t(B) * T), pos(size_t(B) * T);
  for (int b = 0; b < B; ++b) {
    int cur = 0;
    for (int t = 0; t < T; ++t) {
      for (int s : starts[size_t(b)]) if (s == t) cur = t;
      ds[size_t(b * T + t)] = cur;
      pos[size_t(b * T + t)] = t - cur;
    }
  }
  Tok dsk(p, ds), posk(p, pos);
  for (Gqa h : {Gqa{4, 4, 64}, Gqa{8, 2, 64}, Gqa{6, 6, 19}, Gqa{4, 1, 128}}) {
    const bool mha = h.NH == h.NKV;
    const std::string sh = shape({{"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}});
    const size_t nqkv = size_t(B) * T * h.ld(), nout = size_t(B) * T * h.C();
    Twin qkv(p, randn(nqkv, 291), true);
    Twin out = out_twin(p, nout, true);
    DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_gqa_saved_floats(B, T, h.NH) * 4);
    DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_gqa_saved_floats(B, T, h.NH) * 4);
    Twin dout(p, randn(nout, 292), true);
    Twin dqkv = out_twin(p, nqkv, true);
    if (mha) {
      const int C = int(h.C());
      p.cpu->attention_forward(out.c(), csaved.as<float>(), qkv.c(), B, T, C, h.NH, dsk.cp());
      p.gpu->attention_forward(out.g(), gsaved.as<float>(), qkv.g(), B, T, C, h.NH, dsk.gp());
      p.cpu->attention_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), B, T, C, h.NH, dsk.cp());
      p.gpu->attention_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), B, T, C, h.NH, dsk.gp());
    } else {
      p.cpu->attention_gqa_forward(out.c(), csaved.as<float>(), qkv.c(), B, T, h.NH, h.NKV, h.HS, dsk.cp());
      p.gpu->attention_gqa_forward(out.g(), gsaved.as<float>(), qkv.g(), B, T, h.NH, h.NKV, h.HS, dsk.gp());
      p.cpu->attention_gqa_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), B, T, h.NH, h.NKV, h.HS,
                                    dsk.cp());
      p.gpu->attention_gqa_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), B, T, h.NH, h.NKV, h.HS,
                                    dsk.gp());
    }
    check_close("doc-masked attention out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);
    check_close("doc-masked attention dqkv " + sh, dqkv.read_gpu(p), dqkv.read_cpu(p), kAttnBwd);
  }
  {
    const Gqa h{8, 2, 64};
    const std::vector<float> table = rope_table(T, h.HS, 500000.0, nullptr);
    DeviceBuffer ccs = upload_f32(p.cpu.get(), table), gcs = upload_f32(p.gpu.get(), table);
    Twin x(p, randn(size_t(B) * T * h.ld(), 293), true);
    p.cpu->rope_forward(x.c(), ccs.as<float>(), B, T, h.NH, h.NKV, h.HS, 0, posk.cp());
    p.gpu->rope_forward(x.g(), gcs.as<float>(), B, T, h.NH, h.NKV, h.HS, 0, posk.gp());
    check_close("doc-masked rope forward", x.read_gpu(p), x.read_cpu(p), kBf16);
    p.cpu->rope_backward(x.c(), ccs.as<float>(), B, T, h.NH, h.NKV, h.HS, 0, posk.cp());
    p.gpu->rope_backward(x.g(), gcs.as<float>(), B, T, h.NH, h.NKV, h.HS, 0, posk.gp());
    check_close("doc-masked rope backward", x.read_gpu(p), x.read_cpu(p), kBf16);
  }
  {
    const int C = 72, V = 50;
    Tok tk(p, rand_tokens(size_t(B) * T, V, 294));
    Twin wte(p, randn(size_t(V) * C, 295), true), wpe(p, randn(size_t(T) * C, 296), true);
    Twin out = out_twin(p, size_t(B) * T * C, true);
    p.cpu->encoder_forward(out.c(), tk.cp(), wte.c(), wpe.c(), B, T, C, posk.cp());
    p.gpu->encoder_forward(out.g(), tk.gp(), wte.g(), wpe.g(), B, T, C, posk.gp());
    check_close("doc-masked encoder fwd", out.read_gpu(p), out.read_cpu(p), kBf16);
    Twin dout(p, randn(size_t(B) * T * C, 297), true);
    Twin dwte(p, Vec(size_t(V) * C, 0.0f), false), dwpe(p, Vec(size_t(T) * C, 0.0f), false);
    p.cpu->encoder_backward(dwte.cf(), dwpe.cf(), dout.c(), tk.cp(), B, T, C, posk.cp());
    p.gpu->encoder_backward(dwte.gf(), dwpe.gf(), dout.g(), tk.gp(), B, T, C, posk.gp());
    check_close("doc-masked encoder dwte", dwte.read_gpu(p), dwte.read_cpu(p), kF32);
    check_close("doc-masked encoder dwpe (by position)", dwpe.read_gpu(p), dwpe.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: grouped-query attention with NKV == NH is multi-head attention bit for bit", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  Backend* g = p.gpu.get();
  struct S { int B, T, NH, HS; };
  for (S s : {S{2, 130, 3, 64}, S{1, 70, 2, 128}, S{2, 19, 2, 19}}) {
    const int C = s.NH * s.HS;
    const size_t nqkv = size_t(s.B) * s.T * 3 * C, nout = size_t(s.B) * s.T * C;
    INFO(shape({{"B", s.B}, {"T", s.T}, {"NH", s.NH}, {"HS", s.HS}}));
    const size_t es = dtype_size(g->act_dtype());
    DeviceBuffer qkv = test::upload_act(g, randn(nqkv, 201)), dout = test::upload_act(g, randn(nout, 202));
    DeviceBuffer o1(g, nout * es), o2(g, nout * es), l1(g, g->attention_saved_floats(s.B, s.T, s.NH) * 4),
        l2(g, g->attention_gqa_saved_floats(s.B, s.T, s.NH) * 4), d1(g, nqkv * es), d2(g, nqkv * es);
    g->attention_forward(o1.get(), l1.as<float>(), qkv.get(), s.B, s.T, C, s.NH);
    g->attention_gqa_forward(o2.get(), l2.as<float>(), qkv.get(), s.B, s.T, s.NH, s.NH, s.HS);
    CHECK(same_bits(download_act(g, o1.get(), nout), download_act(g, o2.get(), nout)));
    CHECK(same_bits(download_f32(g, l1.get(), l1.bytes() / 4), download_f32(g, l2.get(), l2.bytes() / 4)));
    g->attention_backward(d1.get(), dout.get(), qkv.get(), o1.get(), l1.as<float>(), s.B, s.T, C, s.NH);
    g->attention_gqa_backward(d2.get(), dout.get(), qkv.get(), o2.get(), l2.as<float>(), s.B, s.T, s.NH, s.NH, s.HS);
    CHECK(same_bits(download_act(g, d1.get(), nqkv), download_act(g, d2.get(), nqkv)));
    // The KV-cached pair too: the caches and the output.
    const int Tq = std::min(s.T, 7);
    const size_t cache = size_t(s.T) * C * es;
    DeviceBuffer kc1(g, cache), vc1(g, cache), kc2(g, cache), vc2(g, cache);
    g->attention_kv_forward(o1.get(), kc1.get(), vc1.get(), qkv.get(), 0, Tq, C, s.NH);
    g->attention_kv_gqa_forward(o2.get(), kc2.get(), vc2.get(), qkv.get(), 0, Tq, s.NH, s.NH, s.HS);
    CHECK(same_bits(download_act(g, o1.get(), size_t(Tq) * C), download_act(g, o2.get(), size_t(Tq) * C)));
    CHECK(same_bits(download_act(g, kc1.get(), size_t(Tq) * C), download_act(g, kc2.get(), size_t(Tq) * C)));
    CHECK(same_bits(download_act(g, vc1.get(), size_t(Tq) * C), download_act(g, vc2.get(), size_t(Tq) * C)));
  }
}

namespace {
// One attention_kv_gqa_forward call on both backends from the same caches
// (rows [0, pos) filled; from pos on NaN on the GPU, so a row read before it
// is written, or past the causal edge, shows up as NaN).
void check_attention_kv_gqa(Pair& p, Twin& kc, Twin& vc, const Twin& qkv, int pos, int Tq, const Gqa& h,
                            const std::string& tag, Vec* gpu_out = nullptr) {
  const std::string sh = tag + shape({{"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}, {"pos", pos}, {"Tq", Tq}});
  Twin out = out_twin(p, size_t(Tq) * h.C(), true);
  p.cpu->attention_kv_gqa_forward(out.c(), kc.c(), vc.c(), qkv.c(), pos, Tq, h.NH, h.NKV, h.HS);
  p.gpu->attention_kv_gqa_forward(out.g(), kc.g(), vc.g(), qkv.g(), pos, Tq, h.NH, h.NKV, h.HS);
  // P stays fp32 in this kernel: only the output's rounding differs.
  const Vec og = out.read_gpu(p);
  check_close("attention_kv_gqa out " + sh, og, out.read_cpu(p), kBf16);
  if (gpu_out) *gpu_out = og;
  // Rows [pos, pos+Tq) now hold the new k, v (exact copies); the rest is untouched.
  const size_t written = size_t(pos + Tq) * h.KV();
  for (Twin* t : {&kc, &vc}) {
    const Vec g = t->read_gpu(p), c = t->read_cpu(p);
    CHECK(same_bits(Vec(g.begin(), g.begin() + written), Vec(c.begin(), c.begin() + written)));
    CHECK(std::all_of(g.begin() + written, g.end(), [](float v) { return std::isnan(v); }));
  }
}
}  // namespace

TEST_CASE("cuda: grouped-query attention with a KV cache (prefill and decode)", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { Gqa h; int maxT, pos, Tq; };
  // Llama-3.2-1B's decode at the last position of a 2048 cache; HS 128,
  // 200 (8 dims per lane), 19 (scalar key loads); Tq 1, 3, 37 and a
  // prefill longer than 1024.
  for (S s : {S{{32, 8, 64}, 2048, 2047, 1}, S{{8, 2, 128}, 300, 100, 37}, S{{4, 1, 200}, 80, 33, 3},
              S{{6, 6, 19}, 64, 23, 1}, S{{8, 2, 64}, 1100, 0, 1030}}) {
    Twin kc = kv_cache(p, s.maxT, s.pos, int(s.h.KV()), 211), vc = kv_cache(p, s.maxT, s.pos, int(s.h.KV()), 212);
    Twin qkv(p, randn(size_t(s.Tq) * s.h.ld(), 213), true);
    check_attention_kv_gqa(p, kc, vc, qkv, s.pos, s.Tq, s.h, "");
  }
  DeviceBuffer q(p.gpu.get(), 8192), o(p.gpu.get(), 4096), k(p.gpu.get(), 4096), v(p.gpu.get(), 4096);
  CHECK_THROWS_WITH(p.gpu->attention_kv_gqa_forward(o.get(), k.get(), v.get(), q.get(), 0, 1, 6, 4, 2),
                    Catch::Matchers::Contains("num_key_value_heads 4 must divide num_attention_heads 6"));
  CHECK_THROWS_WITH(p.gpu->attention_kv_gqa_forward(o.get(), k.get(), v.get(), q.get(), 0, 1, 2, 1, 512),
                    Catch::Matchers::Contains("head size 512 (head_dim)"));
}

TEST_CASE("cuda: rope + attention_kv_gqa_forward in pieces match rope + attention_gqa_forward", "[cuda][llama]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  RopeScaling llama31;
  // One sequence of T tokens on the GPU: rotated from 0 and attended at
  // once (the training path), and in pieces (a prefill, then single tokens
  // and short runs at pos > 0), each rotated at its own positions and
  // attended through the GPU's own cache. The pieces' rows must be the whole
  // sequence's: RoPE bit for bit, attention to kAttnFwd (the flash kernel
  // rounds P to bf16 before P V, the cached kernel keeps it fp32). Each
  // piece is also checked against the CPU on the same inputs and caches.
  struct S { Gqa h; int T, prefill; };
  for (S s : {S{{8, 2, 64}, 200, 64}, S{{32, 8, 64}, 150, 37}, S{{4, 1, 128}, 1030, 1000}, S{{6, 6, 38}, 70, 1},
              S{{4, 1, 6}, 40, 19}}) {
    const Gqa& h = s.h;
    const size_t ld = h.ld(), C = h.C(), KV = h.KV();
    const int maxT = s.T + 5;
    INFO(shape({{"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}, {"T", s.T}}));
    RopeTab tab(p, maxT, h.HS, &llama31);
    const Vec raw = randn(size_t(s.T) * ld, 221);
    Twin full(p, raw, true);
    p.gpu->rope_forward(full.g(), tab.gp(), 1, s.T, h.NH, h.NKV, h.HS, 0);
    const Vec rotated = full.read_gpu(p);
    Twin out_full = out_twin(p, size_t(s.T) * C, true);
    DeviceBuffer lse(p.gpu.get(), p.gpu->attention_gqa_saved_floats(1, s.T, h.NH) * 4);
    p.gpu->attention_gqa_forward(out_full.g(), lse.as<float>(), full.g(), 1, s.T, h.NH, h.NKV, h.HS);
    const Vec want = out_full.read_gpu(p);

    Twin kc = kv_cache(p, maxT, 0, int(KV), 222), vc = kv_cache(p, maxT, 0, int(KV), 223);
    std::vector<std::pair<int, int>> pieces{{0, s.prefill}};
    const int runs[] = {1, 3, 1, 17};
    for (int pos = s.prefill, i = 0; pos < s.T; pos += pieces.back().second, ++i)
      pieces.push_back({pos, std::min(runs[i % 4], s.T - pos)});
    Vec got, got_rot;
    for (const auto& [pos, len] : pieces) {
      Twin piece(p, rows(full.val, ld, pos, len), true);
      p.gpu->rope_forward(piece.g(), tab.gp(), 1, len, h.NH, h.NKV, h.HS, pos);
      const Vec pr = piece.read_gpu(p);
      set_cpu(p, piece, pr);  // the CPU attends over the GPU's rotated values
      got_rot.insert(got_rot.end(), pr.begin(), pr.end());
      Vec rows_out;
      check_attention_kv_gqa(p, kc, vc, piece, pos, len, h, "piece ", &rows_out);
      got.insert(got.end(), rows_out.begin(), rows_out.end());
    }
    CHECK(same_bits(got_rot, rotated));
    check_close("attention_kv_gqa pieces vs attention_gqa rows", got, want, kAttnFwd);
    // The cache holds every token's rotated k and its v.
    const Vec k = kc.read_gpu(p), v = vc.read_gpu(p);
    CHECK(same_bits(Vec(k.begin(), k.begin() + size_t(s.T) * KV), columns(rotated, ld, C, KV)));
    CHECK(same_bits(Vec(v.begin(), v.begin() + size_t(s.T) * KV), columns(rotated, ld, C + KV, KV)));
  }
}

// AttentionOptions in the flash kernels: a sliding window (T > W, windows
// narrower than a 64-key tile, straddling tiles and wider than one), with
// document masks, a soft-cap that bites and a score scale, against the CPU
// op (itself checked against the definition and finite differences in
// test_sliding_window). Not yet run on a GPU (2026-12-04).
TEST_CASE("cuda: attention with a sliding window, soft-cap and scale matches the CPU backend", "[cuda][llama][window]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  const int B = 2, T = 300;
  std::vector<int32_t> ds(size_t(B) * T);
  for (int t = 0; t < T; ++t) {
    ds[size_t(t)] = 0;                               // one document
    ds[size_t(T + t)] = t < 90 ? 0 : t < 250 ? 90 : 250;  // 90, 160 and 50 rows
  }
  Tok dsk(p, ds);
  struct S { Gqa h; AttentionOptions opt; bool docs; };
  for (S s : {S{{8, 2, 64}, {7, 0.f, 0.f}, false}, S{{8, 2, 64}, {100, 0.f, 0.f}, true},
              S{{4, 1, 128}, {64, 0.f, 0.f}, true}, S{{6, 6, 19}, {33, 0.f, 0.f}, false},
              S{{8, 2, 64}, {0, 20.f, 0.0625f}, true}, S{{4, 1, 40}, {50, 2.f, 0.3f}, true}}) {
    const Gqa& h = s.h;
    const std::string sh = shape({{"NH", h.NH}, {"NKV", h.NKV}, {"HS", h.HS}, {"window", s.opt.window},
                                  {"softcap", long(s.opt.softcap)}, {"docs", s.docs}});
    const size_t nqkv = size_t(B) * T * h.ld(), nout = size_t(B) * T * h.C();
    Twin qkv(p, randn(nqkv, 391, 2.0), true);
    Twin out = out_twin(p, nout, true);
    DeviceBuffer csaved(p.cpu.get(), p.cpu->attention_gqa_saved_floats(B, T, h.NH) * 4);
    DeviceBuffer gsaved(p.gpu.get(), p.gpu->attention_gqa_saved_floats(B, T, h.NH) * 4);
    const int32_t* cds = s.docs ? dsk.cp() : nullptr;
    const int32_t* gds = s.docs ? dsk.gp() : nullptr;
    p.cpu->attention_gqa_forward(out.c(), csaved.as<float>(), qkv.c(), B, T, h.NH, h.NKV, h.HS, cds, s.opt);
    p.gpu->attention_gqa_forward(out.g(), gsaved.as<float>(), qkv.g(), B, T, h.NH, h.NKV, h.HS, gds, s.opt);
    check_close("options attention out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);
    Twin dout(p, randn(nout, 392), true);
    Twin dqkv = out_twin(p, nqkv, true);
    p.cpu->attention_gqa_backward(dqkv.c(), dout.c(), qkv.c(), out.c(), csaved.as<float>(), B, T, h.NH, h.NKV, h.HS,
                                  cds, s.opt);
    p.gpu->attention_gqa_backward(dqkv.g(), dout.g(), qkv.g(), out.g(), gsaved.as<float>(), B, T, h.NH, h.NKV, h.HS,
                                  gds, s.opt);
    check_close("options attention dqkv " + sh, dqkv.read_gpu(p), dqkv.read_cpu(p), kAttnBwd);
  }
}

// The ring cache of the KV-cached kernel (window W: W rows, position p at
// row p % W) fed in pieces longer and shorter than W, against the CPU op on
// the same inputs and rings (the rings equal bit for bit after each piece),
// and the pieces' rows against the windowed flash forward. Not yet run on a
// GPU (2026-12-04).
TEST_CASE("cuda: attention_kv_gqa_forward with a sliding-window ring matches the CPU and the windowed forward",
          "[cuda][llama][window]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  for (const int W : {5, 40}) {
    const Gqa h{8, 2, 64};
    const int T = 150;
    AttentionOptions opt;
    opt.window = W;
    opt.softcap = 3.f;
    const size_t ld = h.ld(), C = h.C(), KV = h.KV();
    Twin full(p, randn(size_t(T) * ld, 401 + W, 1.5), true);
    Twin out_full = out_twin(p, size_t(T) * C, true);
    DeviceBuffer lse(p.gpu.get(), p.gpu->attention_gqa_saved_floats(1, T, h.NH) * 4);
    p.gpu->attention_gqa_forward(out_full.g(), lse.as<float>(), full.g(), 1, T, h.NH, h.NKV, h.HS, nullptr, opt);
    const Vec want = out_full.read_gpu(p);
    Twin kc(p, Vec(size_t(W) * KV, 0.0f), true), vc(p, Vec(size_t(W) * KV, 0.0f), true);
    Vec got;
    for (const auto& [pos, len] : std::vector<std::pair<int, int>>{{0, 70}, {70, 1}, {71, 3}, {74, 1}, {75, 40},
                                                                   {115, 1}, {116, 34}}) {
      Twin piece(p, rows(full.val, ld, pos, len), true);
      Twin out = out_twin(p, size_t(len) * C, true);
      p.cpu->attention_kv_gqa_forward(out.c(), kc.c(), vc.c(), piece.c(), pos, len, h.NH, h.NKV, h.HS, opt);
      p.gpu->attention_kv_gqa_forward(out.g(), kc.g(), vc.g(), piece.g(), pos, len, h.NH, h.NKV, h.HS, opt);
      const Vec og = out.read_gpu(p);
      check_close("ring attention_kv_gqa out " + shape({{"W", W}, {"pos", pos}, {"Tq", len}}), og, out.read_cpu(p),
                  kBf16);
      got.insert(got.end(), og.begin(), og.end());
      CHECK(same_bits(kc.read_gpu(p), kc.read_cpu(p)));
      CHECK(same_bits(vc.read_gpu(p), vc.read_cpu(p)));
    }
    check_close("ring pieces vs windowed attention_gqa rows W=" + std::to_string(W), got, want, kAttnFwd);
  }
}

namespace {
// The first V of every ldv-long row.
Vec unpad(const Vec& x, int N, int V, int ldv) {
  Vec r;
  for (int n = 0; n < N; ++n) r.insert(r.end(), x.begin() + size_t(n) * ldv, x.begin() + size_t(n) * ldv + V);
  return r;
}
bool pad_is_nan(const Vec& x, int N, int V, int ldv) {
  for (int n = 0; n < N; ++n)
    for (int v = V; v < ldv; ++v)
      if (!std::isnan(x[size_t(n) * ldv + v])) return false;
  return true;
}
}  // namespace

TEST_CASE("cuda: softmax cross-entropy", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, V, ldv; };
  // ldv > V: the model's padded rows (logits_stride) and an odd pad whose
  // rows start unaligned; pad columns must stay untouched (poisoned).
  for (S s : {S{1, 1, 1}, S{19, 37, 37}, S{5, 111, 111}, S{3, 500, 500}, S{4, 50257, 50257}, S{5, 111, 118},
              S{4, 50257, p.gpu->logits_stride(50257)}}) {
    const std::string sh = shape({{"N", s.N}, {"V", s.V}, {"ldv", s.ldv}});
    auto tgt = rand_tokens(s.N, s.V, 61);
    if (s.N > 2) tgt[1] = -1;  // ignored position
    Tok tk(p, tgt);
    const size_t n = size_t(s.N) * s.ldv;
    Twin logits(p, randn(n, 62, 3.0f), true);
    Twin loss = out_twin(p, s.N, false);
    p.cpu->softmax_cross_entropy(loss.cf(), nullptr, logits.c(), tk.cp(), s.N, s.V, s.ldv, 0.0f);
    p.gpu->softmax_cross_entropy(loss.gf(), nullptr, logits.g(), tk.gp(), s.N, s.V, s.ldv, 0.0f);
    check_close("softmax-CE loss " + sh, loss.read_gpu(p), loss.read_cpu(p), kF32);
    const float scale = 1.0f / 7;
    Twin dl = out_twin(p, n, true);
    Twin loss2 = out_twin(p, s.N, false);
    p.cpu->softmax_cross_entropy(loss2.cf(), dl.c(), logits.c(), tk.cp(), s.N, s.V, s.ldv, scale);
    p.gpu->softmax_cross_entropy(loss2.gf(), dl.g(), logits.g(), tk.gp(), s.N, s.V, s.ldv, scale);
    const Vec dl_gpu = dl.read_gpu(p), dl_cpu = dl.read_cpu(p);
    check_close("softmax-CE dlogits " + sh, unpad(dl_gpu, s.N, s.V, s.ldv), unpad(dl_cpu, s.N, s.V, s.ldv), kBf16);
    CHECK(pad_is_nan(dl_gpu, s.N, s.V, s.ldv));
    check_close("softmax-CE loss (with grad) " + sh, loss2.read_gpu(p), loss.read_cpu(p), kF32);
    // In place over the logits, as the model calls it.
    p.gpu->softmax_cross_entropy(loss2.gf(), logits.g(), logits.g(), tk.gp(), s.N, s.V, s.ldv, scale);
    check_close("softmax-CE dlogits in place " + sh, unpad(logits.read_gpu(p), s.N, s.V, s.ldv),
                unpad(dl_cpu, s.N, s.V, s.ldv), kBf16);
  }
}

TEST_CASE("cuda: vocab-parallel embedding forward and backward", "[cuda][tp]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int B, T, C, V, v_begin, v_count; bool wpe; };
  for (S s : {S{1, 1, 1, 5, 0, 3, true}, S{2, 19, 111, 37, 12, 13, false}, S{3, 64, 64, 500, 250, 250, true},
              S{2, 111, 19, 7, 6, 1, false}}) {
    const std::string sh = shape({{"B", s.B}, {"T", s.T}, {"C", s.C}, {"v_begin", s.v_begin}, {"v_count", s.v_count}});
    Tok tk(p, rand_tokens(size_t(s.B) * s.T, s.V, 17 + s.C));
    Twin wte(p, randn(size_t(s.v_count) * s.C, 18), true), wpe(p, randn(size_t(s.T) * s.C, 19), true);
    const size_t n = size_t(s.B) * s.T * s.C;
    Twin out = out_twin(p, n, true);
    p.cpu->vocab_embedding_forward(out.c(), tk.cp(), wte.c(), s.wpe ? wpe.c() : nullptr, s.v_begin, s.v_count, s.B,
                                   s.T, s.C);
    p.gpu->vocab_embedding_forward(out.g(), tk.gp(), wte.g(), s.wpe ? wpe.g() : nullptr, s.v_begin, s.v_count, s.B,
                                   s.T, s.C);
    check_close("vocab embedding fwd " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
    Twin dout(p, randn(n, 20), true);
    Twin dwte(p, randn(size_t(s.v_count) * s.C, 21), false), dwpe(p, randn(size_t(s.T) * s.C, 22), false);
    p.cpu->vocab_embedding_backward(dwte.cf(), s.wpe ? dwpe.cf() : nullptr, dout.c(), tk.cp(), s.v_begin, s.v_count,
                                    s.B, s.T, s.C);
    p.gpu->vocab_embedding_backward(dwte.gf(), s.wpe ? dwpe.gf() : nullptr, dout.g(), tk.gp(), s.v_begin, s.v_count,
                                    s.B, s.T, s.C);
    check_close("vocab embedding dwte (+=) " + sh, dwte.read_gpu(p), dwte.read_cpu(p), kF32);
    check_close("vocab embedding dwpe (+= or untouched) " + sh, dwpe.read_gpu(p), dwpe.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: vocab-parallel cross-entropy (max, sum-exp, finish)", "[cuda][tp]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, V, ldv, v_begin; };
  for (S s : {S{1, 1, 1, 0}, S{19, 37, 40, 37}, S{5, 111, 111, 0}, S{4, 25000, 25024, 25000}}) {
    const std::string sh = shape({{"N", s.N}, {"V", s.V}, {"ldv", s.ldv}, {"v_begin", s.v_begin}});
    auto tgt = rand_tokens(s.N, 2 * s.V + s.v_begin, 63);  // some targets on this rank, some elsewhere
    if (s.N > 2) tgt[1] = -1;
    if (s.N > 3) tgt[2] = s.v_begin;  // one surely held
    Tok tk(p, tgt);
    const size_t n = size_t(s.N) * s.ldv;
    Twin logits(p, randn(n, 64, 3.0f), true);
    Twin mx = out_twin(p, s.N, false);
    p.cpu->vocab_ce_max(mx.cf(), logits.c(), s.N, s.V, s.ldv);
    p.gpu->vocab_ce_max(mx.gf(), logits.g(), s.N, s.V, s.ldv);
    check_close("vocab CE max " + sh, mx.read_gpu(p), mx.read_cpu(p), kF32);
    // The group's max is at least this rank's: raise it a little, as another rank would.
    Vec gmax = mx.read_cpu(p);
    for (auto& x : gmax) x += 0.5f;
    Twin M(p, gmax, false);
    Twin st = out_twin(p, 2 * size_t(s.N), false);
    p.cpu->vocab_ce_sumexp(st.cf(), logits.c(), tk.cp(), M.cf(), s.v_begin, s.N, s.V, s.ldv);
    p.gpu->vocab_ce_sumexp(st.gf(), logits.g(), tk.gp(), M.gf(), s.v_begin, s.N, s.V, s.ldv);
    check_close("vocab CE sum-exp and target logit " + sh, st.read_gpu(p), st.read_cpu(p), kF32);
    Vec stats = st.read_cpu(p);
    for (int i = 0; i < s.N; ++i) stats[size_t(i)] += 1.0f;  // the other ranks' share of the sum
    Twin S2(p, stats, false);
    Twin loss = out_twin(p, s.N, false), dl = out_twin(p, n, true);
    p.cpu->vocab_ce_finish(loss.cf(), dl.c(), logits.c(), tk.cp(), M.cf(), S2.cf(), s.v_begin, s.N, s.V, s.ldv, 0.25f);
    p.gpu->vocab_ce_finish(loss.gf(), dl.g(), logits.g(), tk.gp(), M.gf(), S2.gf(), s.v_begin, s.N, s.V, s.ldv, 0.25f);
    check_close("vocab CE loss " + sh, loss.read_gpu(p), loss.read_cpu(p), kF32);
    const Vec dg = dl.read_gpu(p), dc = dl.read_cpu(p);
    check_close("vocab CE dlogits " + sh, unpad(dg, s.N, s.V, s.ldv), unpad(dc, s.N, s.V, s.ldv), kBf16);
    CHECK(pad_is_nan(dg, s.N, s.V, s.ldv));
  }
}

// Gemma 2's ops (kernels/cuda: swiglu.cu's GeGLU, rmsnorm.cu's w_offset,
// logit_softcap.cu, the cap of softmax_cross_entropy.cu and vocab_parallel.cu,
// elementwise.cu's scale_bf16; not yet run on a GPU when written): against
// the CPU ops on the same bf16-representable inputs, with values where the
// caps bite.
TEST_CASE("cuda: Gemma 2's ops (GeGLU, RMSNorm (1+w), logit soft-cap, capped cross-entropy, scale_act) match the CPU",
          "[cuda][gemma2]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  {  // GeGLU: F = 13 (scalar), 2048 (packs), unaligned; gates out to +-40.
    struct S { int N, F; size_t off; };
    for (S s : {S{7, 13, 0}, S{19, 2048, 0}, S{19, 2048, 1}}) {
      const std::string sh = shape({{"N", s.N}, {"F", s.F}}) + (s.off ? " unaligned" : "");
      const size_t nin = size_t(s.N) * 2 * s.F, nout = size_t(s.N) * s.F;
      Vec in = randn(nin, 281, 3.0f);
      in[0] = 40.0f;
      in[1] = -40.0f;
      Twin x(p, in, true, s.off);
      Twin out = out_twin(p, nout, true, s.off);
      p.cpu->geglu_forward(out.c(), x.c(), s.N, s.F);
      p.gpu->geglu_forward(out.g(), x.g(), s.N, s.F);
      check_close("geglu fwd " + sh, out.read_gpu(p), out.read_cpu(p), kBf16);
      Twin dout(p, randn(nout, 282), true, s.off);
      Twin dinp = out_twin(p, nin, true, s.off);
      p.cpu->geglu_backward(dinp.c(), dout.c(), x.c(), s.N, s.F);
      p.gpu->geglu_backward(dinp.g(), dout.g(), x.g(), s.N, s.F);
      const Vec dg = dinp.read_gpu(p), dc = dinp.read_cpu(p);
      check_close("geglu dgate " + sh, columns(dg, 2 * s.F, 0, s.F), columns(dc, 2 * s.F, 0, s.F), kBf16);
      check_close("geglu dup " + sh, columns(dg, 2 * s.F, s.F, s.F), columns(dc, 2 * s.F, s.F, s.F), kBf16);
      p.gpu->geglu_backward(x.g(), dout.g(), x.g(), s.N, s.F);  // in place: the same bits
      CHECK(same_bits(x.read_gpu(p), dg));
    }
  }
  {  // RMSNorm x * (1 + w), w around 0; plain and fused with the residual; backward +=.
    struct S { int N, C; size_t off; };
    for (S s : {S{7, 13, 0}, S{19, 2304, 0}, S{111, 2304, 1}}) {
      const std::string sh = shape({{"N", s.N}, {"C", s.C}}) + (s.off ? " unaligned" : "");
      const size_t n = size_t(s.N) * s.C;
      Twin x(p, randn(n, 291, 2.0f, 0.5f), true, s.off), w(p, randn(s.C, 292, 0.3f), true, s.off);
      Twin out = out_twin(p, n, true, s.off), rstd = out_twin(p, s.N, false);
      p.cpu->rmsnorm_forward(out.c(), rstd.cf(), x.c(), w.c(), s.N, s.C, 1e-6f, 1.f);
      p.gpu->rmsnorm_forward(out.g(), rstd.gf(), x.g(), w.g(), s.N, s.C, 1e-6f, 1.f);
      const Vec og = out.read_gpu(p), rg = rstd.read_gpu(p);
      check_close("rmsnorm (1+w) out " + sh, og, out.read_cpu(p), kBf16);
      // Gemma2RMSNorm: (x * rstd) * (1 + w) in fp32, rounded once: bit for bit with the GPU's rstd.
      Vec hf(n);
      for (int r = 0; r < s.N; ++r)
        for (int c = 0; c < s.C; ++c) {
          const size_t i = size_t(r) * s.C + c;
          hf[i] = bf16_round(x.val[i] * rg[r] * (1.0f + w.val[c]));
        }
      CHECK(same_bits(og, hf));
      Twin a(p, randn(n, 293), true, s.off), b(p, randn(n, 294), true, s.off);
      Twin res = out_twin(p, n, true, s.off), out2 = out_twin(p, n, true, s.off), rstd2 = out_twin(p, s.N, false);
      p.cpu->residual_rmsnorm_forward(res.c(), out2.c(), rstd2.cf(), a.c(), b.c(), w.c(), s.N, s.C, 1e-6f, 1.f);
      p.gpu->residual_rmsnorm_forward(res.g(), out2.g(), rstd2.gf(), a.g(), b.g(), w.g(), s.N, s.C, 1e-6f, 1.f);
      check_close("fused rmsnorm (1+w) out " + sh, out2.read_gpu(p), out2.read_cpu(p), kBf16);
      Twin r2(p, rstd.read_cpu(p), false);
      Twin dout(p, randn(n, 295), true, s.off), dinp(p, randn(n, 296), true, s.off);
      Twin dw(p, randn(s.C, 297), false);
      p.cpu->rmsnorm_backward(dinp.c(), dw.cf(), dout.c(), x.c(), w.c(), r2.cf(), s.N, s.C, 1.f);
      p.gpu->rmsnorm_backward(dinp.g(), dw.gf(), dout.g(), x.g(), w.g(), r2.gf(), s.N, s.C, 1.f);
      check_close("rmsnorm (1+w) dinp (+=) " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
      check_close("rmsnorm (1+w) dweight (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
    }
  }
  {  // The final cap, then the cross-entropy through it: whole rows and a vocab shard.
    struct S { int N, V, ldv; };
    for (S s : {S{1, 1, 1}, S{19, 37, 40}, S{4, 25000, p.gpu->logits_stride(25000)}}) {
      const std::string sh = shape({{"N", s.N}, {"V", s.V}, {"ldv", s.ldv}});
      const float cap = 3.0f, scale = 0.25f;
      auto tgt = rand_tokens(s.N, s.V, 301);
      if (s.N > 2) tgt[1] = -1;
      Tok tk(p, tgt);
      const size_t n = size_t(s.N) * s.ldv;
      Vec z = randn(n, 302, 8.0f);  // |z| well above the cap; NaN pad columns must stay untouched
      for (int r = 0; r < s.N; ++r)
        for (int v = s.V; v < s.ldv; ++v) z[size_t(r) * s.ldv + v] = std::numeric_limits<float>::quiet_NaN();
      Twin logits(p, z, true);
      p.cpu->logit_softcap_forward(logits.c(), s.N, s.V, s.ldv, cap);
      p.gpu->logit_softcap_forward(logits.g(), s.N, s.V, s.ldv, cap);
      const Vec yg = logits.read_gpu(p);
      check_close("logit softcap " + sh, unpad(yg, s.N, s.V, s.ldv), unpad(logits.read_cpu(p), s.N, s.V, s.ldv),
                  kBf16);
      CHECK(pad_is_nan(yg, s.N, s.V, s.ldv));
      Twin y(p, logits.read_cpu(p), true);  // both sides from the same capped logits
      Twin loss = out_twin(p, s.N, false), dl = out_twin(p, n, true);
      p.cpu->softmax_cross_entropy(loss.cf(), dl.c(), y.c(), tk.cp(), s.N, s.V, s.ldv, scale, cap);
      p.gpu->softmax_cross_entropy(loss.gf(), dl.g(), y.g(), tk.gp(), s.N, s.V, s.ldv, scale, cap);
      check_close("capped CE loss " + sh, loss.read_gpu(p), loss.read_cpu(p), kF32);
      const Vec dc = dl.read_cpu(p);
      check_close("capped CE dlogits " + sh, unpad(dl.read_gpu(p), s.N, s.V, s.ldv), unpad(dc, s.N, s.V, s.ldv),
                  kBf16);
      // The vocab-parallel finish with the whole vocabulary on this rank: the same gradient.
      Twin mx = out_twin(p, s.N, false), st = out_twin(p, 2 * size_t(s.N), false);
      p.cpu->vocab_ce_max(mx.cf(), y.c(), s.N, s.V, s.ldv);
      p.cpu->vocab_ce_sumexp(st.cf(), y.c(), tk.cp(), mx.cf(), 0, s.N, s.V, s.ldv);
      Twin M(p, mx.read_cpu(p), false), S2(p, st.read_cpu(p), false);
      Twin loss2 = out_twin(p, s.N, false), dl2 = out_twin(p, n, true);
      p.gpu->vocab_ce_finish(loss2.gf(), dl2.g(), y.g(), tk.gp(), M.gf(), S2.gf(), 0, s.N, s.V, s.ldv, scale, cap);
      check_close("capped vocab CE loss " + sh, loss2.read_gpu(p), loss.read_cpu(p), kF32);
      check_close("capped vocab CE dlogits " + sh, unpad(dl2.read_gpu(p), s.N, s.V, s.ldv),
                  unpad(dc, s.N, s.V, s.ldv), kBf16);
    }
  }
  {  // scale_act: x * bf16(sqrt(C)), one rounding (HF's normaliser in the activation dtype).
    const size_t n = 1001;
    Twin x(p, randn(n, 311), true);
    const float s = std::sqrt(2304.0f);
    p.gpu->scale_act(x.g(), s, int64_t(n));
    Vec want(n);
    for (size_t i = 0; i < n; ++i) want[i] = bf16_round(x.val[i] * bf16_round(s));
    CHECK(same_bits(x.read_gpu(p), want));
  }
}

TEST_CASE("cuda: lm head over padded logits rows", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C, V; };
  for (S s : {S{1, 8, 1}, S{19, 64, 111}, S{37, 768, 500}, S{16, 768, 50257}}) {
    const int ldv = p.gpu->logits_stride(s.V);
    CHECK(ldv % 64 == 0);
    CHECK(ldv >= s.V);
    const std::string sh = shape({{"N", s.N}, {"C", s.C}, {"V", s.V}, {"ldv", ldv}});
    Twin x(p, randn(size_t(s.N) * s.C, 81), true), wte(p, randn(size_t(s.V) * s.C, 82, 0.2f), true);
    Twin logits = out_twin(p, size_t(s.N) * ldv, true);
    p.cpu->lm_head_forward(logits.c(), x.c(), wte.c(), s.N, s.C, s.V, ldv);
    p.gpu->lm_head_forward(logits.g(), x.g(), wte.g(), s.N, s.C, s.V, ldv);
    const Vec lg = logits.read_gpu(p);
    check_close("lm head logits " + sh, unpad(lg, s.N, s.V, ldv), unpad(logits.read_cpu(p), s.N, s.V, ldv), kBf16);
    CHECK(pad_is_nan(lg, s.N, s.V, ldv));  // the pad is never written ...
    Vec dlv = randn(size_t(s.N) * ldv, 83);
    for (int n = 0; n < s.N; ++n)
      for (int v = s.V; v < ldv; ++v) dlv[size_t(n) * ldv + v] = NAN;  // ... nor read: NaN there must not leak
    Twin dln(p, dlv, true);
    Twin dinp = out_twin(p, size_t(s.N) * s.C, true);
    Twin dw(p, randn(size_t(s.V) * s.C, 84), false);  // += : pre-filled
    p.cpu->lm_head_backward(dinp.c(), dw.cf(), dln.c(), x.c(), wte.c(), s.N, s.C, s.V, ldv);
    p.gpu->lm_head_backward(dinp.g(), dw.gf(), dln.g(), x.g(), wte.g(), s.N, s.C, s.V, ldv);
    check_close("lm head dinp " + sh, dinp.read_gpu(p), dinp.read_cpu(p), kBf16);
    check_close("lm head dwte (+=) " + sh, dw.read_gpu(p), dw.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda: sum_squares, sum, scale, accumulate", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  for (size_t n : {size_t(1), size_t(19), size_t(111), size_t(500), size_t(1) << 20 | 3}) {
    for (size_t off : {size_t(0), size_t(1)}) {
      const std::string sh = "n=" + std::to_string(n) + (off ? " unaligned" : "");
      Twin x(p, randn(n, 71), false, off);
      Twin acc(p, Vec{2.5f}, false);
      p.cpu->sum_squares(acc.cf(), x.cf(), int64_t(n));
      p.gpu->sum_squares(acc.gf(), x.gf(), int64_t(n));
      check_close("sum_squares (+=) " + sh, acc.read_gpu(p), acc.read_cpu(p), kF32);
      Twin acc2(p, Vec{0.0f}, false), acc3(p, Vec{0.0f}, false);
      p.gpu->sum_squares(acc2.gf(), x.gf(), int64_t(n));
      p.gpu->sum_squares(acc3.gf(), x.gf(), int64_t(n));
      CHECK(acc2.read_gpu(p)[0] == acc3.read_gpu(p)[0]);  // deterministic
      // sum: the trainer's loss total, over positive values like losses.
      Vec pos = randn(n, 73);
      for (float& v : pos) v = std::abs(v) + 0.5f;
      Twin losses(p, pos, false, off);
      Twin tot(p, Vec{1.25f}, false);
      p.cpu->sum(tot.cf(), losses.cf(), int64_t(n));
      p.gpu->sum(tot.gf(), losses.gf(), int64_t(n));
      check_close("sum (+=) " + sh, tot.read_gpu(p), tot.read_cpu(p), kF32);
      p.cpu->scale(x.cf(), 0.37f, int64_t(n));
      p.gpu->scale(x.gf(), 0.37f, int64_t(n));
      check_close("scale " + sh, x.read_gpu(p), x.read_cpu(p), kF32);
      Twin src(p, randn(n, 72), false, off);
      p.cpu->accumulate(x.cf(), src.cf(), int64_t(n));
      p.gpu->accumulate(x.gf(), src.gf(), int64_t(n));
      check_close("accumulate " + sh, x.read_gpu(p), x.read_cpu(p), kF32);
    }
  }
}

TEST_CASE("cuda: adamw updates fp32 master and writes bf16 params", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  for (size_t n : {size_t(1), size_t(19), size_t(111), size_t(500), size_t(4099)}) {
    for (size_t off : {size_t(0), size_t(3)}) {
      const std::string sh = "n=" + std::to_string(n) + (off ? " unaligned" : "");
      Twin master(p, randn(n, 81, 0.05f), false, off), grad(p, randn(n, 82, 1e-2f), false, off);
      Twin m(p, randn(n, 83, 1e-3f), false, off);
      Vec v0 = randn(n, 84, 1e-5f);
      for (auto& x : v0) x = std::fabs(x);
      Twin v(p, v0, false, off);
      Twin param = out_twin(p, n, true, off);
      for (int step : {1, 7}) {
        p.cpu->adamw_update(master.cf(), master.cf(), grad.cf(), m.cf(), v.cf(), int64_t(n), 3e-3f, 0.9f, 0.95f,
                            1e-8f, 0.1f, step, 0.5f);
        p.gpu->adamw_update(master.gf(), param.g(), grad.gf(), m.gf(), v.gf(), int64_t(n), 3e-3f, 0.9f, 0.95f, 1e-8f,
                            0.1f, step, 0.5f);
      }
      const Vec gm = master.read_gpu(p);
      check_close("adamw master " + sh, gm, master.read_cpu(p), kF32);
      check_close("adamw m " + sh, m.read_gpu(p), m.read_cpu(p), kF32);
      check_close("adamw v " + sh, v.read_gpu(p), v.read_cpu(p), kF32);
      // The bf16 params are exactly the rounded master weights.
      DeviceBuffer staged = upload_f32(p.gpu.get(), gm);
      DeviceBuffer rounded(p.gpu.get(), n * 2);
      p.gpu->cast_from_f32(rounded.get(), staged.as<float>(), int64_t(n));
      const Vec want = download_act(p.gpu.get(), rounded.get(), n), got = param.read_gpu(p);
      CHECK(std::memcmp(want.data(), got.data(), n * 4) == 0);
    }
  }
}

TEST_CASE("cuda: nccl communicator with one rank", "[cuda]") {
  CUDA_TEST_OR_SKIP();
  auto be = make_backend("cuda", 0, nullptr);
  auto comm = make_nccl_communicator(be.get(), nullptr, "t/", 0, 1, std::chrono::seconds(30));
  CHECK(comm->name() == "nccl");
  CHECK(comm->world_size() == 1);
  const Vec v = randn(37, 91);
  DeviceBuffer a = upload_f32(be.get(), v), b(be.get(), 37 * 4);
  comm->all_reduce(a.as<float>(), 37, ReduceOp::Avg);
  comm->reduce_scatter(b.as<float>(), a.as<float>(), 37, ReduceOp::Sum);
  CHECK(download_f32(be.get(), b.get(), 37) == v);
  be->zero(b.get(), 37 * 4);
  comm->all_gather(b.get(), a.get(), 37 * 4);
  CHECK(download_f32(be.get(), b.get(), 37) == v);
  float host = 3.5f;  // host scalars (the trainer's loss) are fine too
  comm->all_reduce(&host, 1, ReduceOp::Sum);
  CHECK(host == 3.5f);
  // all_to_all_v (expert dispatch) over one rank: a copy of its one block,
  // device to device and host to host; a size that disagrees is refused.
  // Not yet run on a GPU.
  const size_t n = 37 * 4;
  comm->all_to_all_v(b.get(), &n, a.get(), &n);
  CHECK(download_f32(be.get(), b.get(), 37) == v);
  Vec hout(37, 0.f);
  comm->all_to_all_v(hout.data(), &n, v.data(), &n);
  CHECK(hout == v);
  const size_t fewer = n - 4;
  CHECK_THROWS_WITH(comm->all_to_all_v(b.get(), &fewer, a.get(), &n), Catch::Contains("all_to_all_v"));
  comm->barrier();
}

namespace {
std::string job_yaml(const std::string& dir, const std::string& backend, const std::string& sharding) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 61, seq_len: 32}\n"
         "data: {format: synthetic, synthetic: {vocab: 61, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: 20, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, eval_interval: 0, eval_steps: 1, log_interval: 5, grad_clip: 1.0}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + sharding + ", timeout_s: 60}\n"
         "backend: " + backend + "\n";
}
TrainSummary train(const std::string& backend, const std::string& sharding) {
  test::TempDir dir("cuda_train");
  JobSpec job = parse_job_spec(job_yaml(dir.path(), backend, sharding), "job.yaml");
  return run_training(job, WorkerInfo{});
}
}  // namespace

TEST_CASE("cuda: 20 GPT-2 steps track the CPU backend's losses", "[cuda][train]") {
  CUDA_TEST_OR_SKIP();
  const TrainSummary cpu = train("cpu", "no_shard");
  for (const char* sharding : {"no_shard", "full_shard"}) {
    const TrainSummary gpu = train("cuda", sharding);
    REQUIRE(gpu.losses.size() == cpu.losses.size());
    double worst = 0;
    for (size_t i = 0; i < cpu.losses.size(); ++i)
      worst = std::max(worst, std::fabs(gpu.losses[i] - cpu.losses[i]) / std::fabs(cpu.losses[i]));
    std::printf("  %-58s max rel diff %.3e (tol %.0e); loss %.4f -> %.4f (cpu %.4f -> %.4f)\n",
                (std::string("losses over 20 steps, ") + sharding).c_str(), worst, kLoss, gpu.losses.front(),
                gpu.losses.back(), cpu.losses.front(), cpu.losses.back());
    CHECK(worst <= kLoss);
    CHECK(gpu.losses.back() < gpu.losses.front());  // it learns
  }
}

TEST_CASE("cuda: sharded runs over NCCL match the single-GPU run", "[cuda][train]") {
  CUDA_TEST_OR_SKIP_BELOW(2);
  const TrainSummary single = train("cuda", "no_shard");
  for (const char* sharding : {"no_shard", "full_shard"}) {
    test::TempDir dir("cuda_nccl");
    const int world = 2;
    JobSpec job = parse_job_spec(job_yaml(dir.path(), "cuda", sharding), "job.yaml");
    // Thread r is rank r on GPU r (local_rank r); throws with every rank's error.
    const std::vector<TrainSummary> out = test::run_ranks_inprocess(job, world);
    REQUIRE(out[0].losses.size() == single.losses.size());
    double worst = 0;
    for (size_t i = 0; i < single.losses.size(); ++i)
      worst = std::max(worst, std::fabs(out[0].losses[i] - single.losses[i]) / std::fabs(single.losses[i]));
    std::printf("  %-58s max rel diff %.3e (tol %.0e)\n", (std::string("2 GPUs over NCCL, ") + sharding).c_str(),
                worst, kLoss);
    CHECK(worst <= kLoss);
  }
}

TEST_CASE("cuda: pp2 over NCCL links (a stream per link, sends from the compute thread) matches the single-GPU run",
          "[cuda][pp][train]") {
  CUDA_TEST_OR_SKIP_BELOW(2);
  // 4 layers, micro-batch 2: 4 microbatches per step, so the schedules
  // really overlap stages (and interleaving has 2 chunks per rank).
  const std::vector<std::string> common = {"model.n_layer=4", "train.micro_batch_size=2"};
  auto spec = [&](const std::string& dir, std::vector<std::string> sets) {
    sets.insert(sets.end(), common.begin(), common.end());
    return parse_job_spec(job_yaml(dir, "cuda", "full_shard"), "job.yaml", sets);
  };
  test::TempDir ref_dir("cuda_pp_ref");
  const TrainSummary single = run_training(spec(ref_dir.path(), {"parallel.sharding=no_shard"}), WorkerInfo{});
  struct Case {
    const char* schedule;
    int v;
  };
  for (const Case& c : {Case{"1f1b", 1}, Case{"gpipe", 1}, Case{"zero_bubble", 1}, Case{"interleaved_1f1b", 2}}) {
    test::TempDir dir("cuda_pp");
    const JobSpec job = spec(dir.path(), {"parallel.pipeline_parallel=2", std::string("parallel.pipeline_schedule=") +
                                          c.schedule, "parallel.pipeline_virtual_stages=" + std::to_string(c.v)});
    set_pipeline_link_recording(true);
    const std::vector<TrainSummary> out = test::run_ranks_inprocess(job, 2);  // rank r on GPU r
    const std::vector<PipelineLinkUse> uses = recorded_pipeline_link_uses();
    set_pipeline_link_recording(false);
    REQUIRE(out[0].losses.size() == single.losses.size());
    CHECK(out[1].losses == out[0].losses);  // the loss is reported on every stage
    double worst = 0;
    for (size_t i = 0; i < single.losses.size(); ++i)
      worst = std::max(worst, std::fabs(out[0].losses[i] - single.losses[i]) / std::fabs(single.losses[i]));
    std::printf("  %-58s max rel diff %.3e (tol %.0e)\n",
                (std::string("pp2 over NCCL links, ") + c.schedule).c_str(), worst, kLoss);
    CHECK(worst <= kLoss);
    // Stream-ordered links: every send and receive of a rank is issued
    // from one thread (its compute thread), and both links are used.
    std::map<int, std::set<std::thread::id>> threads;
    for (const PipelineLinkUse& u : uses) threads[u.rank].insert(u.thread);
    CHECK(threads.size() == 2);
    for (const auto& [rank, t] : threads) {
      INFO("rank " << rank);
      CHECK(t.size() == 1);
    }
  }
}

// NF4 dequantization (kernels/cuda/nf4.cu) against the CPU backend's, which
// tests/test_nf4.cpp checks against the bitsandbytes reference: the same
// bits, fp32 and bf16, at odd sizes (tails of n % 16, one element past a
// 64-block and past an absmax run, an all-zero block) and with pointers off
// alignment (packed by 1 byte, out by 4: the one-element-per-thread path).
TEST_CASE("cuda: nf4_dequantize and nf4_dequantize_blocks equal the CPU backend's, fp32 and bf16", "[cuda][nf4]") {
  CUDA_TEST_OR_SKIP();
  auto gpu = make_backend("cuda", 0, nullptr);
  const auto& map = nf4::dynamic_map();
  // `bytes` copied into device memory `skew` bytes past a fresh allocation's start.
  struct Placed {
    DeviceBuffer buf;
    char* p;
    Placed(Backend* be, const void* host, size_t bytes, size_t skew)
        : buf(be, bytes + skew + 16), p(buf.as<char>() + skew) {
      be->copy_to_device(p, host, bytes);
    }
  };
  auto first_diff = [](const void* a, const void* b, size_t n, size_t elem) {
    for (size_t i = 0; i < n; ++i)
      if (std::memcmp(static_cast<const char*>(a) + i * elem, static_cast<const char*>(b) + i * elem, elem) != 0)
        return i;
    return n;
  };
  for (int64_t n : {int64_t(1), int64_t(19), int64_t(65), int64_t(111), int64_t(500), int64_t(70001),
                    int64_t(16384 * 64 + 1), int64_t(64 * 1000)}) {
    Vec x = randn(size_t(n), uint64_t(n), 0.02f);
    if (n > 200) std::fill(x.begin() + 64, x.begin() + 128, 0.0f);
    const auto t = nf4::quantize(x.data(), n, "x");
    Vec want(x.size());
    std::vector<uint16_t> want16(x.size());
    nf4::dequantize(t, want.data());
    nf4::dequantize_bf16(t, want16.data());
    for (size_t skew : {size_t(0), size_t(1)}) {
      INFO("n = " << n << ", skew " << skew);
      Placed packed(gpu.get(), t.packed.data(), t.packed.size(), skew);
      Placed qabsmax(gpu.get(), t.qabsmax.data(), t.qabsmax.size(), 0);
      Placed absmax2(gpu.get(), t.absmax2.data(), 4 * t.absmax2.size(), 0);
      Placed dmap(gpu.get(), map.data(), 4 * map.size(), 0);
      const Vec poison(x.size(), std::numeric_limits<float>::quiet_NaN());
      Placed out(gpu.get(), poison.data(), 4 * x.size(), 4 * skew);
      Placed out16(gpu.get(), poison.data(), 2 * x.size(), 4 * skew);
      auto q = [](const Placed& b) { return reinterpret_cast<const uint8_t*>(b.p); };
      auto f = [](const Placed& b) { return reinterpret_cast<const float*>(b.p); };
      gpu->nf4_dequantize(out.p, DType::F32, q(packed), q(qabsmax), f(absmax2), f(dmap), t.offset, n);
      gpu->nf4_dequantize(out16.p, DType::BF16, q(packed), q(qabsmax), f(absmax2), f(dmap), t.offset, n);
      Vec got(x.size());
      std::vector<uint16_t> got16(x.size());
      gpu->copy_to_host(got.data(), out.p, 4 * x.size());
      gpu->copy_to_host(got16.data(), out16.p, 2 * x.size());
      gpu->synchronize();
      const size_t d32 = first_diff(got.data(), want.data(), x.size(), 4);
      const size_t d16 = first_diff(got16.data(), want16.data(), x.size(), 2);
      INFO("fp32: first difference at " << d32 << " of " << x.size());
      INFO("bf16: first difference at " << d16 << " of " << x.size());
      CHECK(d32 == x.size());
      CHECK(d16 == x.size());
      // nf4_dequantize_blocks (a TP slice's form): the same bits from one
      // fp32 absmax per block, computed on the host as the store does.
      std::vector<float> scale(t.qabsmax.size());
      for (size_t b = 0; b < scale.size(); ++b)
        scale[b] = nf4::block_scale(map.data(), t.qabsmax[b], t.absmax2[b / nf4::kAbsmaxBlock], t.offset);
      Placed blocks(gpu.get(), scale.data(), 4 * scale.size(), 0);
      Placed bout(gpu.get(), poison.data(), 4 * x.size(), 4 * skew);
      Placed bout16(gpu.get(), poison.data(), 2 * x.size(), 4 * skew);
      gpu->nf4_dequantize_blocks(bout.p, DType::F32, q(packed), f(blocks), n);
      gpu->nf4_dequantize_blocks(bout16.p, DType::BF16, q(packed), f(blocks), n);
      gpu->copy_to_host(got.data(), bout.p, 4 * x.size());
      gpu->copy_to_host(got16.data(), bout16.p, 2 * x.size());
      gpu->synchronize();
      CHECK(first_diff(got.data(), want.data(), x.size(), 4) == x.size());
      CHECK(first_diff(got16.data(), want16.data(), x.size(), 2) == x.size());
    }
  }
}

// ---- the adapters' ops (core/model/adapter; kernels/cuda/adapter_gemm, dropout, row_norms, dora) ------------
// Written 2026-12-04, not yet run on a GPU. Tag [adapter]: scripts/gpu-check.sh's
// `adapters` step runs them (and the adapter training case below).

// Backend::gemm, row-major c (M,N) = alpha op(a) op(b) + beta c: every
// (op(a), op(b)) pair, a, b and c with padded rows (c: a block of columns
// inside wider rows, as a LoRA target's share of a fused q|k|v output) and,
// with beta 1, c one element past an aligned start (2-byte aligned bf16).
// The padding columns of c must come back untouched: the whole buffer is compared.
TEST_CASE("cuda: adapter gemm (op(a), op(b) either way, strided, offset, bf16 or fp32 c, beta 0 or 1)",
          "[cuda][adapter]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  using Op = Backend::GemmOp;
  struct S { int M, N, K; };
  uint64_t seed = 900;
  for (S s : {S{1, 1, 1}, S{19, 8, 111}, S{111, 19, 1}, S{37, 111, 19}, S{500, 16, 768}, S{16, 768, 500}})
    for (Op ta : {Op::N, Op::T})
      for (Op tb : {Op::N, Op::T})
        for (bool c_f32 : {false, true})
          for (float beta : {0.0f, 1.0f}) {
            const int a_rows = ta == Op::N ? s.M : s.K, a_cols = ta == Op::N ? s.K : s.M, lda = a_cols + 3;
            const int b_rows = tb == Op::N ? s.K : s.N, b_cols = tb == Op::N ? s.N : s.K, ldb = b_cols + 1;
            const int ldc = s.N + 5;
            const size_t off = beta == 1.0f ? 1 : 0;
            const std::string sh = shape({{"M", s.M}, {"N", s.N}, {"K", s.K}}) + (ta == Op::T ? " aT" : " aN") +
                                   (tb == Op::T ? " bT" : " bN") + (c_f32 ? " c fp32" : " c bf16") +
                                   (beta == 1.0f ? " beta 1 (offset c)" : " beta 0");
            Twin a(p, randn(size_t(a_rows) * lda, ++seed), true), b(p, randn(size_t(b_rows) * ldb, ++seed), true);
            Twin c(p, randn(size_t(s.M) * ldc, ++seed), !c_f32, off);
            p.cpu->gemm(c.c(), ldc, c_f32, a.c(), lda, ta, b.c(), ldb, tb, s.M, s.N, s.K, 0.75f, beta);
            p.gpu->gemm(c.g(), ldc, c_f32, a.g(), lda, ta, b.g(), ldb, tb, s.M, s.N, s.K, 0.75f, beta);
            check_close("adapter gemm " + sh, c.read_gpu(p), c.read_cpu(p), c_f32 ? kF32 : kBf16);
          }
  // K = 0, an empty sum: beta 0 zeroes the M x N block (a strided memset:
  // cuBLASLt refuses k = 0), beta 1 leaves c; the padding is never touched.
  for (bool c_f32 : {false, true})
    for (float beta : {0.0f, 1.0f}) {
      const int M = 19, N = 7, ldc = 11;
      Twin a(p, Vec{1.0f}, true), b(p, Vec{1.0f}, true);
      Twin c(p, randn(size_t(M) * ldc, ++seed), !c_f32, 1);
      p.gpu->gemm(c.g(), ldc, c_f32, a.g(), 1, Op::N, b.g(), N, Op::N, M, N, 0, 1.0f, beta);
      Vec want = c.val;
      if (beta == 0.0f)
        for (int m = 0; m < M; ++m) std::fill(want.begin() + m * ldc, want.begin() + m * ldc + N, 0.0f);
      INFO("K = 0, " << (c_f32 ? "fp32" : "bf16") << " c, beta " << beta);
      CHECK(c.read_gpu(p) == want);
    }
  // Only beta 0 and 1 exist on CUDA (GemmDesc::accumulate): any other is an Error, not a wrong answer.
  Twin a(p, randn(4, 1), true), b(p, randn(4, 2), true), c(p, randn(4, 3), true);
  CHECK_THROWS_WITH(p.gpu->gemm(c.g(), 2, false, a.g(), 2, Op::N, b.g(), 2, Op::N, 2, 2, 2, 1.0f, 0.5f),
                    Catch::Contains("beta 0.5 is not supported"));
}

// Backend::dropout_forward: the mask must be the CPU's bit for bit (it is
// kernels/dropout_mask.h's on both), for any row0 (a micro-batch's first
// global row), aligned (16-byte packs) and not; values at bf16 tolerance.
// In place gives the same bits, and rows [k, N) at row0 + k are rows [k, N)
// of the whole: the counter is the global (row, feature).
TEST_CASE("cuda: dropout draws the CPU's mask bit for bit (any row0, in place, unaligned, split rows)",
          "[cuda][adapter]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; int64_t row0; float p; };
  for (S s : {S{1, 1, 0, 0.5f}, S{19, 111, 7, 0.1f}, S{111, 19, 1000003, 0.25f}, S{64, 768, 123456789012LL, 0.05f},
              S{3, 4099, 5, 0.9f}})
    for (size_t off : {size_t(0), size_t(1)}) {
      const size_t n = size_t(s.N) * s.C;
      const uint64_t seed = 0x5eed0000ull + uint64_t(s.C);
      const std::string sh = shape({{"N", s.N}, {"C", s.C}, {"row0", long(s.row0)}}) + " p " + std::to_string(s.p) +
                             (off ? " unaligned" : "");
      Twin x(p, randn(n, uint64_t(s.N) * 7 + off), true, off);
      Twin y = out_twin(p, n, true, off);
      p.cpu->dropout_forward(y.c(), x.c(), s.N, s.C, s.p, seed, s.row0);
      p.gpu->dropout_forward(y.g(), x.g(), s.N, s.C, s.p, seed, s.row0);
      const Vec got = y.read_gpu(p), want = y.read_cpu(p);
      size_t diff = 0, first = n, kept = 0;
      for (size_t i = 0; i < n; ++i) {
        const bool kg = got[i] != 0.0f, kc = want[i] != 0.0f;  // x is never 0, so 0 is exactly a dropped element
        kept += kc;
        if (kg != kc) {
          ++diff;
          first = std::min(first, i);
        }
      }
      INFO("dropout " << sh << ": " << diff << " mask bits differ, the first at element " << first);
      CHECK(diff == 0);
      check_close("dropout values " + sh, got, want, kBf16);
      // Not all kept or all dropped: the threshold is p's.
      if (n >= 1000) CHECK(std::fabs(double(kept) / double(n) - (1.0 - s.p)) < 0.05);
      Twin z(p, x.val, true, off);
      p.gpu->dropout_forward(z.g(), z.g(), s.N, s.C, s.p, seed, s.row0);
      CHECK(z.read_gpu(p) == got);
      if (s.N > 1) {
        const int k = s.N / 2;
        Twin t = out_twin(p, n, true, off);
        p.gpu->dropout_forward(t.g(), x.g(), k, s.C, s.p, seed, s.row0);
        p.gpu->dropout_forward(static_cast<uint16_t*>(t.g()) + size_t(k) * s.C,
                               static_cast<const uint16_t*>(x.g()) + size_t(k) * s.C, s.N - k, s.C, s.p, seed,
                               s.row0 + k);
        CHECK(t.read_gpu(p) == got);
      }
    }
}

// Backend::row_norms (DoRA's ||W + s B A||_row and its magnitude init
// ||W||_row): fp32 out of bf16 rows, against the CPU's double sums.
TEST_CASE("cuda: row_norms (fp32 norms of bf16 rows)", "[cuda][adapter]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int rows, cols; };
  for (S s : {S{1, 1}, S{19, 111}, S{111, 19}, S{37, 64}, S{256, 768}, S{5, 8192}, S{3, 8200}})
    for (size_t off : {size_t(0), size_t(1)}) {
      const std::string sh = shape({{"rows", s.rows}, {"cols", s.cols}}) + (off ? " unaligned" : "");
      Twin w(p, randn(size_t(s.rows) * s.cols, uint64_t(s.rows) * 31 + s.cols, 0.05f), true, off);
      Twin out = out_twin(p, size_t(s.rows), false);
      p.cpu->row_norms(out.cf(), w.c(), s.rows, s.cols);
      p.gpu->row_norms(out.gf(), w.g(), s.rows, s.cols);
      check_close("row_norms " + sh, out.read_gpu(p), out.read_cpu(p), kF32);
    }
}

// Backend::scale_rows (the preference objectives' per-token weights on the
// cross-entropy gradient): bf16 rows ldv apart times fp32 weights, the pad
// columns untouched, against the CPU's fp32.
TEST_CASE("cuda: scale_rows (per-row weights on bf16 logits' gradients)", "[cuda][preference]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, V, ldv; };
  for (S s : {S{1, 1, 1}, S{19, 111, 112}, S{7, 500, 512}, S{64, 2050, 2056}}) {
    const std::string sh = shape({{"N", s.N}, {"V", s.V}, {"ldv", s.ldv}});
    Twin x(p, randn(size_t(s.N) * s.ldv, uint64_t(s.N) * 7 + s.V), true);
    Vec wv = randn(size_t(s.N), uint64_t(s.V) + 3);
    wv[0] = 0.0f;  // a padding / prompt row: exact zeros
    Twin w(p, wv, false);
    p.cpu->scale_rows(x.c(), w.cf(), s.N, s.V, s.ldv);
    p.gpu->scale_rows(x.g(), w.gf(), s.N, s.V, s.ldv);
    check_close("scale_rows " + sh, x.read_gpu(p), x.read_cpu(p), kBf16);
  }
}

// Tensor parallelism (core/model/adapter/lora.h): a row-parallel linear's
// input columns [col0, col0 + C) of rows key_cols wide draw the whole rows'
// mask, the CPU's bit for bit; row_sum_squares then sqrt_in_place (a
// row-parallel DoRA norm, with the TP sum between) is row_norms in two steps.
TEST_CASE("cuda: dropout of a column slice, row_sum_squares and sqrt_in_place (tensor parallelism)",
          "[cuda][adapter]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, C; int64_t key_cols, col0, row0; };
  for (S s : {S{19, 111, 333, 111, 7}, S{8, 16, 32, 16, 1000003}, S{5, 8, 64, 0, 3}}) {
    const size_t n = size_t(s.N) * s.C;
    const std::string sh = shape({{"N", s.N}, {"C", s.C}, {"key_cols", long(s.key_cols)}, {"col0", long(s.col0)}});
    Twin x(p, randn(n, uint64_t(s.C) * 3 + uint64_t(s.col0)), true);
    Twin y = out_twin(p, n, true);
    p.cpu->dropout_forward(y.c(), x.c(), s.N, s.C, 0.25f, 77, s.row0, s.key_cols, s.col0);
    p.gpu->dropout_forward(y.g(), x.g(), s.N, s.C, 0.25f, 77, s.row0, s.key_cols, s.col0);
    const Vec got = y.read_gpu(p), want = y.read_cpu(p);
    size_t diff = 0;
    for (size_t i = 0; i < n; ++i) diff += (got[i] != 0.0f) != (want[i] != 0.0f);
    INFO("dropout slice " << sh);
    CHECK(diff == 0);
    check_close("dropout slice " + sh, got, want, kBf16);
  }
  struct R { int rows, cols; };
  for (R s : {R{1, 1}, R{19, 111}, R{37, 64}, R{5, 8192}}) {
    const std::string sh = shape({{"rows", s.rows}, {"cols", s.cols}});
    Twin w(p, randn(size_t(s.rows) * s.cols, uint64_t(s.rows) * 17 + s.cols, 0.05f), true);
    Twin sq = out_twin(p, size_t(s.rows), false);
    p.cpu->row_sum_squares(sq.cf(), w.c(), s.rows, s.cols);
    p.gpu->row_sum_squares(sq.gf(), w.g(), s.rows, s.cols);
    check_close("row_sum_squares " + sh, sq.read_gpu(p), sq.read_cpu(p), kF32);
    p.gpu->sqrt_in_place(sq.gf(), s.rows);
    Twin norms = out_twin(p, size_t(s.rows), false);
    p.cpu->row_norms(norms.cf(), w.c(), s.rows, s.cols);
    check_close("sqrt(row_sum_squares) " + sh, sq.read_gpu(p), norms.read_cpu(p), kF32);
  }
}

// Backend::dora_forward / dora_backward: y's target columns start `ycol`
// into rows ldy apart (a fused output); dmag accumulates onto random
// values; xw and xba are overwritten in place by their gradients. N = 300
// and 1000 cross the backward's 256-row chunks.
TEST_CASE("cuda: dora forward (+= into strided y) and backward (dmag +=, in-place xw/xba)", "[cuda][adapter]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int N, out, ldy, ycol; };
  const float sc = 0.75f;  // s = alpha / r
  for (S s : {S{1, 1, 1, 0}, S{19, 111, 148, 37}, S{111, 19, 19, 0}, S{300, 64, 192, 64}, S{1000, 37, 40, 3}}) {
    const std::string sh = shape({{"N", s.N}, {"out", s.out}, {"ldy", s.ldy}, {"col", s.ycol}});
    const size_t no = size_t(s.N) * s.out, ny = size_t(s.N) * s.ldy;
    const uint64_t seed = uint64_t(s.N) * 1000 + s.out;
    Vec nv = randn(size_t(s.out), seed + 4);
    for (float& v : nv) v = std::fabs(v) + 0.5f;  // a norm: positive
    Twin xw(p, randn(no, seed + 1), true), xba(p, randn(no, seed + 2), true);
    Twin mag(p, randn(size_t(s.out), seed + 3, 0.5f, 1.0f), true), norm(p, nv, false);
    Twin y(p, randn(ny, seed + 5), true);
    p.cpu->dora_forward(y.cf() + s.ycol, s.ldy, xw.c(), xba.c(), mag.c(), norm.cf(), sc, s.N, s.out);
    p.gpu->dora_forward(static_cast<uint16_t*>(y.g()) + s.ycol, s.ldy, xw.g(), xba.g(), mag.g(), norm.gf(), sc, s.N,
                        s.out);
    check_close("dora forward y " + sh, y.read_gpu(p), y.read_cpu(p), kBf16);
    Twin dy(p, randn(ny, seed + 6), true), dmag(p, randn(size_t(s.out), seed + 7), false);
    p.cpu->dora_backward(dmag.cf(), xw.c(), xba.c(), dy.cf() + s.ycol, s.ldy, mag.c(), norm.cf(), sc, s.N, s.out);
    p.gpu->dora_backward(dmag.gf(), xw.g(), xba.g(), static_cast<const uint16_t*>(dy.g()) + s.ycol, s.ldy, mag.g(),
                         norm.gf(), sc, s.N, s.out);
    check_close("dora backward dmag (+=) " + sh, dmag.read_gpu(p), dmag.read_cpu(p), kF32);
    check_close("dora backward dxw (in place) " + sh, xw.read_gpu(p), xw.read_cpu(p), kBf16);
    check_close("dora backward dxba (in place) " + sh, xba.read_gpu(p), xba.read_cpu(p), kBf16);
  }
}

namespace {
// A tiny adapter run on job_yaml's model (GPT-2, or Llama with grouped-query
// attention), dropout on, 10 steps, writing its adapter under `dir`.
TrainSummary train_adapter(const std::string& dir, const std::string& backend, const std::string& arch,
                           const std::string& type, std::vector<std::string> sets = {}) {
  for (const char* s : {"model.adapter.rank=4", "model.adapter.alpha=8", "model.adapter.dropout=0.1",
                        "model.adapter.target_modules=all-linear", "train.max_steps=10", "train.lr=1.0e-2"})
    sets.push_back(s);
  sets.push_back("model.adapter.type=" + type);
  if (arch == "llama") {
    sets.push_back("model.arch=llama");
    sets.push_back("model.n_kv_head=1");
    sets.push_back("model.ffn_dim=128");
  }
  return run_training(parse_job_spec(job_yaml(dir, backend, "no_shard"), "job.yaml", sets), WorkerInfo{});
}
}  // namespace

// LoRA and DoRA through the whole trainer on CUDA (bf16 frozen base,
// fp32 adapter masters) against the same job on the CPU: the first loss
// (B = 0: the base's own) at bf16 tolerance, the 10-step curve at kLoss;
// both learn; the PEFT adapter is written. model.base_dtype: fp32 on CUDA
// is refused (the base there is bf16).
TEST_CASE("cuda: LoRA and DoRA training (GPT-2, Llama, dropout 0.1) track the CPU backend's losses",
          "[cuda][adapter][train]") {
  CUDA_TEST_OR_SKIP();
  for (const char* arch : {"gpt2", "llama"})
    for (const char* type : {"lora", "dora"}) {
      const std::string what = std::string(arch) + " " + type;
      INFO(what);
      test::TempDir cdir("cuda_adapter_cpu"), gdir("cuda_adapter_gpu");
      const TrainSummary cpu = train_adapter(cdir.path(), "cpu", arch, type);
      const TrainSummary gpu = train_adapter(gdir.path(), "cuda", arch, type);
      REQUIRE(gpu.losses.size() == cpu.losses.size());
      REQUIRE(!cpu.losses.empty());
      double worst = 0;
      for (size_t i = 0; i < cpu.losses.size(); ++i)
        worst = std::max(worst, std::fabs(gpu.losses[i] - cpu.losses[i]) / std::fabs(cpu.losses[i]));
      const double first = std::fabs(gpu.losses[0] - cpu.losses[0]) / std::fabs(cpu.losses[0]);
      std::printf("  %-58s first %.3e (tol %.0e), max rel diff %.3e (tol %.0e); loss %.4f -> %.4f (cpu %.4f -> %.4f)\n",
                  ("adapter training, " + what).c_str(), first, kBf16, worst, kLoss, gpu.losses.front(),
                  gpu.losses.back(), cpu.losses.front(), cpu.losses.back());
      CHECK(first <= kBf16);
      CHECK(worst <= kLoss);
      CHECK(cpu.losses.back() < cpu.losses.front());
      CHECK(gpu.losses.back() < gpu.losses.front());
      CHECK(test::file_exists(gdir / "adapter/adapter_model.safetensors"));
      CHECK(test::file_exists(gdir / "adapter/adapter_config.json"));
    }
  test::TempDir dir("cuda_adapter_fp32");
  CHECK_THROWS_WITH(train_adapter(dir.path(), "cuda", "gpt2", "lora", {"model.base_dtype=fp32"}),
                    Catch::Contains("model.base_dtype: fp32 with backend cuda"));
}

// Context parallelism's attention by blocks (kernels/attention_block.h):
// a query block against a key/value block at other global positions, with
// document starts, GQA and strided views (q inside a fused qkv row), the
// merge of two partials and the fp32 backward, CUDA against the CPU op.
// Not yet run on a GPU (2026-12-04).
TEST_CASE("cuda: attention by blocks (context parallelism) matches the CPU op", "[cuda][cp]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct S { int B, Tq, Tk, q_pos0, k_pos0, NH, NKV, HS; };
  for (S s : {S{2, 19, 19, 40, 21, 8, 2, 64}, S{1, 33, 17, 64, 64, 4, 1, 40}, S{2, 8, 8, 8, 0, 6, 6, 19}}) {
    const std::string sh = shape({{"B", s.B}, {"Tq", s.Tq}, {"Tk", s.Tk}, {"q_pos0", s.q_pos0}, {"k_pos0", s.k_pos0},
                                  {"NH", s.NH}, {"NKV", s.NKV}, {"HS", s.HS}});
    const int64_t ld = int64_t(s.NH + 2 * s.NKV) * s.HS, C = int64_t(s.NH) * s.HS, kv_ld = 2 * int64_t(s.NKV) * s.HS;
    Twin q(p, randn(size_t(s.B) * s.Tq * ld, 301), true);
    Twin kv(p, randn(size_t(s.B) * s.Tk * kv_ld, 302), true);
    // Documents: odd query rows start theirs inside the key block, never
    // after the row itself or the block's last key (every row sees a key:
    // no -inf in the lse to compare).
    std::vector<int32_t> doc(size_t(s.B) * s.Tq);
    for (int b = 0; b < s.B; ++b)
      for (int i = 0; i < s.Tq; ++i)
        doc[size_t(b) * s.Tq + i] =
            i % 2 ? std::min(s.k_pos0 + (i * 7 + b) % s.Tk, std::min(s.q_pos0 + i, s.k_pos0 + s.Tk - 1)) : 0;
    DeviceBuffer cdoc = test::upload_i32(p.cpu.get(), doc), gdoc = test::upload_i32(p.gpu.get(), doc);
    auto args = [&](bool gpu) {
      AttentionBlock a;
      a.B = s.B, a.Tq = s.Tq, a.Tk = s.Tk, a.NH = s.NH, a.NKV = s.NKV, a.HS = s.HS;
      a.q_pos0 = s.q_pos0, a.k_pos0 = s.k_pos0;
      a.q = gpu ? q.g() : q.c(), a.q_ld = ld, a.q_bs = s.Tq * ld;
      const void* k = gpu ? kv.g() : kv.c();
      const size_t es = gpu ? 2 : 4;
      a.k = k, a.v = static_cast<const char*>(k) + size_t(s.NKV) * s.HS * es, a.kv_ld = kv_ld, a.kv_bs = s.Tk * kv_ld;
      a.o_ld = C, a.o_bs = s.Tq * C, a.lse_bs = int64_t(s.NH) * s.Tq, a.lse_hs = s.Tq;
      a.q_doc = gpu ? gdoc.as<int32_t>() : cdoc.as<int32_t>(), a.doc_bs = s.Tq;
      return a;
    };
    const size_t nout = size_t(s.B) * s.Tq * C, nlse = size_t(s.B) * s.NH * s.Tq;
    Twin out = out_twin(p, nout, true), lse = out_twin(p, nlse, false);
    p.cpu->attention_block_forward(out.c(), static_cast<float*>(lse.c()), args(false));
    p.gpu->attention_block_forward(out.g(), static_cast<float*>(lse.g()), args(true));
    check_close("attention_block out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);
    check_close("attention_block lse " + sh, lse.read_gpu(p), lse.read_cpu(p), kAttnFwd);
    // Merge a second partial (the same block again: out stays, lse + log 2).
    Twin bo(p, out.read_cpu(p), true), bl(p, lse.read_cpu(p), false);
    p.cpu->attention_block_merge(out.c(), static_cast<float*>(lse.c()), bo.c(), static_cast<float*>(bl.c()), args(false));
    p.gpu->attention_block_merge(out.g(), static_cast<float*>(lse.g()), bo.g(), static_cast<float*>(bl.g()), args(true));
    check_close("attention_block merge out " + sh, out.read_gpu(p), out.read_cpu(p), kAttnFwd);
    Twin dout(p, randn(nout, 303), true);
    Twin dq(p, Vec(size_t(s.B) * s.Tq * ld, 0.f), false), dkv(p, Vec(size_t(s.B) * s.Tk * kv_ld, 0.f), false);
    for (bool gpu : {false, true}) {
      Backend* be = gpu ? p.gpu.get() : p.cpu.get();
      float* dkp = static_cast<float*>(gpu ? dkv.g() : dkv.c());
      be->attention_block_backward(static_cast<float*>(gpu ? dq.g() : dq.c()), dkp, dkp + s.NKV * s.HS,
                                   gpu ? dout.g() : dout.c(), gpu ? out.g() : out.c(),
                                   static_cast<const float*>(gpu ? lse.g() : lse.c()), args(gpu));
    }
    check_close("attention_block dq " + sh, columns(dq.read_gpu(p), ld, 0, C), columns(dq.read_cpu(p), ld, 0, C),
                kAttnBwd);
    check_close("attention_block dk|dv " + sh, dkv.read_gpu(p), dkv.read_cpu(p), kAttnBwd);
  }
}

// The tiled block kernels across chunk boundaries, as the ring calls them: a
// query chunk of 80 rows (a full 64-row tile and a partial one) at global
// position 160 of a 320-row sequence of 4 chunks, against K/V blocks of the
// chunk before it (chunk 0), the chunk itself (the diagonal) and the chunk
// after it (chunk 3: every key after every query). Documents on global
// positions: batch row 0 starts one exactly on the query chunk's edge (160:
// the earlier block is invisible to every row), batch row 1 has one of 200
// rows from 10 to 210 (longer than two chunks: rows 160..209 see keys 10..79
// of chunk 0 across both its tiles, rows 210..239 see none of it: lse -inf).
// Forward partials per block (out, lse with -inf rows), the final result
// merged in the ring's order (diagonal, then chunk 0), and the fp32 backward
// of each block accumulated (+=) into pre-filled dq, dk, dv with that final
// out/lse; the chunk-3 block must leave dk/dv bit for bit unchanged. GQA
// 8:2 at HS 64 (16-byte loads), multi-head at HS 40 (padded, scalar loads),
// and window 120 + soft-cap 2 + scale 0.3 with the documents (rows up to
// 198 of batch row 1 still reach chunk 0; query tile 1 skips its key tile 0). Refusals:
// head size 160 and a negative window name the op. Not yet run on a GPU
// (2026-12-05).
TEST_CASE("cuda: tiled block attention across chunk boundaries matches the CPU op", "[cuda][cp]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  constexpr int Tc = 80, T = 4 * Tc, q_pos0 = 2 * Tc;
  struct Case { int B, NH, NKV, HS; bool docs; int window; float softcap, scale; };
  const int kcs[3] = {2, 0, 3};  // the diagonal first (every row sees itself), then before, then after
  for (Case s : {Case{2, 8, 2, 64, true, 0, 0.f, 0.f}, Case{1, 4, 4, 40, false, 0, 0.f, 0.f},
                 Case{2, 8, 2, 64, true, 120, 2.f, 0.3f}}) {
    const std::string sh = shape({{"B", s.B}, {"NH", s.NH}, {"NKV", s.NKV}, {"HS", s.HS}, {"docs", s.docs},
                                  {"window", s.window}, {"softcap_x10", long(s.softcap * 10)}});
    const int64_t ld = int64_t(s.NH + 2 * s.NKV) * s.HS, C = int64_t(s.NH) * s.HS, kv_ld = 2 * int64_t(s.NKV) * s.HS;
    Twin q(p, randn(size_t(s.B) * Tc * ld, 311), true);
    std::vector<Twin> kv;
    for (int i = 0; i < 3; ++i) kv.emplace_back(p, randn(size_t(s.B) * Tc * kv_ld, 312 + i), true);
    // Global document starts, then the query chunk's rows of them.
    std::vector<int32_t> doc(size_t(s.B) * Tc, 0);
    for (int b = 0; b < s.B; ++b) {
      const std::vector<int> starts = b == 0 ? std::vector<int>{0, 30, 160, 240} : std::vector<int>{0, 10, 210};
      for (int i = 0; i < Tc; ++i)
        for (int st : starts)
          if (st <= q_pos0 + i) doc[size_t(b) * Tc + i] = st;
    }
    DeviceBuffer cdoc = test::upload_i32(p.cpu.get(), doc), gdoc = test::upload_i32(p.gpu.get(), doc);
    auto args = [&](bool gpu, int blk) {
      AttentionBlock a;
      a.B = s.B, a.Tq = Tc, a.Tk = Tc, a.NH = s.NH, a.NKV = s.NKV, a.HS = s.HS;
      a.q_pos0 = q_pos0, a.k_pos0 = kcs[blk] * Tc;
      a.q = gpu ? q.g() : q.c(), a.q_ld = ld, a.q_bs = Tc * ld;
      const void* k = gpu ? kv[blk].g() : kv[blk].c();
      a.k = k, a.v = static_cast<const char*>(k) + size_t(s.NKV) * s.HS * (gpu ? 2 : 4);
      a.kv_ld = kv_ld, a.kv_bs = Tc * kv_ld;
      a.o_ld = C, a.o_bs = Tc * C, a.lse_bs = int64_t(s.NH) * Tc, a.lse_hs = Tc;
      if (s.docs) a.q_doc = gpu ? gdoc.as<int32_t>() : cdoc.as<int32_t>(), a.doc_bs = Tc;
      a.window = s.window, a.softcap = s.softcap, a.scale = s.scale;
      return a;
    };
    const size_t nout = size_t(s.B) * Tc * C, nlse = size_t(s.B) * s.NH * Tc;
    // lse: -inf rows (no visible key in the block) must match exactly; the rest norm-wise.
    auto check_lse = [&](const std::string& what, Vec got, Vec want) {
      size_t inf_rows = 0, mismatched = 0;
      for (size_t i = 0; i < want.size(); ++i)
        if (std::isinf(want[i]) || std::isinf(got[i])) {
          mismatched += !(got[i] == want[i]);
          inf_rows += std::isinf(want[i]);
          got[i] = want[i] = 0.f;
        }
      INFO(what << ": " << mismatched << " rows -inf on one backend only");
      CHECK(mismatched == 0);
      check_close(what, got, want, kAttnFwd);
      return inf_rows;
    };
    std::vector<Twin> out, lse;
    for (int blk = 0; blk < 3; ++blk) {
      const std::string what = sh + " kv chunk " + std::to_string(kcs[blk]);
      out.push_back(out_twin(p, nout, true));
      lse.push_back(out_twin(p, nlse, false));
      p.cpu->attention_block_forward(out[blk].c(), lse[blk].cf(), args(false, blk));
      p.gpu->attention_block_forward(out[blk].g(), lse[blk].gf(), args(true, blk));
      check_close("block out " + what, out[blk].read_gpu(p), out[blk].read_cpu(p), kAttnFwd);
      const size_t inf_rows = check_lse("block lse " + what, lse[blk].read_gpu(p), lse[blk].read_cpu(p));
      // The inputs cover what they claim: the diagonal is seen by every row,
      // the later chunk by none, the earlier one (with documents) by some.
      if (kcs[blk] == 2) CHECK(inf_rows == 0);
      if (kcs[blk] == 3) CHECK(inf_rows == nlse);
      if (kcs[blk] == 0 && s.docs) CHECK((inf_rows > 0 && inf_rows < nlse));
    }
    // The final out/lse: the diagonal's partial merged with chunk 0's.
    p.cpu->attention_block_merge(out[0].c(), lse[0].cf(), out[1].c(), lse[1].cf(), args(false, 1));
    p.gpu->attention_block_merge(out[0].g(), lse[0].gf(), out[1].g(), lse[1].gf(), args(true, 1));
    check_close("merged out " + sh, out[0].read_gpu(p), out[0].read_cpu(p), kAttnFwd);
    check_lse("merged lse " + sh, lse[0].read_gpu(p), lse[0].read_cpu(p));
    // Backward of every block into pre-filled accumulators (the ring's +=).
    Twin dout(p, randn(nout, 313), true);
    Twin dq(p, randn(size_t(s.B) * Tc * ld, 314), false);
    std::vector<Twin> dkv;
    for (int blk = 0; blk < 3; ++blk) dkv.emplace_back(p, randn(size_t(s.B) * Tc * kv_ld, 315 + blk), false);
    for (int blk = 0; blk < 3; ++blk)
      for (bool gpu : {false, true}) {
        Backend* be = gpu ? p.gpu.get() : p.cpu.get();
        float* dkp = gpu ? dkv[blk].gf() : dkv[blk].cf();
        be->attention_block_backward(gpu ? dq.gf() : dq.cf(), dkp, dkp + s.NKV * s.HS, gpu ? dout.g() : dout.c(),
                                     gpu ? out[0].g() : out[0].c(), gpu ? lse[0].gf() : lse[0].cf(), args(gpu, blk));
      }
    check_close("block dq (3 blocks) " + sh, columns(dq.read_gpu(p), ld, 0, C), columns(dq.read_cpu(p), ld, 0, C),
                kAttnBwd);
    for (int blk = 0; blk < 2; ++blk)
      check_close("block dk|dv kv chunk " + std::to_string(kcs[blk]) + " " + sh, dkv[blk].read_gpu(p),
                  dkv[blk].read_cpu(p), kAttnBwd);
    CHECK(dkv[2].read_gpu(p) == dkv[2].val);  // no query sees chunk 3: untouched, bit for bit
  }
  AttentionBlock a;
  a.B = 1, a.Tq = a.Tk = 1, a.NH = a.NKV = 1, a.HS = 160;
  DeviceBuffer o(p.gpu.get(), 4096), l(p.gpu.get(), 64);
  CHECK_THROWS_WITH(p.gpu->attention_block_forward(o.get(), l.as<float>(), a),
                    Catch::Contains("attention_block_forward: head size 160 (head_dim) is larger than the supported 128"));
  a.HS = 16, a.window = -1;
  CHECK_THROWS_WITH(p.gpu->attention_block_backward(l.as<float>(), l.as<float>(), l.as<float>(), o.get(), o.get(),
                                                    l.as<float>(), a),
                    Catch::Contains("attention_block_backward: window -1"));
}
