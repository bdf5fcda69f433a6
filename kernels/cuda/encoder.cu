// Token + position embedding, forward and deterministic backward: see encoder.cuh.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/encoder.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kSlab = 256;      // channels per block in the dwte kernel (32 lanes x 8)
constexpr int kRowGroups = 8;   // warps per block in the dwte kernel, each takes every 8th row of a segment
constexpr int kRunChunk = 128;  // sorted rows per chunk: the longest segment one block sums

// ---- kernels ---------------------------------------------------------------------

template <bool VEC>
__global__ void encoder_forward_kernel(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t N,
                                       int T, int C, const int32_t* pos) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (VEC) {
    const int C8 = C / 8;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C8; i += stride) {
      const int64_t bt = i / C8;
      const int c = int(i % C8) * 8;
      const int t = pos ? pos[bt] : int(bt % T);
      const auto e = Pack16<bf16>::load(wte + int64_t(tokens[bt]) * C + c);
      if (!wpe) {  // no position table (Llama): the lookup alone, bit for bit
        e.store(out + bt * C + c);
        continue;
      }
      const auto p = Pack16<bf16>::load(wpe + int64_t(t) * C + c);
      Pack16<bf16> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = from_float<bf16>(to_float(e.v[k]) + to_float(p.v[k]));
      o.store(out + bt * C + c);
    }
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
      const int64_t bt = i / C;
      const int c = int(i % C);
      const int t = pos ? pos[bt] : int(bt % T);
      const bf16 e = wte[int64_t(tokens[bt]) * C + c];
      out[i] = wpe ? from_float<bf16>(to_float(e) + to_float(wpe[int64_t(t) * C + c])) : e;
    }
  }
}

__global__ void iota_kernel(int32_t* v, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

// A segment is a run of equal sorted tokens cut at chunk boundaries: it
// starts at i when i is the head of a run or i % kRunChunk == 0, and ends at
// the run's end or the chunk's end, whichever is first.
__device__ __forceinline__ bool run_leaves_chunk(const int32_t* sorted_tokens, int chunk, int N, int v) {
  const int next = (chunk + 1) * kRunChunk;  // first row of the next chunk
  return next < N && sorted_tokens[next] == v;
}

// grid (N, ceil(C / kSlab)), block (32, kRowGroups). Block x = sorted index i;
// only the first index of each segment works (the test is uniform over the
// block). Row group g sums rows i+g, i+g+8, ... of the segment; the groups
// are combined in order. A whole run (it starts and ends in this chunk) is
// added to dwte[v]; a piece of a longer run goes to its partial slot.
// Rows whose token is `skip` (-1: none) are left out: the vocab-parallel
// backward maps other ranks' tokens to it and scatters straight into its
// shard. Their segments write no partial slot, and no runs-kernel block
// reads one (skip sorts last: a chunk that ends in it returns there).
__global__ void encoder_backward_wte_kernel(float* dwte, float* partial, const bf16* dout,
                                            const int32_t* sorted_tokens, const int32_t* sorted_pos, int N, int C,
                                            int skip) {
  __shared__ float red[kRowGroups][kSlab];
  const int i = blockIdx.x;
  const int v = sorted_tokens[i];
  if (v == skip) return;  // uniform over the block
  const bool run_head = i == 0 || sorted_tokens[i - 1] != v;
  const bool chunk_head = i % kRunChunk == 0;
  if (!run_head && !chunk_head) return;  // inside a segment
  const int chunk = i / kRunChunk;
  const int end = min(N, (chunk + 1) * kRunChunk);  // the segment stops at the chunk's end at the latest
  const int c0 = blockIdx.y * kSlab;
  const int tx = threadIdx.x, g = threadIdx.y;
  float acc[kSlab / 32];
#pragma unroll
  for (int j = 0; j < kSlab / 32; ++j) acc[j] = 0.0f;
  for (int r = i + g; r < end && sorted_tokens[r] == v; r += kRowGroups) {
    const bf16* row = dout + int64_t(sorted_pos[r]) * C;
#pragma unroll
    for (int j = 0; j < kSlab / 32; ++j) {
      const int c = c0 + j * 32 + tx;
      if (c < C) acc[j] += to_float(row[c]);
    }
  }
#pragma unroll
  for (int j = 0; j < kSlab / 32; ++j) red[g][j * 32 + tx] = acc[j];
  __syncthreads();
  const int t = g * 32 + tx;  // 0..255: one channel of the slab each
  const int c = c0 + t;
  if (c < C) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kRowGroups; ++k) s += red[k][t];
    if (run_head && !run_leaves_chunk(sorted_tokens, chunk, N, v)) {
      dwte[int64_t(v) * C + c] += s;  // the whole run
    } else {
      // Slot 2k: the segment that starts chunk k (a continuation, or a run
      // whose head is the chunk's first row); 2k+1: the one run that starts
      // inside chunk k and leaves it. At most one of each per chunk.
      const int slot = 2 * chunk + (chunk_head ? 0 : 1);
      partial[int64_t(slot) * C + c] = s;
    }
  }
}

