// The building blocks of the tiled flash-attention kernels, shared by the
// whole-sequence kernels (attention.cu) and context parallelism's block
// kernels (attention_block.cu): shared-memory tile layout, tile loads and
// stores, the WMMA products of a 64 x 64 tile, the online-softmax step of a
// lane's half row, the backward's P / dS, and the head-size dispatch. The
// kernels differ only in where their rows live and which (query, key) pairs
// are visible; that is the `visible(kj)` predicate the steps take.
//
// Shared-memory tiles (row strides padded so WMMA's alignment rules hold and
// rows fall in different banks):
//   bf16 (64, HSP) tiles of q, k, v, dout     row stride LDH = HSP + 8
//   fp32 (64, 64) scores S and dP             row stride LDS = 68
//   bf16 (64, 64) probabilities P and dS      row stride LDP = 72
//   fp32 (64, HSP) output accumulator / staging for the final store, LDO = HSP + 4
// HSP = 16 * D16 is the head size padded with zeros to the WMMA k-step.
//
// Row ownership: warp w owns rows [16w, 16w+16) of every (64, *) tile it
// computes; within the warp, lane l handles row 16w + l/2, columns
// [32*(l%2), 32*(l%2) + 32) of S (and the matching half of an O row). So the
// softmax bookkeeping needs only __syncwarp(); __syncthreads() is needed only
// where a tile loaded or written by all warps is read by others.
#pragma once
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "core/common/error.h"
#include "kernels/cuda/attention.cuh"  // kAttnMaxHeadSize
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda::attn_tiles {

using namespace nvcuda;

constexpr int kTile = 64;     // queries and keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int LDS = kTile + 4;
constexpr int LDP = kTile + 8;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;  // a transposed view
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;  // b = X^T of a row-major X
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <int D16>
struct Dims {
  static constexpr int HSP = 16 * D16;
  static constexpr int LDH = HSP + 8;
  static constexpr int LDO = HSP + 4;
  static constexpr size_t tile_h = size_t(kTile) * LDH * sizeof(bf16);   // one (64, HSP) bf16 tile
  static constexpr size_t tile_s = size_t(kTile) * LDS * sizeof(float);  // one (64, 64) fp32 tile
  static constexpr size_t tile_p = size_t(kTile) * LDP * sizeof(bf16);   // one (64, 64) bf16 tile
  static constexpr size_t tile_o = size_t(kTile) * LDO * sizeof(float);  // one (64, HSP) fp32 tile
  // forward: q k v | S | P | O
  static constexpr size_t fwd_smem = 3 * tile_h + tile_s + tile_p + tile_o;
  // backward dq: q dout k v | S dP (also the dq staging, 64 x LDO <= 2 x 64 x LDS) | dS | lse D
  static constexpr size_t dq_smem = 4 * tile_h + 2 * tile_s + tile_p + 2 * kTile * sizeof(float);
  // backward dk dv: k v q dout | S dP (staging) | P dS | lse D
  static constexpr size_t dkv_smem = 4 * tile_h + 2 * tile_s + 2 * tile_p + 2 * kTile * sizeof(float);
  static_assert(size_t(kTile) * LDO <= size_t(2) * kTile * LDS, "staging must fit in S|dP");
  static_assert(tile_h % 128 == 0 && tile_s % 128 == 0 && tile_p % 128 == 0 && tile_o % 128 == 0,
                "tile regions keep 128-byte alignment");
};

// Copies rows [row0, row0+64) x columns [0, HS) of a row-major matrix with
// row stride `ld` (elements) into a (64, HSP) shared tile, zero-filling rows
// >= T and columns >= HS. VEC: src, ld and HS allow 16-byte loads.
template <int D16, bool VEC>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t ld, int row0, int T, int HS) {
  constexpr int HSP = Dims<D16>::HSP, LDH = Dims<D16>::LDH, CH = HSP / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < kTile * CH; i += kThreads) {
    const int r = i / CH, c = (i % CH) * 8;
    const int row = row0 + r;
    Pack16<bf16> p;
    if (VEC && row < T && c + 8 <= HS) {
      p = Pack16<bf16>::load(src + int64_t(row) * ld + c);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        p.v[k] = (row < T && c + k < HS) ? src[int64_t(row) * ld + c + k] : from_float<bf16>(0.0f);
    }
    p.store(dst + r * LDH + c);
  }
}

