// The CUDA backend: bf16 parameters and activations, fp32 master weights,
// moments, gradients, LayerNorm/RMSNorm statistics, the RoPE table and
// losses (kernels/backend.h).
//
// Streams: every op is enqueued on the compute stream; the NCCL
// communicator runs collectives on the comm stream, which waits on an event
// recorded on the compute stream (never a host sync in the step). Both are
// non-blocking streams (no implicit sync with the legacy default stream).
//
// Host-visible synchronisation happens only where the interface demands it:
// copy_to_host (the caller reads the bytes next), synchronize(), the
// first alloc() after a failed cudaMalloc (see DeviceAllocator), and the
// experts' grouped GEMM, which reads the E+1 expert offsets back because
// cuBLAS takes the group shapes on the host (one wait per call, not per
// expert: moe_grouped_gemm.h).
//
// Threads: the sharding layer calls accumulate/alloc/synchronize from its
// communication thread; every entry point first makes this backend's device
// current on the calling thread, and the shared state (allocator, GEMM plan
// cache, attention bookkeeping) is locked.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include "kernels/backend.h"
#include "kernels/cuda/device_allocator.h"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

class MoeGroupedGemm;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  DType act_dtype() const override { return DType::BF16; }

  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy_to_device(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_device(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override;
  size_t bytes_in_use() const override { return alloc_->in_use(); }
  size_t peak_bytes() const override { return alloc_->peak(); }
  void reset_peak() override { alloc_->reset_peak(); }
  // parallel.offload's host state: page-locked in place (cudaHostRegister),
  // so copy_to_device sees it as pinned and DMAs it directly.
  bool wants_pinned_host() const override { return true; }
  bool pin_host(void* p, size_t bytes) override;
  void unpin_host(void* p) override;
  // On copy_ (a stream of its own, waiting on `ready`'s event), through two
  // pinned landing buffers: chunk i+1's DMA runs while the caller consumes
  // chunk i; only these copies' events are waited on, never the compute
  // stream.
  void copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                           const HostChunkSink& consume) override;
  // Timing events on the compute stream (Backend::time_mark).
  std::shared_ptr<void> time_mark() override;
  double ms_between(const std::shared_ptr<void>& from, const std::shared_ptr<void>& to) override;

  void cast_from_f32(void* dst, const float* src, int64_t n) override;
  void cast_to_f32(float* dst, const void* src, int64_t n) override;
  void encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T,
                       int C, const int32_t* pos = nullptr) override;
  void encoder_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int B, int T,
                        int C, const int32_t* pos = nullptr) override;
  // Vocab-parallel ops (tensor parallelism): vocab_parallel.cu.
  void vocab_embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int v_begin,
                               int v_count, int B, int T, int C, const int32_t* pos = nullptr) override;
  void vocab_embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int v_begin,
                                int v_count, int B, int T, int C, const int32_t* pos = nullptr) override;
  void vocab_ce_max(float* rowmax, const void* logits, int N, int V, int ldv) override;
  void vocab_ce_sumexp(float* stats, const void* logits, const int32_t* targets, const float* rowmax, int v_begin,
                       int N, int V, int ldv) override;
  void vocab_ce_finish(float* losses, void* dlogits, const void* logits, const int32_t* targets, const float* rowmax,
                       const float* stats, int v_begin, int N, int V, int ldv, float dloss_scale,
                       float cap = 0.f) override;
  void layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const void* weight,
                         const void* bias, int N, int C) override;
  void residual_layernorm_forward(void* res_out, void* out, float* mean, float* rstd, const void* a, const void* b,
                                  const void* weight, const void* bias, int N, int C) override;
  void layernorm_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                          const void* weight, const float* mean, const float* rstd, int N, int C) override;
  void matmul_forward(void* out, const void* inp, const void* weight, const void* bias, int N, int C,
                      int OC) override;
  void matmul_backward(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                       const void* weight, int N, int C, int OC) override;
  size_t attention_saved_floats(int B, int T, int NH) const override;
  void attention_forward(void* out, float* saved, const void* qkv, int B, int T, int C, int NH,
                         const int32_t* doc_start = nullptr) override;
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* saved, int B, int T, int C,
                          int NH, const int32_t* doc_start = nullptr) override;
  void attention_kv_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq, int C,
                            int NH) override;
  // w_offset (Gemma 2's x * (1 + w)): rmsnorm.cu. The AttentionOptions are refused by name: not implemented
  // on CUDA yet.
  void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C, float eps,
                       float w_offset = 0.f) override;
  void residual_rmsnorm_forward(void* res_out, void* out, float* rstd, const void* a, const void* b,
                                const void* weight, int N, int C, float eps, float w_offset = 0.f) override;
  void rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const void* weight,
                        const float* rstd, int N, int C, float w_offset = 0.f) override;
  void rope_forward(void* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                    const int32_t* pos = nullptr) override;
  void rope_backward(void* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                     const int32_t* pos = nullptr) override;
  // qk-norm (Qwen3): qk_norm.cu.
  void qk_norm_forward(void* qkv, void* pre, float* rstd, const void* wq, const void* wk, int N, int NH, int NKV,
                       int HS, float eps) override;
  void qk_norm_backward(void* dqkv, float* dwq, float* dwk, const void* pre, const void* wq, const void* wk,
                        const float* rstd, int N, int NH, int NKV, int HS) override;
  void swiglu_forward(void* out, const void* inp, int N, int F) override;
  void swiglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) override;
  // Gemma 2: GeGLU (swiglu.cu), the final logit cap (logit_softcap.cu; its backward is the cross-entropy's
  // cap), the embedding scale (elementwise.cu). Not yet run on a GPU.
  void geglu_forward(void* out, const void* inp, int N, int F) override;
  void geglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) override;
  void logit_softcap_forward(void* logits, int N, int V, int ldv, float cap) override;
  void scale_act(void* x, float s, int64_t n) override;
  // Attention by blocks (context parallelism): attention_block.cu. Not yet run on a GPU.
  void attention_block_forward(void* out, float* lse, const AttentionBlock& a) override;
  void attention_block_backward(float* dq, float* dk, float* dv, const void* dout, const void* out, const float* lse,
                                const AttentionBlock& a) override;
  void attention_block_merge(void* out, float* lse, const void* block_out, const float* block_lse,
                             const AttentionBlock& a) override;
  void copy_rows(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type, int64_t src_ld,
                 int64_t rows, int64_t cols) override;
  void add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                    int64_t cols) override;
  size_t attention_gqa_saved_floats(int B, int T, int NH) const override;
  void attention_gqa_forward(void* out, float* saved, const void* qkv, int B, int T, int NH, int NKV,
                             int HS, const int32_t* doc_start = nullptr, const AttentionOptions& opt = {}) override;
  void attention_gqa_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* saved,
                              int B, int T, int NH, int NKV, int HS, const int32_t* doc_start = nullptr,
                              const AttentionOptions& opt = {}) override;
  void attention_kv_gqa_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq, int NH,
                                int NKV, int HS, const AttentionOptions& opt = {}) override;
  void gelu_forward(void* out, const void* inp, int64_t n) override;
  void gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n) override;
  void residual_forward(void* out, const void* a, const void* b, int64_t n) override;
  int logits_stride(int V) const override { return (V + 63) / 64 * 64; }
  void matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias, int N, int C,
                           int OC) override;
  void matmul_backward_dgelu(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                             const void* weight, const void* pre, int N, int C, int OC) override;
  void lm_head_forward(void* logits, const void* inp, const void* wte, int N, int C, int V, int ldv) override;
  void lm_head_backward(void* dinp, float* dwte, const void* dlogits, const void* inp, const void* wte, int N, int C,
                        int V, int ldv) override;
  void softmax_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets, int N, int V,
                             int ldv, float dloss_scale, float cap = 0.f) override;
  // The adapters' ops (core/model/adapter): adapter_gemm.cu (through the
  // cuBLASLt wrapper), dropout.cu, row_norms.cu, dora.cu. Not yet run on a GPU.
  void gemm(void* c, int ldc, bool c_f32, const void* a, int lda, GemmOp ta, const void* b, int ldb, GemmOp tb,
            int M, int N, int K, float alpha, float beta) override;
  void dropout_forward(void* out, const void* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                       int64_t key_cols = 0, int64_t col0 = 0) override;
  void row_norms(float* out, const void* w, int rows, int cols) override;
  void scale_rows(void* x, const float* w, int N, int V, int ldv) override;  // scale_rows.cu, not yet run on a GPU
  void row_sum_squares(float* out, const void* w, int rows, int cols) override;
  void sqrt_in_place(float* x, int64_t n) override;
  void dora_forward(void* y, int ldy, const void* xw, const void* xba, const void* mag, const float* norm, float s,
                    int N, int out) override;
  void dora_backward(float* dmag, void* xw, void* xba, const void* dy, int ldy, const void* mag, const float* norm,
                     float s, int N, int out) override;
  // NF4 dequantization (QLoRA's base): nf4.cu.
  void nf4_dequantize(void* out, DType out_dtype, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2,
                      const float* map, float offset, int64_t n) override;
  void nf4_dequantize_blocks(void* out, DType out_dtype, const uint8_t* packed, const float* block_absmax,
                             int64_t n) override;
  // Mixture of experts: cuda_moe.cpp (moe_route.cu, moe_permute.cu, moe_grouped_gemm.cpp). Not yet run on a GPU.
  void moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const void* logits, int N, int E, int K,
                         bool renorm) override;
  void moe_route_backward(void* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* idx,
                          const float* aux_grad, float z_scale, int N, int E, int K, bool renorm) override;
  void moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N, int E,
                        int K) override;
  void moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens, int E,
                    float aux_coef, float z_coef, float grad_scale) override;
  void moe_permute(int32_t* pos, int32_t* offsets, void* xp, const int32_t* idx, const void* x, int N, int K, int E,
                   int C) override;
  void moe_permute_backward(void* dx, const void* dxp, const int32_t* pos, int N, int K, int C) override;
  void moe_expert_matmul_forward(void* out, const void* in, const void* w, const int32_t* offsets, int E, int IC,
                                 int OC) override;
  void moe_expert_matmul_backward(void* din, float* dw, const void* dout, const void* in, const void* w,
                                  const int32_t* offsets, int E, int IC, int OC) override;
  void moe_unpermute_forward(void* out, const void* yp, const int32_t* pos, const float* w, int N, int K,
                             int C) override;
  void moe_unpermute_backward(void* dyp, float* dw, const void* dout, const void* yp, const int32_t* pos,
                              const float* w, int N, int K, int C) override;
  void moe_sigmoid_gate_forward(void* out, const void* y, const void* g, int N, int C) override;
  void moe_sigmoid_gate_backward(void* dy, void* dg, const void* dout, const void* y, const void* g, int N,
                                 int C) override;
  void sum_squares(float* out, const float* x, int64_t n) override;
  void sum(float* out, const float* x, int64_t n) override;
  void scale(float* x, float s, int64_t n) override;
  void accumulate(float* dst, const float* src, int64_t n) override;
  void adamw_update(float* master, void* param, const float* grad, float* m, float* v, int64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) override;

  // ---- for the NCCL communicator, the benchmark and the tests -------------------
  int device() const { return device_; }
  int num_sms() const { return num_sms_; }
  cudaStream_t compute_stream() const { return compute_; }
  cudaStream_t comm_stream() const { return comm_; }
  Gemm& gemm() { return *gemm_; }
  DeviceAllocator& allocator() { return *alloc_; }
  // Makes this backend's device current on the calling thread.
  void make_current() const;
  // Whether the experts' grouped GEMM fell back to per-expert cuBLASLt calls (moe_grouped_gemm.h).
  bool moe_gemm_fallback_used() const;

 private:
  // Scratch for one op, from the caching allocator; freed at scope exit.
  // Safe to reuse right away: the next user is ordered on the same stream.
  class Scratch {
   public:
    Scratch(DeviceAllocator& a, size_t bytes) : a_(a), p_(bytes ? a.allocate(bytes) : nullptr), bytes_(bytes) {}
    ~Scratch() { a_.release(p_); }
    template <typename T> T* as() const { return static_cast<T*>(p_); }
    size_t bytes() const { return bytes_; }
   private:
    DeviceAllocator& a_;
    void* p_;
    size_t bytes_;
  };

  int device_;
  int num_sms_ = 0;
  bool bgrad_epilogue_ = false;  // TRAINRUN_CUDA_GEMM_BGRAD=1
  bool gelu_epilogue_ = true;    // TRAINRUN_CUDA_GEMM_GELU=0 turns the fused GELU epilogues off
  cudaStream_t compute_ = nullptr, comm_ = nullptr;
  // Pinned staging for host->device copies of pageable memory (see
  // copy_to_device): a ring of slots, each reused once its DMA has passed.
  struct PinnedSlot {
    void* p = nullptr;
    size_t bytes = 0;
    cudaEvent_t read = nullptr;  // recorded after the DMA that reads the slot
  };
  static constexpr int kPinnedSlots = 4;
  static constexpr size_t kMaxPinnedCopy = size_t(16) << 20;
  PinnedSlot pinned_[kPinnedSlots];
  int next_pinned_ = 0;
  std::mutex pinned_mu_;
  // copy_to_host_chunks: one caller at a time (the sharded store's comm
  // thread); the landing buffers are allocated at its first call.
  static constexpr size_t kLandingBytes = size_t(4) << 20;
  cudaStream_t copy_ = nullptr;
  PinnedSlot landing_[2];
  std::mutex landing_mu_;
  // TRAINRUN_CUDA_ATTN_DKV_SPLITS=n: the attention backward's dk/dv query
  // splits (attention.cuh); unset or 0: chosen from the SM count.
  int attn_dkv_splits_ = 0;
  std::unique_ptr<DeviceAllocator> alloc_;
  std::unique_ptr<Gemm> gemm_;
  // The experts' grouped GEMM (its cuBLAS handle), made on first use.
  MoeGroupedGemm& moe_gemm();
  std::unique_ptr<MoeGroupedGemm> moe_gemm_;
  mutable std::mutex moe_mu_;
};

}  // namespace trainrun::cuda
