// Attention by blocks (kernels/cuda/attention_block.cuh): tiled flash
// kernels on global positions. Not yet run on a GPU.
#include <math.h>

#include "core/common/error.h"
#include "kernels/attention_block_tiles.h"
#include "kernels/cuda/attention_block.cuh"
#include "kernels/cuda/attention_tiles.cuh"

namespace trainrun::cuda {

namespace {

using namespace attn_tiles;
static_assert(kTile == block_tiles::kTile, "the skipping rules (attention_block_tiles.h) assume the kernels' tile");

// The first global key position query row i (local, < Tq) may see: its
// document's start and, with a window W, qpos - W + 1 (attention_block.h).
__device__ __forceinline__ int row_first_pos(const AttentionBlock& a, int b, int i) {
  return block_tiles::first_pos(a.q_doc ? a.q_doc[int64_t(b) * a.doc_bs + i] : 0, a.q_pos0 + i, a.window);
}

// Whether query row i (local) sees key row j (local) of the block.
__device__ __forceinline__ bool sees(const AttentionBlock& a, int i, int j, int first_pos) {
  const int kpos = a.k_pos0 + j;
  return i < a.Tq && j < a.Tk && kpos <= a.q_pos0 + i && kpos >= first_pos;
}

// The key tiles [*kt0, *kt1) query tile q0 may see: from the tile of the
// smallest first position of its rows (a block-wide min: the CPU op takes
// any per-row document starts, not only non-decreasing ones) to the tile of
// its last row's diagonal. Every key tile outside is skipped whole; all of
// them when the block's keys all lie after the tile's queries or before
// their documents. Called by every thread (barriers inside).
__device__ __forceinline__ void key_tile_range(const AttentionBlock& a, int b, int q0, int* smin, int* kt0, int* kt1) {
  if (threadIdx.x == 0) *smin = INT_MAX;
  __syncthreads();
  if (threadIdx.x < kTile && q0 + int(threadIdx.x) < a.Tq) atomicMin(smin, row_first_pos(a, b, q0 + threadIdx.x));
  __syncthreads();
  const block_tiles::TileRange t = block_tiles::key_tiles(*smin, a.q_pos0 + min(q0 + kTile, a.Tq) - 1, a.k_pos0, a.Tk);
  *kt0 = t.begin;
  *kt1 = t.end;
}

// Forward: one block per (query tile, query head, batch row), the online
// softmax over the visible key tiles of the block (attention.cu's forward
// with the block's strides and global positions). Rows that see no key get
// out = 0 and lse = -inf, the CPU op's convention, so the merge skips them.
//
// Tiles computed for a chunk of Tc rows (nt = ceil(Tc/64) tiles) against one
// K/V block of Tc rows, per (head, batch row), without documents or window:
//   K/V block before the query chunk: all nt^2 tile pairs (every key visible);
//   the diagonal block (k_pos0 == q_pos0): nt(nt+1)/2, nt(nt-1)/2 skipped
//     (the key tiles past each query tile's diagonal);
//   K/V block after the chunk: none (the ring does not call it; called, every
//     tile's range is empty and only out = 0 / lse = -inf are written).
// Documents and windows move kt0 right: a query tile whose rows start their
// documents (or windows) past a key tile skips it, so a block that only a
// chunk's first document reaches computes only the first document's tiles.
template <int D16, bool VEC>
__global__ void __launch_bounds__(kThreads) block_fwd_kernel(bf16* out, float* lse, AttentionBlock a, float scale) {
  using D = Dims<D16>;
  constexpr int HSP = D::HSP, LDO = D::LDO;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver cv{smem};
  bf16* sQ = cv.take<bf16>(D::tile_h);
  bf16* sK = cv.take<bf16>(D::tile_h);
  bf16* sV = cv.take<bf16>(D::tile_h);
  float* sS = cv.take<float>(D::tile_s);
  bf16* sP = cv.take<bf16>(D::tile_p);
  float* sO = cv.take<float>(D::tile_o);
  __shared__ int smin;

  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, g = h / (a.NH / a.NKV), HS = a.HS;
  const int q0 = qt * kTile;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;
  const int qi = q0 + r;
  const int first = qi < a.Tq ? row_first_pos(a, b, qi) : 0;
  const bf16* kb = static_cast<const bf16*>(a.k) + b * a.kv_bs + g * HS;
  const bf16* vb = static_cast<const bf16*>(a.v) + b * a.kv_bs + g * HS;

  load_tile<D16, VEC>(sQ, static_cast<const bf16*>(a.q) + b * a.q_bs + h * HS, a.q_ld, q0, a.Tq, HS);
  for (int i = threadIdx.x; i < kTile * LDO; i += kThreads) sO[i] = 0.0f;
  float m_i = -INFINITY, l_i = 0.0f;
  int kt0, kt1;
  key_tile_range(a, b, q0, &smin, &kt0, &kt1);
  for (int kt = kt0; kt < kt1; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // everyone is done with the previous K/V tiles
    load_tile<D16, VEC>(sK, kb, a.kv_ld, k0, a.Tk, HS);
    load_tile<D16, VEC>(sV, vb, a.kv_ld, k0, a.Tk, HS);
    __syncthreads();
    warp_xyt<D16>(sS, sQ, sK, w);
    __syncwarp();
    const int j0 = k0 + 32 * half;
    online_softmax_half_row(
        sS + r * LDS + 32 * half, sP + r * LDP + 32 * half, sO + r * LDO + (HSP / 2) * half, HSP / 2, scale,
        a.softcap, [&](int c) { return sees(a, qi, j0 + c, first); }, m_i, l_i);
    __syncwarp();
    warp_o_plus_pv<D16>(sO, sP, sV, w);
    __syncwarp();
  }
  const float inv = l_i > 0.0f ? 1.0f / l_i : 0.0f;  // O's row is 0 where nothing was seen
  float* orow = sO + r * LDO + (HSP / 2) * half;
  for (int c = 0; c < HSP / 2; ++c) orow[c] *= inv;
  if (half == 0 && qi < a.Tq) lse[b * a.lse_bs + h * a.lse_hs + qi] = l_i > 0.0f ? m_i + logf(l_i) : -INFINITY;
  __syncthreads();
  store_tile<D16>(out + b * a.o_bs + h * HS, a.o_ld, sO, q0, a.Tq, HS, 1.0f);
}

// dst[row0 + r, c] += src[r, c] (fp32, a (64, HSP) staging tile of stride
// LDO) for rows < T and columns < HS: the backward's += into the caller's
// accumulators. Each element has one writer (this block), so no atomics.
template <int D16>
__device__ __forceinline__ void add_tile(float* dst, int64_t ld, const float* src, int row0, int T, int HS) {
  constexpr int HSP = Dims<D16>::HSP, LDO = Dims<D16>::LDO;
  for (int i = threadIdx.x; i < kTile * HSP; i += kThreads) {
    const int r = i / HSP, c = i % HSP, row = row0 + r;
    if (row < T && c < HS) dst[int64_t(row) * ld + c] += src[r * LDO + c];
  }
}

// The query tile's lse and D = rowsum(dout * out) (fp32) into sL, sD; rows
// past Tq get 0 (they are masked).
__device__ __forceinline__ void load_row_stats(float* sL, float* sD, const bf16* dout, const bf16* out,
                                               const float* lse, const AttentionBlock& a, int b, int h, int q0) {
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    const int qi = q0 + i;
    float d = 0.0f, l = 0.0f;
    if (qi < a.Tq) {
      const int64_t o = b * a.o_bs + qi * a.o_ld + int64_t(h) * a.HS;
      for (int c = 0; c < a.HS; ++c) d += to_float(dout[o + c]) * to_float(out[o + c]);
      l = lse[b * a.lse_bs + h * a.lse_hs + qi];
    }
    sL[i] = l;
    sD[i] = d;
  }
}

// dq for one (query tile, query head, batch row): over the key tiles of
// key_tile_range (the forward's), dq in registers, added to the caller's
// fp32 dq at the end.
template <int D16, bool VEC>
__global__ void __launch_bounds__(kThreads) block_dq_kernel(float* dq, const bf16* dout, const bf16* out,
                                                            const float* lse, AttentionBlock a, float scale) {
  using D = Dims<D16>;
  constexpr int LDO = D::LDO;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver cv{smem};
  bf16* sQ = cv.take<bf16>(D::tile_h);
  bf16* sdO = cv.take<bf16>(D::tile_h);
  bf16* sK = cv.take<bf16>(D::tile_h);
  bf16* sV = cv.take<bf16>(D::tile_h);
  float* sS = cv.take<float>(D::tile_s);
  float* sdP = cv.take<float>(D::tile_s);
  bf16* sdS = cv.take<bf16>(D::tile_p);
  float* sL = cv.take<float>(kTile * sizeof(float));
  float* sD = cv.take<float>(kTile * sizeof(float));
  __shared__ int smin;

  const int qt = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, g = h / (a.NH / a.NKV), HS = a.HS;
  const int q0 = qt * kTile;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;
  const int qi = q0 + r;
  const int first = qi < a.Tq ? row_first_pos(a, b, qi) : 0;
  const bf16* kb = static_cast<const bf16*>(a.k) + b * a.kv_bs + g * HS;
  const bf16* vb = static_cast<const bf16*>(a.v) + b * a.kv_bs + g * HS;

  load_tile<D16, VEC>(sQ, static_cast<const bf16*>(a.q) + b * a.q_bs + h * HS, a.q_ld, q0, a.Tq, HS);
  load_tile<D16, VEC>(sdO, dout + b * a.o_bs + h * HS, a.o_ld, q0, a.Tq, HS);
  load_row_stats(sL, sD, dout, out, lse, a, b, h, q0);
  FragC acc[D16];
#pragma unroll
  for (int j = 0; j < D16; ++j) wmma::fill_fragment(acc[j], 0.0f);
  int kt0, kt1;
  key_tile_range(a, b, q0, &smin, &kt0, &kt1);
  if (kt0 == kt1) return;  // no key of the block is visible to the tile: dq unchanged
  for (int kt = kt0; kt < kt1; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();
    load_tile<D16, VEC>(sK, kb, a.kv_ld, k0, a.Tk, HS);
    load_tile<D16, VEC>(sV, vb, a.kv_ld, k0, a.Tk, HS);
    __syncthreads();
    warp_xyt<D16>(sS, sQ, sK, w);    // S = q k^T
    warp_xyt<D16>(sdP, sdO, sV, w);  // dP = dout v^T
    __syncwarp();
    const int j0 = k0 + 32 * half;
    probs_and_dscores(sS + r * LDS + 32 * half, sdP + r * LDS + 32 * half, nullptr, sdS + r * LDP + 32 * half, sL[r],
                      sD[r], scale, a.softcap, [&](int c) { return sees(a, qi, j0 + c, first); });
    __syncwarp();
    warp_dq_plus_dsk<D16>(acc, sdS, sK, w);
  }
  __syncthreads();  // S|dP becomes the staging tile
  float* stage = sS;
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, acc[j], LDO, wmma::mem_row_major);
  __syncthreads();
  add_tile<D16>(dq + b * a.q_bs + h * HS, a.q_ld, stage, q0, a.Tq, HS);
}

