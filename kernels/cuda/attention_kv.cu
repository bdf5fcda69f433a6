// KV-cached causal attention (prefill and decode): see attention_kv.cuh.
#include "kernels/cuda/attention_kv.cuh"

#include <type_traits>

namespace trainrun::cuda {

namespace {

constexpr int kWarps = 8;  // per attention block, all on one head
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;  // keys a warp scores at once (one per lane)

// ---- kernels ---------------------------------------------------------------------

// kcache/vcache rows [pos, pos+Tq) = the k / v columns of qkv. VEC: C % 8 == 0
// and all three buffers 16-byte aligned (then every row piece is too).
template <bool VEC>
__global__ void kv_cache_write_kernel(bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int C) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t C3 = 3 * int64_t(C);
  if (VEC) {
    const int C8 = C / 8;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(Tq) * C8; idx += stride) {
      const int64_t i = idx / C8;
      const int c = int(idx % C8) * 8;
      const bf16* src = qkv + i * C3 + C + c;
      Pack16<bf16>::load(src).store(kcache + (pos + i) * C + c);
      Pack16<bf16>::load(src + C).store(vcache + (pos + i) * C + c);
    }
  } else {
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(Tq) * C; idx += stride) {
      const int64_t i = idx / C;
      const int c = int(idx % C);
      kcache[(pos + i) * C + c] = qkv[i * C3 + C + c];
      vcache[(pos + i) * C + c] = qkv[i * C3 + 2 * C + c];
    }
  }
}

// grid (ceil(Tq / QPB), NH), block kThreads; QPB = kWarps / S queries per
// block, S key splits per query (S in 1, 2, 4, 8). Warp w serves query
// blockIdx.x * QPB + w / S with split w % S. DPL: head dims per lane
// (HS <= 32 * DPL); lane l owns dims l, l+32, ...
// VEC: key rows are read as 16-byte packs (kcache 16-byte aligned, C and HS
// multiples of 8).
template <int DPL, bool VEC>
__global__ void __launch_bounds__(kThreads)
    attention_kv_kernel(bf16* out, const bf16* kcache, const bf16* vcache, const bf16* qkv, int pos, int Tq, int C,
                        int HS, int S, float scale) {
  constexpr int HSP = 32 * DPL;
  __shared__ float sq[kWarps][HSP];    // each warp's query, times scale, zero-padded
  __shared__ float sacc[kWarps][HSP];  // each warp's unnormalised output (for the merge)
  __shared__ float smax[kWarps], ssum[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y;
  const int qpb = kWarps / S;
  const int qslot = warp / S, split = warp % S;
  const int i = blockIdx.x * qpb + qslot;
  const bool active = i < Tq;  // uniform over the warp

  float m = -INFINITY, l = 0.0f;  // running max and sum of exp over this warp's keys
  float acc[DPL];
#pragma unroll
  for (int t = 0; t < DPL; ++t) acc[t] = 0.0f;

  if (active) {
    const bf16* q = qkv + int64_t(i) * 3 * C + int64_t(h) * HS;
    for (int d = lane; d < HSP; d += 32) sq[warp][d] = d < HS ? to_float(q[d]) * scale : 0.0f;
    __syncwarp();
    const int last = pos + i;  // the query's own position: keys [0, last] are visible
    const int nchunks = last / kChunk + 1;
    const bf16* kh = kcache + int64_t(h) * HS;
    const bf16* vh = vcache + int64_t(h) * HS;
    for (int ch = split; ch < nchunks; ch += S) {  // warp-uniform bounds: shuffles below are safe
      const int j0 = ch * kChunk;
      const int j = j0 + lane;
      const bool valid = j <= last;  // never read a row past the causal edge (it may be past maxT)
      float s = -INFINITY;
      if (valid) {
        const bf16* krow = kh + int64_t(j) * C;
        float dot = 0.0f;
        if (VEC) {
#pragma unroll 4
          for (int c = 0; c < HSP; c += 8) {
            if (c < HS) {  // HS % 8 == 0: the whole pack is inside the head
              const auto kp = Pack16<bf16>::load(krow + c);
#pragma unroll
              for (int k = 0; k < 8; ++k) dot += to_float(kp.v[k]) * sq[warp][c + k];
            }
          }
        } else {
          for (int c = 0; c < HS; ++c) dot += to_float(krow[c]) * sq[warp][c];
        }
        s = dot;
      }
      // Key j0 <= last is valid, so the chunk max and m_new are finite.
      const float m_new = fmaxf(m, warp_max(s));
      const float alpha = __expf(m - m_new);  // 0 on the first chunk (m = -inf)
      const float p = valid ? __expf(s - m_new) : 0.0f;
      l = l * alpha + warp_sum(p);
      m = m_new;
#pragma unroll
      for (int t = 0; t < DPL; ++t) acc[t] *= alpha;
      const int nv = min(kChunk, last + 1 - j0);  // valid keys of the chunk (uniform)
      for (int jj = 0; jj < nv; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const bf16* vrow = vh + int64_t(j0 + jj) * C;
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
          const int d = lane + 32 * t;
          if (d < HS) acc[t] += pj * to_float(vrow[d]);
        }
      }
    }
  }

  // Merge the S splits of each query, in split order (deterministic). A
  // split that got no chunk has max -inf: its weight exp(-inf - M) is 0, and
  // split 0 always holds key 0, so M is finite.
  if (lane == 0) {
    smax[warp] = m;
    ssum[warp] = l;
  }
#pragma unroll
  for (int t = 0; t < DPL; ++t) sacc[warp][lane + 32 * t] = acc[t];
  __syncthreads();
  if (!active || split != 0) return;
  const int w0 = qslot * S;
  float M = -INFINITY;
  for (int k = 0; k < S; ++k) M = fmaxf(M, smax[w0 + k]);
  float L = 0.0f;
  float o[DPL];
#pragma unroll
  for (int t = 0; t < DPL; ++t) o[t] = 0.0f;
  for (int k = 0; k < S; ++k) {
    const float f = __expf(smax[w0 + k] - M);
    L += ssum[w0 + k] * f;
#pragma unroll
    for (int t = 0; t < DPL; ++t) o[t] += sacc[w0 + k][lane + 32 * t] * f;
  }
  const float inv = 1.0f / L;
  bf16* orow = out + int64_t(i) * C + int64_t(h) * HS;
#pragma unroll
  for (int t = 0; t < DPL; ++t) {
    const int d = lane + 32 * t;
    if (d < HS) orow[d] = from_float<bf16>(o[t] * inv);
  }
}

