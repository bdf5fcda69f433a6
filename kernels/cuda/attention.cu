// Flash-style causal attention, forward and backward: see attention.cuh.
// The tile layout, the WMMA products and the per-tile softmax steps are
// attention_tiles.cuh's (shared with context parallelism's block kernels).
#include <mma.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_tiles.cuh"

namespace trainrun::cuda {

namespace {

using namespace attn_tiles;  // the tiles, WMMA products and head-size dispatch shared with attention_block.cu

// The qkv layout (attention.cuh): row stride and the first column of key
// head g and of value head g. With NKV == NH they are 3C, C + g*HS and
// 2C + g*HS, multi-head attention's.
__device__ __forceinline__ int64_t qkv_row_stride(int NH, int NKV, int HS) { return int64_t(NH + 2 * NKV) * HS; }
__device__ __forceinline__ int k_col(int NH, int HS, int g) { return (NH + g) * HS; }
__device__ __forceinline__ int v_col(int NH, int NKV, int HS, int g) { return (NH + NKV + g) * HS; }

// ---- forward --------------------------------------------------------------------------

// Document masking (doc_start (B,T) or null; kernels/backend.h): the first
// key row qi may see. Rows past T (a partial last tile) take row T-1's.
__device__ __forceinline__ int row_doc_start(const int32_t* doc_start, int b, int T, int qi) {
  return doc_start ? doc_start[int64_t(b) * T + min(qi, T - 1)] : 0;
}
// The first key query row qi sees: its document's start and, with a sliding
// window W > 0 (AttentionOptions::window), qi - W + 1 (keys qi - W < j <= qi).
// Never decreasing in qi, so a tile's first row gives the tile's first key.
__device__ __forceinline__ int row_first_key(const int32_t* doc_start, int b, int T, int qi, int window) {
  const int f = row_doc_start(doc_start, b, T, qi);
  return window > 0 ? max(f, qi - window + 1) : f;
}
// The first query t >= j1 whose document starts at or after key j1 (T when
// none): the queries [j1 - 64, that) are all that see keys [j1 - 64, j1).
// doc_start never decreases, so a binary search.
__device__ __forceinline__ int doc_queries_end(const int32_t* doc_start, int b, int T, int j1) {
  if (!doc_start) return T;
  const int32_t* ds = doc_start + int64_t(b) * T;
  int lo = j1, hi = T;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ds[mid] < j1) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

template <int D16, bool VEC>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T,
                                                                     int NH, int NKV, int HS, float scale,
                                                                     const int32_t* doc_start, int window,
                                                                     float softcap) {
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

  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z;
  const int g = h / (NH / NKV);  // its key/value head
  const int q0 = qt * kTile;
  const int C = NH * HS;  // out's row stride
  const int64_t ld = qkv_row_stride(NH, NKV, HS);
  const bf16* base = qkv + int64_t(b) * T * ld;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;
  const int qi = q0 + r;
  const int ds_i = row_first_key(doc_start, b, T, qi, window);

  load_tile<D16, VEC>(sQ, base + h * HS, ld, q0, T, HS);
  for (int i = threadIdx.x; i < kTile * LDO; i += kThreads) sO[i] = 0.0f;
  float m_i = -INFINITY, l_i = 0.0f;

  // Key tiles before the tile's first visible key (its first document's
  // start, the window's left edge) are skipped whole; the edge tile is masked.
  for (int kt = row_first_key(doc_start, b, T, q0, window) / kTile; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // everyone is done with the previous K/V tiles
    load_tile<D16, VEC>(sK, base + k_col(NH, HS, g), ld, k0, T, HS);
    load_tile<D16, VEC>(sV, base + v_col(NH, NKV, HS, g), ld, k0, T, HS);
    __syncthreads();
    warp_xyt<D16>(sS, sQ, sK, w);
    __syncwarp();
    // Online softmax on this lane's half row. Without documents or a window
    // every row sees key 0, so m_i is finite after the first tile; with them
    // a row sees nothing in the tiles before its first key (m_i stays -inf).
    const int kb = k0 + 32 * half;
    online_softmax_half_row(
        sS + r * LDS + 32 * half, sP + r * LDP + 32 * half, sO + r * LDO + (HSP / 2) * half, HSP / 2, scale,
        softcap, [&](int c) { return kb + c <= qi && kb + c >= ds_i; }, m_i, l_i);
    __syncwarp();
    warp_o_plus_pv<D16>(sO, sP, sV, w);
    __syncwarp();
  }
  // Normalise this lane's half row, then store the tile cooperatively.
  const float inv = 1.0f / l_i;
  float* orow = sO + r * LDO + (HSP / 2) * half;
  for (int c = 0; c < HSP / 2; ++c) orow[c] *= inv;
  if (half == 0 && qi < T) lse[(int64_t(b) * NH + h) * T + qi] = m_i + logf(l_i);
  __syncthreads();
  store_tile<D16>(out + int64_t(b) * T * C + h * HS, C, sO, q0, T, HS, 1.0f);
}

// ---- backward ---------------------------------------------------------------------------

// D[b,h,t] = sum_c dout[b,t,h*HS+c] * out[b,t,h*HS+c]; one warp per (b,t,h).
__global__ void attention_backward_d_kernel(float* Dv, const bf16* dout, const bf16* out, int B, int T, int C, int NH,
                                            int HS) {
  const int lane = threadIdx.x & 31;
  const int64_t nrows = int64_t(B) * T * NH;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t i = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); i < nrows; i += warps) {
    const int h = int(i % NH);
    const int64_t bt = i / NH;
    const int b = int(bt / T), t = int(bt % T);
    const int64_t off = bt * C + int64_t(h) * HS;
    float acc = 0.0f;
    for (int c = lane; c < HS; c += 32) acc += to_float(dout[off + c]) * to_float(out[off + c]);
    acc = warp_sum(acc);
    if (lane == 0) Dv[(int64_t(b) * NH + h) * T + t] = acc;
  }
}

