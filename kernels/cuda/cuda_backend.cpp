// The CUDA backend: memory, streams, and the dispatch of every Backend op to
// its launcher (one file per op in kernels/cuda/*.cu).
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/common/error.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/adapter_gemm.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_kv.cuh"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/dora.cuh"
#include "kernels/cuda/dropout.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/encoder.cuh"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/matmul_gelu.cuh"
#include "kernels/cuda/nf4.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/attention_block.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/row_norms.cuh"
#include "kernels/cuda/scale_rows.cuh"
#include "kernels/cuda/softmax_cross_entropy.cuh"
#include "kernels/cuda/logit_softcap.cuh"
#include "kernels/cuda/vocab_parallel.cuh"
#include "kernels/cuda/sum_squares.cuh"
#include "kernels/cuda/moe_grouped_gemm.h"
#include "kernels/cuda/qk_norm.cuh"
#include "kernels/cuda/swiglu.cuh"

namespace trainrun::cuda {

namespace {
inline bf16* H(void* p) { return static_cast<bf16*>(p); }
inline const bf16* H(const void* p) { return static_cast<const bf16*>(p); }

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}
}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
  TR_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  TR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  TR_CHECK(prop.major >= 8, "cuda:", device, ": ", prop.name, " is sm_", prop.major, prop.minor,
           "; the CUDA backend needs sm_80 or newer (A100, H100, H200); use backend: cpu");
  num_sms_ = prop.multiProcessorCount;
  bgrad_epilogue_ = env_flag("TRAINRUN_CUDA_GEMM_BGRAD");
  if (const char* v = std::getenv("TRAINRUN_CUDA_GEMM_GELU")) gelu_epilogue_ = std::strcmp(v, "0") != 0;
  TR_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  TR_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
  TR_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  if (const char* v = std::getenv("TRAINRUN_CUDA_ATTN_DKV_SPLITS"); v && *v) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    TR_CHECK(end && *end == '\0' && n >= 0 && n <= 64, "TRAINRUN_CUDA_ATTN_DKV_SPLITS=", v,
             " must be an integer in [0, 64] (0: chosen from the SM count)");
    attn_dkv_splits_ = int(n);
  }
  alloc_ = std::make_unique<DeviceAllocator>(device);
  alloc_->set_release_stream(compute_);  // every op runs there: a block's last use is in its order
  gemm_ = std::make_unique<Gemm>(device);
}

CudaBackend::~CudaBackend() {
  // Best effort; destructors must not throw (the device may be in an error state).
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != device_) cudaSetDevice(device_);
  if (compute_) cudaStreamSynchronize(compute_);
  if (comm_) cudaStreamSynchronize(comm_);
  if (copy_) cudaStreamSynchronize(copy_);
  for (PinnedSlot& s : landing_) {
    if (s.p) cudaFreeHost(s.p);
    if (s.read) cudaEventDestroy(s.read);
  }
  for (PinnedSlot& s : pinned_) {
    if (s.p) cudaFreeHost(s.p);
    if (s.read) cudaEventDestroy(s.read);
  }
  moe_gemm_.reset();  // uses gemm_ and alloc_
  gemm_.reset();
  alloc_.reset();
  if (copy_) cudaStreamDestroy(copy_);
  if (comm_) cudaStreamDestroy(comm_);
  if (compute_) cudaStreamDestroy(compute_);
}

void CudaBackend::make_current() const {
  int cur = -1;
  TR_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device_) TR_CUDA_CHECK(cudaSetDevice(device_));
}

// ---- memory --------------------------------------------------------------------------

void* CudaBackend::alloc(size_t bytes) {
  make_current();
  void* p = alloc_->allocate(bytes);
  TR_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));  // the contract: zero-initialised
  return p;
}

void CudaBackend::free(void* p) { alloc_->release(p); }

