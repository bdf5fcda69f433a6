// qk-norm forward and backward: see qk_norm.cuh.
#include "kernels/cuda/qk_norm.cuh"

#include <algorithm>

#include "core/common/error.h"

namespace trainrun::cuda {

namespace {

constexpr int kWarps = 8;                  // warps per block
constexpr int kPer = kQkNormMaxHS / 32;    // channels per lane at most

__global__ void qk_norm_forward_kernel(bf16* qkv, bf16* pre, float* rstd, const bf16* wq, const bf16* wk, int64_t items,
                                       int NH, int NKV, int HS, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= items) return;  // whole warps leave
  const int H = NH + NKV;
  const int64_t n = item / H;
  const int h = int(item % H);
  bf16* x = qkv + n * int64_t(NH + 2 * NKV) * HS + int64_t(h) * HS;
  bf16* p = pre + n * int64_t(H) * HS + int64_t(h) * HS;
  const bf16* w = h < NH ? wq : wk;
  float v[kPer];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int c = lane + 32 * k;
    v[k] = c < HS ? to_float(x[c]) : 0.0f;
    ss += v[k] * v[k];
  }
  ss = warp_sum(ss);
  const float s = rsqrtf(ss / HS + eps);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int c = lane + 32 * k;
    if (c < HS) {
      p[c] = x[c];
      const float xh = to_float(from_float<bf16>(v[k] * s));
      x[c] = from_float<bf16>(xh * to_float(w[c]));
    }
  }
  if (lane == 0) rstd[item] = s;
}

// Each block: rows x heads items [begin, end) in turn by its warps; its
// weight-gradient partial (dwq | dwk, 2*HS floats) to partial[blockIdx.x].
__global__ void qk_norm_backward_kernel(bf16* dqkv, float* partial, const bf16* pre, const bf16* wq, const bf16* wk,
                                        const float* rstd, int64_t items, int64_t per_block, int NH, int NKV,
                                        int HS) {
  extern __shared__ float sh[];  // kWarps x 2*HS
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int H = NH + NKV;
  float aq[kPer], ak[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) aq[k] = ak[k] = 0.0f;
  const int64_t begin = int64_t(blockIdx.x) * per_block, end = min(items, begin + per_block);
  for (int64_t item = begin + warp; item < end; item += kWarps) {
    const int64_t n = item / H;
    const int h = int(item % H);
    bf16* d = dqkv + n * int64_t(NH + 2 * NKV) * HS + int64_t(h) * HS;
    const bf16* x = pre + n * int64_t(H) * HS + int64_t(h) * HS;
    const bf16* w = h < NH ? wq : wk;
    const float s = rstd[item];
    float dy[kPer], xh[kPer], wc[kPer];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      dy[k] = c < HS ? to_float(d[c]) : 0.0f;
      xh[k] = c < HS ? to_float(x[c]) * s : 0.0f;
      wc[k] = c < HS ? to_float(w[c]) : 0.0f;
      sum += dy[k] * wc[k] * xh[k];
    }
    sum = warp_sum(sum) / HS;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      if (c < HS) {
        if (h < NH) aq[k] += dy[k] * xh[k];
        else ak[k] += dy[k] * xh[k];
        d[c] = from_float<bf16>(s * (dy[k] * wc[k] - xh[k] * sum));
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int c = lane + 32 * k;
    if (c < HS) {
      sh[warp * 2 * HS + c] = aq[k];
      sh[warp * 2 * HS + HS + c] = ak[k];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < 2 * HS; c += blockDim.x) {
    float t = 0.0f;
    for (int w2 = 0; w2 < kWarps; ++w2) t += sh[w2 * 2 * HS + c];  // warps in order
    partial[int64_t(blockIdx.x) * 2 * HS + c] = t;
  }
}

// dwq / dwk += the blocks' partials, summed in block order.
__global__ void qk_norm_dweight_kernel(float* dwq, float* dwk, const float* partial, int blocks, int HS) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * HS) return;
  float t = 0.0f;
  for (int b = 0; b < blocks; ++b) t += partial[int64_t(b) * 2 * HS + c];
  float* dw = c < HS ? dwq : dwk;
  if (dw) dw[c < HS ? c : c - HS] += t;
}

void check(const char* op, int N, int NH, int NKV, int HS) {
  TR_CHECK(N >= 0 && NH > 0 && NKV > 0 && HS > 0, op, ": N ", N, ", NH ", NH, ", NKV ", NKV, " and HS ", HS,
           " must be positive");
  TR_CHECK(HS <= kQkNormMaxHS, op, ": head_dim ", HS, " is above the ", kQkNormMaxHS,
           " the CUDA kernel holds in registers");
}

int backward_blocks(int64_t items, int num_sms) {
  const int64_t want = (items + kWarps - 1) / kWarps;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(std::max(num_sms, 1)) * 4)));
}

}  // namespace

void qk_norm_forward(bf16* qkv, bf16* pre, float* rstd, const bf16* wq, const bf16* wk, int N, int NH, int NKV,
                     int HS, float eps, cudaStream_t stream) {
  check("qk_norm_forward", N, NH, NKV, HS);
  const int64_t items = int64_t(N) * (NH + NKV);
  if (items == 0) return;
  const int64_t grid = (items + kWarps - 1) / kWarps;
  qk_norm_forward_kernel<<<unsigned(grid), kWarps * 32, 0, stream>>>(qkv, pre, rstd, wq, wk, items, NH, NKV, HS, eps);
  TR_CUDA_LAUNCH_CHECK("qk_norm_forward");
}

size_t qk_norm_backward_scratch_bytes(int N, int NH, int NKV, int HS, int num_sms) {
  return size_t(backward_blocks(int64_t(N) * (NH + NKV), num_sms)) * 2 * size_t(HS) * sizeof(float);
}

void qk_norm_backward(bf16* dqkv, float* dwq, float* dwk, const bf16* pre, const bf16* wq, const bf16* wk,
                      const float* rstd, int N, int NH, int NKV, int HS, float* scratch, int num_sms,
                      cudaStream_t stream) {
  check("qk_norm_backward", N, NH, NKV, HS);
  const int64_t items = int64_t(N) * (NH + NKV);
  if (items == 0) return;
  const int blocks = backward_blocks(items, num_sms);
  const int64_t per_block = (items + blocks - 1) / blocks;
  const size_t smem = size_t(kWarps) * 2 * HS * sizeof(float);  // HS 256: 16 KiB
  qk_norm_backward_kernel<<<blocks, kWarps * 32, smem, stream>>>(dqkv, scratch, pre, wq, wk, rstd, items, per_block,
                                                                   NH, NKV, HS);
  TR_CUDA_LAUNCH_CHECK("qk_norm_backward");
  qk_norm_dweight_kernel<<<(2 * HS + 255) / 256, 256, 0, stream>>>(dwq, dwk, scratch, blocks, HS);
  TR_CUDA_LAUNCH_CHECK("qk_norm_backward (dweight)");
}

}  // namespace trainrun::cuda