// dk, dv for one (key tile, key/value head, batch row): over the group's R
// query heads in order and, for each, the query tiles that see a key of the
// tile (a query tile is skipped whole when none of its rows does: all its
// rows before the tile's first key, or all their documents / windows
// starting after its last key, decided by one __syncthreads_or), the sums
// in registers in that fixed order (deterministic, no atomics), added to the
// caller's fp32 dk / dv at the end.
template <int D16, bool VEC>
__global__ void __launch_bounds__(kThreads) block_dkv_kernel(float* dk, float* dv, const bf16* dout, const bf16* out,
                                                             const float* lse, AttentionBlock a, float scale) {
  using D = Dims<D16>;
  constexpr int LDO = D::LDO;
  extern __shared__ __align__(128) unsigned char smem[];
  Carver cv{smem};
  bf16* sK = cv.take<bf16>(D::tile_h);
  bf16* sV = cv.take<bf16>(D::tile_h);
  bf16* sQ = cv.take<bf16>(D::tile_h);
  bf16* sdO = cv.take<bf16>(D::tile_h);
  float* sS = cv.take<float>(D::tile_s);
  float* sdP = cv.take<float>(D::tile_s);
  bf16* sP = cv.take<bf16>(D::tile_p);
  bf16* sdS = cv.take<bf16>(D::tile_p);
  float* sL = cv.take<float>(kTile * sizeof(float));
  float* sD = cv.take<float>(kTile * sizeof(float));

  const int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z, HS = a.HS, R = a.NH / a.NKV;
  const int k0 = kt * kTile;
  const int kp0 = a.k_pos0 + k0, kp1 = a.k_pos0 + min(k0 + kTile, a.Tk) - 1;  // the tile's first / last key
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;
  load_tile<D16, VEC>(sK, static_cast<const bf16*>(a.k) + b * a.kv_bs + g * HS, a.kv_ld, k0, a.Tk, HS);
  load_tile<D16, VEC>(sV, static_cast<const bf16*>(a.v) + b * a.kv_bs + g * HS, a.kv_ld, k0, a.Tk, HS);
  FragC dkf[D16], dvf[D16];
#pragma unroll
  for (int j = 0; j < D16; ++j) {
    wmma::fill_fragment(dkf[j], 0.0f);
    wmma::fill_fragment(dvf[j], 0.0f);
  }
  // Query tiles before the one holding the tile's first key's position
  // cannot see it (causal): start there.
  const int qt0 = max(0, kp0 - a.q_pos0) / kTile, nqt = (a.Tq + kTile - 1) / kTile;
  bool any = false;
  for (int qt = qt0; qt < nqt; ++qt) {
    const int q0 = qt * kTile;
    const int qi = q0 + r;
    const int first = qi < a.Tq ? row_first_pos(a, b, qi) : 0;
    // Does any row of the query tile see a key of this tile? (qpos >= kp0, first <= kp1)
    const int t = q0 + int(threadIdx.x);
    const bool row_sees =
        threadIdx.x < kTile && t < a.Tq && block_tiles::row_reaches(a.q_pos0 + t, row_first_pos(a, b, t), kp0, kp1);
    if (!__syncthreads_or(row_sees)) continue;  // also: everyone is done with the previous tiles
    any = true;
    for (int h = g * R; h < (g + 1) * R; ++h) {
      __syncthreads();  // everyone is done with the previous Q/dO/P/dS tiles
      load_tile<D16, VEC>(sQ, static_cast<const bf16*>(a.q) + b * a.q_bs + h * HS, a.q_ld, q0, a.Tq, HS);
      load_tile<D16, VEC>(sdO, dout + b * a.o_bs + h * HS, a.o_ld, q0, a.Tq, HS);
      load_row_stats(sL, sD, dout, out, lse, a, b, h, q0);
      __syncthreads();
      warp_xyt<D16>(sS, sQ, sK, w);    // S(q rows of warp, keys)
      warp_xyt<D16>(sdP, sdO, sV, w);  // dP
      __syncwarp();
      const int j0 = k0 + 32 * half;
      probs_and_dscores(sS + r * LDS + 32 * half, sdP + r * LDS + 32 * half, sP + r * LDP + 32 * half,
                        sdS + r * LDP + 32 * half, sL[r], sD[r], scale, a.softcap,
                        [&](int c) { return sees(a, qi, j0 + c, first); });
      __syncthreads();  // dv/dk of the warp's key rows read every query row of P and dS
      warp_dkdv_plus<D16>(dkf, dvf, sP, sdS, sdO, sQ, w);
    }
  }
  if (!any) return;  // no query sees the tile: dk, dv unchanged
  __syncthreads();
  float* stage = sS;
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, dkf[j], LDO, wmma::mem_row_major);
  __syncthreads();
  add_tile<D16>(dk + b * a.kv_bs + g * HS, a.kv_ld, stage, k0, a.Tk, HS);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, dvf[j], LDO, wmma::mem_row_major);
  __syncthreads();
  add_tile<D16>(dv + b * a.kv_bs + g * HS, a.kv_ld, stage, k0, a.Tk, HS);
}