void CudaBackend::copy_to_device(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  make_current();
  cudaPointerAttributes attr{};
  bool pinned = false;
  if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
    cudaGetLastError();  // an unknown pointer is plain pageable memory: not an error to keep
  } else {
    pinned = attr.type == cudaMemoryTypeHost;
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      copy_device(dst, src, bytes);  // not host memory after all: no staging
      return;
    }
  }
  if (pinned) {
    // The DMA reads `src` later: wait, since the caller may reuse it at once.
    TR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, compute_));
    TR_CUDA_CHECK(cudaStreamSynchronize(compute_));
    return;
  }
  if (bytes > kMaxPinnedCopy) {
    // Large one-off copies (loading weights): the driver stages them and
    // may synchronise the stream first, which costs nothing here.
    TR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, compute_));
    return;
  }
  // Small, frequent copies (every micro-batch's tokens): through a pinned
  // slot, so the DMA is truly asynchronous. From pageable memory the driver
  // may first wait for the whole stream to drain (CUDA's "API
  // synchronization behavior"): a host wait in every micro-batch, during
  // which the GPU runs out of queued work.
  std::lock_guard<std::mutex> lk(pinned_mu_);
  PinnedSlot& slot = pinned_[next_pinned_];
  next_pinned_ = (next_pinned_ + 1) % kPinnedSlots;
  if (slot.read) TR_CUDA_CHECK(cudaEventSynchronize(slot.read));  // its last DMA (kPinnedSlots copies ago)
  if (slot.bytes < bytes) {
    // Grown geometrically from 1 MiB: a caller whose copies grow a little
    // each time (generate's prompt) must not pin fresh memory every call.
    const size_t want = std::max({bytes, 2 * slot.bytes, size_t(1) << 20});
    if (slot.p) TR_CUDA_CHECK(cudaFreeHost(slot.p));
    slot.p = nullptr;
    slot.bytes = 0;
    TR_CUDA_CHECK(cudaHostAlloc(&slot.p, want, cudaHostAllocDefault));
    slot.bytes = want;
  }
  if (!slot.read) TR_CUDA_CHECK(cudaEventCreateWithFlags(&slot.read, cudaEventDisableTiming));
  std::memcpy(slot.p, src, bytes);
  TR_CUDA_CHECK(cudaMemcpyAsync(dst, slot.p, bytes, cudaMemcpyHostToDevice, compute_));
  TR_CUDA_CHECK(cudaEventRecord(slot.read, compute_));
}

bool CudaBackend::pin_host(void* p, size_t bytes) {
  make_current();
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    cudaGetLastError();  // the caller falls back to pageable memory with a warning
    return false;
  }
  return true;
}

void CudaBackend::unpin_host(void* p) {
  make_current();
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

std::shared_ptr<void> CudaBackend::time_mark() {
  make_current();
  cudaEvent_t ev = nullptr;
  TR_CUDA_CHECK(cudaEventCreate(&ev));  // with timing, unlike the ordering events
  TR_CUDA_CHECK(cudaEventRecord(ev, compute_));
  // Destroyed with the last reference (cudaEventDestroy is fine on a pending event).
  return std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
}

double CudaBackend::ms_between(const std::shared_ptr<void>& from, const std::shared_ptr<void>& to) {
  make_current();
  auto a = static_cast<cudaEvent_t>(from.get()), b = static_cast<cudaEvent_t>(to.get());
  TR_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  TR_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return double(ms);
}

void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  make_current();
  TR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, compute_));
  TR_CUDA_CHECK(cudaStreamSynchronize(compute_));  // the caller reads dst next
}

