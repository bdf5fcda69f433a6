// Vocab-parallel embedding and cross-entropy: see vocab_parallel.cuh.
#include "kernels/cuda/encoder.cuh"
#include "kernels/cuda/vocab_parallel.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRowThreads = 512;

__device__ __forceinline__ bool in_range(int tok, int v_begin, int v_count) {
  return tok >= v_begin && tok < v_begin + v_count;
}

__global__ void vocab_embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe,
                                               int v_begin, int v_count, int64_t N, int T, int C,
                                               const int32_t* pos) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N * C; i += stride) {
    const int64_t bt = i / C;
    const int c = int(i % C);
    const int tok = tokens[bt];
    float v = in_range(tok, v_begin, v_count) ? to_float(wte[int64_t(tok - v_begin) * C + c]) : 0.0f;
    if (wpe) v += to_float(wpe[int64_t(pos ? pos[bt] : bt % T) * C + c]);
    out[i] = from_float<bf16>(v);
  }
}

__global__ void remap_tokens_kernel(int32_t* local, const int32_t* tokens, int v_begin, int v_count, int64_t N) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < N; i += int64_t(gridDim.x) * blockDim.x) {
    const int tok = tokens[i];
    local[i] = in_range(tok, v_begin, v_count) ? tok - v_begin : v_count;
  }
}

__global__ void ce_max_kernel(float* rowmax, const bf16* logits, int V, int64_t ldv) {
  __shared__ float red[32];
  const bf16* z = logits + int64_t(blockIdx.x) * ldv;
  float m = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, to_float(z[v]));
  m = block_max(m, red);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = m;
}

__global__ void ce_sumexp_kernel(float* stats, const bf16* logits, const int32_t* targets, const float* rowmax,
                                 int v_begin, int N, int V, int64_t ldv) {
  __shared__ float red[32];
  const int n = blockIdx.x;
  const bf16* z = logits + int64_t(n) * ldv;
  const float M = rowmax[n];
  float s = 0.0f;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += __expf(to_float(z[v]) - M);
  s = block_sum(s, red);
  if (threadIdx.x == 0) {
    stats[n] = s;
    const int t = targets[n];
    stats[N + n] = in_range(t, v_begin, V) ? to_float(z[t - v_begin]) : 0.0f;
  }
}

__global__ void ce_finish_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                 const float* rowmax, const float* stats, int v_begin, int N, int V, int64_t ldv,
                                 float dloss_scale, float cap) {
  const int n = blockIdx.x;
  const int t = targets[n];
  bf16* d = dlogits ? dlogits + int64_t(n) * ldv : nullptr;
  if (t < 0) {
    if (threadIdx.x == 0) losses[n] = 0.0f;
    if (d)
      for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = from_float<bf16>(0.0f);
    return;
  }
  const float lse = rowmax[n] + logf(stats[n]);
  if (threadIdx.x == 0) losses[n] = lse - stats[N + n];
  if (!d) return;
  const bf16* z = logits + int64_t(n) * ldv;
  const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;  // 0: no cap, the factor is 1
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = to_float(z[v]), c = x * inv_cap;  // read before this thread overwrites it
    const float g = (__expf(x - lse) - (v + v_begin == t ? 1.0f : 0.0f)) * (1.0f - c * c);
    d[v] = from_float<bf16>(dloss_scale * g);
  }
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

}  // namespace

void vocab_embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int v_begin,
                             int v_count, int B, int T, int C, cudaStream_t stream, const int32_t* pos) {
  const int64_t N = int64_t(B) * T;
  if (N == 0 || C == 0) return;
  vocab_embedding_forward_kernel<<<grid_for(N * C, kThreads), kThreads, 0, stream>>>(out, tokens, wte, wpe, v_begin,
                                                                                     v_count, N, T, C, pos);
  TR_CUDA_LAUNCH_CHECK("vocab_embedding_forward");
}

// No (v_count, C) table: the scatter goes straight into dwte, skipping the
// other ranks' tokens (was: a zeroed fp32 copy of the shard plus an add,
// per micro-batch; 0.8 GB at 70B tp8).
size_t vocab_embedding_backward_scratch_bytes(int v_count, int B, int T, int C) {
  (void)v_count;
  (void)T;
  const int N = B * T;
  return align256(size_t(N) * 4) + align256(encoder_backward_scratch_bytes(N, C));
}

void vocab_embedding_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int v_begin,
                              int v_count, int B, int T, int C, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream, const int32_t* pos_ids) {
  const int N = B * T;
  TR_CHECK(scratch_bytes >= vocab_embedding_backward_scratch_bytes(v_count, B, T, C),
           "vocab_embedding_backward: scratch too small (a bug)");
  if (N <= 0 || C <= 0) return;
  char* p = static_cast<char*>(scratch);
  int32_t* local = reinterpret_cast<int32_t*>(p);  // this shard's row, or v_count: another rank's token
  p += align256(size_t(N) * 4);
  const size_t enc_bytes = encoder_backward_scratch_bytes(N, C);
  remap_tokens_kernel<<<grid_for(N, kThreads), kThreads, 0, stream>>>(local, tokens, v_begin, v_count, N);
  TR_CUDA_LAUNCH_CHECK("vocab_embedding_backward (remap)");
  // dwte += the scatter of this shard's rows, in the encoder's fixed order
  // (each row summed in sorted-row order, as before through the table:
  // the same bits); dwpe (when there is one) the full position gradient.
  encoder_backward(dwte, dwpe, dout, local, B, T, C, p, enc_bytes, stream, pos_ids, v_count);
}

void vocab_ce_max(float* rowmax, const bf16* logits, int N, int V, int64_t ldv, cudaStream_t stream) {
  if (N <= 0) return;
  ce_max_kernel<<<N, kRowThreads, 0, stream>>>(rowmax, logits, V, ldv);
  TR_CUDA_LAUNCH_CHECK("vocab_ce_max");
}

void vocab_ce_sumexp(float* stats, const bf16* logits, const int32_t* targets, const float* rowmax, int v_begin, int N,
                     int V, int64_t ldv, cudaStream_t stream) {
  if (N <= 0) return;
  ce_sumexp_kernel<<<N, kRowThreads, 0, stream>>>(stats, logits, targets, rowmax, v_begin, N, V, ldv);
  TR_CUDA_LAUNCH_CHECK("vocab_ce_sumexp");
}

void vocab_ce_finish(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, const float* rowmax,
                     const float* stats, int v_begin, int N, int V, int64_t ldv, float dloss_scale,
                     cudaStream_t stream, float cap) {
  TR_CHECK(cap >= 0.f, "vocab_ce_finish: the soft-cap ", cap, " must be >= 0 (0 = none)");
  if (N <= 0) return;
  ce_finish_kernel<<<N, kRowThreads, 0, stream>>>(losses, dlogits, logits, targets, rowmax, stats, v_begin, N, V, ldv,
                                                  dloss_scale, cap);
  TR_CUDA_LAUNCH_CHECK("vocab_ce_finish");
}

}  // namespace trainrun::cuda
