// Linear layer forward/backward on the cuBLASLt wrapper, and the
// deterministic bias-gradient kernel: see matmul.cuh.
#include "kernels/cuda/matmul.cuh"

#include <algorithm>

#include "kernels/cuda/elementwise.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kBgCols = 64;      // columns per block (2 per lane)
constexpr int kBgRowGroups = 8;  // warps per block
constexpr int kBgRowsPerChunk = 256;

int bias_grad_chunks(int N) { return (N + kBgRowsPerChunk - 1) / kBgRowsPerChunk; }

// grid (ceil(OC/64), chunks), block (32, 8): lane l owns columns 2l, 2l+1 of
// the block's slab; warp g takes rows g, g+8, ... of the chunk; warps are
// combined in order into partial[chunk][col].
__global__ void bias_grad_partial_kernel(float* partial, const bf16* dout, int N, int OC) {
  __shared__ float red[kBgRowGroups][kBgCols];
  const int lane = threadIdx.x, g = threadIdx.y;
  const int c = blockIdx.x * kBgCols + 2 * lane;
  const int r0 = blockIdx.y * kBgRowsPerChunk;
  const int r1 = min(N, r0 + kBgRowsPerChunk);
  float a0 = 0.0f, a1 = 0.0f;
  for (int r = r0 + g; r < r1; r += kBgRowGroups) {
    const bf16* row = dout + int64_t(r) * OC;
    if (c < OC) a0 += to_float(row[c]);
    if (c + 1 < OC) a1 += to_float(row[c + 1]);
  }
  red[g][2 * lane] = a0;
  red[g][2 * lane + 1] = a1;
  __syncthreads();
  const int t = g * 32 + lane;
  if (t < kBgCols) {
    const int col = blockIdx.x * kBgCols + t;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kBgRowGroups; ++k) s += red[k][t];
    if (col < OC) partial[int64_t(blockIdx.y) * OC + col] = s;
  }
}

__global__ void bias_grad_finish_kernel(float* dbias, const float* partial, int chunks, int OC) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < OC; c += gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (int k = 0; k < chunks; ++k) s += partial[int64_t(k) * OC + c];
    dbias[c] += s;
  }
}

}  // namespace

size_t bias_grad_scratch_bytes(int N, int OC) { return size_t(bias_grad_chunks(N)) * OC * sizeof(float); }

void bias_grad_accumulate(float* dbias, const bf16* dout, int N, int OC, float* scratch, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  const int chunks = bias_grad_chunks(N);
  dim3 grid((OC + kBgCols - 1) / kBgCols, chunks), block(32, kBgRowGroups);
  bias_grad_partial_kernel<<<grid, block, 0, stream>>>(scratch, dout, N, OC);
  TR_CUDA_LAUNCH_CHECK("bias_grad_partial");
  bias_grad_finish_kernel<<<grid_for(OC, 256, 1024), 256, 0, stream>>>(dbias, scratch, chunks, OC);
  TR_CUDA_LAUNCH_CHECK("bias_grad_finish");
}

GemmDesc linear_forward_desc(int N, int C, int OC, bool bias, int64_t ld_out) {
  GemmDesc g;  // out^T(OC,N) = op_T(weight: (C,OC) col-major) @ inp^T (C,N)
  g.transa = true;
  g.m = OC;
  g.n = N;
  g.k = C;
  g.lda = C;
  g.ldb = C;
  g.ldd = ld_out > 0 ? ld_out : OC;
  g.ab_type = g.d_type = DType::BF16;
  g.epilogue = bias ? GemmEpilogue::Bias : GemmEpilogue::None;
  g.bias_type = DType::BF16;  // the layer's bias (bf16 parameter), also for GELU_AUX_BIAS
  return g;
}

GemmDesc linear_dinp_desc(int N, int C, int OC, int64_t ld_out) {
  GemmDesc g;  // dinp^T(C,N) = weight-as-stored (C,OC) @ dout^T (OC,N)
  g.m = C;
  g.n = N;
  g.k = OC;
  g.lda = C;
  g.ldb = ld_out > 0 ? ld_out : OC;
  g.ldd = C;
  return g;
}

GemmDesc linear_dweight_desc(int N, int C, int OC, int64_t ld_out) {
  GemmDesc g;  // dweight^T(C,OC) += inp^T (C,N) @ op_T(dout^T (OC,N))
  g.transb = true;
  g.m = C;
  g.n = OC;
  g.k = N;
  g.lda = C;
  g.ldb = ld_out > 0 ? ld_out : OC;
  g.ldd = C;
  g.d_type = DType::F32;
  g.accumulate = true;
  g.bias_type = DType::F32;  // BGRADB (matmul_backward): the dbias scratch is fp32
  return g;
}

void matmul_forward(Gemm& gemm, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                    int OC, cudaStream_t stream, int64_t ld_out) {
  if (N <= 0 || OC <= 0) return;
  GemmPtrs p;
  p.a = weight;
  p.b = inp;
  p.d = out;
  p.bias = bias;
  gemm.run(linear_forward_desc(N, C, OC, bias != nullptr, ld_out), p, stream);
}

size_t matmul_backward_scratch_bytes(int N, int OC) {
  // The larger of: the BGRADB epilogue's OC floats, the kernel's partials.
  return std::max(size_t(OC) * sizeof(float), bias_grad_scratch_bytes(N, OC));
}

void matmul_backward(Gemm& gemm, bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, int N, int C, int OC, bool bgrad_epilogue, float* scratch,
                     cudaStream_t stream, int64_t ld_out) {
  if (N <= 0) return;
  if (OC <= 0) {
    // No output features (a TP rank whose vocab shard is all padding): the
    // input gradient is an empty sum, zero; dweight and dbias have no
    // elements. A k = 0 GEMM is not a valid cuBLASLt problem.
    if (dinp) TR_CUDA_CHECK(cudaMemsetAsync(dinp, 0, size_t(N) * size_t(C) * sizeof(bf16), stream));
    return;
  }
  const int64_t ldo = ld_out > 0 ? ld_out : OC;
  TR_CHECK(!dbias || ldo == OC, "matmul_backward: a bias gradient needs dout rows OC (", OC, ") apart, not ", ldo);
  if (dinp) {
    GemmPtrs p;
    p.a = weight;
    p.b = dout;
    p.d = dinp;
    gemm.run(linear_dinp_desc(N, C, OC, ldo), p, stream);
  }
  // No weight gradient asked for (zero_bubble's input step): no bias one either.
  if (!dweight) {
    TR_CHECK(!dbias, "matmul_backward: a bias gradient without the weight gradient is not supported");
    return;
  }
  const GemmDesc g = linear_dweight_desc(N, C, OC, ldo);
  GemmPtrs p;
  p.a = inp;
  p.b = dout;
  p.d = dweight;
  bool bias_done = false;
  if (dbias && bgrad_epilogue) {
    GemmDesc ge = g;
    ge.epilogue = GemmEpilogue::BGradB;  // bias_grad(OC) = sum over k=N of op(B) = column sums of dout
    GemmPtrs pe = p;
    pe.bias_grad = scratch;
    if (gemm.supported(ge, pe)) {
      gemm.run(ge, pe, stream);
      bias_done = true;
    }
  }
  if (!bias_done) gemm.run(g, p, stream);
  if (dbias) {
    if (bias_done) {
      // cuBLASLt overwrote scratch with the bias gradient; the contract is +=.
      accumulate_f32(dbias, scratch, OC, stream);
    } else {
      bias_grad_accumulate(dbias, dout, N, OC, scratch, stream);
    }
  }
}

}  // namespace trainrun::cuda
