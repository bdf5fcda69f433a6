// Self-check of the cuBLASLt wrapper (gemm.h) against a double-precision host
// reference, one case per epilogue and layout, at odd sizes (m=37, n=19,
// k=41) so transposed or swapped dimensions cannot line up. Inputs are
// random bf16 (never zeros); outputs are poisoned (NaN) before the call so an
// unwritten element fails. Reached through run_gemm_epilogue_check
// (tests/test_cuda_ops.cpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/common/error.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

namespace {

// bf16 output: one rounding of O(1) values (2^-9 relative) dominates -> ~3e-3
// norm-wise; 1e-2 leaves room. fp32 output: fp32 accumulation of k=41 exact
// bf16 products -> ~1e-6; 1e-4 leaves room.
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-4;

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double gelu_grad(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x), th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) { TR_CUDA_CHECK(cudaMalloc(&p, b ? b : 1)); }
  ~DevBuf() { cudaFree(p); }
};

// Host values (already rounded to the dtype) <-> device bytes.
std::vector<double> rand_vals(size_t n, std::mt19937_64& g, DType t) {
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> v(n);
  for (auto& x : v) {
    x = d(g);
    x = t == DType::BF16 ? double(__bfloat162float(__float2bfloat16(float(x)))) : double(float(x));
  }
  return v;
}
void upload(void* dst, const std::vector<double>& v, DType t, size_t offset_elems = 0) {
  if (t == DType::BF16) {
    std::vector<__nv_bfloat16> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(float(v[i]));
    TR_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + offset_elems * 2, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  } else {
    std::vector<float> h(v.begin(), v.end());
    TR_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + offset_elems * 4, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
}
std::vector<double> download(const void* src, size_t n, DType t) {
  std::vector<double> v(n);
  if (t == DType::BF16) {
    std::vector<__nv_bfloat16> h(n);
    TR_CUDA_CHECK(cudaMemcpy(h.data(), src, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(h[i]);
  } else {
    std::vector<float> h(n);
    TR_CUDA_CHECK(cudaMemcpy(h.data(), src, n * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i) v[i] = h[i];
  }
  return v;
}
void poison(void* p, size_t bytes) { TR_CUDA_CHECK(cudaMemset(p, 0xFF, bytes)); }  // NaN in bf16 and fp32

// Norm-wise relative error over the logical (rows x cols, ld) matrix; a NaN
// (an unwritten element) gives infinity.
double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

struct Case {
  std::string name;
  GemmDesc g;
  size_t misalign = 0;  // elements added to the A/B/D pointers (alignment handling)
};

void run_case(Gemm& gemm, const Case& c, std::mt19937_64& gen, std::vector<GemmCheckRow>& rows) {
  const GemmDesc& g = c.g;
  const int m = g.m, n = g.n, k = g.k, nb = g.batch;
  const size_t a_cols = g.transa ? m : k, b_cols = g.transb ? k : n;
  const size_t a_elems = size_t(g.lda) * a_cols, b_elems = size_t(g.ldb) * b_cols, d_elems = size_t(g.ldd) * n;
  const int64_t sa = nb > 1 ? g.stride_a : 0, sb = nb > 1 ? g.stride_b : 0, sd = nb > 1 ? g.stride_d : 0;
  const size_t a_total = a_elems + size_t(sa) * (nb - 1), b_total = b_elems + size_t(sb) * (nb - 1),
               d_total = d_elems + size_t(sd) * (nb - 1);
  const size_t es_ab = dtype_size(g.ab_type), es_d = dtype_size(g.d_type);

  auto A = rand_vals(a_total, gen, g.ab_type), B = rand_vals(b_total, gen, g.ab_type);
  auto D0 = rand_vals(d_total, gen, g.d_type);
  auto bias = rand_vals(size_t(m), gen, g.bias_type);
  const size_t aux_elems = size_t(g.ld_aux) * n;
  auto AUX = rand_vals(aux_elems, gen, g.d_type);

  DevBuf dA((a_total + c.misalign) * es_ab), dB((b_total + c.misalign) * es_ab), dD((d_total + c.misalign) * es_d);
  const size_t es_bias = dtype_size(g.bias_type);
  DevBuf dBias(size_t(m) * es_bias), dBG(size_t(std::max(m, n)) * es_bias), dAux(aux_elems * es_d + 16);
  upload(dA.p, A, g.ab_type, c.misalign);
  upload(dB.p, B, g.ab_type, c.misalign);
  char* d_ptr = static_cast<char*>(dD.p) + c.misalign * es_d;
  if (g.accumulate) upload(dD.p, D0, g.d_type, c.misalign);
  else poison(dD.p, dD.bytes);
  upload(dBias.p, bias, g.bias_type);
  poison(dBG.p, dBG.bytes);
  const bool aux_in = g.epilogue == GemmEpilogue::DGelu || g.epilogue == GemmEpilogue::DGeluBGrad;
  if (aux_in) upload(dAux.p, AUX, g.d_type);
  else poison(dAux.p, dAux.bytes);

  GemmPtrs p;
  p.a = static_cast<char*>(dA.p) + c.misalign * es_ab;
  p.b = static_cast<char*>(dB.p) + c.misalign * es_ab;
  p.d = d_ptr;
  p.bias = dBias.p;
  p.bias_grad = dBG.p;
  p.aux = dAux.p;
  GemmCheckRow row;
  row.name = c.name;
  row.tol = g.d_type == DType::BF16 ? kTolBf16 : kTolF32;
  if (!gemm.supported(g, p)) {
    row.supported = false;
    rows.push_back(row);
    return;
  }
  gemm.run(g, p, nullptr);
  TR_CUDA_CHECK(cudaDeviceSynchronize());

  // Reference, in double.
  std::vector<double> want_d(d_total), want_aux(aux_elems), want_bg;
  for (int bi = 0; bi < nb; ++bi) {
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double acc = 0;
        for (int q = 0; q < k; ++q) {
          const double a = g.transa ? A[bi * sa + size_t(i) * g.lda + q] : A[bi * sa + size_t(q) * g.lda + i];
          const double b = g.transb ? B[bi * sb + size_t(q) * g.ldb + j] : B[bi * sb + size_t(j) * g.ldb + q];
          acc += a * b;
        }
        const size_t di = bi * sd + size_t(j) * g.ldd + i;
        double v = acc;
        switch (g.epilogue) {
          case GemmEpilogue::Bias: v = acc + bias[i]; break;
          case GemmEpilogue::GeluAux: want_aux[size_t(j) * g.ld_aux + i] = acc; v = gelu(acc); break;
          case GemmEpilogue::GeluAuxBias:
            want_aux[size_t(j) * g.ld_aux + i] = acc + bias[i];
            v = gelu(acc + bias[i]);
            break;
          case GemmEpilogue::DGelu:
          case GemmEpilogue::DGeluBGrad: v = acc * gelu_grad(AUX[size_t(j) * g.ld_aux + i]); break;
          default: break;
        }
        want_d[di] = g.accumulate ? D0[di] + v : v;
      }
  }
  if (g.epilogue == GemmEpilogue::DGeluBGrad) {
    want_bg.assign(m, 0.0);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) want_bg[i] += want_d[size_t(j) * g.ldd + i] - (g.accumulate ? D0[size_t(j) * g.ldd + i] : 0);
  } else if (g.epilogue == GemmEpilogue::BGradA) {
    want_bg.assign(m, 0.0);
    for (int i = 0; i < m; ++i)
      for (int q = 0; q < k; ++q) want_bg[i] += g.transa ? A[size_t(i) * g.lda + q] : A[size_t(q) * g.lda + i];
  } else if (g.epilogue == GemmEpilogue::BGradB) {
    want_bg.assign(n, 0.0);
    for (int j = 0; j < n; ++j)
      for (int q = 0; q < k; ++q) want_bg[j] += g.transb ? B[size_t(q) * g.ldb + j] : B[size_t(j) * g.ldb + q];
  }

  // Compare only the logical elements (padding rows of ld are not outputs).
  auto got_all = download(d_ptr, d_total, g.d_type);
  std::vector<double> got, want;
  for (int bi = 0; bi < nb; ++bi)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        const size_t di = bi * sd + size_t(j) * g.ldd + i;
        got.push_back(got_all[di]);
        want.push_back(want_d[di]);
      }
  row.rel_err = rel_err(got, want);
  rows.push_back(row);
  if (g.epilogue == GemmEpilogue::GeluAux || g.epilogue == GemmEpilogue::GeluAuxBias) {
    auto aux_all = download(dAux.p, aux_elems, g.d_type);
    std::vector<double> ga, wa;
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        ga.push_back(aux_all[size_t(j) * g.ld_aux + i]);
        wa.push_back(want_aux[size_t(j) * g.ld_aux + i]);
      }
    rows.push_back({c.name + ": aux", rel_err(ga, wa), row.tol, true});
  }
  if (!want_bg.empty()) {
    // The bias gradient is a sum of k (or n) terms of O(1): looser for bf16.
    rows.push_back({c.name + ": bias_grad", rel_err(download(dBG.p, want_bg.size(), g.bias_type), want_bg), row.tol, true});
  }
}

}  // namespace

