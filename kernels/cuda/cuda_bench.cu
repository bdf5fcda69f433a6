// `trainrun bench kernels`: the CUDA backend's kernels and GEMMs, timed with
// CUDA events (median of `repeats` launches after two warm-ups), next to the
// card's own ceilings measured in the same run:
//   - copy bandwidth: a 2 GiB device-to-device cudaMemcpy, bytes read + written;
//   - cuBLASLt large-GEMM rate: 8192^3 bf16, the best of the heuristic's 8 algorithms.
// Memory-bound kernels report GB/s over the fewest bytes they must move (each
// input read once, each output written once) and % of the copy bandwidth;
// GEMMs report TFLOP/s and % of the best of 8 cuBLASLt algorithms for the
// same shape (the wrapper runs the heuristic's first); attention reports
// TFLOP/s with the causal FLOP count (forward 2 products over half the
// square, backward 2.5x the forward, FlashAttention's convention).
// Sizes are GPT-2 124M's: B=16, T=1024, C=768, NH=12, V=50257 (quick: B=2),
// then the Llama ops (RMSNorm, RoPE, SwiGLU, grouped-query attention) at
// Llama-3.2-1B's: C=2048, NH=32, NKV=8, HS=64, F=8192, T=2048, B=4 (quick: 1).
// Wide models: TRAINRUN_BENCH_C=<C> (scripts/gpu-check.sh runs 4096 and
// 8192) times the C-dependent rows at that width instead, with HS = 128
// (NH = C/128, as Llama 7B / 70B) and B=4 (quick: 1), so each run stays
// within a minute or so; the rows that do not depend on C (softmax+CE,
// AdamW, casts, sum of squares over 124M parameters) are left out there.
// The kernel bench's options are the CLI's (apps/main.cpp); this knob is an
// environment variable because the plugin alone owns it, and the table's
// header names it when set.
// Then the MoE ops at Qwen3-30B-A3B's shape (router, permute, the experts'
// grouped GEMM against one dense GEMM of the same rows, unpermute).
// Inputs are random (never zeros: zeros run faster than real data); the
// embedding backward is timed with uniform tokens and with 70% of them one
// hot token (the long-run path).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/matmul.cuh"

namespace trainrun::cuda {

namespace {

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}
// Uniform in [-amp, amp).
template <typename T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float amp) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = from_float<T>(amp * (float(hash32(seed * 0x9E3779B97F4A7C15ull + i)) * 4.656612873e-10f - 1.0f));
}
// Uniform over [0, V), except a fraction `hot` of them (by hash) = token 0.
__global__ void fill_tokens_kernel(int32_t* p, int64_t n, uint64_t seed, int V, float hot) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const bool is_hot = float(hash32(~seed * 0x9E3779B97F4A7C15ull + i)) * 2.3283064e-10f < hot;
    p[i] = is_hot ? 0 : int32_t(hash32(seed * 0x9E3779B97F4A7C15ull + i) % uint32_t(V));
  }
}

struct Row {
  std::string name, shape;
  double us = 0, rate = 0, pct = -1;
  std::string unit, ref;
};

class Bench {
 public:
  Bench(CudaBackend& be, int repeats) : be_(be), s_(be.compute_stream()), repeats_(repeats) {
    TR_CUDA_CHECK(cudaEventCreate(&e0_));
    TR_CUDA_CHECK(cudaEventCreate(&e1_));
  }
  ~Bench() {
    for (void* p : bufs_) be_.free(p);
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
  }

