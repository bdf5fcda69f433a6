// GPT-2: token + learned position embeddings, L pre-LayerNorm blocks
// (causal multi-head attention, GELU(tanh) MLP of width 4C), a final
// LayerNorm and an LM head tied to the token embedding.
//
// Parameters live in one contiguous buffer, grouped into the units that
// sharding (parallel/) moves as one flat parameter:
//   unit 0 "embeddings": wte (V,C), wpe (T,C)
//   unit 1+l "block l":  ln1w (C), ln1b (C), qkvw (3C,C), qkvb (3C),
//                        attprojw (C,C), attprojb (C), ln2w (C), ln2b (C),
//                        fcw (4C,C), fcb (4C), fcprojw (C,4C), fcprojb (C)
//   unit L+1 "head":     lnfw (C), lnfb (C)   (the LM head reuses wte)
// External names (safetensors, the PyTorch reference) follow HF GPT-2 with
// nn.Linear layout (out, in): transformer.wte.weight, transformer.h.{l}.attn.c_attn.weight, ...
//
// GPT2Arch (gpt2_arch.h) is this architecture's ModelArch; the functions
// and the GPT2 class here are what it is built from (tests use them too).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/model/arena_plan.h"
#include "core/model/model.h"
#include "core/model/tensor_parallel.h"
#include "parallel/context/cp_attention.h"

namespace trainrun {

// The many tests written against GPT-2 call its config by this name.
using GPT2Config = ModelConfig;

// Tensors with their Split: qkv and fc column (q|k|v as 3 blocks), the two
// output projections row, their biases replicated, the column layers'
// biases column, wte vocab, wpe and LayerNorms replicated; lm_head.weight
// tied to transformer.wte.weight.
ParamLayout make_gpt2_layout(const GPT2Config& cfg);

// Element offsets of one block's tensors, relative to the block unit's
// start (the order make_gpt2_layout adds them in).
struct GPT2BlockOffsets {
  int64_t ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, total;
  explicit GPT2BlockOffsets(int64_t C) : GPT2BlockOffsets(C, C, 4 * C) {}
  // Q: attention width NH*HS, F: MLP width (C and 4C on one rank; a
  // tensor-parallel rank's slices, tensor_parallel.h).
  GPT2BlockOffsets(int64_t C, int64_t Q, int64_t F) {
    int64_t o = 0;
    ln1w = o; o += C;
    ln1b = o; o += C;
    qkvw = o; o += 3 * Q * C;
    qkvb = o; o += 3 * Q;
    attprojw = o; o += C * Q;
    attprojb = o; o += C;
    ln2w = o; o += C;
    ln2b = o; o += C;
    fcw = o; o += F * C;
    fcb = o; o += F;
    fcprojw = o; o += C * F;
    fcprojb = o; o += C;
    total = o;
  }
};

// Deterministic, counter-based GPT-2 init (ModelArch::init_params): element i
// of the flat buffer is a function of (seed, i) only. Writes [begin, end) of
// the flat parameter vector into host memory `out` (end-begin floats).
void gpt2_init_params(const GPT2Config& cfg, const ParamLayout& layout, uint64_t seed, int64_t begin,
                      int64_t end, float* out);

// Forward/backward of GPT-2 over a Backend. Owns the activation buffers for
// up to (maxB, T) tokens; parameters are reached through UnitAccess.
class GPT2 final : public Network {
 public:
  // tp: tensor parallelism (this rank's slices, the collectives between
  // the linears); null = the whole model. stage: one pipeline stage's
  // layers (model.h); null = all of them.
  GPT2(const GPT2Config& cfg, Backend* be, int maxB, bool activation_checkpointing,
       const TensorParallel* tp = nullptr, const PipelineStage* stage = nullptr,
       const ContextParallel* cp = nullptr);
  ~GPT2() override;
  const GPT2Config& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }

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

  int64_t stage_io_elems(int B, int T) const override { return int64_t(tpc_.rows(B * T)) * cfg_.C; }
  void* stage_input() override { return encoded_; }
  const void* stage_output() const override { return res3_.back(); }
  void* stage_output_grad() override { return dres_; }
  const void* stage_input_grad() const override { return dres_; }
  void backward_input(UnitAccess& units) override;
  void backward_weight(UnitAccess& units) override;