// P and dS (attention_tiles.cuh's probs_and_dscores) see keys [ds_i, qi] of
// rows qi < T: the document's and the window's first key, the diagonal.
// dq for one query tile: loops over key tiles 0..qt. dq accumulates in
// registers (D16 fragments per warp).
template <int D16, bool VEC>
__global__ void __launch_bounds__(kThreads) attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                                         const float* lse, const float* Dv, int T,
                                                                         int NH, int NKV, int HS, float scale,
                                                                         const int32_t* doc_start, int window,
                                                                         float softcap) {
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

  const int qt = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int g = h / (NH / NKV);
  const int q0 = qt * kTile;
  const int C = NH * HS;  // dout's row stride
  const int64_t ld = qkv_row_stride(NH, NKV, HS);
  const bf16* base = qkv + int64_t(b) * T * ld;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;
  const int qi = q0 + r;
  const int ds_i = row_first_key(doc_start, b, T, qi, window);
  const int64_t stat = (int64_t(b) * NH + h) * T;

  load_tile<D16, VEC>(sQ, base + h * HS, ld, q0, T, HS);
  load_tile<D16, VEC>(sdO, dout + int64_t(b) * T * C + h * HS, C, q0, T, HS);
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    sL[i] = q0 + i < T ? lse[stat + q0 + i] : 0.0f;
    sD[i] = q0 + i < T ? Dv[stat + q0 + i] : 0.0f;
  }
  FragC dq[D16];
#pragma unroll
  for (int j = 0; j < D16; ++j) wmma::fill_fragment(dq[j], 0.0f);

  for (int kt = row_first_key(doc_start, b, T, q0, window) / kTile; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();
    load_tile<D16, VEC>(sK, base + k_col(NH, HS, g), ld, k0, T, HS);
    load_tile<D16, VEC>(sV, base + v_col(NH, NKV, HS, g), ld, k0, T, HS);
    __syncthreads();
    warp_xyt<D16>(sS, sQ, sK, w);    // S = q k^T
    warp_xyt<D16>(sdP, sdO, sV, w);  // dP = dout v^T
    __syncwarp();
    const int kb = k0 + 32 * half;
    probs_and_dscores(sS + r * LDS + 32 * half, sdP + r * LDS + 32 * half, nullptr, sdS + r * LDP + 32 * half, sL[r],
                      sD[r], scale, softcap, [&](int c) { return qi < T && kb + c <= qi && kb + c >= ds_i; });
    __syncwarp();
    warp_dq_plus_dsk<D16>(dq, sdS, sK, w);
  }
  __syncthreads();  // S|dP becomes the staging tile
  float* stage = sS;
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, dq[j], LDO, wmma::mem_row_major);
  __syncthreads();
  store_tile<D16>(dqkv + int64_t(b) * T * ld + h * HS, ld, stage, q0, T, HS, 1.0f);
}