// Writes a (64, HSP) fp32 staging tile (row stride LDO), times `scale`, as
// bf16 into rows [row0, row0+64) x [0, HS) of a row-major matrix (stride ld).
template <int D16>
__device__ __forceinline__ void store_tile(bf16* dst, int64_t ld, const float* src, int row0, int T, int HS,
                                           float scale) {
  constexpr int HSP = Dims<D16>::HSP, LDO = Dims<D16>::LDO;
  for (int i = threadIdx.x; i < kTile * HSP; i += kThreads) {
    const int r = i / HSP, c = i % HSP;
    const int row = row0 + r;
    if (row < T && c < HS) dst[int64_t(row) * ld + c] = from_float<bf16>(src[r * LDO + c] * scale);
  }
}

// Carves the dynamic shared memory in declaration order.
struct Carver {
  unsigned char* p;
  template <typename T>
  __device__ T* take(size_t bytes) {
    T* r = reinterpret_cast<T*>(p);
    p += bytes;
    return r;
  }
};

// S(16 rows of warp w, 64) = X(rows) . Y^T, X and Y (64, HSP) bf16 tiles.
template <int D16>
__device__ __forceinline__ void warp_xyt(float* S, const bf16* X, const bf16* Y, int w) {
  constexpr int LDH = Dims<D16>::LDH;
#pragma unroll
  for (int j = 0; j < kTile / 16; ++j) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D16; ++kk) {
      FragA a;
      FragBT b;
      wmma::load_matrix_sync(a, X + (16 * w) * LDH + 16 * kk, LDH);
      wmma::load_matrix_sync(b, Y + (16 * j) * LDH + 16 * kk, LDH);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(S + (16 * w) * LDS + 16 * j, acc, LDS, wmma::mem_row_major);
  }
}

// The score as the softmax sees it: scaled, then soft-capped when softcap > 0
// (Gemma 2: softcap * tanh(s / softcap)); *dcap = its derivative w.r.t. the
// scaled score, 1 - tanh^2 (1 without a cap).
__device__ __forceinline__ float capped_score(float raw, float scale, float softcap, float* dcap) {
  const float s = raw * scale;
  if (softcap <= 0.0f) {
    *dcap = 1.0f;
    return s;
  }
  const float t = tanhf(s / softcap);
  *dcap = 1.0f - t * t;
  return softcap * t;
}
// Maps the runtime head size to the padded compile-time size (in 16s):
// 1, 2, 4, 6 or 8, i.e. HS <= 16, 32, 64, 96, 128. `hint` names where the
// head size comes from in the model's config.
template <typename F>
void dispatch_head_size(int HS, const char* what, const char* hint, F&& f) {
  if (HS <= 16) f(std::integral_constant<int, 1>{});
  else if (HS <= 32) f(std::integral_constant<int, 2>{});
  else if (HS <= 64) f(std::integral_constant<int, 4>{});
  else if (HS <= 96) f(std::integral_constant<int, 6>{});
  else if (HS <= kAttnMaxHeadSize) f(std::integral_constant<int, 8>{});
  else
    TR_FAIL(what, ": head size ", HS, " (", hint, ") is larger than the supported ", kAttnMaxHeadSize,
            "; use more heads");
}

template <typename Kernel>
void set_smem(Kernel k, size_t bytes) {
  TR_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}


// O(warp rows) += P(warp rows, 64) . V(64, HSP): the forward's update after
// the online-softmax step has rescaled O's rows.
template <int D16>
__device__ __forceinline__ void warp_o_plus_pv(float* sO, const bf16* sP, const bf16* sV, int w) {
  constexpr int LDH = Dims<D16>::LDH, LDO = Dims<D16>::LDO;
#pragma unroll
  for (int j = 0; j < D16; ++j) {
    FragC acc;
    wmma::load_matrix_sync(acc, sO + (16 * w) * LDO + 16 * j, LDO, wmma::mem_row_major);
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragA a;
      FragB bv;
      wmma::load_matrix_sync(a, sP + (16 * w) * LDP + 16 * kk, LDP);
      wmma::load_matrix_sync(bv, sV + (16 * kk) * LDH + 16 * j, LDH);
      wmma::mma_sync(acc, a, bv, acc);
    }
    wmma::store_matrix_sync(sO + (16 * w) * LDO + 16 * j, acc, LDO, wmma::mem_row_major);
  }
}