  template <typename T>
  T* buf(int64_t n, float amp = 1.0f) {
    T* p = static_cast<T*>(be_.alloc(size_t(n) * sizeof(T)));
    bufs_.push_back(p);
    fill_kernel<T><<<grid_for(n, 256), 256, 0, s_>>>(p, n, ++seed_, amp);
    TR_CUDA_LAUNCH_CHECK("bench fill");
    return p;
  }
  // Raw bytes (for the copy ceiling): a non-zero pattern.
  char* bytes(int64_t n) {
    auto* p = static_cast<char*>(be_.alloc(size_t(n)));
    bufs_.push_back(p);
    TR_CUDA_CHECK(cudaMemsetAsync(p, 0x5A, size_t(n), s_));
    return p;
  }
  int32_t* tokens(int64_t n, int V, float hot = 0.0f) {
    auto* p = static_cast<int32_t*>(be_.alloc(size_t(n) * 4));
    bufs_.push_back(p);
    fill_tokens_kernel<<<grid_for(n, 256), 256, 0, s_>>>(p, n, ++seed_, V, hot);
    TR_CUDA_LAUNCH_CHECK("bench tokens");
    return p;
  }

  // Median microseconds of f() over the repeats.
  double time_us(const std::function<void()>& f) {
    f();
    f();
    std::vector<float> t;
    for (int r = 0; r < repeats_; ++r) {
      TR_CUDA_CHECK(cudaEventRecord(e0_, s_));
      f();
      TR_CUDA_CHECK(cudaEventRecord(e1_, s_));
      TR_CUDA_CHECK(cudaEventSynchronize(e1_));
      float ms = 0;
      TR_CUDA_CHECK(cudaEventElapsedTime(&ms, e0_, e1_));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return 1000.0 * t[t.size() / 2];
  }

  void memory(const std::string& name, const std::string& shape, double bytes, const std::function<void()>& f) {
    Row r{name, shape};
    r.us = time_us(f);
    r.rate = bytes / (r.us * 1e-6) / 1e9;
    r.unit = "GB/s";
    r.pct = copy_gbs_ > 0 ? 100.0 * r.rate / copy_gbs_ : -1;
    r.ref = "copy";
    rows_.push_back(r);
  }

  void gemm(const std::string& name, const GemmDesc& g, const GemmPtrs& p) {
    auto t = be_.gemm().time_algorithms(g, p, s_, 8, repeats_);
    double best = 1e30;
    for (float x : t)
      if (x > 0) best = std::min(best, double(x));
    Row r{name, detail::cat(g.m, "x", g.n, "x", g.k, g.accumulate ? " +=" : "")};
    const double flops = 2.0 * g.m * g.n * double(g.k) * g.batch;
    r.us = 1000.0 * t[0];
    r.rate = flops / (r.us * 1e-6) / 1e12;
    r.unit = "TFLOP/s";
    r.pct = 100.0 * best / t[0];
    r.ref = detail::cat("best of ", t.size(), " algos: ", int(flops / (best * 1e-3) / 1e12), " TFLOP/s");
    rows_.push_back(r);
  }

  void compute(const std::string& name, const std::string& shape, double flops, const std::function<void()>& f,
               const std::string& ref) {
    Row r{name, shape};
    r.us = time_us(f);
    r.rate = flops / (r.us * 1e-6) / 1e12;
    r.unit = "TFLOP/s";
    r.ref = ref;
    rows_.push_back(r);
  }

  void set_copy_gbs(double g) { copy_gbs_ = g; }
  std::vector<Row>& rows() { return rows_; }
  cudaStream_t stream() const { return s_; }

 private:
  CudaBackend& be_;
  cudaStream_t s_;
  int repeats_;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
  std::vector<void*> bufs_;
  uint64_t seed_ = 1;
  double copy_gbs_ = 0;
  std::vector<Row> rows_;
};

}  // namespace