void CudaBackend::copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                                      const HostChunkSink& consume) {
  if (!bytes) return;
  make_current();
  std::lock_guard<std::mutex> lk(landing_mu_);
  for (PinnedSlot& s : landing_) {
    if (s.p) continue;
    TR_CUDA_CHECK(cudaHostAlloc(&s.p, kLandingBytes, cudaHostAllocDefault));
    s.bytes = kLandingBytes;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&s.read, cudaEventDisableTiming));
  }
  // Start after `ready` only (the reduce-scatter that wrote src), not after
  // the backward the compute stream has queued since. Without one: after
  // everything enqueued on the compute stream so far.
  cudaEvent_t after = static_cast<cudaEvent_t>(ready.get());
  cudaEvent_t own = nullptr;
  if (!after) {
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&own, cudaEventDisableTiming));
    TR_CUDA_CHECK(cudaEventRecord(own, compute_));
    after = own;
  }
  const cudaError_t waited = cudaStreamWaitEvent(copy_, after, 0);
  if (own) cudaEventDestroy(own);  // released once the copy stream has passed it
  TR_CUDA_CHECK(waited);
  const size_t chunks = (bytes + kLandingBytes - 1) / kLandingBytes;
  auto issue = [&](size_t i) {
    PinnedSlot& s = landing_[i % 2];
    const size_t off = i * kLandingBytes, n = std::min(kLandingBytes, bytes - off);
    TR_CUDA_CHECK(cudaMemcpyAsync(s.p, static_cast<const char*>(src) + off, n, cudaMemcpyDeviceToHost, copy_));
    TR_CUDA_CHECK(cudaEventRecord(s.read, copy_));
  };
  issue(0);
  for (size_t i = 0; i < chunks; ++i) {
    // Chunk i+1 lands in the other buffer, whose chunk (i-1) was consumed
    // in the previous iteration, while the caller consumes chunk i.
    if (i + 1 < chunks) issue(i + 1);
    PinnedSlot& s = landing_[i % 2];
    TR_CUDA_CHECK(cudaEventSynchronize(s.read));
    const size_t off = i * kLandingBytes;
    consume(s.p, off, std::min(kLandingBytes, bytes - off));
  }
}

void CudaBackend::copy_device(void* dst, const void* src, size_t bytes) {
  if (!bytes || dst == src) return;
  make_current();
  TR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, compute_));
}

void CudaBackend::zero(void* p, size_t bytes) {
  if (!bytes) return;
  make_current();
  TR_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
}

void CudaBackend::synchronize() {
  make_current();
  TR_CUDA_CHECK(cudaStreamSynchronize(compute_));
  TR_CUDA_CHECK(cudaStreamSynchronize(comm_));
}

// ---- ops --------------------------------------------------------------------------------

void CudaBackend::cast_from_f32(void* dst, const float* src, int64_t n) {
  make_current();
  cast_f32_to_bf16(H(dst), src, n, compute_);
}

void CudaBackend::cast_to_f32(float* dst, const void* src, int64_t n) {
  make_current();
  cast_bf16_to_f32(dst, H(src), n, compute_);
}

void CudaBackend::encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T,
                                  int C, const int32_t* pos) {
  make_current();
  cuda::encoder_forward(H(out), tokens, H(wte), H(wpe), B, T, C, compute_, pos);
}

void CudaBackend::encoder_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int B, int T,
                                   int C, const int32_t* pos) {
  make_current();
  Scratch s(*alloc_, encoder_backward_scratch_bytes(B * T, C));
  cuda::encoder_backward(dwte, dwpe, H(dout), tokens, B, T, C, s.as<void>(), s.bytes(), compute_, pos);
}

void CudaBackend::vocab_embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                                          int v_begin, int v_count, int B, int T, int C, const int32_t* pos) {
  make_current();
  cuda::vocab_embedding_forward(H(out), tokens, H(wte), H(wpe), v_begin, v_count, B, T, C, compute_, pos);
}

void CudaBackend::vocab_embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                                           int v_begin, int v_count, int B, int T, int C, const int32_t* pos) {
  make_current();
  Scratch s(*alloc_, cuda::vocab_embedding_backward_scratch_bytes(v_count, B, T, C));
  cuda::vocab_embedding_backward(dwte, dwpe, H(dout), tokens, v_begin, v_count, B, T, C, s.as<void>(), s.bytes(),
                                 compute_, pos);
}

void CudaBackend::vocab_ce_max(float* rowmax, const void* logits, int N, int V, int ldv) {
  make_current();
  cuda::vocab_ce_max(rowmax, H(logits), N, V, ldv, compute_);
}

void CudaBackend::vocab_ce_sumexp(float* stats, const void* logits, const int32_t* targets, const float* rowmax,
                                  int v_begin, int N, int V, int ldv) {
  make_current();
  cuda::vocab_ce_sumexp(stats, H(logits), targets, rowmax, v_begin, N, V, ldv, compute_);
}

void CudaBackend::vocab_ce_finish(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                                  const float* rowmax, const float* stats, int v_begin, int N, int V, int ldv,
                                  float dloss_scale, float cap) {
  make_current();
  cuda::vocab_ce_finish(losses, H(dlogits), H(logits), targets, rowmax, stats, v_begin, N, V, ldv, dloss_scale,
                        compute_, cap);
}

