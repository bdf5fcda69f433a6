// Attention by blocks (kernels/cuda/attention_block.cuh). Not yet run on a GPU.
#include <math.h>

#include "core/common/error.h"
#include "kernels/cuda/attention_block.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kMaxHS = 256;
constexpr int kThreads = 128;

__device__ __forceinline__ void visible_range(const AttentionBlock& a, int b, int i, int* lo, int* hi) {
  const int qpos = a.q_pos0 + i;
  const int doc = a.q_doc ? a.q_doc[int64_t(b) * a.doc_bs + i] : 0;
  *lo = max(0, doc - a.k_pos0);
  *hi = min(a.Tk - 1, qpos - a.k_pos0);
}

__device__ __forceinline__ float score(const bf16* qi, const bf16* kj, int HS, float sc) {
  float d = 0.f;
  for (int c = 0; c < HS; ++c) d += __bfloat162float(qi[c]) * __bfloat162float(kj[c]);
  return d * sc;
}

__global__ void block_forward_kernel(bf16* out, float* lse, AttentionBlock a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.B) * a.NH * a.Tq) return;
  const int i = int(idx % a.Tq), h = int((idx / a.Tq) % a.NH), b = int(idx / (int64_t(a.Tq) * a.NH));
  const int g = h / (a.NH / a.NKV), HS = a.HS;
  const float sc = rsqrtf(float(HS));
  const bf16* q = static_cast<const bf16*>(a.q) + b * a.q_bs + i * a.q_ld + h * HS;
  const bf16* k = static_cast<const bf16*>(a.k) + b * a.kv_bs + g * HS;
  const bf16* v = static_cast<const bf16*>(a.v) + b * a.kv_bs + g * HS;
  bf16* o = out + b * a.o_bs + i * a.o_ld + h * HS;
  float& l = lse[b * a.lse_bs + h * a.lse_hs + i];
  int lo, hi;
  visible_range(a, b, i, &lo, &hi);
  if (lo > hi) {
    for (int c = 0; c < HS; ++c) o[c] = __float2bfloat16(0.f);
    l = -INFINITY;
    return;
  }
  float acc[kMaxHS];
  for (int c = 0; c < HS; ++c) acc[c] = 0.f;
  float m = -INFINITY, sum = 0.f;
  for (int j = lo; j <= hi; ++j) {  // online softmax over the row's keys
    const float s = score(q, k + j * a.kv_ld, HS, sc);
    const float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
    sum = sum * corr + p;
    for (int c = 0; c < HS; ++c) acc[c] = acc[c] * corr + p * __bfloat162float(v[j * a.kv_ld + c]);
    m = mn;
  }
  for (int c = 0; c < HS; ++c) o[c] = __float2bfloat16(acc[c] / sum);
  l = m + logf(sum);
}

__global__ void block_merge_kernel(bf16* out, float* lse, const bf16* bo, const float* blse, AttentionBlock a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.B) * a.NH * a.Tq) return;
  const int i = int(idx % a.Tq), h = int((idx / a.Tq) % a.NH), b = int(idx / (int64_t(a.Tq) * a.NH));
  const int HS = a.HS;
  float& l = lse[b * a.lse_bs + h * a.lse_hs + i];
  const float lb = blse[(int64_t(b) * a.NH + h) * a.Tq + i];
  if (lb == -INFINITY) return;
  bf16* o = out + b * a.o_bs + i * a.o_ld + h * HS;
  const bf16* p = bo + (int64_t(b) * a.Tq + i) * a.NH * HS + h * HS;
  if (l == -INFINITY) {
    for (int c = 0; c < HS; ++c) o[c] = p[c];
    l = lb;
    return;
  }
  const float mx = fmaxf(l, lb), ea = expf(l - mx), eb = expf(lb - mx), tot = ea + eb;
  for (int c = 0; c < HS; ++c)
    o[c] = __float2bfloat16((ea * __bfloat162float(o[c]) + eb * __bfloat162float(p[c])) / tot);
  l = mx + logf(tot);
}