// grid (chunks, ceil(C / kSlab)), block kSlab: block k finishes the run that
// starts in chunk k and leaves it (if any): dwte[v] += its partials, the
// head segment's first, then one per later chunk, in chunk order.
__global__ void encoder_backward_wte_runs_kernel(float* dwte, const float* partial, const int32_t* sorted_tokens,
                                                 int N, int C, int skip) {
  const int k = blockIdx.x;
  const int first = k * kRunChunk;
  const int lastrow = min(N, first + kRunChunk) - 1;
  const int v = sorted_tokens[lastrow];
  if (v == skip) return;  // the skipped rows' run: nothing to add
  if (!run_leaves_chunk(sorted_tokens, k, N, v)) return;  // no run crosses this chunk's end
  const bool covers_start = sorted_tokens[first] == v;
  if (covers_start && first > 0 && sorted_tokens[first - 1] == v) return;  // began in an earlier chunk
  const int c = blockIdx.y * kSlab + threadIdx.x;
  if (c >= C) return;
  float s = partial[int64_t(2 * k + (covers_start ? 0 : 1)) * C + c];
  for (int kk = k + 1; kk * kRunChunk < N && sorted_tokens[kk * kRunChunk] == v; ++kk)
    s += partial[int64_t(2 * kk) * C + c];
  dwte[int64_t(v) * C + c] += s;
}

// One thread per (t, c): dwpe[t, c] += sum over b, b in order.
__global__ void encoder_backward_wpe_kernel(float* dwpe, const bf16* dout, int B, int T, int C) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < int64_t(T) * C; i += stride) {
    float s = 0.0f;
    for (int b = 0; b < B; ++b) s += to_float(dout[int64_t(b) * T * C + i]);
    dwpe[i] += s;
  }
}

// ---- scratch layout -----------------------------------------------------------------

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

size_t cub_temp_bytes(int N) {
  size_t temp = 0;
  TR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), N, 0, 31));
  return temp;
}

int run_chunks(int N) { return (N + kRunChunk - 1) / kRunChunk; }

// Two partial rows of C floats per chunk (see encoder_backward_wte_kernel).
size_t partial_bytes(int N, int C) { return size_t(2) * run_chunks(N) * C * sizeof(float); }

}  // namespace

// ---- launchers -------------------------------------------------------------------

void encoder_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                     cudaStream_t stream, const int32_t* pos) {
  const int64_t N = int64_t(B) * T;
  if (N <= 0 || C <= 0) return;
  if (C % 8 == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe)) {
    encoder_forward_kernel<true><<<grid_for(N * C / 8, kThreads), kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C,
                                                                                                 pos);
  } else {
    encoder_forward_kernel<false><<<grid_for(N * C, kThreads), kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C,
                                                                                             pos);
  }
  TR_CUDA_LAUNCH_CHECK("encoder_forward");
}

size_t encoder_backward_scratch_bytes(int N, int C) {
  return 3 * align256(size_t(N) * 4) + align256(partial_bytes(N, C)) + align256(cub_temp_bytes(N));
}

void encoder_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream, const int32_t* pos,
                      int skip_token) {
  const int N = B * T;
  if (N <= 0 || C <= 0) return;
  TR_CHECK(scratch_bytes >= encoder_backward_scratch_bytes(N, C), "encoder_backward: scratch too small");
  // Scratch: pos_in | sorted_tokens | sorted_pos (N ints each) | partial | CUB temp.
  char* s = static_cast<char*>(scratch);
  const size_t ints = align256(size_t(N) * 4);
  int32_t* pos_in = reinterpret_cast<int32_t*>(s);
  int32_t* sorted_tokens = reinterpret_cast<int32_t*>(s + ints);
  int32_t* sorted_pos = reinterpret_cast<int32_t*>(s + 2 * ints);
  float* partial = reinterpret_cast<float*>(s + 3 * ints);
  void* temp = s + 3 * ints + align256(partial_bytes(N, C));
  size_t temp_bytes = cub_temp_bytes(N);

  iota_kernel<<<grid_for(N, kThreads), kThreads, 0, stream>>>(pos_in, N);
  TR_CUDA_LAUNCH_CHECK("encoder_backward iota");
  const int slabs = (C + kSlab - 1) / kSlab;
  // dtable[index[n]] += dout[n], deterministically: the rows sorted by index.
  auto scatter = [&](float* dtable, const int32_t* index, int skip) {
    // Stable LSD radix sort over bits [0, 31) (ids are non-negative): equal
    // ids keep their row order, so every run is summed in that order.
    TR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, index, sorted_tokens, pos_in, sorted_pos, N, 0, 31,
                                                  stream));
    // Every partial slot that the second kernel reads is written by the first
    // (a run that leaves chunk k wrote its head slot and one slot 2kk per
    // later chunk it covers), so the partials need no zeroing.
    dim3 grid(N, slabs), block(32, kRowGroups);
    encoder_backward_wte_kernel<<<grid, block, 0, stream>>>(dtable, partial, dout, sorted_tokens, sorted_pos, N, C,
                                                            skip);
    TR_CUDA_LAUNCH_CHECK("encoder_backward_wte");
    encoder_backward_wte_runs_kernel<<<dim3(run_chunks(N), slabs), kSlab, 0, stream>>>(dtable, partial, sorted_tokens,
                                                                                      N, C, skip);
    TR_CUDA_LAUNCH_CHECK("encoder_backward_wte_runs");
  };
  scatter(dwte, tokens, skip_token);
  if (!dwpe) return;  // no position table (Llama)
  if (pos) {  // document masking: many rows share a position, as tokens share a row of wte
    scatter(dwpe, pos, -1);
    return;
  }
  encoder_backward_wpe_kernel<<<grid_for(int64_t(T) * C, kThreads), kThreads, 0, stream>>>(dwpe, dout, B, T, C);
  TR_CUDA_LAUNCH_CHECK("encoder_backward_wpe");
}

}  // namespace trainrun::cuda