void CudaBackend::layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const void* weight,
                                    const void* bias, int N, int C) {
  make_current();
  cuda::layernorm_forward(H(out), mean, rstd, H(inp), H(weight), H(bias), N, C, compute_);
}

void CudaBackend::residual_layernorm_forward(void* res_out, void* out, float* mean, float* rstd, const void* a,
                                             const void* b, const void* weight, const void* bias, int N, int C) {
  make_current();
  cuda::residual_layernorm_forward(H(res_out), H(out), mean, rstd, H(a), H(b), H(weight), H(bias), N, C, compute_);
}

void CudaBackend::layernorm_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                     const void* weight, const float* mean, const float* rstd, int N, int C) {
  make_current();
  Scratch s(*alloc_, layernorm_backward_scratch_bytes(N, C, num_sms_));
  cuda::layernorm_backward(H(dinp), dweight, dbias, H(dout), H(inp), H(weight), mean, rstd, N, C, s.as<float>(),
                           num_sms_, compute_);
}

void CudaBackend::matmul_forward(void* out, const void* inp, const void* weight, const void* bias, int N, int C,
                                 int OC) {
  make_current();
  cuda::matmul_forward(*gemm_, H(out), H(inp), H(weight), H(bias), N, C, OC, compute_);
}

void CudaBackend::matmul_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                  const void* weight, int N, int C, int OC) {
  make_current();
  Scratch s(*alloc_, dbias ? matmul_backward_scratch_bytes(N, OC) : 0);
  cuda::matmul_backward(*gemm_, H(dinp), dweight, dbias, H(dout), H(inp), H(weight), N, C, OC, bgrad_epilogue_,
                        s.as<float>(), compute_);
}

size_t CudaBackend::attention_saved_floats(int B, int T, int NH) const {
  return cuda::attention_saved_floats(B, T, NH);
}

void CudaBackend::attention_forward(void* out, float* saved, const void* qkv, int B, int T, int C, int NH,
                                    const int32_t* doc_start) {
  make_current();
  cuda::attention_forward(H(out), saved, H(qkv), B, T, C, NH, compute_, doc_start);
}

void CudaBackend::attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                     const float* saved, int B, int T, int C, int NH, const int32_t* doc_start) {
  make_current();
  const int splits = attention_dkv_splits(B, T, NH, attn_dkv_splits_, num_sms_);
  Scratch s(*alloc_, attention_backward_scratch_bytes(B, T, NH, NH, NH > 0 ? C / NH : 0, splits));
  cuda::attention_backward(H(dqkv), H(dout), H(qkv), H(out), saved, s.as<float>(), B, T, C, NH, compute_, doc_start,
                           splits);
}

void CudaBackend::attention_kv_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq,
                                       int C, int NH) {
  make_current();
  cuda::attention_kv_forward(H(out), H(kcache), H(vcache), H(qkv), pos, Tq, C, NH, compute_);
}

// ---- Llama ops ------------------------------------------------------------------------

void CudaBackend::rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C,
                                  float eps, float w_offset) {
  make_current();
  cuda::rmsnorm_forward(H(out), rstd, H(inp), H(weight), N, C, eps, compute_, w_offset);
}

void CudaBackend::residual_rmsnorm_forward(void* res_out, void* out, float* rstd, const void* a, const void* b,
                                           const void* weight, int N, int C, float eps, float w_offset) {
  make_current();
  cuda::residual_rmsnorm_forward(H(res_out), H(out), rstd, H(a), H(b), H(weight), N, C, eps, compute_, w_offset);
}

void CudaBackend::rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const void* weight,
                                   const float* rstd, int N, int C, float w_offset) {
  make_current();
  Scratch s(*alloc_, rmsnorm_backward_scratch_bytes(N, C, num_sms_));
  cuda::rmsnorm_backward(H(dinp), dweight, H(dout), H(inp), H(weight), rstd, N, C, s.as<float>(), num_sms_,
                         compute_, w_offset);
}