// dq: one thread per (b, h, query row), over its visible keys.
__global__ void block_dq_kernel(float* dq, const bf16* dout, const bf16* out, const float* lse, AttentionBlock a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.B) * a.NH * a.Tq) return;
  const int i = int(idx % a.Tq), h = int((idx / a.Tq) % a.NH), b = int(idx / (int64_t(a.Tq) * a.NH));
  const int g = h / (a.NH / a.NKV), HS = a.HS;
  const float sc = rsqrtf(float(HS));
  int lo, hi;
  visible_range(a, b, i, &lo, &hi);
  if (lo > hi) return;
  const bf16* q = static_cast<const bf16*>(a.q) + b * a.q_bs + i * a.q_ld + h * HS;
  const bf16* doi = dout + b * a.o_bs + i * a.o_ld + h * HS;
  const bf16* oi = out + b * a.o_bs + i * a.o_ld + h * HS;
  const float l = lse[b * a.lse_bs + h * a.lse_hs + i];
  float D = 0.f;
  for (int c = 0; c < HS; ++c) D += __bfloat162float(doi[c]) * __bfloat162float(oi[c]);
  float* dqi = dq + b * a.q_bs + i * a.q_ld + h * HS;
  for (int j = lo; j <= hi; ++j) {
    const bf16* kj = static_cast<const bf16*>(a.k) + b * a.kv_bs + j * a.kv_ld + g * HS;
    const bf16* vj = static_cast<const bf16*>(a.v) + b * a.kv_bs + j * a.kv_ld + g * HS;
    float dp = 0.f;
    for (int c = 0; c < HS; ++c) dp += __bfloat162float(doi[c]) * __bfloat162float(vj[c]);
    const float p = expf(score(q, kj, HS, sc) - l), ds = p * (dp - D) * sc;
    for (int c = 0; c < HS; ++c) dqi[c] += ds * __bfloat162float(kj[c]);
  }
}

// dk, dv: one thread per (b, g, key row), over the group's query heads and
// the query rows that see the key (qpos >= kpos and doc <= kpos).
__global__ void block_dkv_kernel(float* dk, float* dv, const bf16* dout, const bf16* out, const float* lse,
                                 AttentionBlock a) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(a.B) * a.NKV * a.Tk) return;
  const int j = int(idx % a.Tk), g = int((idx / a.Tk) % a.NKV), b = int(idx / (int64_t(a.Tk) * a.NKV));
  const int R = a.NH / a.NKV, HS = a.HS, kpos = a.k_pos0 + j;
  const float sc = rsqrtf(float(HS));
  const bf16* kj = static_cast<const bf16*>(a.k) + b * a.kv_bs + j * a.kv_ld + g * HS;
  const bf16* vj = static_cast<const bf16*>(a.v) + b * a.kv_bs + j * a.kv_ld + g * HS;
  float* dkj = dk + b * a.kv_bs + j * a.kv_ld + g * HS;
  float* dvj = dv + b * a.kv_bs + j * a.kv_ld + g * HS;
  const int i0 = max(0, kpos - a.q_pos0);
  for (int h = g * R; h < (g + 1) * R; ++h)
    for (int i = i0; i < a.Tq; ++i) {
      const int doc = a.q_doc ? a.q_doc[int64_t(b) * a.doc_bs + i] : 0;
      if (doc > kpos) continue;
      const bf16* q = static_cast<const bf16*>(a.q) + b * a.q_bs + i * a.q_ld + h * HS;
      const bf16* doi = dout + b * a.o_bs + i * a.o_ld + h * HS;
      const bf16* oi = out + b * a.o_bs + i * a.o_ld + h * HS;
      float D = 0.f, dp = 0.f;
      for (int c = 0; c < HS; ++c) {
        D += __bfloat162float(doi[c]) * __bfloat162float(oi[c]);
        dp += __bfloat162float(doi[c]) * __bfloat162float(vj[c]);
      }
      const float p = expf(score(q, kj, HS, sc) - lse[b * a.lse_bs + h * a.lse_hs + i]), ds = p * (dp - D) * sc;
      for (int c = 0; c < HS; ++c) {
        dkj[c] += ds * __bfloat162float(q[c]);
        dvj[c] += p * __bfloat162float(doi[c]);
      }
    }
}

