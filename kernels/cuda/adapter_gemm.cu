// The adapters' general product on the cuBLASLt wrapper: see adapter_gemm.cuh.
#include "kernels/cuda/adapter_gemm.cuh"

namespace trainrun::cuda {

GemmDesc adapter_gemm_desc(int ldc, bool c_f32, int lda, Backend::GemmOp ta, int ldb, Backend::GemmOp tb, int M,
                           int N, int K, float beta) {
  using Op = Backend::GemmOp;
  TR_CHECK(beta == 0.0f || beta == 1.0f, "gemm (cuda): beta ", beta,
           " is not supported; the CUDA backend overwrites (beta 0) or accumulates (beta 1)");
  GemmDesc g;  // c^T (N,M) = op(b)^T @ op(a)^T, column-major
  g.transa = tb == Op::T;
  g.transb = ta == Op::T;
  g.m = N;
  g.n = M;
  g.k = K;
  g.lda = ldb;
  g.ldb = lda;
  g.ldd = ldc;
  g.ab_type = DType::BF16;
  g.d_type = c_f32 ? DType::F32 : DType::BF16;
  g.accumulate = beta == 1.0f;
  return g;
}

void adapter_gemm(Gemm& gemm, void* c, int ldc, bool c_f32, const bf16* a, int lda, Backend::GemmOp ta,
                  const bf16* b, int ldb, Backend::GemmOp tb, int M, int N, int K, float alpha, float beta,
                  cudaStream_t stream) {
  TR_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm (cuda): negative shape M ", M, " N ", N, " K ", K);
  const GemmDesc g = adapter_gemm_desc(ldc, c_f32, lda, ta, ldb, tb, M, N, K, beta);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    // An empty sum: c = beta c. Beta 1 leaves c; beta 0 zeroes its M rows of N.
    const size_t es = c_f32 ? 4 : 2;
    if (!g.accumulate)
      TR_CUDA_CHECK(cudaMemset2DAsync(c, size_t(ldc) * es, 0, size_t(N) * es, size_t(M), stream));
    return;
  }
  GemmPtrs p;
  p.a = b;
  p.b = a;
  p.d = c;
  p.alpha = alpha;
  gemm.run(g, p, stream);
}

}  // namespace trainrun::cuda
