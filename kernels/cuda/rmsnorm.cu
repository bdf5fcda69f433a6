// RMSNorm forward and backward: see rmsnorm.cuh.
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/smem_occupancy.cuh"

#include <algorithm>

namespace trainrun::cuda {

namespace {

constexpr int kFwdWarps = 8;  // rows per forward block (one per warp)

// ---- forward -------------------------------------------------------------------------

// One warp per row. VEC (C % 8 == 0, pointers 16-byte aligned): lanes take
// 16-byte packs; the row is read twice (sum of squares, normalise), the
// second time from L1/L2.
// RES (the fused residual add): the first pass computes x = res_a + res_b,
// rounds it to bf16 and stores it as the residual stream; the statistics are
// taken over the rounded values, exactly what an unfused RMSNorm would read
// back, and the second pass re-reads the lane's own stores (coherently).
template <bool VEC, bool RES>
__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C,
                                       float eps, bf16* res_out, const bf16* res_a, const bf16* res_b,
                                       float w_offset) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kFwdWarps + (threadIdx.x >> 5);
  if (row >= N) return;  // whole warps leave: the shuffles below stay full-warp
  const int64_t off = int64_t(row) * C;
  const bf16* x = RES ? res_out + off : inp + off;
  bf16* y = out + off;
  float ss = 0.0f;
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
      for (int k = 0; k < 8; ++k) {
        const float v = to_float(p.v[k]);
        ss += v * v;
      }
    }
  } else {
    for (int c = lane; c < C; c += 32) {
      float v;
      if (RES) {
        const bf16 r = from_float<bf16>(to_float(res_a[off + c]) + to_float(res_b[off + c]));
        res_out[off + c] = r;
        v = to_float(r);
      } else {
        v = to_float(x[c]);
      }
      ss += v * v;
    }
  }
  const float r = rsqrtf(warp_sum(ss) / C + eps);
  // HF's LlamaRMSNorm: weight * (x * rstd).to(bf16), the product rounded to
  // bf16 again. Gemma2RMSNorm (w_offset 1): (x * rstd) * (1 + weight) all in
  // fp32, rounded once.
  const bool round_xh = w_offset == 0.0f;
  auto norm = [&](float xv, float wv) {
    const float xh = round_xh ? to_float(from_float<bf16>(xv * r)) : xv * r;
    return from_float<bf16>(xh * (w_offset + wv));
  };
  if (VEC) {
    for (int c = lane * 8; c < C; c += 256) {
      const auto p = RES ? Pack16<bf16>::load_rw(x + c) : Pack16<bf16>::load(x + c);
      const auto w = Pack16<bf16>::load(weight + c);
      Pack16<bf16> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = norm(to_float(p.v[k]), to_float(w.v[k]));
      o.store(y + c);
    }
  } else {
    for (int c = lane; c < C; c += 32) y[c] = norm(to_float(x[c]), to_float(weight[c]));
  }
  if (lane == 0) rstd[row] = r;
}

// ---- backward ------------------------------------------------------------------------

constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = 32 * kBwdWarps;
// Shared memory a block may use without the opt-in attribute, and the one
// the team count aims for: it keeps several blocks per SM resident.
constexpr size_t kBwdSmemTarget = 48 * 1024;