__global__ void copy_rows_kernel(void* dst, bool dst_bf16, int64_t dst_ld, const void* src, bool src_bf16,
                                 int64_t src_ld, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, c = e % cols;
    const float x = src_bf16 ? __bfloat162float(static_cast<const bf16*>(src)[r * src_ld + c])
                             : static_cast<const float*>(src)[r * src_ld + c];
    if (dst_bf16)
      static_cast<bf16*>(dst)[r * dst_ld + c] = __float2bfloat16(x);
    else
      static_cast<float*>(dst)[r * dst_ld + c] = x;
  }
}

__global__ void add_rows_kernel(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                                int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x)
    dst[(e / cols) * dst_ld + e % cols] += src[(e / cols) * src_ld + e % cols];
}

void check(const char* op, const AttentionBlock& a) {
  TR_CHECK(a.HS > 0 && a.HS <= kMaxHS, op, ": head size ", a.HS, " is above the CUDA block op's ", kMaxHS);
  TR_CHECK(a.NKV > 0 && a.NH % a.NKV == 0, op, ": NKV ", a.NKV, " must divide NH ", a.NH);
  TR_CHECK(a.window == 0 && a.softcap == 0.f && a.scale == 0.f, op, ": window ", a.window, ", softcap ", a.softcap,
           ", scale ", a.scale, ": the CUDA block op computes none of them yet (the CPU's does); use "
           "parallel.context_parallel: 1 for this model on CUDA");
}

int blocks_for(int64_t n) { return int((n + kThreads - 1) / kThreads); }

}  // namespace

void attention_block_forward(bf16* out, float* lse, const AttentionBlock& a, cudaStream_t stream) {
  check("attention_block_forward", a);
  const int64_t n = int64_t(a.B) * a.NH * a.Tq;
  if (n == 0) return;
  block_forward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, lse, a);
  TR_CUDA_LAUNCH_CHECK("block_forward_kernel");
}

void attention_block_merge(bf16* out, float* lse, const bf16* block_out, const float* block_lse,
                           const AttentionBlock& a, cudaStream_t stream) {
  check("attention_block_merge", a);
  const int64_t n = int64_t(a.B) * a.NH * a.Tq;
  if (n == 0) return;
  block_merge_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, lse, block_out, block_lse, a);
  TR_CUDA_LAUNCH_CHECK("block_merge_kernel");
}

void attention_block_backward(float* dq, float* dk, float* dv, const bf16* dout, const bf16* out, const float* lse,
                              const AttentionBlock& a, cudaStream_t stream) {
  check("attention_block_backward", a);
  const int64_t nq = int64_t(a.B) * a.NH * a.Tq, nk = int64_t(a.B) * a.NKV * a.Tk;
  if (nq > 0) {
    block_dq_kernel<<<blocks_for(nq), kThreads, 0, stream>>>(dq, dout, out, lse, a);
    TR_CUDA_LAUNCH_CHECK("block_dq_kernel");
  }
  if (nk > 0) {
    block_dkv_kernel<<<blocks_for(nk), kThreads, 0, stream>>>(dk, dv, dout, out, lse, a);
    TR_CUDA_LAUNCH_CHECK("block_dkv_kernel");
  }
}

void copy_rows(void* dst, bool dst_bf16, int64_t dst_ld, const void* src, bool src_bf16, int64_t src_ld, int64_t rows,
               int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  copy_rows_kernel<<<grid_for(rows * cols, 256), 256, 0, stream>>>(dst, dst_bf16, dst_ld, src, src_bf16, src_ld, rows,
                                                                   cols);
  TR_CUDA_LAUNCH_CHECK("copy_rows_kernel");
}

void add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  if (rows * cols == 0) return;
  add_rows_kernel<<<grid_for(rows * cols, 256), 256, 0, stream>>>(dst, dst_ld, src, src_ld, rows, cols);
  TR_CUDA_LAUNCH_CHECK("add_rows_kernel");
}

}  // namespace trainrun::cuda