int run_kernel_bench_impl(const KernelBenchOptions& opts) {
  CudaBackend be(opts.device);
  cudaDeviceProp prop{};
  TR_CUDA_CHECK(cudaGetDeviceProperties(&prop, opts.device));
  Bench b(be, std::max(3, opts.repeats));
  int wide = 0;  // TRAINRUN_BENCH_C: 0 = GPT-2 124M's shapes
  if (const char* v = std::getenv("TRAINRUN_BENCH_C"); v && *v) {
    char* end = nullptr;
    const long c = std::strtol(v, &end, 10);
    TR_CHECK(end && *end == 0 && c >= 128 && c % 128 == 0 && c <= 65536, "TRAINRUN_BENCH_C=", v,
             ": expected a width in [128, 65536] that is a multiple of 128 (HS = 128), e.g. 4096 or 8192");
    wide = int(c);
  }
  const int B = wide ? (opts.quick ? 1 : 4) : (opts.quick ? 2 : 16), T = 1024, V = 50257;
  const int C = wide ? wide : 768, NH = wide ? wide / 128 : 12;
  const int N = B * T;
  std::printf("trainrun bench kernels: %s (%d SMs, %.0f GB), B=%d T=%d C=%d NH=%d V=%d, median of %d%s\n", prop.name,
              prop.multiProcessorCount, prop.totalGlobalMem / 1e9, B, T, C, NH, V, std::max(3, opts.repeats),
              wide ? detail::cat(" (TRAINRUN_BENCH_C=", wide, ")").c_str() : "");
  std::fflush(stdout);

  // ---- ceilings -------------------------------------------------------------------
  {
    const int64_t bytes = opts.quick ? (int64_t(256) << 20) : (int64_t(2) << 30);
    char* src = b.bytes(bytes);
    char* dst = b.bytes(bytes);
    Row r{"ceiling: device copy (cudaMemcpy D2D)", detail::cat(bytes >> 20, " MiB")};
    r.us = b.time_us([&] { TR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b.stream())); });
    r.rate = 2.0 * bytes / (r.us * 1e-6) / 1e9;
    r.unit = "GB/s";
    r.ref = "read + write";
    b.set_copy_gbs(r.rate);
    b.rows().push_back(r);
  }
  {
    const int S = opts.quick ? 2048 : 8192;
    GemmDesc g = linear_forward_desc(S, S, S, false);
    GemmPtrs p;
    p.a = b.buf<bf16>(int64_t(S) * S);
    p.b = b.buf<bf16>(int64_t(S) * S);
    p.d = b.buf<bf16>(int64_t(S) * S);
    b.gemm("ceiling: cuBLASLt bf16 GEMM", g, p);
    b.rows().back().name = "ceiling: cuBLASLt bf16 GEMM (wrapper)";
  }

  // ---- GEMMs at GPT-2 124M shapes --------------------------------------------------------------
  {
    bf16* x = b.buf<bf16>(int64_t(N) * 4 * C);
    bf16* w = b.buf<bf16>(int64_t(V) * C, 0.02f);
    bf16* bias = b.buf<bf16>(int64_t(V));
    const int Vp = be.logits_stride(V);  // what the model uses (kernels/backend.h)
    bf16* y = b.buf<bf16>(int64_t(N) * Vp);
    float* dw = b.buf<float>(int64_t(V) * C);
    struct L { std::string name; int c, oc; bool bias; int ld; };
    // The LM head twice: logits rows padded to Vp (as trained) and unpadded
    // (rows V apart, 2-byte aligned), to show what the padding buys.
    for (const L& l : {L{"qkv", C, 3 * C, true, 0}, L{"attn proj", C, C, true, 0}, L{"fc", C, 4 * C, true, 0},
                       L{"fc proj", 4 * C, C, true, 0}, L{detail::cat("lm head (rows ", Vp, ")"), C, V, false, Vp},
                       L{detail::cat("lm head (rows ", V, ", unpadded)"), C, V, false, V}}) {
      GemmPtrs pf;
      pf.a = w; pf.b = x; pf.d = y; pf.bias = l.bias ? bias : nullptr;
      b.gemm(detail::cat("gemm fwd ", l.name), linear_forward_desc(N, l.c, l.oc, l.bias, l.ld), pf);
      GemmPtrs pi;
      pi.a = w; pi.b = y; pi.d = x;
      b.gemm(detail::cat("gemm bwd dinp ", l.name), linear_dinp_desc(N, l.c, l.oc, l.ld), pi);
      GemmPtrs pw;
      pw.a = x; pw.b = y; pw.d = dw;
      b.gemm(detail::cat("gemm bwd dweight ", l.name), linear_dweight_desc(N, l.c, l.oc, l.ld), pw);
    }
  }

  // ---- fusions: the fused op next to the ops it replaces ------------------------------------------
  {
    const int64_t NC = int64_t(N) * C;
    bf16* x = b.buf<bf16>(NC);
    bf16* w = b.buf<bf16>(int64_t(4) * C * C, 0.02f);
    bf16* bias = b.buf<bf16>(4 * C);
    bf16* pre = b.buf<bf16>(4 * NC);
    bf16* out = b.buf<bf16>(4 * NC);
    bf16* dout = b.buf<bf16>(NC);
    bf16* dpre = b.buf<bf16>(4 * NC);
    float* dw = b.buf<float>(int64_t(4) * C * C);
    float* db = b.buf<float>(C);
    const double fc = 2.0 * N * C * 4.0 * C;
    const std::string sh = detail::cat(N, "x", C, "->", 4 * C);
    b.compute("fc + gelu (GELU_AUX_BIAS epilogue)", sh, fc,
              [&] { be.matmul_gelu_forward(out, pre, x, w, bias, N, C, 4 * C); }, "vs the next row");
    b.compute("fc, then gelu kernel", sh, fc, [&] {
      be.matmul_forward(pre, x, w, bias, N, C, 4 * C);
      be.gelu_forward(out, pre, 4 * NC);
    }, "unfused");
    // fc proj backward (4C -> C) with GELU's backward: dinp, dweight, dbias.
    const std::string shb = detail::cat(N, "x", 4 * C, "->", C);
    b.compute("fc proj bwd + dgelu (DGELU epilogue)", shb, 3 * fc,
              [&] { be.matmul_backward_dgelu(dpre, dw, db, dout, out, w, pre, N, 4 * C, C); }, "vs the next row");
    b.compute("fc proj bwd, then gelu bwd kernel", shb, 3 * fc, [&] {
      be.matmul_backward(dpre, dw, db, dout, out, w, N, 4 * C, C);
      be.gelu_backward(dpre, pre, dpre, 4 * NC);
    }, "unfused");
    bf16* res = b.buf<bf16>(NC);
    bf16* ln = b.buf<bf16>(NC);
    bf16* lw = b.buf<bf16>(C);
    bf16* lb = b.buf<bf16>(C);
    float* mean = b.buf<float>(N);
    float* rstd = b.buf<float>(N);
    const std::string shl = detail::cat(N, "x", C);
    b.memory("residual + layernorm (fused)", shl, 4.0 * NC * 2 + 8.0 * N,
             [&] { be.residual_layernorm_forward(res, ln, mean, rstd, x, dout, lw, lb, N, C); });
    b.memory("residual, then layernorm", shl, 4.0 * NC * 2 + 8.0 * N, [&] {
      be.residual_forward(res, x, dout, NC);
      be.layernorm_forward(ln, mean, rstd, res, lw, lb, N, C);
    });
  }

  // ---- memory-bound kernels ----------------------------------------------------------------------
  {
    const int64_t NC = int64_t(N) * C;
    bf16* x = b.buf<bf16>(NC);
    bf16* y = b.buf<bf16>(NC);
    bf16* z = b.buf<bf16>(NC);
    bf16* w = b.buf<bf16>(C);
    bf16* bb = b.buf<bf16>(C);
    float* mean = b.buf<float>(N);
    float* rstd = b.buf<float>(N, 0.5f);
    float* dw = b.buf<float>(C);
    float* db = b.buf<float>(C);
    const std::string sh = detail::cat(N, "x", C);
    b.memory("layernorm fwd", sh, 2.0 * NC * 2 + 8.0 * N, [&] { be.layernorm_forward(y, mean, rstd, x, w, bb, N, C); });
    b.memory("layernorm bwd (dinp +=)", sh, 4.0 * NC * 2 + 8.0 * N,
             [&] { be.layernorm_backward(z, dw, db, y, x, w, mean, rstd, N, C); });
    b.memory("residual add", sh, 3.0 * NC * 2, [&] { be.residual_forward(z, x, y, NC); });
    bf16* h = b.buf<bf16>(4 * NC);
    bf16* hg = b.buf<bf16>(4 * NC);
    const std::string sh4 = detail::cat(N, "x", 4 * C);
    b.memory("gelu fwd", sh4, 2.0 * 4 * NC * 2, [&] { be.gelu_forward(hg, h, 4 * NC); });
    b.memory("gelu bwd (in place)", sh4, 3.0 * 4 * NC * 2, [&] { be.gelu_backward(hg, h, hg, 4 * NC); });
    int32_t* tok = b.tokens(N, V);
    bf16* wte = b.buf<bf16>(int64_t(V) * C);
    bf16* wpe = b.buf<bf16>(int64_t(T) * C);
    float* dwte = b.buf<float>(int64_t(V) * C);
    float* dwpe = b.buf<float>(int64_t(T) * C);
    b.memory("encoder fwd", sh, 2.0 * NC * 2 + 4.0 * N, [&] { be.encoder_forward(y, tok, wte, wpe, B, T, C); });
    b.memory("encoder bwd (sort + sums)", sh, NC * 2 + 2.0 * NC * 4, [&] { be.encoder_backward(dwte, dwpe, y, tok, B, T, C); });
    int32_t* hot = b.tokens(N, V, 0.7f);
    b.memory("encoder bwd, 70% one token", sh, NC * 2 + 2.0 * NC * 4,
             [&] { be.encoder_backward(dwte, dwpe, y, hot, B, T, C); });
  }
  if (!wide) {
    const int Nce = opts.quick ? 512 : 4096;
    const int Vp = be.logits_stride(V);
    bf16* logits = b.buf<bf16>(int64_t(Nce) * Vp, 4.0f);
    float* losses = b.buf<float>(Nce);
    int32_t* tgt = b.tokens(Nce, V);
    const double rowbytes = double(Nce) * V * 2;
    b.memory("softmax+CE fwd only", detail::cat(Nce, "x", V), rowbytes + 8.0 * Nce,
             [&] { be.softmax_cross_entropy(losses, nullptr, logits, tgt, Nce, V, Vp, 0.0f); });
    b.memory("softmax+CE fwd+grad (in place)", detail::cat(Nce, "x", V), 2 * rowbytes + 8.0 * Nce,
             [&] { be.softmax_cross_entropy(losses, logits, logits, tgt, Nce, V, Vp, 1e-6f); });
  }
  if (!wide) {
    const int64_t P = opts.quick ? (int64_t(16) << 20) : 124439808;  // GPT-2 124M
    float* master = b.buf<float>(P, 0.02f);
    bf16* param = b.buf<bf16>(P);
    float* grad = b.buf<float>(P, 1e-3f);
    float* m = b.buf<float>(P, 1e-4f);
    float* v = b.buf<float>(P, 1e-6f);
    be.scale(v, 0.0f, P);  // the second moment must be >= 0; 0 is a valid (first-step) state
    float* acc = b.buf<float>(1);
    const std::string sh = detail::cat(P, " params");
    b.memory("adamw (fp32 master + bf16 copy)", sh, 30.0 * P,
             [&] { be.adamw_update(master, param, grad, m, v, P, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 10, 1.0f); });
    b.memory("cast fp32 -> bf16", sh, 6.0 * P, [&] { be.cast_from_f32(param, master, P); });
    b.memory("sum_squares (grad norm)", sh, 4.0 * P, [&] { be.sum_squares(acc, grad, P); });
    b.memory("accumulate fp32", sh, 12.0 * P, [&] { be.accumulate(m, grad, P); });
  }

  // ---- attention ----------------------------------------------------------------------------------
  {
    const int HS = C / NH;
    bf16* qkv = b.buf<bf16>(int64_t(N) * 3 * C);
    bf16* out = b.buf<bf16>(int64_t(N) * C);
    bf16* dout = b.buf<bf16>(int64_t(N) * C);
    bf16* dqkv = b.buf<bf16>(int64_t(N) * 3 * C);
    float* lse = b.buf<float>(int64_t(be.attention_saved_floats(B, T, NH)));
    const double fwd = 4.0 * B * NH * double(T) * T * HS / 2;  // causal: half the square
    const std::string sh = detail::cat("B", B, " T", T, " NH", NH, " HS", HS);
    b.compute("attention fwd (flash, WMMA)", sh, fwd, [&] { be.attention_forward(out, lse, qkv, B, T, C, NH); },
              "cuDNN/torch SDPA: see gpu-check.sh");
    b.compute("attention bwd (flash, WMMA)", sh, 2.5 * fwd,
              [&] { be.attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH); }, "");
    // The sampler's op on one sequence: a prompt of T into empty caches, and
    // one decode step at the last position (reads the whole cache: memory-bound).
    bf16* kc = b.buf<bf16>(int64_t(T) * C);
    bf16* vc = b.buf<bf16>(int64_t(T) * C);
    const double fwd1 = 4.0 * NH * double(T) * T * HS / 2;
    b.compute("attention kv prefill (Tq=T, pos 0)", detail::cat("T", T, " NH", NH, " HS", HS), fwd1,
              [&] { be.attention_kv_forward(out, kc, vc, qkv, 0, T, C, NH); }, "CUDA cores, fp32");
    b.memory("attention kv decode (Tq=1, pos T-1)", detail::cat("cache ", T, "x", C), 2.0 * T * C * 2 + 8.0 * C,
             [&] { be.attention_kv_forward(out, kc, vc, qkv, T - 1, 1, C, NH); });
  }

  // ---- Llama-3.2-1B: RMSNorm, RoPE, SwiGLU, grouped-query attention ------------------------------
  if (!wide) {
    const int LB = opts.quick ? 1 : 4, LT = 2048, LC = 2048, LNH = 32, LNKV = 8, LHS = 64, LF = 8192;
    const int LN = LB * LT, ld = (LNH + 2 * LNKV) * LHS, KV = LNKV * LHS;
    const int64_t NC = int64_t(LN) * LC;
    const float eps = 1e-5f;
    bf16* x = b.buf<bf16>(NC);
    bf16* y = b.buf<bf16>(NC);
    bf16* res = b.buf<bf16>(NC);
    bf16* dx = b.buf<bf16>(NC);
    bf16* w = b.buf<bf16>(LC);
    float* rstd = b.buf<float>(LN, 0.5f);
    float* dw = b.buf<float>(LC);
    const std::string sh = detail::cat(LN, "x", LC);
    b.memory("llama rmsnorm fwd", sh, 2.0 * NC * 2 + 4.0 * LN,
             [&] { be.rmsnorm_forward(y, rstd, x, w, LN, LC, eps); });
    b.memory("llama residual + rmsnorm (fused)", sh, 4.0 * NC * 2 + 4.0 * LN,
             [&] { be.residual_rmsnorm_forward(res, y, rstd, x, dx, w, LN, LC, eps); });
    b.memory("llama rmsnorm bwd (dinp +=)", sh, 4.0 * NC * 2 + 4.0 * LN,
             [&] { be.rmsnorm_backward(dx, dw, y, x, w, rstd, LN, LC); });
    // RoPE: plain frequencies (theta 5e5) are enough to time it.
    std::vector<float> tab(size_t(LT) * LHS);
    for (int t = 0; t < LT; ++t)
      for (int i = 0; i < LHS / 2; ++i) {
        const double a = t * std::pow(500000.0, -2.0 * i / LHS);
        tab[(size_t(t) * LHS / 2 + i) * 2] = float(std::cos(a));
        tab[(size_t(t) * LHS / 2 + i) * 2 + 1] = float(std::sin(a));
      }
    float* cs = b.buf<float>(int64_t(tab.size()));
    be.copy_to_device(cs, tab.data(), tab.size() * 4);
    bf16* qkv = b.buf<bf16>(int64_t(LN) * ld);
    const double rope_bytes = 2.0 * LN * (LNH + LNKV) * LHS * 2;  // q and k read and written
    const std::string shq = detail::cat(LN, "x", ld, " (q|k of NH", LNH, " NKV", LNKV, ")");
    b.memory("llama rope fwd (in place)", shq, rope_bytes,
             [&] { be.rope_forward(qkv, cs, LB, LT, LNH, LNKV, LHS, 0); });
    b.memory("llama rope bwd (in place)", shq, rope_bytes,
             [&] { be.rope_backward(qkv, cs, LB, LT, LNH, LNKV, LHS, 0); });
    bf16* gu = b.buf<bf16>(int64_t(LN) * 2 * LF);
    bf16* h = b.buf<bf16>(int64_t(LN) * LF);
    const std::string shf = detail::cat(LN, "x", 2 * LF, "->", LF);
    b.memory("llama swiglu fwd", shf, 3.0 * LN * LF * 2, [&] { be.swiglu_forward(h, gu, LN, LF); });
    b.memory("llama swiglu bwd (in place)", shf, 5.0 * LN * LF * 2, [&] { be.swiglu_backward(gu, h, gu, LN, LF); });
    // Attention, causal FLOP count as above.
    bf16* aout = b.buf<bf16>(int64_t(LN) * LNH * LHS);
    bf16* adout = b.buf<bf16>(int64_t(LN) * LNH * LHS);
    bf16* dqkv = b.buf<bf16>(int64_t(LN) * ld);
    float* lse = b.buf<float>(int64_t(be.attention_gqa_saved_floats(LB, LT, LNH)));
    const double fwd = 4.0 * LB * LNH * double(LT) * LT * LHS / 2;
    const std::string sha = detail::cat("B", LB, " T", LT, " NH", LNH, " NKV", LNKV, " HS", LHS);
    b.compute("llama attention gqa fwd (flash, WMMA)", sha, fwd,
              [&] { be.attention_gqa_forward(aout, lse, qkv, LB, LT, LNH, LNKV, LHS); }, "");
    b.compute("llama attention gqa bwd (flash, WMMA)", sha, 2.5 * fwd,
              [&] { be.attention_gqa_backward(dqkv, adout, qkv, aout, lse, LB, LT, LNH, LNKV, LHS); }, "");
    bf16* kc = b.buf<bf16>(int64_t(LT) * KV);
    bf16* vc = b.buf<bf16>(int64_t(LT) * KV);
    b.compute("llama attention kv gqa prefill (pos 0)", detail::cat("T", LT, " NH", LNH, " NKV", LNKV), fwd / LB,
              [&] { be.attention_kv_gqa_forward(aout, kc, vc, qkv, 0, LT, LNH, LNKV, LHS); }, "CUDA cores, fp32");
    b.memory("llama attention kv gqa decode (pos T-1)", detail::cat("cache ", LT, "x", KV), 2.0 * LT * KV * 2,
             [&] { be.attention_kv_gqa_forward(aout, kc, vc, qkv, LT - 1, 1, LNH, LNKV, LHS); });
  }

  // ---- mixture of experts at Qwen3-30B-A3B's shape: C 2048, 128 experts of F 768, top-8 ----------
  // Ids uniform over the experts (the balanced case); the grouped GEMM is
  // set against one dense GEMM over the same rows (its ceiling: the same
  // FLOPs with no groups), and includes the offsets' read-back (one stream
  // sync, moe_grouped_gemm.h) as a training step pays it.
  if (!wide) {
    const int MN = opts.quick ? 1024 : 4096, MC = 2048, ME = 128, MK = 8, MF = 768;
    const int64_t R = int64_t(MN) * MK;
    bf16* logits = b.buf<bf16>(int64_t(MN) * ME);
    float* probs = b.buf<float>(int64_t(MN) * ME);
    float* lse = b.buf<float>(MN);
    int32_t* idx = b.tokens(R, ME);
    float* wts = b.buf<float>(R);
    bf16* x = b.buf<bf16>(int64_t(MN) * MC);
    bf16* xp = b.buf<bf16>(R * MC);
    int32_t* pos = b.tokens(R, 1);
    int32_t* offsets = b.tokens(ME + 1, 1);
    bf16* w_gu = b.buf<bf16>(int64_t(ME) * 2 * MF * MC, 0.02f);
    bf16* gu = b.buf<bf16>(R * 2 * MF);
    bf16* y = b.buf<bf16>(int64_t(MN) * MC);
    float* dw = b.buf<float>(int64_t(ME) * 2 * MF * MC);
    bf16* dxp = b.buf<bf16>(R * MC);
    int32_t* ridx = static_cast<int32_t*>(be.alloc(size_t(R) * 4));  // the router's ids, for the permute
    float* rw = b.buf<float>(R);
    const std::string shr = detail::cat(MN, " tokens, E", ME, " K", MK);
    b.memory("moe route fwd (softmax + top-k)", shr, 2.0 * MN * ME + 4.0 * MN * ME + 8.0 * R,
             [&] { be.moe_route_forward(probs, lse, ridx, rw, logits, MN, ME, MK, true); });
    b.memory("moe permute (radix sort + gather)", detail::cat(R, " rows x ", MC), 2.0 * R * MC * 2 + 12.0 * R,
             [&] { be.moe_permute(pos, offsets, xp, idx, x, MN, MK, ME, MC); });
    const double flops = 2.0 * R * MC * 2 * MF;
    const double dense_us = b.time_us([&] { be.matmul_forward(gu, xp, w_gu, nullptr, int(R), MC, 2 * MF); });
    const std::string ref = detail::cat("one dense GEMM of these rows: ", int(flops / (dense_us * 1e-6) / 1e12),
                                        " TFLOP/s");
    const std::string shg = detail::cat(R, " rows, ", ME, " x ", 2 * MF, "x", MC);
    b.compute("moe grouped GEMM gate|up fwd", shg, flops,
              [&] { be.moe_expert_matmul_forward(gu, xp, w_gu, offsets, ME, MC, 2 * MF); }, ref);
    b.compute("moe grouped GEMM gate|up bwd (din, dw +=)", shg, 2 * flops,
              [&] { be.moe_expert_matmul_backward(dxp, dw, gu, xp, w_gu, offsets, ME, MC, 2 * MF); }, "");
    // Which path ran (known once they have): cuBLAS grouped, or the per-expert fallback.
    b.rows().back().ref = be.moe_gemm_fallback_used() ? "per-expert cuBLASLt fallback ran" : "cuBLAS grouped";
    b.memory("moe unpermute fwd (weighted sum of K rows)", detail::cat(MN, "x", MC, " K", MK),
             (double(R) + MN) * MC * 2 + 8.0 * R, [&] { be.moe_unpermute_forward(y, xp, pos, wts, MN, MK, MC); });
    be.free(ridx);
  }

  std::printf("\n%-40s %-22s %12s %12s %-8s %7s  %s\n", "kernel", "size", "time (us)", "achieved", "", "%",
              "of what");
  for (const auto& r : b.rows()) {
    std::printf("%-40s %-22s %12.1f %12.1f %-8s %7s  %s\n", r.name.c_str(), r.shape.c_str(), r.us, r.rate,
                r.unit.c_str(), r.pct >= 0 ? detail::cat(int(r.pct + 0.5)).c_str() : "-", r.ref.c_str());
  }
  std::fflush(stdout);
  be.synchronize();
  return 0;
}

}  // namespace trainrun::cuda