// p[0..8) += v as two 16-byte shared memory accesses (conflict-free across a
// warp whose lanes own consecutive 32-byte pieces). p is 16-byte aligned.
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
// of its team's dweight partial (C floats in shared memory), so no two
// threads touch one partial element: no atomics. The row sum of g*xhat is a
// warp shuffle, then, when W > 1, the team's W warp sums through shared
// memory in warp order. Every team runs the same number of iterations (a
// team past the block's rows idles), so the __syncthreads() inside are
// reached by all threads.
// Shared memory: teams x C floats, then kBwdWarps floats (the row sums).
template <bool VEC>
__global__ void __launch_bounds__(kBwdThreads)
    rmsnorm_backward_kernel(bf16* dinp, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                            const float* rstd, int N, int C, int rows_per_block, int teams, float w_offset) {
  extern __shared__ __align__(16) float sh[];
  const int W = kBwdWarps / teams, team_threads = 32 * W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int team = warp / W;
  const int k = threadIdx.x % team_threads;
  float* sdw = sh + size_t(team) * C;
  float* red = sh + size_t(teams) * C;  // [kBwdWarps]
  for (int c = k; c < C; c += team_threads) sdw[c] = 0.0f;
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
    const float s = has_row ? rstd[row] : 0.0f;
    float sum_gx = 0.0f;
    if (has_row) {
      if (VEC) {
        for (int c = 8 * k; c < C; c += 8 * team_threads) {
          const auto xp = Pack16<bf16>::load(x + c), dp = Pack16<bf16>::load(dy + c);
          const auto wp = Pack16<bf16>::load(weight + c);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum_gx += to_float(dp.v[e]) * (w_offset + to_float(wp.v[e])) * (to_float(xp.v[e]) * s);
        }
      } else {
        for (int c = k; c < C; c += team_threads)
          sum_gx += to_float(dy[c]) * (w_offset + to_float(weight[c])) * (to_float(x[c]) * s);
      }
    }
    sum_gx = warp_sum(sum_gx);
    if (W > 1) {  // uniform over the block
      if (lane == 0) red[warp] = sum_gx;
      __syncthreads();
      sum_gx = 0.0f;
      for (int w = team * W; w < (team + 1) * W; ++w) sum_gx += red[w];
      __syncthreads();  // red is rewritten in the next iteration
    }
    if (!has_row) continue;
    sum_gx /= C;
    if (VEC) {
      for (int c = 8 * k; c < C; c += 8 * team_threads) {
        const auto xp = Pack16<bf16>::load(x + c), dp = Pack16<bf16>::load(dy + c);
        const auto wp = Pack16<bf16>::load(weight + c);
        auto gp = Pack16<bf16>::load_rw(dx + c);  // dinp += : read it coherently
        float dw[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xh = to_float(xp.v[e]) * s;
          const float d = to_float(dp.v[e]);
          gp.v[e] = from_float<bf16>(to_float(gp.v[e]) + s * (d * (w_offset + to_float(wp.v[e])) - xh * sum_gx));
          dw[e] = d * xh;
        }
        add8(sdw + c, dw);
        gp.store(dx + c);
      }
    } else {
      for (int c = k; c < C; c += team_threads) {
        const float xh = to_float(x[c]) * s;
        const float d = to_float(dy[c]);
        dx[c] = from_float<bf16>(to_float(dx[c]) + s * (d * (w_offset + to_float(weight[c])) - xh * sum_gx));
        sdw[c] += d * xh;
      }
    }
  }
  __syncthreads();
  // Combine the teams in order; one partial dweight row per block.
  float* out = partial + size_t(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.0f;
    for (int t = 0; t < teams; ++t) acc += sh[size_t(t) * C + c];
    out[c] = acc;
  }
}

// dweight[c] += sum over blocks (in block order) of partial[b][c].
__global__ void rmsnorm_backward_finish_kernel(float* dweight, const float* partial, int nblocks, int C) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < nblocks; ++b) acc += partial[size_t(b) * C + c];
    dweight[c] += acc;
  }
}

// The backward's per-device launch facts (opt-in shared memory, blocks
// per SM of each variant), queried once per device and size.
SmemOccupancyCache& bwd_cache() {
  static SmemOccupancyCache c(reinterpret_cast<const void*>(rmsnorm_backward_kernel<true>),
                              reinterpret_cast<const void*>(rmsnorm_backward_kernel<false>), kBwdThreads,
                              kBwdSmemTarget);
  return c;
}

struct BwdPlan {
  int teams, blocks, rows_per_block;
  size_t smem;
};

// Teams: as many as fit kBwdSmemTarget. Blocks: every SM filled to its
// occupancy, never more than the rows need (one row per team).
BwdPlan bwd_plan(int N, int C, bool vec, int num_sms) {
  auto smem_for = [C](int teams) { return size_t(teams) * C * sizeof(float) + kBwdWarps * sizeof(float); };
  BwdPlan p{};
  p.teams = kBwdWarps;
  while (p.teams > 1 && smem_for(p.teams) > kBwdSmemTarget) p.teams /= 2;
  p.smem = smem_for(p.teams);
  int optin = 0;
  const int per_sm = bwd_cache().blocks_per_sm(vec, p.smem, &optin);
  TR_CHECK(p.smem <= size_t(optin), "rmsnorm_backward: C=", C, " needs ", p.smem,
           " bytes of shared memory per block (the dweight partial, 4 bytes per channel), the GPU allows ", optin,
           "; C up to ", (optin - kBwdWarps * int(sizeof(float))) / 4, " is supported");
  TR_CHECK(per_sm >= 1, "rmsnorm_backward: C=", C, ": no block of ", kBwdThreads, " threads with ", p.smem,
           " bytes of shared memory fits on an SM of this GPU");
  const int want = std::max(1, num_sms) * per_sm;
  p.blocks = std::max(1, std::min(want, (N + p.teams - 1) / p.teams));
  p.rows_per_block = (N + p.blocks - 1) / p.blocks;
  return p;
}

