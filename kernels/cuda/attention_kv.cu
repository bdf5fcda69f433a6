// KV-cached causal attention (prefill and decode): see attention_kv.cuh.
#include "kernels/cuda/attention_kv.cuh"

#include <algorithm>
#include <type_traits>

namespace trainrun::cuda {

namespace {

constexpr int kWarps = 8;  // per attention block, all on one head
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 32;  // keys a warp scores at once (one per lane)

// ---- kernels ---------------------------------------------------------------------

// kcache/vcache rows [pos, pos+Tq) = the k / v columns of qkv: row i of
// qkv (stride ld = (NH+2*NKV)*HS) has its k heads at [C, C+KV) and its v
// heads at [C+KV, C+2*KV), C = NH*HS, KV = NKV*HS (the caches' row stride).
// VEC: C and KV multiples of 8 and all three buffers 16-byte aligned (then
// every row piece is too).
// With a window W > 0 the caches are rings of W rows: qkv rows [i0, Tq)
// (the last min(Tq, W) new tokens; i0 = 0 without a window) go to rows
// (pos + i) % W, after the attention has read the old ones.
template <bool VEC>
__global__ void kv_cache_write_kernel(bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int i0, int Tq, int C,
                                      int KV, int W) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t ld = int64_t(C) + 2 * int64_t(KV);
  const int n = Tq - i0;
  auto row = [&](int64_t i) -> int64_t { return W > 0 ? (pos + i) % W : pos + i; };
  if (VEC) {
    const int KV8 = KV / 8;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(n) * KV8; idx += stride) {
      const int64_t i = i0 + idx / KV8;
      const int c = int(idx % KV8) * 8;
      const bf16* src = qkv + i * ld + C + c;
      Pack16<bf16>::load(src).store(kcache + row(i) * KV + c);
      Pack16<bf16>::load(src + KV).store(vcache + row(i) * KV + c);
    }
  } else {
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < int64_t(n) * KV; idx += stride) {
      const int64_t i = i0 + idx / KV;
      const int c = int(idx % KV);
      kcache[row(i) * KV + c] = qkv[i * ld + C + c];
      vcache[row(i) * KV + c] = qkv[i * ld + C + KV + c];
    }
  }
}

// Where position j's key (value) row of head g lives: without a window the
// cache row j (the new rows were written before the attention); with one,
// the new tokens' rows of qkv (j >= pos) or the ring row j % W.
__device__ __forceinline__ const bf16* kv_row(const bf16* cache_h, const bf16* qkv_h, int j, int pos, int W, int KV,
                                              int64_t ld) {
  if (W > 0) return j >= pos ? qkv_h + int64_t(j - pos) * ld : cache_h + int64_t(j % W) * KV;
  return cache_h + int64_t(j) * KV;
}

