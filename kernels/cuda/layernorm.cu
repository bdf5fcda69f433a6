// LayerNorm forward and backward: see layernorm.cuh.
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/smem_occupancy.cuh"

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

constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = 32 * kBwdWarps;
// Shared memory a block may use without the opt-in attribute, and the one
// the team count aims for: it keeps several blocks per SM resident.
constexpr size_t kBwdSmemTarget = 48 * 1024;

// p[0..8) += v, as two 16-byte shared memory accesses (a warp's 16-byte
// accesses to consecutive 32-byte pieces are conflict-free; 8 scalar ones
// 32 bytes apart would be 8-way conflicts). p is 16-byte aligned.
__device__ __forceinline__ void add8(float* p, const float (&v)[8]) {
  float4* q = reinterpret_cast<float4*>(p);
  float4 a = q[0], b = q[1];
  a.x += v[0];
  a.y += v[1];
  a.z += v[2];
  a.w += v[3];
  b.x += v[4];
  b.y += v[5];
  b.z += v[6];
  b.w += v[7];
  q[0] = a;
  q[1] = b;
}

// The block's 8 warps form `teams` teams of W = 8 / teams warps. Block b owns
// rows [b*rows_per_block, ...); team t takes its rows t, t+teams, ...; thread
// k of a team (team_threads = 32 W of them) owns channels k, k+team_threads,
// ... (VEC: packs of 8 channels, 8k, 8k + 8 team_threads, ...) of the row and
// of its team's dweight | dbias partial (2C floats in shared memory), so no
// two threads touch one partial element: no atomics. The row sums (g and
// g*xhat) are warp shuffles, then, when W > 1, the team's W warp sums
// through shared memory in warp order. The loop runs the same number of
// iterations in every team (a team past the block's rows idles), so the
// __syncthreads() inside are reached by all threads.
// Shared memory: teams x 2C floats, then 2 x kBwdWarps floats (the row sums).
template <bool VEC>
__global__ void __launch_bounds__(kBwdThreads)
    layernorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                              const float* mean, const float* rstd, int N, int C, int rows_per_block, int teams) {
  extern __shared__ __align__(16) float sh[];
  const int W = kBwdWarps / teams, team_threads = 32 * W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int team = warp / W;
  const int k = threadIdx.x % team_threads;
  float* sdw = sh + size_t(team) * 2 * C;
  float* sdb = sdw + C;
  float* red = sh + size_t(teams) * 2 * C;  // [2][kBwdWarps]
  for (int c = k; c < C; c += team_threads) {
    sdw[c] = 0.0f;
    sdb[c] = 0.0f;
  }
  __syncthreads();  // VEC threads own other channels than the zeroing loop's
  const int r0 = blockIdx.x * rows_per_block;
  const int r1 = min(N, r0 + rows_per_block);
  const int iters = (rows_per_block + teams - 1) / teams;
  for (int it = 0; it < iters; ++it) {
    const int row = r0 + it * teams + team;
    const bool has_row = row < r1;  // uniform over the team
    const int64_t off = int64_t(has_row ? row : 0) * C;
    const bf16* x = inp + off;
    const bf16* dy = dout + off;
    bf16* dx = dinp + off;
    const float m = has_row ? mean[row] : 0.0f, s = has_row ? rstd[row] : 0.0f;
    float sum_g = 0.0f, sum_gx = 0.0f;
    if (has_row) {
      if (VEC) {
        for (int c = 8 * k; c < C; c += 8 * team_threads) {
          const auto xp = Pack16<bf16>::load(x + c), dp = Pack16<bf16>::load(dy + c);
          const auto wp = Pack16<bf16>::load(weight + c);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float xh = (to_float(xp.v[e]) - m) * s;
            const float g = to_float(dp.v[e]) * to_float(wp.v[e]);
            sum_g += g;
            sum_gx += g * xh;
          }
        }
      } else {
        for (int c = k; c < C; c += team_threads) {
          const float xh = (to_float(x[c]) - m) * s;
          const float g = to_float(dy[c]) * to_float(weight[c]);
          sum_g += g;
          sum_gx += g * xh;
        }
      }
    }
    sum_g = warp_sum(sum_g);
    sum_gx = warp_sum(sum_gx);
    if (W > 1) {  // uniform over the block
      if (lane == 0) {
        red[warp] = sum_g;
        red[kBwdWarps + warp] = sum_gx;
      }
      __syncthreads();
      sum_g = 0.0f;
      sum_gx = 0.0f;
      for (int w = team * W; w < (team + 1) * W; ++w) {
        sum_g += red[w];
        sum_gx += red[kBwdWarps + w];
      }
      __syncthreads();  // red is rewritten in the next iteration
    }
    if (!has_row) continue;
    sum_g /= C;
    sum_gx /= C;
    if (VEC) {
      for (int c = 8 * k; c < C; c += 8 * team_threads) {
        const auto xp = Pack16<bf16>::load(x + c), dp = Pack16<bf16>::load(dy + c);
        const auto wp = Pack16<bf16>::load(weight + c);
        auto gp = Pack16<bf16>::load_rw(dx + c);  // dinp += : read it coherently
        float dw[8], db[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xh = (to_float(xp.v[e]) - m) * s;
          const float d = to_float(dp.v[e]);
          const float g = d * to_float(wp.v[e]);
          gp.v[e] = from_float<bf16>(to_float(gp.v[e]) + s * (g - sum_g - xh * sum_gx));
          dw[e] = d * xh;
          db[e] = d;
        }
        add8(sdw + c, dw);
        add8(sdb + c, db);
        gp.store(dx + c);
      }
    } else {
      for (int c = k; c < C; c += team_threads) {
        const float xh = (to_float(x[c]) - m) * s;
        const float d = to_float(dy[c]);
        const float g = d * to_float(weight[c]);
        dx[c] = from_float<bf16>(to_float(dx[c]) + s * (g - sum_g - xh * sum_gx));
        sdw[c] += d * xh;
        sdb[c] += d;
      }
    }
  }
  __syncthreads();
  // Combine the teams in order; one partial row (dweight | dbias) per block.
  float* out = partial + size_t(blockIdx.x) * 2 * C;
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    float acc = 0.0f;
    for (int t = 0; t < teams; ++t) acc += sh[size_t(t) * 2 * C + c];
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