void CudaBackend::rope_forward(void* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                               const int32_t* pos) {
  make_current();
  cuda::rope_forward(H(qkv), cos_sin, B, T, NH, NKV, HS, pos0, compute_, pos);
}

void CudaBackend::rope_backward(void* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                                const int32_t* pos) {
  make_current();
  cuda::rope_backward(H(dqkv), cos_sin, B, T, NH, NKV, HS, pos0, compute_, pos);
}

// ---- attention by blocks (context parallelism) -----------------------------------------

void CudaBackend::attention_block_forward(void* out, float* lse, const AttentionBlock& a) {
  make_current();
  cuda::attention_block_forward(H(out), lse, a, compute_);
}

void CudaBackend::attention_block_backward(float* dq, float* dk, float* dv, const void* dout, const void* out,
                                           const float* lse, const AttentionBlock& a) {
  make_current();
  cuda::attention_block_backward(dq, dk, dv, H(dout), H(out), lse, a, compute_);
}

void CudaBackend::attention_block_merge(void* out, float* lse, const void* block_out, const float* block_lse,
                                        const AttentionBlock& a) {
  make_current();
  cuda::attention_block_merge(H(out), lse, H(block_out), block_lse, a, compute_);
}

void CudaBackend::copy_rows(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type,
                            int64_t src_ld, int64_t rows, int64_t cols) {
  make_current();
  cuda::copy_rows(dst, dst_type == DType::BF16, dst_ld, src, src_type == DType::BF16, src_ld, rows, cols, compute_);
}

void CudaBackend::add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                               int64_t cols) {
  make_current();
  cuda::add_rows_f32(dst, dst_ld, src, src_ld, rows, cols, compute_);
}

// ---- the adapters' ops (core/model/adapter) ------------------------------------------

void CudaBackend::gemm(void* c, int ldc, bool c_f32, const void* a, int lda, GemmOp ta, const void* b, int ldb,
                       GemmOp tb, int M, int N, int K, float alpha, float beta) {
  make_current();
  cuda::adapter_gemm(*gemm_, c, ldc, c_f32, H(a), lda, ta, H(b), ldb, tb, M, N, K, alpha, beta, compute_);
}

void CudaBackend::dropout_forward(void* out, const void* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                                  int64_t key_cols, int64_t col0) {
  make_current();
  cuda::dropout_forward(H(out), H(inp), N, C, p, seed, row0, key_cols, col0, compute_);
}

void CudaBackend::scale_rows(void* x, const float* w, int N, int V, int ldv) {
  make_current();
  cuda::scale_rows(H(x), w, N, V, ldv, compute_);
}

void CudaBackend::row_norms(float* out, const void* w, int rows, int cols) {
  make_current();
  cuda::row_norms(out, H(w), rows, cols, compute_);
}

void CudaBackend::row_sum_squares(float* out, const void* w, int rows, int cols) {
  make_current();
  cuda::row_sum_squares(out, H(w), rows, cols, compute_);
}

void CudaBackend::sqrt_in_place(float* x, int64_t n) {
  make_current();
  cuda::sqrt_in_place(x, n, compute_);
}

void CudaBackend::dora_forward(void* y, int ldy, const void* xw, const void* xba, const void* mag, const float* norm,
                               float s, int N, int out) {
  make_current();
  cuda::dora_forward(H(y), ldy, H(xw), H(xba), H(mag), norm, s, N, out, compute_);
}

void CudaBackend::dora_backward(float* dmag, void* xw, void* xba, const void* dy, int ldy, const void* mag,
                                const float* norm, float s, int N, int out) {
  make_current();
  Scratch sc(*alloc_, dora_backward_scratch_bytes(N, out));
  cuda::dora_backward(dmag, H(xw), H(xba), H(dy), ldy, H(mag), norm, s, N, out, sc.as<float>(), compute_);
}

void CudaBackend::nf4_dequantize(void* out, DType out_dtype, const uint8_t* packed, const uint8_t* qabsmax,
                                 const float* absmax2, const float* map, float offset, int64_t n) {
  make_current();
  if (out_dtype == DType::F32)
    cuda::nf4_dequantize(static_cast<float*>(out), packed, qabsmax, absmax2, map, offset, n, compute_);
  else
    cuda::nf4_dequantize(H(out), packed, qabsmax, absmax2, map, offset, n, compute_);
}