// grid (ceil(Tq / QPB), NH), block kThreads; QPB = kWarps / S queries per
// block, S key splits per query (S in 1, 2, 4, 8). Warp w serves query
// blockIdx.x * QPB + w / S with split w % S, of query head blockIdx.y and
// its key/value head g = h / (NH/NKV). DPL: head dims per lane (HS <= 32 *
// DPL); lane l owns dims l, l+32, ...
// VEC: key rows are read as 16-byte packs (kcache 16-byte aligned, HS a
// multiple of 8, so the caches' row stride NKV*HS is too).
template <int DPL, bool VEC>
__global__ void __launch_bounds__(kThreads)
    attention_kv_kernel(bf16* out, const bf16* kcache, const bf16* vcache, const bf16* qkv, int pos, int Tq, int NH,
                        int NKV, int HS, int S, float scale, int W, float softcap) {
  constexpr int HSP = 32 * DPL;
  __shared__ float sq[kWarps][HSP];    // each warp's query, times scale, zero-padded
  __shared__ float sacc[kWarps][HSP];  // each warp's unnormalised output (for the merge)
  __shared__ float smax[kWarps], ssum[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, g = h / (NH / NKV);
  const int C = NH * HS, KV = NKV * HS;  // the row strides of out and of the caches
  const int qpb = kWarps / S;
  const int qslot = warp / S, split = warp % S;
  const int i = blockIdx.x * qpb + qslot;
  const bool active = i < Tq;  // uniform over the warp

  float m = -INFINITY, l = 0.0f;  // running max and sum of exp over this warp's keys
  float acc[DPL];
#pragma unroll
  for (int t = 0; t < DPL; ++t) acc[t] = 0.0f;

  if (active) {
    const bf16* q = qkv + int64_t(i) * (C + 2 * KV) + int64_t(h) * HS;
    for (int d = lane; d < HSP; d += 32) sq[warp][d] = d < HS ? to_float(q[d]) * scale : 0.0f;
    __syncwarp();
    const int last = pos + i;  // the query's own position: keys [first, last] are visible
    const int first = W > 0 ? max(0, last - W + 1) : 0;
    const int ch0 = first / kChunk, nchunks = last / kChunk + 1;  // chunks left of the window: skipped
    const int64_t ld = int64_t(C) + 2 * KV;
    const bf16* kh = kcache + int64_t(g) * HS;
    const bf16* vh = vcache + int64_t(g) * HS;
    const bf16* kq = qkv + C + int64_t(g) * HS;       // the new tokens' key head g (ring mode)
    const bf16* vq = qkv + C + KV + int64_t(g) * HS;  // and value head g
    for (int ch = ch0 + split; ch < nchunks; ch += S) {  // warp-uniform bounds: shuffles below are safe
      const int j0 = ch * kChunk;
      const int j = j0 + lane;
      const bool valid = j <= last && j >= first;  // never read a row past the causal edge (it may be past maxT)
      float s = -INFINITY;
      if (valid) {
        const bf16* krow = kv_row(kh, kq, j, pos, W, KV, ld);
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
        s = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
      }
      // Every chunk from ch0 holds a valid key (first in ch0, j0 in the
      // later ones), so the chunk max and m_new are finite.
      const float m_new = fmaxf(m, warp_max(s));
      const float alpha = __expf(m - m_new);  // 0 on the first chunk (m = -inf)
      const float p = valid ? __expf(s - m_new) : 0.0f;
      l = l * alpha + warp_sum(p);
      m = m_new;
#pragma unroll
      for (int t = 0; t < DPL; ++t) acc[t] *= alpha;
      const int nv = min(kChunk, last + 1 - j0);  // keys of the chunk up to the causal edge (uniform)
      for (int jj = max(0, first - j0); jj < nv; ++jj) {  // from the window's edge (uniform)
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const bf16* vrow = kv_row(vh, vq, j0 + jj, pos, W, KV, ld);
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
  // split 0 always holds the first visible key, so M is finite.
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
  else f(std::integral_constant<int, 8>{});  // HS <= kKvMaxHeadSize: checked by the caller
}

// Both entry points run this (multi-head: NKV = NH), so they agree bit for
// bit when NKV == NH. `hint` names where HS comes from in the config.
void kv_forward_impl(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int NH, int NKV,
                     int HS, const char* what, const char* hint, const AttentionOptions& opt, cudaStream_t stream) {
  TR_CHECK(pos >= 0, what, ": negative position ", pos);
  TR_CHECK(opt.window >= 0 && opt.softcap >= 0.f && opt.scale >= 0.f, what, ": window ", opt.window, ", softcap ",
           opt.softcap, " and scale ", opt.scale, " must be >= 0 (0: none / 1/sqrt(head size))");
  const int W = opt.window;
  TR_CHECK(NH <= 65535, what, ": NH=", NH, " heads exceed the grid's y limit (65535)");
  // Checked before the cache write, so a rejected call changes nothing.
  TR_CHECK(HS <= kKvMaxHeadSize, what, ": head size ", HS, " (", hint, ") is larger than the supported ",
           kKvMaxHeadSize, "; use more heads");
  const int C = NH * HS, KV = NKV * HS;

  const bool vec_copy = C % 8 == 0 && KV % 8 == 0 && aligned16(qkv) && aligned16(kcache) && aligned16(vcache);
  // Without a window the new rows go in first and the attention reads the
  // cache; a ring is written after (the chunk may overwrite keys its first
  // queries still need), the attention reading the new rows from qkv.
  auto write_cache = [&]() {
    const int i0 = W > 0 ? std::max(0, Tq - W) : 0;
    const int64_t work = vec_copy ? int64_t(Tq - i0) * (KV / 8) : int64_t(Tq - i0) * KV;
    if (vec_copy) {
      kv_cache_write_kernel<true>
          <<<grid_for(work, 256), 256, 0, stream>>>(kcache, vcache, qkv, pos, i0, Tq, C, KV, W);
    } else {
      kv_cache_write_kernel<false>
          <<<grid_for(work, 256), 256, 0, stream>>>(kcache, vcache, qkv, pos, i0, Tq, C, KV, W);
    }
    TR_CUDA_LAUNCH_CHECK("kv_cache_write_kernel");
  };
  if (W == 0) write_cache();

  // Key splits per query: all 8 warps on the one query of a decode step,
  // one warp per query from Tq = 8 up (then 8 queries per block).
  int S = kWarps;
  while (S > 1 && S * Tq > kWarps) S /= 2;
  const int qpb = kWarps / S;
  const dim3 grid((Tq + qpb - 1) / qpb, NH);
  const float scale = opt.scale > 0.f ? opt.scale : 1.0f / sqrtf(float(HS));
  // Key rows come from the cache, and with a window also from qkv (its row stride C + 2 KV is a multiple of 8 too).
  const bool vec = HS % 8 == 0 && aligned16(kcache) && (W == 0 || aligned16(qkv));
  dispatch_kv_head_size(HS, [&](auto dpl) {
    constexpr int DPL = decltype(dpl)::value;
    if (vec) {
      attention_kv_kernel<DPL, true>
          <<<grid, kThreads, 0, stream>>>(out, kcache, vcache, qkv, pos, Tq, NH, NKV, HS, S, scale, W, opt.softcap);
    } else {
      attention_kv_kernel<DPL, false>
          <<<grid, kThreads, 0, stream>>>(out, kcache, vcache, qkv, pos, Tq, NH, NKV, HS, S, scale, W, opt.softcap);
    }
  });
  TR_CUDA_LAUNCH_CHECK("attention_kv_kernel");
  if (W > 0) write_cache();
}

}  // namespace

// ---- launchers -------------------------------------------------------------------

void attention_kv_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int C, int NH,
                          cudaStream_t stream) {
  if (Tq <= 0) return;
  TR_CHECK(NH > 0 && C > 0 && C % NH == 0, "attention_kv_forward: C=", C, " is not divisible by NH=", NH);
  kv_forward_impl(out, kcache, vcache, qkv, pos, Tq, NH, NH, C / NH, "attention_kv_forward", "n_embd / n_head", {},
                  stream);
}

void attention_kv_gqa_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int NH,
                              int NKV, int HS, cudaStream_t stream, const AttentionOptions& opt) {
  TR_CHECK(NH > 0 && NKV > 0 && HS > 0, "attention_kv_gqa_forward: NH ", NH, ", NKV ", NKV, " and HS ", HS,
           " must be positive");
  TR_CHECK(NH % NKV == 0, "attention_kv_gqa_forward: num_key_value_heads ", NKV,
           " must divide num_attention_heads ", NH);
  if (Tq <= 0) return;
  kv_forward_impl(out, kcache, vcache, qkv, pos, Tq, NH, NKV, HS, "attention_kv_gqa_forward", "head_dim", opt, stream);
}

}  // namespace trainrun::cuda