// The backward's per-device launch facts (opt-in shared memory, blocks
// per SM of each variant), queried once per device and size.
SmemOccupancyCache& bwd_cache() {
  static SmemOccupancyCache c(reinterpret_cast<const void*>(layernorm_backward_kernel<true>),
                              reinterpret_cast<const void*>(layernorm_backward_kernel<false>), kBwdThreads,
                              kBwdSmemTarget);
  return c;
}

struct BwdPlan {
  int teams, blocks, rows_per_block;
  size_t smem;
};

// Teams: as many as fit kBwdSmemTarget (8 up to C = 767, 4 to 1534, 2 to
// 3069, else 1; C = 4096 takes 32 KiB, C = 8192 64 KiB through the opt-in). Blocks: every SM
// filled to its occupancy, never more than the rows need. The plan depends
// on the GPU (SM count, occupancy), so dweight/dbias are deterministic for
// a given GPU and shape.
BwdPlan bwd_plan(int N, int C, bool vec, int num_sms) {
  auto smem_for = [C](int teams) { return size_t(teams) * 2 * C * sizeof(float) + 2 * kBwdWarps * sizeof(float); };
  BwdPlan p{};
  p.teams = kBwdWarps;
  while (p.teams > 1 && smem_for(p.teams) > kBwdSmemTarget) p.teams /= 2;
  p.smem = smem_for(p.teams);
  int optin = 0;
  const int per_sm = bwd_cache().blocks_per_sm(vec, p.smem, &optin);
  TR_CHECK(p.smem <= size_t(optin), "layernorm_backward: C=", C, " needs ", p.smem,
           " bytes of shared memory per block (dweight and dbias partials, 8 bytes per channel), the GPU allows ",
           optin, "; C up to ", (optin - 2 * kBwdWarps * int(sizeof(float))) / 8, " is supported");
  TR_CHECK(per_sm >= 1, "layernorm_backward: C=", C, ": no block of ", kBwdThreads, " threads with ", p.smem,
           " bytes of shared memory fits on an SM of this GPU");
  const int want = std::max(1, num_sms) * per_sm;
  p.blocks = std::max(1, std::min(want, (N + p.teams - 1) / p.teams));
  p.rows_per_block = (N + p.blocks - 1) / p.blocks;
  return p;
}

bool bwd_vec(int C, const bf16* dinp, const bf16* dout, const bf16* inp, const bf16* weight) {
  return C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight);
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
  if (N <= 0 || C <= 0) return 0;
  // The larger of the two variants' partials (the pointers' alignment is not known here).
  const BwdPlan a = bwd_plan(N, C, true, num_sms), b = bwd_plan(N, C, false, num_sms);
  return size_t(std::max(a.blocks, b.blocks)) * 2 * C * sizeof(float);
}

void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        int num_sms, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const bool vec = bwd_vec(C, dinp, dout, inp, weight);
  const BwdPlan p = bwd_plan(N, C, vec, num_sms);
  if (vec) {
    layernorm_backward_kernel<true><<<p.blocks, kBwdThreads, p.smem, stream>>>(dinp, scratch, dout, inp, weight, mean,
                                                                               rstd, N, C, p.rows_per_block, p.teams);
  } else {
    layernorm_backward_kernel<false><<<p.blocks, kBwdThreads, p.smem, stream>>>(dinp, scratch, dout, inp, weight, mean,
                                                                                rstd, N, C, p.rows_per_block, p.teams);
  }
  TR_CUDA_LAUNCH_CHECK("layernorm_backward");
  layernorm_backward_finish_kernel<<<grid_for(2 * C, 256, 1024), 256, 0, stream>>>(dweight, dbias, scratch, p.blocks,
                                                                                  C);
  TR_CUDA_LAUNCH_CHECK("layernorm_backward_finish");
}

}  // namespace trainrun::cuda