// dk, dv for one key tile of key/value head g: loops over the group's R =
// NH / NKV query heads in order, and for each over the query tiles
// kt..last. The accumulators for the warp's 16 key rows live in registers
// across all of it, so the sum over the group runs in a fixed order with no
// atomics. GROUPED = false fixes R = 1 at compile time (multi-head
// attention: the loop over query tiles alone, as before grouped-query
// attention, and its register allocation).
// With S > 1 splits (attention.cuh) the grid's x is key tiles x S: block
// (kt, s) takes the s-th of S equal runs of that (head, query tile) list
// and writes its fp32 sums to `partial` (B, NKV, key tiles, S, 2, 64, HSP);
// attention_dkdv_reduce_kernel adds the S runs in order. S = 1 is the
// whole list in one block, written to dqkv as before (the same bits).
template <int D16, bool VEC, bool GROUPED>
__global__ void __launch_bounds__(kThreads) attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout,
                                                                           const bf16* qkv, const float* lse,
                                                                           const float* Dv, int T, int NH, int NKV,
                                                                           int HS, float scale,
                                                                           const int32_t* doc_start, int window,
                                                                           float softcap, float* partial, int S) {
  using D = Dims<D16>;
  constexpr int HSP = D::HSP, LDO = D::LDO;
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

  const int kt = blockIdx.x / S, split = blockIdx.x % S;  // key tile; the first ones have the most work
  const int g = blockIdx.y, b = blockIdx.z;
  // The query tiles that see a key of this tile: kt up to the one holding
  // the last query of the document of the tile's last key, and with a
  // window W the last query that still reaches it (key j1 - 1 + W - 1).
  const int j1 = min(T, (kt + 1) * kTile);
  int q_end = doc_queries_end(doc_start, b, T, j1);
  if (window > 0 && int64_t(j1) + window - 1 < q_end) q_end = j1 + window - 1;
  const int ntiles = (q_end + kTile - 1) / kTile;
  const int R = GROUPED ? NH / NKV : 1;
  const int k0 = kt * kTile;
  const int C = NH * HS;  // dout's row stride
  const int64_t ld = qkv_row_stride(NH, NKV, HS);
  const bf16* base = qkv + int64_t(b) * T * ld;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * w + (lane >> 1), half = lane & 1;

  load_tile<D16, VEC>(sK, base + k_col(NH, HS, g), ld, k0, T, HS);
  load_tile<D16, VEC>(sV, base + v_col(NH, NKV, HS, g), ld, k0, T, HS);
  FragC dk[D16], dv[D16];
#pragma unroll
  for (int j = 0; j < D16; ++j) {
    wmma::fill_fragment(dk[j], 0.0f);
    wmma::fill_fragment(dv[j], 0.0f);
  }

  // One pass over the (query head, query tile) pairs: the group's heads
  // h = g*R .. g*R+R-1 in order, for each the query tiles kt..last: the
  // fixed summation order of dk and dv. This block's run of that list:
  // pairs [p0, p1) of R * (ntiles - kt) (all of it when S = 1).
  const int per_head = ntiles - kt;
  const int64_t pairs = int64_t(R) * per_head;
  const int64_t p0 = pairs * split / S, p1 = pairs * (split + 1) / S;
  for (int64_t pi = p0; pi < p1; ++pi) {
    const int h = g * R + int(pi / per_head), qt = kt + int(pi % per_head);
    const int64_t stat = (int64_t(b) * NH + h) * T;
    const int q0 = qt * kTile;
    const int qi = q0 + r;
    const int ds_i = row_first_key(doc_start, b, T, qi, window);
    __syncthreads();  // everyone is done with the previous Q/dO/P/dS tiles
    load_tile<D16, VEC>(sQ, base + h * HS, ld, q0, T, HS);
    load_tile<D16, VEC>(sdO, dout + int64_t(b) * T * C + h * HS, C, q0, T, HS);
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      sL[i] = q0 + i < T ? lse[stat + q0 + i] : 0.0f;
      sD[i] = q0 + i < T ? Dv[stat + q0 + i] : 0.0f;
    }
    __syncthreads();
    warp_xyt<D16>(sS, sQ, sK, w);    // S(q rows of warp, keys)
    warp_xyt<D16>(sdP, sdO, sV, w);  // dP
    __syncwarp();
    const int kb = k0 + 32 * half;
    probs_and_dscores(sS + r * LDS + 32 * half, sdP + r * LDS + 32 * half, sP + r * LDP + 32 * half,
                      sdS + r * LDP + 32 * half, sL[r], sD[r], scale, softcap,
                      [&](int c) { return qi < T && kb + c <= qi && kb + c >= ds_i; });
    __syncthreads();  // dv/dk of the warp's key rows read every query row of P and dS
    warp_dkdv_plus<D16>(dk, dv, sP, sdS, sdO, sQ, w);
  }
  if (S > 1) {
    // This run's sums, fp32, for the reduce kernel: no staging needed, each
    // warp stores its own 16 key rows.
    const int key_tiles = gridDim.x / S;
    float* part = partial + ((int64_t(b) * gridDim.y + g) * key_tiles + kt) * S * 2 * kTile * HSP +
                  int64_t(split) * 2 * kTile * HSP;
#pragma unroll
    for (int j = 0; j < D16; ++j) {
      wmma::store_matrix_sync(part + (16 * w) * HSP + 16 * j, dk[j], HSP, wmma::mem_row_major);
      wmma::store_matrix_sync(part + kTile * HSP + (16 * w) * HSP + 16 * j, dv[j], HSP, wmma::mem_row_major);
    }
    return;
  }
  __syncthreads();
  float* stage = sS;
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, dk[j], LDO, wmma::mem_row_major);
  __syncthreads();
  store_tile<D16>(dqkv + int64_t(b) * T * ld + k_col(NH, HS, g), ld, stage, k0, T, HS, 1.0f);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < D16; ++j)
    wmma::store_matrix_sync(stage + (16 * w) * LDO + 16 * j, dv[j], LDO, wmma::mem_row_major);
  __syncthreads();
  store_tile<D16>(dqkv + int64_t(b) * T * ld + v_col(NH, NKV, HS, g), ld, stage, k0, T, HS, 1.0f);
}

