// LayerNorm forward and backward: see layernorm.cuh.
#include "kernels/cuda/layernorm.cuh"

#include <algorithm>

namespace trainrun::cuda {

namespace {

constexpr float kEps = 1e-5f;
constexpr int kFwdWarps = 8;  // rows per forward block (one per warp)

// ---- forward -------------------------------------------------------------------------

// One warp per row. VEC (C % 8 == 0, pointers 16-byte aligned): lanes take
// 16-byte packs; the row is read three times (sum, centred sum of squares,
// normalise), the second and third from L1/L2.
// RES (the fused residual add): the first pass computes x = res_a + res_b,
// rounds it to bf16 and stores it as the residual stream; the statistics are
// taken over the rounded values, exactly what an unfused LayerNorm would
// read back, and the later passes re-read the lane's own stores.
template <bool VEC, bool RES>
__global__ void layernorm_forward_kernel(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight,
                                         const bf16* bias, int N, int C, bf16* res_out, const bf16* res_a,
                                         const bf16* res_b) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kFwdWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const int64_t off = int64_t(row) * C;
  const bf16* x = RES ? res_out + off : inp + off;
  bf16* y = out + off;
  float s = 0.0f;
  if (VEC) {
    for (int c = lane * 8; c < C; c += 256) {
      Pack16<bf16> p;
      if (RES) {
        const auto pa = Pack16<bf16>::load(res_a + off + c);
        const auto pb = Pack16<bf16>::load(res_b + off + c);
#pragma unroll
        for (int k = 0; k < 8; ++k) p.v[k] = from_float<bf16>(to_float(pa.v[k]) + to_float(pb.v[k]));
        p.store(res_out + off + c);
      } else {
        p = Pack16<bf16>::load(x + c);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) s += to_float(p.v[k]);
    }
  } else {
    for (int c = lane; c < C; c += 32) {
      if (RES) {
        const bf16 v = from_float<bf16>(to_float(res_a[off + c]) + to_float(res_b[off + c]));
        res_out[off + c] = v;
        s += to_float(v);
      } else {
        s += to_float(x[c]);
      }
    }
  }
  const float m = warp_sum(s) / C;
  float ss = 0.0f;
  if (VEC) {
    for (int c = lane * 8; c < C; c += 256) {
      const auto p = RES ? Pack16<bf16>::load_rw(x + c) : Pack16<bf16>::load(x + c);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float d = to_float(p.v[k]) - m;
        ss += d * d;
      }
    }
  } else {
    for (int c = lane; c < C; c += 32) {
      const float d = to_float(x[c]) - m;
      ss += d * d;
    }
  }
  const float r = rsqrtf(warp_sum(ss) / C + kEps);
  if (VEC) {
    for (int c = lane * 8; c < C; c += 256) {
      const auto p = RES ? Pack16<bf16>::load_rw(x + c) : Pack16<bf16>::load(x + c);
      const auto w = Pack16<bf16>::load(weight + c);
      const auto b = Pack16<bf16>::load(bias + c);
      Pack16<bf16> o;
#pragma unroll
      for (int k = 0; k < 8; ++k)
        o.v[k] = from_float<bf16>((to_float(p.v[k]) - m) * r * to_float(w.v[k]) + to_float(b.v[k]));
      o.store(y + c);
    }
  } else {
    for (int c = lane; c < C; c += 32)
      y[c] = from_float<bf16>((to_float(x[c]) - m) * r * to_float(weight[c]) + to_float(bias[c]));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// ---- backward ------------------------------------------------------------------------

// Block b owns rows [b*rows_per_block, ...); warp w of it takes every
// nwarps-th of them. Shared memory: nwarps x (dweight | dbias) partials of C
// floats each; lane l owns channels l, l+32, ... of its warp's partial.
__global__ void layernorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp,
                                          const bf16* weight, const float* mean, const float* rstd, int N, int C,
                                          int rows_per_block) {
  extern __shared__ float sh[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  float* sdw = sh + size_t(warp) * 2 * C;
  float* sdb = sdw + C;
  for (int c = lane; c < C; c += 32) {
    sdw[c] = 0.0f;
    sdb[c] = 0.0f;
  }
  const int r0 = blockIdx.x * rows_per_block;
  const int r1 = min(N, r0 + rows_per_block);
  for (int row = r0 + warp; row < r1; row += nwarps) {
    const bf16* x = inp + int64_t(row) * C;
    const bf16* dy = dout + int64_t(row) * C;
    bf16* dx = dinp + int64_t(row) * C;
    const float m = mean[row], s = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = lane; c < C; c += 32) {
      const float xh = (to_float(x[c]) - m) * s;
      const float g = to_float(dy[c]) * to_float(weight[c]);
      sum_g += g;
      sum_gx += g * xh;
    }
    sum_g = warp_sum(sum_g) / C;
    sum_gx = warp_sum(sum_gx) / C;
    for (int c = lane; c < C; c += 32) {
      const float xh = (to_float(x[c]) - m) * s;
      const float d = to_float(dy[c]);
      const float g = d * to_float(weight[c]);
      dx[c] = from_float<bf16>(to_float(dx[c]) + s * (g - sum_g - xh * sum_gx));
      sdw[c] += d * xh;
      sdb[c] += d;
    }
  }
  __syncthreads();
  // Combine the warps in order; one partial row (dweight | dbias) per block.
  float* out = partial + size_t(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    float acc = 0.0f;
    for (int w = 0; w < nwarps; ++w) acc += sh[size_t(w) * 2 * C + c];
    out[c] = acc;
  }
}

// dweight[c] += sum over blocks (in order) of partial[b][c]; likewise dbias.
__global__ void layernorm_backward_finish_kernel(float* dweight, float* dbias, const float* partial, int nblocks,
                                                 int C) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < 2 * C; c += gridDim.x * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < nblocks; ++b) acc += partial[size_t(b) * 2 * C + c];
    if (c < C) dweight[c] += acc;
    else dbias[c - C] += acc;
  }
}