// The merge: one thread per (b, h, query row), elementwise over HS.
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

constexpr int kThreads1 = 128;  // the row-wise merge

// The head-size limit is dispatch_head_size's (the tiled kernels').
float check(const char* op, const AttentionBlock& a) {
  TR_CHECK(a.NKV > 0 && a.NH % a.NKV == 0, op, ": NKV ", a.NKV, " must divide NH ", a.NH);
  TR_CHECK(a.window >= 0 && a.softcap >= 0.f && a.scale >= 0.f, op, ": window ", a.window, ", softcap ", a.softcap,
           " and scale ", a.scale, " must be >= 0 (0: none / none / 1/sqrt(HS))");
  TR_CHECK(a.NH <= 65535 && a.B <= 65535 && a.NKV <= 65535, op, ": NH=", a.NH, " and B=", a.B,
           " must be at most 65535 (the grid's limits)");
  return a.scale > 0.f ? a.scale : 1.0f / sqrtf(float(a.HS));
}

int blocks_for(int64_t n) { return int((n + kThreads1 - 1) / kThreads1); }

bool aligned_view(const void* p, int64_t ld, int64_t bs) { return aligned16(p) && ld % 8 == 0 && bs % 8 == 0; }

}  // namespace

void attention_block_forward(bf16* out, float* lse, const AttentionBlock& a, cudaStream_t stream) {
  const float scale = check("attention_block_forward", a);
  if (int64_t(a.B) * a.NH * a.Tq == 0) return;
  // 16-byte tile loads: every view's base, row and batch strides in whole 8s, and HS too.
  const bool vec = a.HS % 8 == 0 && aligned_view(a.q, a.q_ld, a.q_bs) && aligned_view(a.k, a.kv_ld, a.kv_bs) &&
                   aligned16(a.v);
  const dim3 grid((a.Tq + kTile - 1) / kTile, a.NH, a.B);
  dispatch_head_size(a.HS, "attention_block_forward", "head_dim", [&](auto d16) {
    constexpr int D16 = decltype(d16)::value;
    const size_t smem = Dims<D16>::fwd_smem;
    auto launch = [&](auto kernel) {
      set_smem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(out, lse, a, scale);
    };
    vec ? launch(block_fwd_kernel<D16, true>) : launch(block_fwd_kernel<D16, false>);
  });
  TR_CUDA_LAUNCH_CHECK("block_fwd_kernel");
}