 private:
  struct LayerActs {
    void* ln1; float* ln1_mean; float* ln1_rstd;   // (N,C) (N) (N)
    void* qkv;                                      // (N,3C)
    void* atty;                                     // (N,C)
    float* att;                                     // backend-private saved state
    void* res2;                                     // (N,C) residual after attention
    void* ln2; float* ln2_mean; float* ln2_rstd;   // (N,C) (N) (N)
    void* fch;                                      // (N,4C)
    void* fch_gelu;                                 // (N,4C)
  };
  void block_forward(const void* p, int l, const void* res_in, int B, int T);
  // With `keep` (zero_bubble's input step) the four linears' weight and
  // bias gradients are skipped and their output gradients copied to keep;
  // block_weight_grads computes them from there.
  struct KeptGrads {
    void* d_fcproj; void* d_fc; void* d_attproj; void* d_qkv;  // (N,C) (N,F) (N,C) (N,3Q)
  };
  void block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T,
                      const KeptGrads* keep = nullptr);
  void block_weight_grads(float* g, int l, const KeptGrads& keep, int N);
  void backward_pass(UnitAccess& units, bool input_only);
  std::vector<KeptGrads> kept_;            // per layer, zero_bubble only
  LinearAdapters* ad_ = nullptr;           // the pass's adapters (UnitAccess::adapters()), null = none
  bool frozen_ = false;                    // the pass's base is frozen: no base linear weight/bias gradients
  // The first stage's token + position embedding into encoded_; the last
  // stage's final LayerNorm, LM head and loss.
  void embed(UnitAccess& units, const int32_t* inputs, int B, int T);
  void head_forward(UnitAccess& units, const int32_t* targets, int N, bool for_backward, float dloss_scale);
  LayerActs& acts(int l) { return layers_[ckpt_ ? 0 : l]; }

  GPT2Config cfg_;             // cfg_.L: the blocks this network computes (a pipeline stage's)
  ParamLayout layout_;
  PipelineStage stage_;        // first / last: embeds the tokens / computes the head and loss
  Backend* be_;
  int maxB_;
  bool ckpt_;
  int B_ = 0, T_ = 0;
  // This rank's sizes (the whole model without tensor parallelism).
  const TensorParallel* tp_ = nullptr;
  // Context parallelism: attention through the cp group (null = none).
  std::unique_ptr<CpAttention> cpa_;
  int NH_ = 0, Q_ = 0, F_ = 0;             // heads, NH*HS, MLP width
  int VL_ = 0, v_begin_ = 0, v_valid_ = 0; // vocab rows held (padded), first id, real rows
  bool adds_row_bias_ = true;              // row-parallel biases: added by TP rank 0 only
  float* ce_rowmax_ = nullptr;             // (N) vocab-parallel cross-entropy
  float* ce_stats_ = nullptr;              // (2N)
  void tp_sum(void* buf, int64_t n);
  // Sequence parallelism (parallel.sequence_parallel): TpCollectives.
  TpCollectives tpc_;
  bool sp_ = false;
  void* sp_rows_ = nullptr;                // (N/T, C)
  void* dres_full_ = nullptr;              // (N, C)
  float* norm_grad_ = nullptr;             // (2C) one LayerNorm's weight | bias gradient
  const void* mlp_out() const { return sp_ ? sp_rows_ : dbuf_c_; }
  DeviceBuffer arena_;  // every buffer, or the kept ones with shared_
  size_t act_bytes_ = 0;
  ArenaPlan plan_;      // points into arena_ and the bound scratch (arena_plan.h)
  bool shared_ = false, bound_ = false;  // PipelineStage::shared_scratch; bind_transient done
  void wire_scratch();  // the collectives' buffers from the plan's pointers
  void* encoded_ = nullptr;                // (N,C)
  std::vector<void*> res3_;                // per layer (N,C): block outputs (the checkpoints)
  std::vector<LayerActs> layers_;          // L sets, or 1 when checkpointing
  void* lnf_ = nullptr; float* lnf_mean_ = nullptr; float* lnf_rstd_ = nullptr;
  void* logits_ = nullptr;                 // (N,V), rows ldv_ apart
  int ldv_ = 0;
  float* losses_ = nullptr;                // (N)
  const int32_t* inputs_ = nullptr;
  DocumentMask docs_;                      // the last forward's (backward reuses them)
  // backward scratch
  void* dres_ = nullptr;                   // (N,C)
  void* dbuf_c_ = nullptr;                 // (N,C)
  void* dbuf_3c_ = nullptr;                // (N,3C)
  void* dbuf_4c_ = nullptr;                // (N,4C)
};

}  // namespace trainrun