std::vector<GemmCheckRow> run_gemm_epilogue_check_impl(int device) {
  TR_CUDA_CHECK(cudaSetDevice(device));
  Gemm gemm(device, size_t(4) << 20);
  std::mt19937_64 gen(20240611);
  const int m = 37, n = 19, k = 41;
  std::vector<Case> cases;
  auto base = [&](bool ta, bool tb, DType d) {
    GemmDesc g;
    g.transa = ta;
    g.transb = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.lda = ta ? k : m;
    g.ldb = tb ? n : k;
    g.ldd = m;
    g.d_type = d;
    g.bias_type = d;  // bias and bias gradient in D's type (gemm.h)
    return g;
  };
  {
    Case c{"plain (T,N) bf16", base(true, false, DType::BF16)};
    cases.push_back(c);
  }
  {
    Case c{"plain (N,N) bf16, operands 2-byte aligned only", base(false, false, DType::BF16), 1};
    cases.push_back(c);
  }
  {
    Case c{"bias (T,N) bf16", base(true, false, DType::BF16)};
    c.g.epilogue = GemmEpilogue::Bias;
    cases.push_back(c);
  }
  for (auto ep : {GemmEpilogue::GeluAux, GemmEpilogue::GeluAuxBias, GemmEpilogue::DGelu, GemmEpilogue::DGeluBGrad}) {
    Case c{std::string(epilogue_name(ep)) + " (T,N) bf16", base(true, false, DType::BF16)};
    c.g.epilogue = ep;
    c.g.ld_aux = (m + 7) / 8 * 8;
    cases.push_back(c);
  }
  {
    // matmul_backward's dweight product: fp32 D += A op_T(B), bias grad of B.
    Case c{"accumulate fp32 (N,T) + bgrad(B)", base(false, true, DType::F32)};
    c.g.accumulate = true;
    c.g.epilogue = GemmEpilogue::BGradB;
    cases.push_back(c);
  }
  {
    Case c{"accumulate fp32 (N,T)", base(false, true, DType::F32)};
    c.g.accumulate = true;
    cases.push_back(c);
  }
  {
    Case c{"bgrad(A) fp32 (N,N)", base(false, false, DType::F32)};
    c.g.epilogue = GemmEpilogue::BGradA;
    cases.push_back(c);
  }
  {
    Case c{"batched x3 (T,N) bf16", base(true, false, DType::BF16)};
    c.g.batch = 3;
    c.g.stride_a = int64_t(c.g.lda) * m + 5;
    c.g.stride_b = int64_t(c.g.ldb) * n + 3;
    c.g.stride_d = int64_t(c.g.ldd) * n + 7;
    cases.push_back(c);
  }
  std::vector<GemmCheckRow> rows;
  for (const auto& c : cases) run_case(gemm, c, gen, rows);
  return rows;
}

}  // namespace trainrun::cuda
