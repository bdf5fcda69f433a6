// Llama 3's training compute (LlamaArch::make_network): token embedding, L
// pre-RMSNorm blocks (fused q|k|v projection, RoPE on q and k, causal
// grouped-query attention, o_proj; fused gate|up projection, SwiGLU,
// down_proj), a final RMSNorm and an LM head, tied to the embedding or its
// own lm_head.weight in the head unit. No biases, except the q|k|v ones of
// ModelConfig::qkv_bias (Qwen2), added in the q|k|v GEMM's epilogue.
//
// It mirrors GPT2 (core/model/gpt2/gpt2.h): one activation arena, the
// residual add fused with the RMSNorm that reads it next, the LM head over
// rows logits_stride() apart with softmax + cross-entropy fused in place,
// the UnitAccess order of model.h, and optional activation checkpointing
// (only the block outputs are kept; each block's forward is rerun just
// before its backward).
//
// The embedding lookup is Backend::encoder_forward with no position table
// (wpe null: out = wte[tok], nothing read; backward: no position gradient).
// Until 2026-12 it read an all-zero (T,C) table and wrote a (T,C) fp32
// gradient of it that was thrown away, every micro-batch.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/arena_plan.h"
#include "core/model/model.h"
#include "core/model/tensor_parallel.h"
#include "parallel/context/cp_attention.h"

namespace trainrun {

class MoeMlp;  // core/model/moe/moe_mlp.h

// Element offsets of one block's tensors relative to the block unit's start
// (llama_layout's order; q|k|v and gate|up adjacent, read as fused weights,
// and with ModelConfig::qkv_bias the q|k|v biases adjacent after them, so
// one GEMM adds all three in its epilogue).
// Q = NH*HS query rows (C on one rank; a tensor-parallel rank's NH/T heads).
// QN: the qk-norm weights' length (head_dim; 0 = none): q_norm and k_norm
// come after the MLP (only Gemma 2's pfnw after them), so the other offsets
// are those of a block without them.
// post_norms (Gemma 2): a norm on the attention output after o_proj (HF's
// post_attention_layernorm; ln2 is then pre_feedforward_layernorm) and one
// on the MLP output after down_proj (post_feedforward_layernorm); -1 without.
struct LlamaBlockOffsets {
  // moe_elems > 0 (ModelConfig::moe): the gated MLP's place holds that many
  // elements of MoE tensors from `moe` on (MoeOffsets), and guw = downw = -1.
  int64_t ln1w, qkvw, qkvb, ow, panw = -1, ln2w, guw, downw, pfnw = -1, qnw, knw, total, moe = -1;
  bool has_qkvb;
  LlamaBlockOffsets(int64_t C, int64_t KV, int64_t F) : LlamaBlockOffsets(C, C, KV, F) {}
  LlamaBlockOffsets(int64_t C, int64_t Q, int64_t KV, int64_t F, int64_t QN = 0, bool qkv_bias = false,
                    bool post_norms = false, int64_t moe_elems = 0)
      : has_qkvb(qkv_bias) {
    int64_t o = 0;
    ln1w = o; o += C;                // input_layernorm (C)
    qkvw = o; o += (Q + 2 * KV) * C; // q_proj (Q,C) | k_proj (KV,C) | v_proj (KV,C)
    qkvb = o; if (qkv_bias) o += Q + 2 * KV;  // q_proj (Q) | k_proj (KV) | v_proj (KV) biases (qkv_bias only)
    ow = o; o += C * Q;              // o_proj (C,Q)
    if (post_norms) { panw = o; o += C; }  // Gemma 2's post_attention_layernorm (C)
    ln2w = o; o += C;                // post_attention_layernorm (C); Gemma 2's pre_feedforward_layernorm
    if (moe_elems > 0) {
      moe = o; o += moe_elems;       // router, experts [, shared expert] (MoeOffsets)
      guw = downw = -1;
    } else {
      guw = o; o += 2 * F * C;       // gate_proj (F,C) | up_proj (F,C)
      downw = o; o += C * F;         // down_proj (C,F)
    }
    qnw = o; o += QN;                // self_attn.q_norm (HS) | k_norm (HS), adjacent
    knw = o; o += QN;
    if (post_norms) { pfnw = o; o += C; }  // Gemma 2's post_feedforward_layernorm (C)
    total = o;
  }
};

class LlamaNetwork final : public Network {
 public:
  // cfg: resolved (LlamaArch::config()); layout: LlamaArch::layout().
  // tp: tensor parallelism (this rank's slice of every tensor, the
  // collectives between the linears); null = the whole model.
  // stage: one pipeline stage's layers (model.h); null = all of them.
  LlamaNetwork(const ModelConfig& cfg, const ParamLayout& layout, Backend* be, int maxB,
               bool activation_checkpointing, const TensorParallel* tp = nullptr,
               const PipelineStage* stage = nullptr, const ContextParallel* cp = nullptr,
               const ExpertParallel* ep = nullptr);
  ~LlamaNetwork() override;