// Not yet run on a GPU (compiled only).
void CudaBackend::nf4_dequantize_blocks(void* out, DType out_dtype, const uint8_t* packed, const float* block_absmax,
                                        int64_t n) {
  make_current();
  if (out_dtype == DType::F32)
    cuda::nf4_dequantize_blocks(static_cast<float*>(out), packed, block_absmax, n, compute_);
  else
    cuda::nf4_dequantize_blocks(H(out), packed, block_absmax, n, compute_);
}

void CudaBackend::qk_norm_forward(void* qkv, void* pre, float* rstd, const void* wq, const void* wk, int N, int NH,
                                  int NKV, int HS, float eps) {
  make_current();
  cuda::qk_norm_forward(H(qkv), H(pre), rstd, H(wq), H(wk), N, NH, NKV, HS, eps, compute_);
}

void CudaBackend::qk_norm_backward(void* dqkv, float* dwq, float* dwk, const void* pre, const void* wq, const void* wk,
                                   const float* rstd, int N, int NH, int NKV, int HS) {
  make_current();
  Scratch s(*alloc_, cuda::qk_norm_backward_scratch_bytes(N, NH, NKV, HS, num_sms_));
  cuda::qk_norm_backward(H(dqkv), dwq, dwk, H(pre), H(wq), H(wk), rstd, N, NH, NKV, HS, s.as<float>(), num_sms_,
                         compute_);
}

void CudaBackend::swiglu_forward(void* out, const void* inp, int N, int F) {
  make_current();
  cuda::swiglu_forward(H(out), H(inp), N, F, compute_);
}

void CudaBackend::swiglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) {
  make_current();
  cuda::swiglu_backward(H(dinp), H(dout), H(inp), N, F, compute_);
}

void CudaBackend::geglu_forward(void* out, const void* inp, int N, int F) {
  make_current();
  cuda::geglu_forward(H(out), H(inp), N, F, compute_);
}

void CudaBackend::geglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) {
  make_current();
  cuda::geglu_backward(H(dinp), H(dout), H(inp), N, F, compute_);
}

void CudaBackend::logit_softcap_forward(void* logits, int N, int V, int ldv, float cap) {
  make_current();
  cuda::logit_softcap_forward(H(logits), N, V, ldv, cap, compute_);
}

void CudaBackend::scale_act(void* x, float s, int64_t n) {
  make_current();
  cuda::scale_bf16(H(x), s, n, compute_);
}

size_t CudaBackend::attention_gqa_saved_floats(int B, int T, int NH) const {
  return cuda::attention_saved_floats(B, T, NH);  // the log-sum-exp, (B,NH,T)
}

void CudaBackend::attention_gqa_forward(void* out, float* saved, const void* qkv, int B, int T, int NH, int NKV,
                                        int HS, const int32_t* doc_start, const AttentionOptions& opt) {
  make_current();
  cuda::attention_gqa_forward(H(out), saved, H(qkv), B, T, NH, NKV, HS, compute_, doc_start, opt);
}

void CudaBackend::attention_gqa_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                         const float* saved, int B, int T, int NH, int NKV, int HS,
                                         const int32_t* doc_start, const AttentionOptions& opt) {
  make_current();
  const int splits = attention_dkv_splits(B, T, NKV, attn_dkv_splits_, num_sms_);
  Scratch s(*alloc_, attention_backward_scratch_bytes(B, T, NH, NKV, HS, splits));
  cuda::attention_gqa_backward(H(dqkv), H(dout), H(qkv), H(out), saved, s.as<float>(), B, T, NH, NKV, HS, compute_,
                               doc_start, splits, opt);
}

void CudaBackend::attention_kv_gqa_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq,
                                           int NH, int NKV, int HS, const AttentionOptions& opt) {
  make_current();
  cuda::attention_kv_gqa_forward(H(out), H(kcache), H(vcache), H(qkv), pos, Tq, NH, NKV, HS, compute_, opt);
}

void CudaBackend::gelu_forward(void* out, const void* inp, int64_t n) {
  make_current();
  cuda::gelu_forward(H(out), H(inp), n, compute_);
}