// dk, dv of key row t = the sum of the S runs' partials (S > 1), in order
// s = 0..S-1 (a fixed order: the same bits every run), rounded once to
// bf16 into dqkv. One thread per (b, g, t, dk|dv, column), columns
// innermost so that the loads and stores coalesce.
__global__ void attention_dkdv_reduce_kernel(bf16* dqkv, const float* partial, int B, int T, int NH, int NKV, int HS,
                                             int HSP, int S, int key_tiles) {
  const int64_t total = int64_t(B) * NKV * T * 2 * HS;
  const int64_t ld = qkv_row_stride(NH, NKV, HS);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % HS);
    int64_t rest = i / HS;
    const int which = int(rest % 2);  // 0 dk, 1 dv
    rest /= 2;
    const int t = int(rest % T);
    rest /= T;
    const int g = int(rest % NKV);
    const int b = int(rest / NKV);
    const int kt = t / kTile, r = t % kTile;
    const float* p = partial + ((int64_t(b) * NKV + g) * key_tiles + kt) * S * 2 * kTile * HSP +
                     (int64_t(which) * kTile + r) * HSP + c;
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) acc += p[int64_t(s) * 2 * kTile * HSP];
    const int col = which == 0 ? k_col(NH, HS, g) : v_col(NH, NKV, HS, g);
    dqkv[(int64_t(b) * T + t) * ld + col + c] = from_float<bf16>(acc);
  }
}

// ---- dispatch ---------------------------------------------------------------------------

// The padded head size of dispatch_head_size's instances (16, 32, 64, 96, 128).
int padded_head_size(int HS) { return HS <= 16 ? 16 : HS <= 32 ? 32 : HS <= 64 ? 64 : HS <= 96 ? 96 : 128; }
// Where the dk/dv partials start in the backward's scratch (after D),
// 256-byte aligned for WMMA's stores.
size_t partial_offset_floats(int B, int T, int NH) { return (size_t(B) * NH * T + 63) / 64 * 64; }

// The grid's y (heads) and z (batch) limits.
void check_grid(const char* what, int B, int NH) {
  TR_CHECK(NH <= 65535 && B <= 65535, what, ": NH=", NH, " and B=", B, " must be at most 65535 (the grid's limits)");
}