// dq(warp rows) += dS(warp rows, 64) . K(64, HSP), in registers.
template <int D16>
__device__ __forceinline__ void warp_dq_plus_dsk(FragC* dq, const bf16* sdS, const bf16* sK, int w) {
  constexpr int LDH = Dims<D16>::LDH;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    FragA a;
    wmma::load_matrix_sync(a, sdS + (16 * w) * LDP + 16 * kk, LDP);
#pragma unroll
    for (int j = 0; j < D16; ++j) {
      FragB bk;
      wmma::load_matrix_sync(bk, sK + (16 * kk) * LDH + 16 * j, LDH);
      wmma::mma_sync(dq[j], a, bk, dq[j]);
    }
  }
}

// dv(key rows of warp) += P^T(keys, queries) . dout(queries, HSP) and
// dk(key rows of warp) += dS^T . q, in registers.
template <int D16>
__device__ __forceinline__ void warp_dkdv_plus(FragC* dk, FragC* dv, const bf16* sP, const bf16* sdS,
                                               const bf16* sdO, const bf16* sQ, int w) {
  constexpr int LDH = Dims<D16>::LDH;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    FragAT pt, dst;
    wmma::load_matrix_sync(pt, sP + (16 * kk) * LDP + 16 * w, LDP);
    wmma::load_matrix_sync(dst, sdS + (16 * kk) * LDP + 16 * w, LDP);
#pragma unroll
    for (int j = 0; j < D16; ++j) {
      FragB bo, bq;
      wmma::load_matrix_sync(bo, sdO + (16 * kk) * LDH + 16 * j, LDH);
      wmma::mma_sync(dv[j], pt, bo, dv[j]);
      wmma::load_matrix_sync(bq, sQ + (16 * kk) * LDH + 16 * j, LDH);
      wmma::mma_sync(dk[j], dst, bq, dk[j]);
    }
  }
}

// The online-softmax step of one key tile for this lane's half row: srow
// (32 raw scores from S) is masked by visible(key column c of the half) and
// capped, the row max and sum are combined with the partner lane (lane ^ 1,
// the other half of the row), P's half row is written, O's half row
// (`ohalf` floats) rescaled, and m_i, l_i updated. A row that has seen no
// visible key keeps m_i = -inf and l_i = 0 (the max is taken as 0 so that p
// = 0 and alpha = 0, not NaN).
template <typename Visible>
__device__ __forceinline__ void online_softmax_half_row(float* srow, bf16* prow, float* orow, int ohalf,
                                                        float scale, float softcap, Visible visible, float& m_i,
                                                        float& l_i) {
  float mx = -INFINITY;
#pragma unroll 8
  for (int c = 0; c < 32; ++c) {
    float dcap;
    const float s = visible(c) ? capped_score(srow[c], scale, softcap, &dcap) : -INFINITY;
    srow[c] = s;
    mx = fmaxf(mx, s);
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  const float m_new = fmaxf(m_i, mx);
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;
  const float alpha = __expf(m_i - m_use);
  float sum = 0.0f;
#pragma unroll 8
  for (int c = 0; c < 32; ++c) {
    const float p = __expf(srow[c] - m_use);
    prow[c] = from_float<bf16>(p);
    sum += p;
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  l_i = l_i * alpha + sum;
  m_i = m_new;
  for (int c = 0; c < ohalf; ++c) orow[c] *= alpha;
}

// P (when prow is not null) and dS for this lane's half row from S and dP:
// p = exp(cap(S*scale) - lse) where visible(c), else 0; ds = p (dP - D) cap' scale.
template <typename Visible>
__device__ __forceinline__ void probs_and_dscores(const float* srow, const float* dprow, bf16* prow, bf16* dsrow,
                                                  float lse_i, float d_i, float scale, float softcap,
                                                  Visible visible) {
#pragma unroll 8
  for (int c = 0; c < 32; ++c) {
    float dcap = 1.0f;
    const float p = visible(c) ? __expf(capped_score(srow[c], scale, softcap, &dcap) - lse_i) : 0.0f;
    if (prow) prow[c] = from_float<bf16>(p);
    dsrow[c] = from_float<bf16>(p * (dprow[c] - d_i) * dcap * scale);
  }
}

}  // namespace trainrun::cuda::attn_tiles
