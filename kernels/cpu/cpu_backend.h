// The CPU backend: fp32 everywhere, OpenBLAS sgemm for every matrix product,
// OpenMP (static schedules, fixed reduction order) for everything else, so
// the same seed and thread count give bit-identical results. It is the
// numerical reference of the project and the embedded default.
#pragma once
#include <atomic>

#include "kernels/backend.h"

namespace trainrun {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads, int logits_align = 1);
  std::string name() const override { return "cpu"; }
  DType act_dtype() const override { return DType::F32; }
  int threads() const { return threads_; }
  int logits_stride(int V) const override { return (V + logits_align_ - 1) / logits_align_ * logits_align_; }

  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  // The "device" is host memory: each caller reads `src` in one chunk, no copy.
  void copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                           const HostChunkSink& consume) override;
  void copy_device(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void synchronize() override {}
  size_t bytes_in_use() const override { return in_use_; }
  size_t peak_bytes() const override { return peak_; }
  void reset_peak() override { peak_ = in_use_.load(); }

  void cast_from_f32(void* dst, const float* src, int64_t n) override;
  void cast_to_f32(float* dst, const void* src, int64_t n) override;

  void encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T,
                       int C, const int32_t* pos = nullptr) override;
  void encoder_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int B, int T,
                        int C, const int32_t* pos = nullptr) override;
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
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* saved, int B, int T,
                          int C, int NH, const int32_t* doc_start = nullptr) override;
  void attention_kv_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq, int C,
                            int NH) override;
  void gelu_forward(void* out, const void* inp, int64_t n) override;
  void gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n) override;
  void residual_forward(void* out, const void* a, const void* b, int64_t n) override;
  void matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias, int N, int C,
                           int OC) override;
  void matmul_backward_dgelu(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                             const void* weight, const void* pre, int N, int C, int OC) override;
  void lm_head_forward(void* logits, const void* inp, const void* wte, int N, int C, int V, int ldv) override;
  void lm_head_backward(void* dinp, float* dwte, const void* dlogits, const void* inp, const void* wte, int N, int C,
                        int V, int ldv) override;
  void softmax_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets, int N, int V,
                             int ldv, float dloss_scale, float cap = 0.f) override;
  // Llama ops: cpu_rmsnorm.cpp, cpu_rope.cpp, cpu_swiglu.cpp, cpu_attention_gqa.cpp.
  void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C, float eps,
                       float w_offset = 0.f) override;
  void residual_rmsnorm_forward(void* res_out, void* out, float* rstd, const void* a, const void* b, const void* weight,
                                int N, int C, float eps, float w_offset = 0.f) override;
  void rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const void* weight,
                        const float* rstd, int N, int C, float w_offset = 0.f) override;
  void rope_forward(void* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                    const int32_t* pos = nullptr) override;
  void rope_backward(void* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                     const int32_t* pos = nullptr) override;
  // qk-norm (Qwen3): cpu_qk_norm.cpp.
  void qk_norm_forward(void* qkv, void* pre, float* rstd, const void* wq, const void* wk, int N, int NH, int NKV,
                       int HS, float eps) override;
  void qk_norm_backward(void* dqkv, float* dwq, float* dwk, const void* pre, const void* wq, const void* wk,
                        const float* rstd, int N, int NH, int NKV, int HS) override;
  void swiglu_forward(void* out, const void* inp, int N, int F) override;
  void swiglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) override;
  // Attention by blocks (context parallelism): cpu/attention_block.cpp.
  void attention_block_forward(void* out, float* lse, const AttentionBlock& a) override;
  void attention_block_backward(float* dq, float* dk, float* dv, const void* dout, const void* out, const float* lse,
                                const AttentionBlock& a) override;
  void attention_block_merge(void* out, float* lse, const void* block_out, const float* block_lse,
                             const AttentionBlock& a) override;
  void copy_rows(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type, int64_t src_ld,
                 int64_t rows, int64_t cols) override;
  void add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                    int64_t cols) override;
  // Mixture of experts: cpu_moe.cpp.
  void moe_route_select_biased(int32_t* idx, float* w, const float* probs, const float* bias, int N, int E, int K,
                               bool renorm) override;
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
  // Gemma 2 ops: cpu_geglu.cpp, cpu_logit_softcap.cpp (attention's softcap/scale: cpu_attention_gqa.cpp).
  void geglu_forward(void* out, const void* inp, int N, int F) override;
  void geglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) override;
  void logit_softcap_forward(void* logits, int N, int V, int ldv, float cap) override;
  void scale_rows(void* x, const float* w, int N, int V, int ldv) override;  // cpu_scale_rows.cpp
  size_t attention_gqa_saved_floats(int B, int T, int NH) const override;
  void attention_gqa_forward(void* out, float* saved, const void* qkv, int B, int T, int NH, int NKV,
                             int HS, const int32_t* doc_start = nullptr, const AttentionOptions& opt = {}) override;
  void attention_gqa_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* saved,
                              int B, int T, int NH, int NKV, int HS, const int32_t* doc_start = nullptr,
                              const AttentionOptions& opt = {}) override;
  void attention_kv_gqa_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq, int NH,
                                int NKV, int HS, const AttentionOptions& opt = {}) override;
  // Vocab-parallel ops: cpu_vocab_parallel.cpp.
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
  void gemm(void* c, int ldc, bool c_f32, const void* a, int lda, GemmOp ta, const void* b, int ldb, GemmOp tb, int M,
            int N, int K, float alpha, float beta) override;
  void dropout_forward(void* out, const void* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                       int64_t key_cols = 0, int64_t col0 = 0) override;
  // NF4 dequantization: cpu_nf4.cpp.
  void nf4_dequantize(void* out, DType out_dtype, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2,
                      const float* map, float offset, int64_t n) override;
  void nf4_dequantize_blocks(void* out, DType out_dtype, const uint8_t* packed, const float* block_absmax,
                             int64_t n) override;
  // DoRA's ops: cpu_dora.cpp.
  void row_norms(float* out, const void* w, int rows, int cols) override;
  void row_sum_squares(float* out, const void* w, int rows, int cols) override;
  void sqrt_in_place(float* x, int64_t n) override;
  void dora_forward(void* y, int ldy, const void* xw, const void* xba, const void* mag, const float* norm, float s,
                    int N, int out) override;
  void dora_backward(float* dmag, void* xw, void* xba, const void* dy, int ldy, const void* mag, const float* norm,
                     float s, int N, int out) override;
  void sum_squares(float* out, const float* x, int64_t n) override;
  void sum(float* out, const float* x, int64_t n) override;
  void scale(float* x, float s, int64_t n) override;
  void accumulate(float* dst, const float* src, int64_t n) override;
  void adamw_update(float* master, void* param, const float* grad, float* m, float* v, int64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int step,
                    float grad_scale) override;

 private:
  int threads_;
  int logits_align_;
  std::atomic<size_t> in_use_{0};
  std::atomic<size_t> peak_{0};
};

}  // namespace trainrun
