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
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

struct GPT2Config {
  int L = 4, NH = 4, C = 128, V = 256, T = 128;  // maxT = position table size
  double init_std = 0.02;
  static GPT2Config from_spec(const ModelSpec& m);
  // A shape by its numbers (tests, benchmarks).
  static GPT2Config of(int L, int NH, int C, int V, int T, double init_std = 0.02) {
    GPT2Config c;
    c.L = L;
    c.NH = NH;
    c.C = C;
    c.V = V;
    c.T = T;
    c.init_std = init_std;
    return c;
  }
  int64_t num_parameters() const;
};

struct ParamTensor {
  std::string name;            // external (HF-style) name
  std::vector<int64_t> shape;
  int64_t offset = 0;          // element offset in the whole-model flat buffer
  int64_t numel = 0;
  int unit = 0;                // which sharding unit owns it
  bool decay = false;          // AdamW weight decay applies (matrices yes, biases/LN no)
};

struct ParamUnit {
  std::string name;            // "embeddings", "block 3", "head"
  int64_t offset = 0;          // element offset of the unit in the flat buffer
  int64_t numel = 0;
};

struct ParamLayout {
  std::vector<ParamTensor> tensors;
  std::vector<ParamUnit> units;
  int64_t total = 0;
  const ParamTensor& get(const std::string& name) const;
};

ParamLayout make_gpt2_layout(const GPT2Config& cfg);

// Element offsets of one block's tensors, relative to the block unit's
// start (the order make_gpt2_layout adds them in).
struct GPT2BlockOffsets {
  int64_t ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, total;
  explicit GPT2BlockOffsets(int64_t C) {
    int64_t o = 0;
    ln1w = o; o += C;
    ln1b = o; o += C;
    qkvw = o; o += 3 * C * C;
    qkvb = o; o += 3 * C;
    attprojw = o; o += C * C;
    attprojb = o; o += C;
    ln2w = o; o += C;
    ln2b = o; o += C;
    fcw = o; o += 4 * C * C;
    fcb = o; o += 4 * C;
    fcprojw = o; o += 4 * C * C;
    fcprojb = o; o += C;
    total = o;
  }
};

}  // namespace trainrun

#include "kernels/backend.h"

namespace trainrun {

// How the model reaches its parameters and gradients, one unit at a time.
// The model calls acquire/release around every use of a unit's parameters
// and grads_done once a unit's gradient is complete, in this order:
//   forward:  acquire(0) ... acquire(1+l)/release(1+l) ... acquire(L+1), acquire(0) for the tied head
//   backward: head, blocks L-1..0, embeddings; grads_done(u) after each.
// Without sharding this is pointer arithmetic into one flat buffer; the
// sharding layer (parallel/) implements it with all-gather / reduce-scatter.
class UnitAccess {
 public:
  virtual ~UnitAccess() = default;
  // Parameters of the unit (act dtype, the unit's numel), valid until release.
  virtual const void* acquire_params(int unit) = 0;
  virtual void release_params(int unit) = 0;
  // fp32 gradient of the unit (accumulated with +=).
  virtual float* unit_grads(int unit) = 0;
  virtual void grads_done(int unit) = 0;
  // Start of a forward (with or without a backward to follow) or a backward
  // pass: lets a sharded implementation prefetch units in the order they come.
  virtual void begin_pass(bool backward_pass, bool backward_follows) {}
};

// Flat, unsharded access: params and grads are whole-model buffers.
class FlatUnitAccess final : public UnitAccess {
 public:
  FlatUnitAccess(const ParamLayout& layout, void* params, float* grads, DType dtype)
      : layout_(layout), params_(static_cast<char*>(params)), grads_(grads), esize_(dtype_size(dtype)) {}
  const void* acquire_params(int unit) override { return params_ + layout_.units[unit].offset * esize_; }
  void release_params(int) override {}
  float* unit_grads(int unit) override { return grads_ + layout_.units[unit].offset; }
  void grads_done(int) override {}

 private:
  const ParamLayout& layout_;
  char* params_;
  float* grads_;
  size_t esize_;
};

// Deterministic, counter-based GPT-2 init: element i of the flat buffer is a
// function of (seed, i) only, so any shard can initialise its own slice and
// every world size starts from the same weights. Writes [begin, end) of the
// flat parameter vector into host memory `out` (end-begin floats).
void gpt2_init_params(const GPT2Config& cfg, const ParamLayout& layout, uint64_t seed, int64_t begin,
                      int64_t end, float* out);

// Forward/backward of GPT-2 over a Backend. Owns the activation buffers for
// up to (maxB, T) tokens; parameters are reached through UnitAccess.
class GPT2 {
 public:
  GPT2(const GPT2Config& cfg, Backend* be, int maxB, bool activation_checkpointing);
  const GPT2Config& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }

  // Forward over inputs (B,T) device int32. With targets: per-token losses
  // (device, B*T fp32 at losses()). When `for_backward`, the logits buffer is
  // replaced by dloss_scale * dloss/dlogits (fused softmax + cross-entropy).
  void forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
               bool for_backward, float dloss_scale);
  // Accumulates parameter gradients (+=) for the last forward(for_backward=true).
  void backward(UnitAccess& units);

  const float* losses() const { return losses_; }       // (B*T) device
  // (B,T,V) device, rows logits_stride() >= V apart, after a forward without for_backward.
  const void* logits() const { return logits_; }
  int logits_stride() const { return ldv_; }
  size_t activation_bytes() const { return act_bytes_; }
  // Frees the activation buffers (the end-of-run sample's decoder needs the
  // room); forward/backward must not be called afterwards.
  void free_activations() { arena_.reset(); }

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
  void block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T);
  LayerActs& acts(int l) { return layers_[ckpt_ ? 0 : l]; }

  GPT2Config cfg_;
  ParamLayout layout_;
  Backend* be_;
  int maxB_;
  bool ckpt_;
  int B_ = 0, T_ = 0;
  DeviceBuffer arena_;
  size_t act_bytes_ = 0;
  void* encoded_ = nullptr;                // (N,C)
  std::vector<void*> res3_;                // per layer (N,C): block outputs (the checkpoints)
  std::vector<LayerActs> layers_;          // L sets, or 1 when checkpointing
  void* lnf_ = nullptr; float* lnf_mean_ = nullptr; float* lnf_rstd_ = nullptr;
  void* logits_ = nullptr;                 // (N,V), rows ldv_ apart
  int ldv_ = 0;
  float* losses_ = nullptr;                // (N)
  const int32_t* inputs_ = nullptr;
  // backward scratch
  void* dres_ = nullptr;                   // (N,C)
  void* dbuf_c_ = nullptr;                 // (N,C)
  void* dbuf_3c_ = nullptr;                // (N,3C)
  void* dbuf_4c_ = nullptr;                // (N,4C)
};

}  // namespace trainrun