// Maps the head size to DPL = dims per lane (1, 2, 4, 8: HS <= 32, 64, 128, 256).
template <typename F>
void dispatch_kv_head_size(int HS, F&& f) {
  if (HS <= 32) f(std::integral_constant<int, 1>{});
  else if (HS <= 64) f(std::integral_constant<int, 2>{});
  else if (HS <= 128) f(std::integral_constant<int, 4>{});
  else if (HS <= kKvMaxHeadSize) f(std::integral_constant<int, 8>{});
  else
    TR_FAIL("attention_kv_forward: head size ", HS, " (n_embd / n_head) is larger than the supported ",
            kKvMaxHeadSize, "; use more heads");
}

}  // namespace

// ---- launcher --------------------------------------------------------------------

void attention_kv_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int C, int NH,
                          cudaStream_t stream) {
  if (Tq <= 0) return;
  TR_CHECK(pos >= 0, "attention_kv_forward: negative position ", pos);
  TR_CHECK(NH > 0 && C > 0 && C % NH == 0, "attention_kv_forward: C=", C, " is not divisible by NH=", NH);
  TR_CHECK(NH <= 65535, "attention_kv_forward: NH=", NH, " heads exceed the grid's y limit (65535)");
  const int HS = C / NH;
  // Checked before the cache write, so a rejected call changes nothing.
  TR_CHECK(HS <= kKvMaxHeadSize, "attention_kv_forward: head size ", HS, " (n_embd / n_head = ", C, " / ", NH,
           ") is larger than the supported ", kKvMaxHeadSize, "; use more heads");

  const bool vec_copy = C % 8 == 0 && aligned16(qkv) && aligned16(kcache) && aligned16(vcache);
  const int64_t work = vec_copy ? int64_t(Tq) * (C / 8) : int64_t(Tq) * C;
  if (vec_copy) {
    kv_cache_write_kernel<true><<<grid_for(work, 256), 256, 0, stream>>>(kcache, vcache, qkv, pos, Tq, C);
  } else {
    kv_cache_write_kernel<false><<<grid_for(work, 256), 256, 0, stream>>>(kcache, vcache, qkv, pos, Tq, C);
  }
  TR_CUDA_LAUNCH_CHECK("attention_kv_forward cache write");

  // Key splits per query: all 8 warps on the one query of a decode step,
  // one warp per query from Tq = 8 up (then 8 queries per block).
  int S = kWarps;
  while (S > 1 && S * Tq > kWarps) S /= 2;
  const int qpb = kWarps / S;
  const dim3 grid((Tq + qpb - 1) / qpb, NH);
  const float scale = 1.0f / sqrtf(float(HS));
  const bool vec = C % 8 == 0 && HS % 8 == 0 && aligned16(kcache);
  dispatch_kv_head_size(HS, [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    if (vec) {
      attention_kv_kernel<DPL, true>
          <<<grid, kThreads, 0, stream>>>(out, kcache, vcache, qkv, pos, Tq, C, HS, S, scale);
    } else {
      attention_kv_kernel<DPL, false>
          <<<grid, kThreads, 0, stream>>>(out, kcache, vcache, qkv, pos, Tq, C, HS, S, scale);
    }
  });
  TR_CUDA_LAUNCH_CHECK("attention_kv_forward");
}

}  // namespace trainrun::cuda