// Both entry points (multi-head with NKV = NH, grouped-query) run these, so
// the two agree bit for bit when NKV == NH.
// The scores' scale: AttentionOptions::scale, else 1/sqrt(HS); the options checked.
float options_scale(const char* what, int HS, const AttentionOptions& opt) {
  TR_CHECK(opt.window >= 0 && opt.softcap >= 0.f && opt.scale >= 0.f, what, ": window ", opt.window, ", softcap ",
           opt.softcap, " and scale ", opt.scale, " must be >= 0 (0: none / 1/sqrt(head size))");
  return opt.scale > 0.f ? opt.scale : 1.0f / sqrtf(float(HS));
}

void forward_impl(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HS, const char* what,
                  const char* hint, const int32_t* doc_start, const AttentionOptions& opt, cudaStream_t stream) {
  check_grid(what, B, NH);
  const float scale = options_scale(what, HS, opt);
  // HS % 8 == 0 makes the row stride and every head's first column multiples of 8.
  const bool vec = aligned16(qkv) && HS % 8 == 0;
  dim3 grid((T + kTile - 1) / kTile, NH, B);
  dispatch_head_size(HS, what, hint, [&](auto d16) {
    constexpr int D16 = decltype(d16)::value;
    const size_t smem = Dims<D16>::fwd_smem;
    if (vec) {
      set_smem(attention_forward_kernel<D16, true>, smem);
      attention_forward_kernel<D16, true>
          <<<grid, kThreads, smem, stream>>>(out, lse, qkv, T, NH, NKV, HS, scale, doc_start, opt.window, opt.softcap);
    } else {
      set_smem(attention_forward_kernel<D16, false>, smem);
      attention_forward_kernel<D16, false>
          <<<grid, kThreads, smem, stream>>>(out, lse, qkv, T, NH, NKV, HS, scale, doc_start, opt.window, opt.softcap);
    }
  });
  TR_CUDA_LAUNCH_CHECK("attention_forward_kernel");
}

void backward_impl(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, float* scratch,
                   int B, int T, int NH, int NKV, int HS, const char* what, const char* hint, const int32_t* doc_start,
                   const AttentionOptions& opt, int S, cudaStream_t stream) {
  check_grid(what, B, NH);
  TR_CHECK(S >= 1 && S <= 64, what, ": dk/dv splits ", S, " must be in [1, 64]");
  const float scale = options_scale(what, HS, opt);
  float* Dv = scratch;
  const int C = NH * HS;
  const int64_t rows = int64_t(B) * T * NH;
  attention_backward_d_kernel<<<grid_for(rows, 8, 8192), 256, 0, stream>>>(Dv, dout, out, B, T, C, NH, HS);
  TR_CUDA_LAUNCH_CHECK("attention_backward_d_kernel");
  const bool vec = aligned16(qkv) && aligned16(dout) && HS % 8 == 0;
  const int ntiles = (T + kTile - 1) / kTile;
  TR_CHECK(int64_t(ntiles) * S <= 0x7fffffff, what, ": T=", T, " with ", S, " dk/dv splits exceeds the grid");
  // dk, dv: one block per key/value head and split of the key tile's queries.
  const dim3 grid_dq(ntiles, NH, B), grid_dkv(unsigned(ntiles * S), NKV, B);
  float* partial = S > 1 ? scratch + partial_offset_floats(B, T, NH) : nullptr;
  // NKV < NH: the dk/dv kernel's group loop; NKV == NH (multi-head): its
  // instance with R = 1 fixed at compile time, which allocates registers as
  // the kernel did before grouped-query attention (168 on sm_90 at HS 128;
  // the grouped instance needs more).
  const bool grouped = NKV != NH;
  dispatch_head_size(HS, what, hint, [&](auto d16) {
    constexpr int D16 = decltype(d16)::value;
    const size_t s_dq = Dims<D16>::dq_smem, s_dkv = Dims<D16>::dkv_smem;
    auto launch = [&](auto vec_c, auto grouped_c) {
      constexpr bool V = decltype(vec_c)::value, G = decltype(grouped_c)::value;
      set_smem(attention_backward_dkdv_kernel<D16, V, G>, s_dkv);
      attention_backward_dkdv_kernel<D16, V, G>
          <<<grid_dkv, kThreads, s_dkv, stream>>>(dqkv, dout, qkv, lse, Dv, T, NH, NKV, HS, scale, doc_start,
                                                  opt.window, opt.softcap, partial, S);
      TR_CUDA_LAUNCH_CHECK("attention_backward_dkdv_kernel");
      if (S > 1) {
        const int64_t n = int64_t(B) * NKV * T * 2 * HS;
        attention_dkdv_reduce_kernel<<<grid_for(n, 256, 8192), 256, 0, stream>>>(dqkv, partial, B, T, NH, NKV, HS,
                                                                                 Dims<D16>::HSP, S, ntiles);
        TR_CUDA_LAUNCH_CHECK("attention_dkdv_reduce_kernel");
      }
      set_smem(attention_backward_dq_kernel<D16, V>, s_dq);
      attention_backward_dq_kernel<D16, V>
          <<<grid_dq, kThreads, s_dq, stream>>>(dqkv, dout, qkv, lse, Dv, T, NH, NKV, HS, scale, doc_start,
                                                opt.window, opt.softcap);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (vec) {
      grouped ? launch(Yes{}, Yes{}) : launch(Yes{}, No{});
    } else {
      grouped ? launch(No{}, Yes{}) : launch(No{}, No{});
    }
  });
  TR_CUDA_LAUNCH_CHECK("attention_backward_dq_kernel");
}

constexpr const char* kMhaHint = "n_embd / n_head";
constexpr const char* kGqaHint = "head_dim";

void check_gqa_heads(const char* what, int NH, int NKV, int HS) {
  TR_CHECK(NH > 0 && NKV > 0 && HS > 0, what, ": NH ", NH, ", NKV ", NKV, " and HS ", HS, " must be positive");
  TR_CHECK(NH % NKV == 0, what, ": num_key_value_heads ", NKV, " must divide num_attention_heads ", NH);
}

}  // namespace