  void forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
               bool for_backward, float dloss_scale, DocumentMask docs = {}) override;
  void backward(UnitAccess& units) override;

  const float* losses() const override { return losses_; }
  void scale_loss_grad(const float* w) override { be_->scale_rows(logits_, w, B_ * T_, v_valid_, ldv_); }
  const void* logits() const override { return logits_; }
  int logits_stride() const override { return ldv_; }
  size_t activation_bytes() const override;
  size_t transient_bytes() const override { return shared_ ? plan_.transient_total : 0; }
  void bind_transient(void* scratch) override;
  void free_activations() override { arena_.reset(); }
  RouterReport router_report() const override;
  void set_expert_bias(const std::vector<float>& bias) override;
  std::vector<float> take_expert_load() override;

  int64_t stage_io_elems(int B, int T) const override {
    TR_CHECK(!router_carry_bytes_ || B * T == maxB_ * cfg_.T, "LlamaNetwork: the router statistics ride after ",
             maxB_, "x", cfg_.T, " rows, not ", B, "x", T, " (a bug)");
    return int64_t(tpc_.rows(B * T)) * cfg_.C + int64_t(router_carry_bytes_ / dtype_size(be_->act_dtype()));
  }
  void* stage_input() override { return encoded_; }
  const void* stage_output() const override { return res3_.back(); }
  void* stage_output_grad() override { return dres_; }
  const void* stage_input_grad() const override { return dres_; }
  void backward_input(UnitAccess& units) override;
  void backward_weight(UnitAccess& units) override;