void attention_block_merge(bf16* out, float* lse, const bf16* block_out, const float* block_lse,
                           const AttentionBlock& a, cudaStream_t stream) {
  check("attention_block_merge", a);
  const int64_t n = int64_t(a.B) * a.NH * a.Tq;
  if (n == 0) return;
  block_merge_kernel<<<blocks_for(n), kThreads1, 0, stream>>>(out, lse, block_out, block_lse, a);
  TR_CUDA_LAUNCH_CHECK("block_merge_kernel");
}

void attention_block_backward(float* dq, float* dk, float* dv, const bf16* dout, const bf16* out, const float* lse,
                              const AttentionBlock& a, cudaStream_t stream) {
  const float scale = check("attention_block_backward", a);
  if (int64_t(a.B) * a.NH * a.Tq == 0 || a.Tk == 0) return;
  const bool vec = a.HS % 8 == 0 && aligned_view(a.q, a.q_ld, a.q_bs) && aligned_view(a.k, a.kv_ld, a.kv_bs) &&
                   aligned16(a.v) && aligned_view(dout, a.o_ld, a.o_bs);
  const dim3 grid_dq((a.Tq + kTile - 1) / kTile, a.NH, a.B), grid_dkv((a.Tk + kTile - 1) / kTile, a.NKV, a.B);
  dispatch_head_size(a.HS, "attention_block_backward", "head_dim", [&](auto d16) {
    constexpr int D16 = decltype(d16)::value;
    auto launch = [&](auto dq_kernel, auto dkv_kernel) {
      set_smem(dq_kernel, Dims<D16>::dq_smem);
      dq_kernel<<<grid_dq, kThreads, Dims<D16>::dq_smem, stream>>>(dq, dout, out, lse, a, scale);
      TR_CUDA_LAUNCH_CHECK("block_dq_kernel");
      set_smem(dkv_kernel, Dims<D16>::dkv_smem);
      dkv_kernel<<<grid_dkv, kThreads, Dims<D16>::dkv_smem, stream>>>(dk, dv, dout, out, lse, a, scale);
      TR_CUDA_LAUNCH_CHECK("block_dkv_kernel");
    };
    vec ? launch(block_dq_kernel<D16, true>, block_dkv_kernel<D16, true>)
        : launch(block_dq_kernel<D16, false>, block_dkv_kernel<D16, false>);
  });
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