size_t attention_saved_floats(int B, int T, int NH) { return size_t(B) * NH * T; }

int attention_dkv_splits(int B, int T, int NKV, int requested, int num_sms) {
  if (requested > 0) return requested;
  const int64_t ntiles = (int64_t(T) + kTile - 1) / kTile;
  const int64_t blocks = ntiles * NKV * B, want = 2 * int64_t(std::max(num_sms, 1));
  if (blocks <= 0 || blocks >= want) return 1;
  return int(std::max<int64_t>(1, std::min<int64_t>({8, (want + blocks - 1) / blocks, ntiles})));
}

size_t attention_backward_scratch_bytes(int B, int T, int NH, int NKV, int HS, int dkv_splits) {
  size_t floats = size_t(B) * NH * T;
  if (dkv_splits > 1) {
    const size_t ntiles = (size_t(T) + kTile - 1) / kTile;
    floats = partial_offset_floats(B, T, NH) +
             size_t(B) * NKV * ntiles * size_t(dkv_splits) * 2 * kTile * size_t(padded_head_size(HS));
  }
  return floats * sizeof(float);
}

void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, cudaStream_t stream,
                       const int32_t* doc_start) {
  if (B <= 0 || T <= 0) return;
  TR_CHECK(NH > 0 && C % NH == 0, "attention_forward: C=", C, " is not divisible by NH=", NH);
  forward_impl(out, lse, qkv, B, T, NH, NH, C / NH, "attention_forward", kMhaHint, doc_start, {}, stream);
}

void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        float* scratch, int B, int T, int C, int NH, cudaStream_t stream, const int32_t* doc_start,
                        int dkv_splits) {
  if (B <= 0 || T <= 0) return;
  TR_CHECK(NH > 0 && C % NH == 0, "attention_backward: C=", C, " is not divisible by NH=", NH);
  backward_impl(dqkv, dout, qkv, out, lse, scratch, B, T, NH, NH, C / NH, "attention_backward", kMhaHint, doc_start,
                {}, dkv_splits, stream);
}

void attention_gqa_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HS,
                           cudaStream_t stream, const int32_t* doc_start, const AttentionOptions& opt) {
  check_gqa_heads("attention_gqa_forward", NH, NKV, HS);
  if (B <= 0 || T <= 0) return;
  forward_impl(out, lse, qkv, B, T, NH, NKV, HS, "attention_gqa_forward", kGqaHint, doc_start, opt, stream);
}

void attention_gqa_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                            float* scratch, int B, int T, int NH, int NKV, int HS, cudaStream_t stream,
                            const int32_t* doc_start, int dkv_splits, const AttentionOptions& opt) {
  check_gqa_heads("attention_gqa_backward", NH, NKV, HS);
  if (B <= 0 || T <= 0) return;
  backward_impl(dqkv, dout, qkv, out, lse, scratch, B, T, NH, NKV, HS, "attention_gqa_backward", kGqaHint, doc_start,
                opt, dkv_splits, stream);
}

}  // namespace trainrun::cuda