 private:
  struct LayerActs {
    void* ln1; float* ln1_rstd;   // (N,C) (N)
    void* qkv;                    // (N,QKV), q and k rotated
    void* qk_pre; float* qk_rstd; // qk-norm: (N,(NH+NKV)*HS) q|k before it, (N,NH+NKV); else null
    void* atty;                   // (N,C)
    float* att;                   // backend-private saved state
    void* res2;                   // (N,C) residual after attention
    void* ln2; float* ln2_rstd;   // (N,C) (N)
    void* gu;                     // (N,2F) gate | up (dgate | dup in backward)
    void* h;                      // (N,F) silu(gate) * up (gelu with mlp_act gelu_tanh)
    // post_norms only: the attention / MLP outputs before their norms, and the norms' rstd
    void* ao = nullptr; float* ao_rstd = nullptr;  // (N,C) (N)
    void* mo = nullptr; float* mo_rstd = nullptr;  // (N,C) (N)
  };
  void block_forward(const void* p, int l, const void* res_in, int B, int T);
  // zero_bubble: with `keep` the linears' weight gradients are skipped and
  // the output gradients they need kept; block_weight_grads computes them.
  struct KeptGrads {
    void* d_down; void* d_o; void* d_qkv;  // (N,C) (N,C) (N,QKV); gate|up's stays in the layer's gu
  };
  void block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T,
                      const KeptGrads* keep = nullptr);
  void block_weight_grads(float* g, int l, const KeptGrads& keep, int N);
  void qk_norm_backward(const LayerActs& a, const void* wq, const void* wk, float* dw, int N);
  void qkv_backward(void* dinp, float* dqkvw, float* dqkvb, const void* dqkv, const void* ln1, const void* wqkv,
                    int N);
  void backward_pass(UnitAccess& units, bool input_only);
  std::vector<KeptGrads> kept_;  // per layer, zero_bubble only
  LinearAdapters* ad_ = nullptr;  // the pass's adapters (UnitAccess::adapters()), null = none
  bool frozen_ = false;           // the pass's base is frozen: no base linear weight gradients
  // The first stage's token embedding into encoded_; the last stage's head backward.
  void embed(UnitAccess& units, const int32_t* inputs, int B, int T);
  float* head_backward(UnitAccess& units);
  LayerActs& acts(int l) { return layers_[ckpt_ ? 0 : l]; }

  ModelConfig cfg_;      // cfg_.L: the blocks this network computes (a pipeline stage's)
  PipelineStage stage_;  // first / last: embeds the tokens / computes the head and loss
  Backend* be_;
  int maxB_;
  bool ckpt_;
  int HS_, KV_, QKV_;             // head size, NKV*HS, Q + 2*KV (this rank's)
  int QN_ = 0;                    // qk-norm: the q_norm / k_norm weights' length (HS); 0 = none
  float* qk_grad_ = nullptr;      // qk-norm under TP: (2*HS) this block's q_norm|k_norm gradient, summed over TP
  LlamaBlockOffsets offsets() const {
    return LlamaBlockOffsets(cfg_.C, Q_, KV_, F_, QN_, cfg_.qkv_bias, cfg_.post_norms, moe_elems_);
  }
  // Mixture of experts (ModelConfig::moe; core/model/moe/moe_mlp.h): the MLP's place in every block.
  int64_t moe_elems_ = 0;
  // Pipeline stages with router losses: the bytes after the activation rows
  // of the stage messages (the statistics forward, the aux gradient back).
  size_t router_carry_bytes_ = 0;
  float* router_tail(const void* rows) const {
    return reinterpret_cast<float*>(static_cast<char*>(const_cast<void*>(rows)) +
                                    int64_t(tpc_.rows(maxB_ * cfg_.T)) * cfg_.C * int64_t(dtype_size(be_->act_dtype())));
  }
  std::unique_ptr<MoeMlp> moe_;
  // This rank's sizes: all of the model without tensor parallelism.
  int NH_ = 0, NKV_ = 0, F_ = 0, Q_ = 0;  // heads, kv heads, MLP width, NH*HS
  int VL_ = 0, v_begin_ = 0, v_valid_ = 0;  // vocab rows held (padded), first id, real rows
  const TensorParallel* tp_ = nullptr;
  std::unique_ptr<CpAttention> cpa_;  // context parallelism: attention through the cp group (null = none)
  void attention_forward(LayerActs& a, int l, int B, int T);
  void attention_backward(LayerActs& a, int l, int B, int T);
  int kv_replicas_ = 1, kv_head_ = 0, NKV_global_ = 0;  // KV heads replicated over TP ranks
  DeviceBuffer kv_grad_scratch_;  // replicated KV, own arena: kv_scratch_'s memory
  DeviceBuffer kv_grad_slots_;    // replicated KV, own arena: kv_slots_'s memory
  float* kv_scratch_ = nullptr;   // replicated KV: (QKV,C) fp32 this step's qkv weight grad [+ (QKV) bias grad]
  float* kv_slots_ = nullptr;     // replicated KV: (NKV_global, 2*KV*C [+ 2*KV]) fp32, summed over TP
  size_t kv_scratch_bytes_ = 0, kv_slots_bytes_ = 0;
  float* ce_rowmax_ = nullptr;    // (N) vocab-parallel cross-entropy
  float* ce_stats_ = nullptr;     // (2N)
  void tp_sum(void* buf, int64_t n);  // all-reduce over TP (no-op without)
  // Sequence parallelism (parallel.sequence_parallel): TpCollectives.
  TpCollectives tpc_;
  bool sp_ = false;
  void* sp_rows_ = nullptr;       // (N/T, C) this rank's rows of a reduce-scattered output / input gradient
  void* dres_full_ = nullptr;     // (N, C) all-gathered rows: the residual gradient, or a norm output a column layer reads
  float* norm_grad_ = nullptr;    // (C) one norm's weight gradient, summed over TP
  int rows(int N) const;          // this rank's rows of N (N without SP)
  const void* row_parallel_out(void* partial, int N);
  const void* full_rows(const void* mine, int N);
  float* norm_grad(float* dweight);
  void norm_grad_done(float* dweight);
  const void* mlp_out() const { return sp_ ? sp_rows_ : dbuf_c_; }  // the last block's output, reduced
  void cross_entropy(const int32_t* targets, int N, bool for_backward, float dloss_scale);
  float eps_;
  // Gemma 2's maths (ModelConfig): RMSNorm weight offset, attention options per layer, embedding scale.
  float wo_ = 0.f;
  AttentionOptions attn_opt(int l) const;
  float embed_scale_ = 0.f;       // 0: none
  void post_norm_forward(void* buf, void* saved, float* rstd, const void* w, int NR);
  const void* post_norm_backward(const void* dout, const void* saved, const float* rstd, const void* w,
                                 float* dweight, int NR);
  void* dpost_ = nullptr;         // (N,C) post_norms: the gradient through a post norm
  int64_t lm_head_off_ = -1;      // untied: lm_head.weight's offset in the head unit
  int B_ = 0, T_ = 0;
  DeviceBuffer arena_;  // every buffer, or the kept ones with shared_
  size_t act_bytes_ = 0;
  ArenaPlan plan_;      // points into arena_ and the bound scratch (arena_plan.h)
  bool shared_ = false, bound_ = false;  // PipelineStage::shared_scratch; bind_transient done
  void wire_scratch();  // the collectives' buffers from the plan's pointers
  float* rope_ = nullptr;         // (T, HS/2, 2) fp32 cos/sin, uploaded once
  void* encoded_ = nullptr;       // (N,C)
  std::vector<void*> res3_;       // per layer (N,C): block outputs (the checkpoints)
  std::vector<LayerActs> layers_; // L sets, or 1 when checkpointing
  void* lnf_ = nullptr; float* lnf_rstd_ = nullptr;  // (N,C) (N)
  void* logits_ = nullptr;        // (N,V), rows ldv_ apart
  int ldv_ = 0;
  float* losses_ = nullptr;       // (N)
  const int32_t* inputs_ = nullptr;
  DocumentMask docs_;                      // the last forward's (backward reuses them)
  // backward scratch
  void* dres_ = nullptr;          // (N,C)
  void* dbuf_c_ = nullptr;        // (N,max(C,Q))
  void* dqkv_ = nullptr;          // (N,QKV)
  void* dh_ = nullptr;            // (N,F)
};

}  // namespace trainrun