bool bwd_vec(int C, const bf16* dinp, const bf16* dout, const bf16* inp, const bf16* weight) {
  return C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight);
}

void check_eps(const char* op, float eps) {
  TR_CHECK(eps >= 0.0f && eps < INFINITY, op, ": eps ", eps, " must be finite and >= 0 (config.json's rms_norm_eps)");
}

}  // namespace

// ---- launchers -------------------------------------------------------------------

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C, float eps,
                     cudaStream_t stream, float w_offset) {
  if (N <= 0 || C <= 0) return;
  check_eps("rmsnorm_forward", eps);
  const int blocks = (N + kFwdWarps - 1) / kFwdWarps;
  if (C % 8 == 0 && aligned16(out) && aligned16(inp) && aligned16(weight)) {
    rmsnorm_forward_kernel<true, false><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, rstd, inp, weight, N, C, eps,
                                                                              nullptr, nullptr, nullptr, w_offset);
  } else {
    rmsnorm_forward_kernel<false, false><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, rstd, inp, weight, N, C, eps,
                                                                               nullptr, nullptr, nullptr, w_offset);
  }
  TR_CUDA_LAUNCH_CHECK("rmsnorm_forward");
}

void residual_rmsnorm_forward(bf16* res_out, bf16* out, float* rstd, const bf16* a, const bf16* b, const bf16* weight,
                              int N, int C, float eps, cudaStream_t stream, float w_offset) {
  if (N <= 0 || C <= 0) return;
  check_eps("residual_rmsnorm_forward", eps);
  const int blocks = (N + kFwdWarps - 1) / kFwdWarps;
  if (C % 8 == 0 && aligned16(out) && aligned16(res_out) && aligned16(a) && aligned16(b) && aligned16(weight)) {
    rmsnorm_forward_kernel<true, true><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, rstd, nullptr, weight, N, C, eps,
                                                                             res_out, a, b, w_offset);
  } else {
    rmsnorm_forward_kernel<false, true><<<blocks, 32 * kFwdWarps, 0, stream>>>(out, rstd, nullptr, weight, N, C, eps,
                                                                              res_out, a, b, w_offset);
  }
  TR_CUDA_LAUNCH_CHECK("residual_rmsnorm_forward");
}

size_t rmsnorm_backward_scratch_bytes(int N, int C, int num_sms) {
  if (N <= 0 || C <= 0) return 0;
  // The larger of the two variants' partials (the pointers' alignment is not known here).
  const BwdPlan a = bwd_plan(N, C, true, num_sms), b = bwd_plan(N, C, false, num_sms);
  return size_t(std::max(a.blocks, b.blocks)) * C * sizeof(float);
}

void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, int N, int C, float* scratch, int num_sms, cudaStream_t stream,
                      float w_offset) {
  if (N <= 0 || C <= 0) return;
  const bool vec = bwd_vec(C, dinp, dout, inp, weight);
  const BwdPlan p = bwd_plan(N, C, vec, num_sms);
  if (vec) {
    rmsnorm_backward_kernel<true><<<p.blocks, kBwdThreads, p.smem, stream>>>(dinp, scratch, dout, inp, weight, rstd,
                                                                             N, C, p.rows_per_block, p.teams, w_offset);
  } else {
    rmsnorm_backward_kernel<false><<<p.blocks, kBwdThreads, p.smem, stream>>>(dinp, scratch, dout, inp, weight, rstd,
                                                                              N, C, p.rows_per_block, p.teams, w_offset);
  }
  TR_CUDA_LAUNCH_CHECK("rmsnorm_backward");
  rmsnorm_backward_finish_kernel<<<grid_for(C, 256, 1024), 256, 0, stream>>>(dweight, scratch, p.blocks, C);
  TR_CUDA_LAUNCH_CHECK("rmsnorm_backward_finish");
}

}  // namespace trainrun::cuda