struct BwdPlan {
  int warps, blocks, rows_per_block;
  size_t smem;
};

BwdPlan bwd_plan(int N, int C, int num_sms) {
  int max_smem = 48 * 1024;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && optin > 0)
      max_smem = optin;
  }
  BwdPlan p{};
  p.warps = 8;
  while (p.warps > 1 && size_t(p.warps) * 2 * C * 4 > size_t(max_smem)) p.warps /= 2;
  p.smem = size_t(p.warps) * 2 * C * 4;
  TR_CHECK(p.smem <= size_t(max_smem), "layernorm_backward: C=", C, " needs ", p.smem,
           " bytes of shared memory per block, the GPU allows ", max_smem);
  const int want = std::max(1, 2 * std::max(1, num_sms));
  p.blocks = std::min(want, (N + p.warps - 1) / p.warps);
  if (p.blocks < 1) p.blocks = 1;
  p.rows_per_block = (N + p.blocks - 1) / p.blocks;
  return p;
}

}  // namespace

// ---- launchers -------------------------------------------------------------------

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight, const bf16* bias,
                       int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int blocks = (N + kFwdWarps - 1) / kFwdWarps;
  if (C % 8 == 0 && aligned16(out) && aligned16(inp) && aligned16(weight) && aligned16(bias)) {
    layernorm_forward_kernel<true, false><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, mean, rstd, inp, weight, bias,
                                                                                N, C, nullptr, nullptr, nullptr);
  } else {
    layernorm_forward_kernel<false, false><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, mean, rstd, inp, weight, bias,
                                                                                 N, C, nullptr, nullptr, nullptr);
  }
  TR_CUDA_LAUNCH_CHECK("layernorm_forward");
}

void residual_layernorm_forward(bf16* res_out, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                                const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int blocks = (N + kFwdWarps - 1) / kFwdWarps;
  if (C % 8 == 0 && aligned16(out) && aligned16(res_out) && aligned16(a) && aligned16(b) && aligned16(weight) &&
      aligned16(bias)) {
    layernorm_forward_kernel<true, true><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, mean, rstd, nullptr, weight,
                                                                               bias, N, C, res_out, a, b);
  } else {
    layernorm_forward_kernel<false, true><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, mean, rstd, nullptr, weight,
                                                                                bias, N, C, res_out, a, b);
  }
  TR_CUDA_LAUNCH_CHECK("residual_layernorm_forward");
}

size_t layernorm_backward_scratch_bytes(int N, int C, int num_sms) {
  const BwdPlan p = bwd_plan(N, C, num_sms);
  return size_t(p.blocks) * 2 * C * sizeof(float);
}

void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        int num_sms, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const BwdPlan p = bwd_plan(N, C, num_sms);
  if (p.smem > 48 * 1024)
    TR_CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(p.smem)));
  layernorm_backward_kernel<<<p.blocks, 32 * p.warps, p.smem, stream>>>(dinp, scratch, dout, inp, weight, mean, rstd,
                                                                        N, C, p.rows_per_block);
  TR_CUDA_LAUNCH_CHECK("layernorm_backward");
  layernorm_backward_finish_kernel<<<grid_for(2 * C, 256, 1024), 256, 0, stream>>>(dweight, dbias, scratch, p.blocks,
                                                                                  C);
  TR_CUDA_LAUNCH_CHECK("layernorm_backward_finish");
}

}  // namespace trainrun::cuda