void CudaBackend::gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n) {
  make_current();
  cuda::gelu_backward(H(dinp), H(inp), H(dout), n, compute_);
}

void CudaBackend::residual_forward(void* out, const void* a, const void* b, int64_t n) {
  make_current();
  cuda::residual_forward(H(out), H(a), H(b), n, compute_);
}

void CudaBackend::matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias,
                                      int N, int C, int OC) {
  make_current();
  if (gelu_epilogue_ && cuda::matmul_gelu_forward(*gemm_, H(out), H(pre), H(inp), H(weight), H(bias), N, C, OC, compute_))
    return;
  // No fused algorithm for this shape/alignment (or turned off): two ops.
  cuda::matmul_forward(*gemm_, H(pre), H(inp), H(weight), H(bias), N, C, OC, compute_);
  cuda::gelu_forward(H(out), H(pre), int64_t(N) * OC, compute_);
}

void CudaBackend::matmul_backward_dgelu(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                        const void* weight, const void* pre, int N, int C, int OC) {
  make_current();
  Scratch s(*alloc_, dbias ? matmul_backward_scratch_bytes(N, OC) : 0);
  if (gelu_epilogue_ && cuda::matmul_dinp_dgelu(*gemm_, H(dinp), H(dout), H(weight), H(pre), N, C, OC, compute_)) {
    // dinp done (with GELU's backward in the epilogue): only the parameter grads remain.
    cuda::matmul_backward(*gemm_, nullptr, dweight, dbias, H(dout), H(inp), H(weight), N, C, OC, bgrad_epilogue_,
                          s.as<float>(), compute_);
    return;
  }
  cuda::matmul_backward(*gemm_, H(dinp), dweight, dbias, H(dout), H(inp), H(weight), N, C, OC, bgrad_epilogue_,
                        s.as<float>(), compute_);
  cuda::gelu_backward(H(dinp), H(pre), H(dinp), int64_t(N) * C, compute_);
}

void CudaBackend::lm_head_forward(void* logits, const void* inp, const void* wte, int N, int C, int V, int ldv) {
  make_current();
  cuda::matmul_forward(*gemm_, H(logits), H(inp), H(wte), nullptr, N, C, V, compute_, ldv);
}

void CudaBackend::lm_head_backward(void* dinp, float* dwte, const void* dlogits, const void* inp, const void* wte,
                                   int N, int C, int V, int ldv) {
  make_current();
  cuda::matmul_backward(*gemm_, H(dinp), dwte, nullptr, H(dlogits), H(inp), H(wte), N, C, V, false, nullptr, compute_,
                        ldv);
}

void CudaBackend::softmax_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                                        int N, int V, int ldv, float dloss_scale, float cap) {
  make_current();
  cuda::softmax_cross_entropy(losses, H(dlogits), H(logits), targets, N, V, ldv, dloss_scale, compute_, cap);
}

void CudaBackend::sum_squares(float* out, const float* x, int64_t n) {
  make_current();
  Scratch s(*alloc_, sum_squares_scratch_bytes(n));
  cuda::sum_squares(out, x, n, s.as<float>(), compute_);
}

void CudaBackend::sum(float* out, const float* x, int64_t n) {
  make_current();
  Scratch s(*alloc_, sum_squares_scratch_bytes(n));
  cuda::sum(out, x, n, s.as<float>(), compute_);
}

void CudaBackend::scale(float* x, float s, int64_t n) {
  make_current();
  scale_f32(x, s, n, compute_);
}

void CudaBackend::accumulate(float* dst, const float* src, int64_t n) {
  make_current();
  accumulate_f32(dst, src, n, compute_);
}

void CudaBackend::adamw_update(float* master, void* param, const float* grad, float* m, float* v, int64_t n,
                               float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                               float grad_scale) {
  make_current();
  AdamWArgs a;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  // In double, as the CPU backend: 1 - beta2^t loses digits in float at small t.
  a.bc1 = static_cast<float>(1.0 - std::pow(double(beta1), step));
  a.bc2 = static_cast<float>(1.0 - std::pow(double(beta2), step));
  a.grad_scale = grad_scale;
  cuda::adamw_update(master, H(param), grad, m, v, n, a, compute_);
}

}  // namespace trainrun::cuda
