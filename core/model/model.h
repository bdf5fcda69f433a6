// The model interface: one description per architecture.
//
// An architecture (core/model/<arch>/) is a ModelArch: its configuration;
// the parameter layout in sharding units (visit order, ties, and how every
// tensor splits for tensor parallelism); a counter-based init that any
// shard runs on its own slice; the cost model (parameters, FLOPs and
// activation bytes per token: MFU and `trainrun plan`); what our own files
// record about it (safetensors __metadata__, the checkpoint manifest's
// "model" block); the Hugging Face side as data (config.json both ways,
// tensor names and layout conversions); and factories for the compute: a
// Network (forward/backward over Backend ops) and a KV-cached Decoder.
//
// Nothing outside core/model names an architecture: the trainer, the
// sharding stores, checkpoints, HF interop, sampling and the planner hold a
// ModelArch and go through this interface; make_model_arch() is the one
// place that maps a name to an implementation.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/moe/moe_config.h"
#include "kernels/backend.h"
#include "kernels/rope_table.h"

namespace trainrun {

// ---- configuration -------------------------------------------------------------------

// Every architecture's shape in one struct; an architecture reads the fields
// it has. The model.* key each field is named by in messages is given in
// brackets (the job spec has the first six today; the others are the names
// the Llama fields will take there).
struct TensorParallel;  // core/model/tensor_parallel.h
struct ContextParallel;  // parallel/context/cp_attention.h
struct ExpertParallel;   // parallel/expert/expert_dispatch.h

struct ModelConfig {
  std::string arch = "gpt2";   // [model.arch] gpt2 | llama | qwen2 | qwen3 (model_arch_names())
  int L = 4;                   // [model.n_layer] transformer blocks
  int NH = 4;                  // [model.n_head] attention (query) heads; divides C unless head_dim is set
  int NKV = 0;                 // [model.n_kv_head] key/value heads (GQA), divides NH; 0 = NH (gpt2: always NH)
  int C = 128;                 // [model.n_embd] residual width
  int F = 0;                   // [model.ffn_dim] MLP width; 0 = the arch's default (gpt2: 4C, the only width it has)
  int V = 256;                 // [model.vocab_size] vocabulary
  int T = 128;                 // [model.seq_len] context: the longest sequence (gpt2: the position table's rows)
  double init_std = 0.02;      // [model.init_std] std of the normal init
  double norm_eps = 1e-5;      // [model.norm_eps] LayerNorm / RMSNorm epsilon (gpt2: 1e-5, the backend's)
  double rope_theta = 10000;   // [model.rope_theta] RoPE base (llama)
  std::string rope_scaling_type;  // [model.rope_scaling.type] "" (none) | "llama3" (llama)
  RopeScaling rope_scaling;    // [model.rope_scaling.*] with rope_scaling_type "llama3"
  bool tied = true;            // [model.tie_embeddings] LM head = the token embedding (gpt2: always)
  bool qkv_bias = false;       // q/k/v biases (Llama-shaped: set by the arch, qwen2 true; not a spec key)
  // [model.head_dim] each attention head's width; 0 = C/NH. Set (Qwen3,
  // Mistral Nemo): q_proj is (NH*head_dim, C), k/v (NKV*head_dim, C) and
  // o_proj (C, NH*head_dim), so the attention width need not be C.
  int head_dim = 0;
  // Per-head RMSNorm on q and on k before RoPE (Qwen3): weights
  // self_attn.q_norm.weight and k_norm.weight (head_dim each), shared by the
  // heads; Backend::qk_norm_forward. Set by the arch, not the job spec.
  bool qk_norm = false;
  // Gemma 2's maths on the shared Llama network (0 / false / "silu": Llama's).
  // Set by the gemma2 arch from config.json (core/model/gemma2/); not job-spec fields yet.
  float attn_softcap = 0;      // attn_logit_softcapping: scores -> cap * tanh(scores / cap)
  float final_softcap = 0;     // final_logit_softcapping: logits -> cap * tanh(logits / cap)
  double query_scale = 0;      // query_pre_attn_scalar: scores scaled by its^-0.5; 0 = the head size's
  bool norm_offset = false;    // RMSNorm x * (1 + w), its weights stored around 0
  bool post_norms = false;     // RMSNorms on the attention and MLP outputs, before their residual adds
  std::string mlp_act = "silu";  // the gated MLP's activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
  bool embed_scale = false;    // the embedding's output times sqrt(C) (in the activation dtype, as HF)
  int sliding_window = 0;      // [model.sliding_window] 0 = none (Mistral's field; the window size)
  // Which layers slide: layer l is local when l % window_period == 0 (Gemma
  // 2: 2, layers 0, 2, 4, ... as transformers 4.44), 0 = every layer.
  int window_period = 0;
  // Mixture of experts (core/model/moe/moe_config.h): set by the MoE
  // families (mixtral, ...); n_experts 0 = the dense gated MLP.
  MoeConfig moe;

  // The config a job spec describes. model.arch auto is resolved here: the
  // architecture of model.init_from's config.json (its model_type), else
  // gpt2. Throws for an architecture the spec cannot describe yet
  // ("model.arch: llama is not implemented yet").
  static ModelConfig from_spec(const ModelSpec& m);
  // The model.* values of this config (the inverse of from_spec for the
  // fields an arch has; tie_embeddings "true"/"false", rope_scaling.type
  // "none" when unscaled). model.init_from's resolution reads config.json's
  // values through it.
  ModelSpec to_spec() const;
  // A GPT-2 shape by its numbers (tests, benchmarks).
  static ModelConfig of(int L, int NH, int C, int V, int T, double init_std = 0.02);

  int kv_heads() const { return NKV > 0 ? NKV : NH; }
  int head_size() const { return head_dim > 0 ? head_dim : C / NH; }
  int q_dim() const { return NH * head_size(); }  // the attention width NH*HS (C unless head_dim is set)
  // Throws an Error naming the model.* key and what to do (every rule,
  // including the architecture's own: make_model_arch runs it).
  void validate() const;
  // Convenience: make_model_arch(*this)->num_parameters().
  int64_t num_parameters() const;
};

// ---- parameter layout ----------------------------------------------------------------------

struct ParamTensor {
  // How tensor parallelism splits the tensor over a TP group. Matrices are in
  // nn.Linear layout (out, in):
  //   Replicated  every rank holds all of it (norms, position tables, the
  //               biases of row-parallel layers: added once, after the all-reduce)
  //   Column      dim 0 (output features) split: column-parallel weights and
  //               their biases; with split_blocks > 1, dim 0 is that many
  //               equal blocks (GPT-2's q|k|v) and each is split alike
  //   Row         dim 1 (input features) split: row-parallel weights, whose
  //               partial outputs are all-reduced
  //   Vocab       dim 0 is the vocabulary: the token embedding (vocab-parallel
  //               embedding and cross-entropy) and an untied LM head
  enum class Split { Replicated, Column, Row, Vocab };

  std::string name;            // our name (HF-style; hf_tensor() gives Hugging Face's)
  std::vector<int64_t> shape;
  int64_t offset = 0;          // element offset in the whole-model flat buffer (global coordinates)
  int64_t numel = 0;
  int unit = 0;                // which sharding unit owns it
  bool decay = false;          // AdamW weight decay applies (matrices yes, biases/norms no)
  Split split = Split::Replicated;
  int split_blocks = 1;        // Column: equal blocks of dim 0 split one by one
  // Column/Row: the split dim (per block) is this many indivisible units,
  // attention heads (q: n_head, k/v: n_kv_head); 0 = rows/columns. Units
  // split evenly when T divides them; when they divide T, each unit is
  // replicated on T/units ranks (Megatron's query groups for KV heads).
  int split_units = 0;
};
const char* split_name(ParamTensor::Split s);  // "replicated", "column", "row", "vocab"

struct ParamUnit {
  std::string name;            // "embeddings", "block 3", "head"
  int64_t offset = 0;          // element offset of the unit in the flat buffer
  int64_t numel = 0;
};

// A parameter the model uses but does not store: it is another tensor
// (the tied LM head is the token embedding).
struct ParamTie {
  std::string name;            // "lm_head.weight"
  std::string tensor;          // the layout tensor it is: "transformer.wte.weight"
};

struct ParamLayout {
  std::vector<ParamTensor> tensors;  // in flat-buffer order
  // Sharding units in the order a forward visits them: embeddings, block
  // 0..L-1, head (then the embeddings again when the head is tied); a
  // backward visits them in reverse. parallel/ moves each as one flat parameter.
  std::vector<ParamUnit> units;
  std::vector<ParamTie> ties;
  int64_t total = 0;
  const ParamTensor& get(const std::string& name) const;  // throws naming the tensor
  const ParamTensor* find(const std::string& name) const;
};

// Builds a layout in flat-buffer order: begin_unit, add..., end_unit, ...
class LayoutBuilder {
 public:
  void begin_unit(const std::string& name);
  void add(const std::string& name, std::vector<int64_t> shape, bool decay, ParamTensor::Split split,
           int split_blocks = 1, int split_units = 0);
  void end_unit();
  void tie(const std::string& name, const std::string& tensor) { lay_.ties.push_back({name, tensor}); }
  ParamLayout finish();

 private:
  ParamLayout lay_;
  int64_t off_ = 0;
};

// ---- how the compute reaches parameters ----------------------------------------------------

// ---- adapters (core/model/adapter) -------------------------------------------------------

// A linear of a transformer block that an adapter can wrap, in Hugging
// Face's terms. Every block has the same list (ModelArch::block_linears).
struct BlockLinear {
  std::string module;     // HF module path inside the block: "self_attn.q_proj", "attn.c_attn"
  int gemm = 0;           // which of the block's GEMMs computes it (the arch's own numbering)
  int64_t in = 0, out = 0;  // features
  int64_t out_begin = 0;  // its first output column in that GEMM's output (fused q|k|v, gate|up)
  // The short name target_modules matches: the last component ("q_proj").
  std::string short_name() const { return module.substr(module.rfind('.') + 1); }
};

// What a Network calls around the linears of a block when its UnitAccess
// carries adapters (UnitAccess::adapters()): the base GEMM runs as before
// and the adapters of that GEMM add their share. Forward: begin_block(l),
// forward(...) after each GEMM, end_block(l). Backward (the recompute of
// activation checkpointing included): begin_block(l, true), backward(...)
// after each GEMM's own backward, end_block(l, true) (the block's adapter
// gradients are then complete).
class LinearAdapters {
 public:
  virtual ~LinearAdapters() = default;
  virtual void begin_block(int layer, bool backward) = 0;
  virtual void end_block(int layer, bool backward) = 0;
  // y (N, rows ldy apart): GEMM `gemm` of block `layer`'s output; x (N, its in) its input.
  virtual void forward(int layer, int gemm, const void* x, void* y, int ldy, int N) = 0;
  // dy: that GEMM's output gradient (rows ldy apart); dx (N, in) += the
  // adapters' input gradient; their weight gradients accumulate.
  virtual void backward(int layer, int gemm, const void* x, const void* dy, int ldy, void* dx, int N) = 0;
};

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
  // Parameter-efficient fine-tuning: the adapters the network adds around
  // its linears (null: none), and whether the base is frozen (the network
  // then skips the base linears' weight gradients; unit_grads still takes
  // what the rest writes, which the caller throws away).
  virtual LinearAdapters* adapters() { return nullptr; }
  virtual bool base_frozen() const { return false; }
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

// ---- the compute ---------------------------------------------------------------------------

// Document masking (data.document_mask): where each token's document starts
// in its sequence, as the backend's document-masked ops take it
// (kernels/backend.h). Both are device int32 (B,T), made on the host from
// the batch's tokens (core/data/document_mask.h). Under tensor/sequence
// parallelism every TP rank passes the same arrays of the full sequence:
// attention and the embedding run on all T rows on every rank.
// Under context parallelism (make_network's cp) both hold this rank's rows
// (parallel/context/sequence_split.h: global doc starts, positions inside
// the document) and host_doc_start the whole sequences' starts on the host.
struct DocumentMask {
  const int32_t* doc_start = nullptr;  // (B,T) first index of t's document; attention sees keys [doc_start, t]
  const int32_t* pos = nullptr;        // (B,T) t - doc_start: the position wpe / RoPE use
  const int32_t* host_doc_start = nullptr;  // cp only: (B, global T) host, the same on every cp rank
  bool on() const { return doc_start != nullptr; }
};
// A pipeline stage's share of the model (parallel.pipeline_parallel; the
// runtime is parallel/pipeline/): blocks [first_layer, first_layer + layers)
// of the global model, the token embedding with the first stage and the
// final norm and LM head with the last. A stage network numbers its units
// as a whole model of `layers` blocks would (0 embeddings, 1..layers its
// blocks, layers + 1 head); the pipeline's UnitAccess maps them onto the
// stage's parameter store.
struct PipelineStage {
  int first_layer = 0, layers = 0;
  bool first = true, last = true;
  // zero_bubble: the backward runs as backward_input() then, later,
  // backward_weight() (the network keeps each block's output gradients
  // for the weight step in between).
  bool split_backward = false;
  // The pipeline executor's stage networks: the network allocates only its
  // kept activations (core/model/arena_plan.h) and computes over a
  // transient scratch the caller shares between every stage network of
  // the rank (Network::bind_transient), one compute call at a time.
  bool shared_scratch = false;
};
// The config a stage network computes with: `stage`'s blocks (cfg when null).
inline ModelConfig stage_config(ModelConfig cfg, const PipelineStage* stage) {
  if (stage) cfg.L = stage->layers;
  return cfg;
}

// Forward/backward of one architecture over a Backend. Owns the activation
// buffers for up to (maxB, T) tokens; parameters come through UnitAccess.
class Network {
 public:
  virtual ~Network() = default;
  // Forward over inputs (B,T) device int32. With targets: per-token losses
  // (device, B*T fp32 at losses()). When `for_backward`, the logits buffer is
  // replaced by dloss_scale * dloss/dlogits (fused softmax + cross-entropy).
  // `docs` (document masking): the batch's documents, which the backward of
  // this forward uses too (they must stay valid until it); default: one
  // document per sequence, bit for bit the model without documents.
  virtual void forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
                       bool for_backward, float dloss_scale, DocumentMask docs = {}) = 0;
  // Accumulates parameter gradients (+=) for the last forward(for_backward=true).
  virtual void backward(UnitAccess& units) = 0;
  virtual const float* losses() const = 0;          // (B*T) device
  // After forward(for_backward=true) and before backward(): multiplies the
  // gradient of token n's loss by w[n] (device fp32, B*T), so the backward
  // differentiates sum_n w[n] * dloss_scale * loss[n]: the preference
  // objectives' per-sequence weights (core/train/preference.h). Exact: the
  // cross-entropy gradient is linear in its scale. Under TP each rank scales
  // its vocabulary columns; the last pipeline stage only.
  virtual void scale_loss_grad(const float* w) { (void)w; not_a_stage("scale_loss_grad (this network)"); }
  // (B,T,V) device, rows logits_stride() >= V apart, after a forward without for_backward.
  virtual const void* logits() const = 0;
  virtual int logits_stride() const = 0;
  // The activation bytes this network allocated: its whole arena, or with
  // PipelineStage::shared_scratch only the kept part (the owner of the
  // shared scratch counts that once).
  virtual size_t activation_bytes() const = 0;
  // With PipelineStage::shared_scratch: the transient scratch it needs (the
  // buffers written and read within one forward / backward call), and
  // where it lies, bound before the first forward; the caller keeps it
  // alive. 0 and a no-op for a network with its own arena.
  virtual size_t transient_bytes() const { return 0; }
  virtual void bind_transient(void* scratch) { (void)scratch; }
  // Frees the activation buffers (the end-of-run sample's decoder needs the
  // room); forward/backward must not be called afterwards.
  virtual void free_activations() = 0;
  // Mixture of experts (ModelConfig::moe): the last forward's router
  // figures, copied to the host (the reporter reads them at logged steps):
  // the load-balancing and z losses (unscaled) and, per layer, the tokens
  // (token, slot pairs) the busiest expert got and the mean per expert
  // (N*K/E; max/mean 1 = balanced). No layers without experts.
  struct RouterReport {
    double aux_loss = 0, z_loss = 0;
    std::vector<double> max_tokens, mean_tokens;  // per layer
  };
  virtual RouterReport router_report() const { return {}; }
  // Aux-loss-free balancing (MoeConfig::bias_rate > 0, moe_config.h): the
  // (layers, E) expert bias the top-k choice adds, and the (layers, E) load
  // the training forwards counted since the last take (which restarts it;
  // empty without the option). The trainer owns the update.
  virtual void set_expert_bias(const std::vector<float>& bias) { (void)bias; }
  virtual std::vector<float> take_expert_load() { return {}; }

  // ---- pipeline stages (make_network with a PipelineStage) ----
  // What one stage hands the next: the residual stream after its last
  // block, (rows, C) act dtype, rows = this rank's rows of the micro-batch's
  // B*T tokens (all of them; 1/T under sequence parallelism). A stage that
  // is not the first reads stage_input() instead of embedding `inputs`
  // (forward may get null inputs); one that is not the last leaves its
  // output at stage_output() and computes no loss (targets may be null).
  // Its backward starts from stage_output_grad() (dL/d output, written by
  // the caller before backward()) and, when not the first, leaves dL/d
  // input at stage_input_grad().
  virtual int64_t stage_io_elems(int B, int T) const { not_a_stage("stage_io_elems"); }
  virtual void* stage_input() { not_a_stage("stage_input"); }
  virtual const void* stage_output() const { not_a_stage("stage_output"); }
  virtual void* stage_output_grad() { not_a_stage("stage_output_grad"); }
  virtual const void* stage_input_grad() const { not_a_stage("stage_input_grad"); }
  // zero_bubble (a stage built with split_backward): backward() in two
  // steps. backward_input() computes the input gradient (stage_input_grad())
  // and every gradient but the blocks' linear weights and biases, keeping
  // the output gradients those need; backward_weight() computes them, after
  // which the blocks' units are grads_done. Together they add exactly what
  // backward() adds.
  virtual void backward_input(UnitAccess& units) { not_a_stage("backward_input"); }
  virtual void backward_weight(UnitAccess& units) { not_a_stage("backward_weight"); }

 private:
  [[noreturn]] static void not_a_stage(const char* what);
};

// Incremental forward for sampling, with a KV cache; parameters come
// through UnitAccess exactly as in training (so a sharded run samples
// without any rank holding the whole model).
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual size_t bytes() const = 0;      // what it allocated on the backend
  virtual int capacity() const = 0;      // positions the cache holds
  virtual int position() const = 0;      // positions in the cache
  virtual void reset() = 0;              // forget the cache (positions restart at 0)
  // Feeds n tokens (host ids) at positions [position(), position()+n) and
  // returns the fp32 logits (V) of the last one. Needs position() + n <= capacity().
  virtual void feed(UnitAccess& units, const int32_t* tokens, int n, std::vector<float>& logits) = 0;
};

// What an activation estimate assumes about the device (the planner's
// DeviceModel); the real sizes come from the Backend (act_dtype,
// attention_saved_floats, logits_stride).
struct ActivationDevice {
  int act_bytes = 4;             // bytes per activation element (fp32 4, bf16 2)
  bool attention_probs = true;   // attention keeps (B,NH,T,T) probabilities (CPU), else (B,NH,T) log-sum-exp
  int logits_align = 1;          // logits rows padded to a multiple of this
};

// How a layout tensor appears in a Hugging Face directory.
//
// One HF tensor may hold several of ours (Phi-3's qkv_proj = q|k|v and
// gate_up_proj = gate|up, stacked along dim 0): each of ours then names the
// fused tensor, its first row there (fused_row) and the fused tensor's rows
// (fused_rows); ours is rows [fused_row, fused_row + shape[0]) of it, a
// contiguous byte range, so import reads and export writes each part by
// ranges like a whole tensor. Our layout keeps the parts apart, so each
// splits for tensor parallelism by its own heads/columns. The parts of one
// fused tensor are adjacent in hf_save_order(), in row order, and cover it.
struct HfTensor {
  std::string name;          // HF's name: "transformer.h.0.attn.c_attn.weight"
  bool transposed = false;   // HF stores it (in, out), the transpose of our (out, in) (GPT-2's Conv1D)
  std::string layout_note;   // for messages about its shape: "Hugging Face Conv1D layout: in, out"
  int64_t fused_row = 0;     // with fused_rows > 0: our first row in the fused tensor
  int64_t fused_rows = 0;    // the fused tensor's dim 0 (0: `name` is ours alone)
  bool fused() const { return fused_rows > 0; }
  // HF's shape of `name` for our tensor t.
  std::vector<int64_t> hf_shape(const std::vector<int64_t>& ours) const {
    if (fused()) {
      std::vector<int64_t> s = ours;
      s[0] = fused_rows;
      return s;
    }
    return transposed ? std::vector<int64_t>{ours[1], ours[0]} : ours;
  }
};

// One model.* field of an architecture's shape and the config.json key that
// holds it ("model.n_layer", "num_hidden_layers").
struct ShapeKey {
  const char* field;
  const char* hf_key;
};

// ---- the architecture ----------------------------------------------------------------------

class ModelArch {
 public:
  virtual ~ModelArch() = default;
  // The validated config, with its defaults resolved (NKV, F filled in).
  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  const std::string& name() const { return cfg_.arch; }  // "gpt2"
  virtual std::string display_name() const = 0;          // "GPT-2", for messages
  // Built on the Llama network (RMSNorm with one statistic per row, fused
  // q|k|v of NH + 2*NKV heads, gated MLP, RoPE): the planner's buffer
  // formulas for such archs are Llama's.
  virtual bool llama_shaped() const { return false; }
  // One line: "gpt2 L=12 C=768 heads=12 V=50257 T=1024".
  virtual std::string describe() const = 0;

  // Deterministic, counter-based init: element i of the flat buffer is a
  // function of (seed, i) only, so any shard initialises its own slice and
  // every world size starts from the same weights. Writes [begin, end) of the
  // flat parameter vector into host memory `out` (end - begin floats).
  virtual void init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const = 0;

  // ---- cost model (MFU and `trainrun plan`: one set of formulas) ----
  int64_t num_parameters() const { return layout_.total; }
  // N of the MFU formula: the weights that multiply activations, i.e. every
  // matrix including the LM head, but not lookup tables (position
  // embeddings; the input embedding when it is not tied to the head).
  virtual int64_t matmul_parameters() const = 0;
  // Training FLOPs per token, forward + backward: 6N + 12*L*Q*T (Q = NH*HS,
  // C unless model.head_dim is set). 6N is two FLOPs per multiply-add, times
  // three for forward + the two backward GEMMs; 12*L*Q*T is attention's QK^T
  // and AV (2*2*T*Q per layer forward, x3). Like PaLM and nanoGPT it counts the full T x T attention, not the
  // causal half, and not the recompute of activation checkpointing (that is
  // hardware FLOPs, not model FLOPs), so MFU is comparable with theirs.
  virtual double flops_per_token() const;
  // The Network's activation arena for micro-batch B, buffer by buffer (on
  // the CPU backend equal to make_network(...)->activation_bytes()).
  virtual double activation_bytes(int B, bool activation_checkpointing, const ActivationDevice& d) const = 0;

  // ---- our files ----
  // The safetensors __metadata__ of our model files (checkpoints' and the
  // run's model.safetensors); config_from_file_metadata() reads it back.
  // It is part of a checkpoint's header: it must not change for an arch
  // whose checkpoints exist.
  virtual std::map<std::string, std::string> file_metadata() const = 0;
  // A checkpoint manifest's "model" block: {"arch": name, shape keys...};
  // a resume must find the same values (manifest_model_mismatch()).
  virtual nlohmann::ordered_json manifest_model() const = 0;

  // ---- compute ----
  // tp: this rank's tensor-parallel plan and group (core/model/tensor_parallel.h);
  // null = the whole model on one rank (the path every tp1 run takes).
  // stage: one pipeline stage's layers (PipelineStage); null = every layer.
  // cp: the context-parallel group (parallel/context/cp_attention.h); null =
  // none. With it the network holds and computes T / cp rows per sequence
  // (forward's T), attention goes through the cp group, and positions come
  // from the DocumentMask (global ones when it has no documents).
  // ep: the expert-parallel group (parallel/expert/expert_dispatch.h); null
  // = none. With it a mixture of experts runs its share of the experts for
  // the tokens of the whole group (a dense model refuses it).
  virtual std::unique_ptr<Network> make_network(Backend* be, int maxB, bool activation_checkpointing,
                                                const TensorParallel* tp = nullptr,
                                                const PipelineStage* stage = nullptr,
                                                const ContextParallel* cp = nullptr,
                                                const ExpertParallel* ep = nullptr) const = 0;
  // capacity: positions the cache holds, 1..T.
  virtual std::unique_ptr<Decoder> make_decoder(Backend* be, int capacity) const = 0;
  // Whether make_decoder works (sampling); the end-of-run sample is skipped,
  // with a line, for an architecture without one.
  virtual bool has_decoder() const { return true; }
  // What a decoder of this capacity allocates on `be`.
  virtual size_t decoder_bytes_needed(const Backend& be, int capacity) const = 0;

  // ---- adapters (core/model/adapter) ----
  // The linears of every block an adapter can wrap (empty: none), and the
  // HF module prefix of block `layer` ("model.layers.3.").
  virtual std::vector<BlockLinear> block_linears() const { return {}; }
  virtual std::string hf_block_prefix(int layer) const { return ""; }

  // ---- Hugging Face ----
  virtual std::string hf_model_type() const = 0;               // config.json's model_type
  // config.json for an export ("torch_dtype" says float32; the export sets the dtype it writes).
  virtual nlohmann::ordered_json hf_config_json() const = 0;
  // An export of a model fine-tuned from an HF directory (model.init_from) or
  // re-exported from one: what of the source's config.json `source` (same
  // model_type) the export keeps in `out` (hf_config_json()). Every arch: the
  // special token ids (bos/eos/pad_token_id: the tokenizer's, which trainrun
  // does not know); Llama also a longer max_position_embeddings.
  virtual void hf_carry_over(const nlohmann::ordered_json& source, nlohmann::ordered_json& out) const;
  // Where a layout tensor is in an HF directory, and in which layout.
  virtual HfTensor hf_tensor(const ParamTensor& t) const = 0;
  // The layout's tensors in the order save_pretrained writes them (the HF
  // model's named_parameters()), which decides where an export's shards
  // split: the same limit gives save_pretrained's shards. Default: the
  // layout's order (GPT-2's is HF's).
  virtual std::vector<const ParamTensor*> hf_save_order() const;
  // A name in an HF file as it is looked up (GPT-2: without the optional
  // "transformer." prefix, which GPT2Model leaves out).
  virtual std::string hf_canonical_name(const std::string& file_name) const { return file_name; }
  // A (canonical) name HF files may carry that is not a parameter (saved
  // buffers such as GPT-2's causal masks): skipped without a warning.
  virtual bool hf_ignored_buffer(const std::string& canonical_name) const { return false; }
  // The config.json keys of the shape, for messages ("n_layer/n_embd/vocab_size").
  virtual std::string hf_shape_keys() const = 0;
  // model.init_from: this (the job's) model must be the directory's, `hf`
  // (read_hf_model_config), except where the arch allows a difference
  // (gpt2: a shorter model.seq_len). Throws naming the model.* key, the
  // config.json key and both values.
  virtual void check_init_from(const ModelConfig& hf, const std::string& dir) const = 0;
  // The model.* fields that describe this model (not model.seq_len, the
  // training context), with their config.json keys: what model.preset and
  // model.init_from fill in (core/model/model_spec.h). Only the fields the
  // arch reads (gpt2 has no n_kv_head); rope_scaling's numbers only when
  // this config is scaled.
  virtual std::vector<ShapeKey> shape_keys() const = 0;
  // config.json's key for the longest context (gpt2 n_positions, llama
  // max_position_embeddings): model.seq_len may not exceed it.
  virtual const char* hf_context_key() const = 0;

 protected:
  ModelArch(ModelConfig cfg, ParamLayout layout) : cfg_(std::move(cfg)), layout_(std::move(layout)) {}
  ModelConfig cfg_;
  ParamLayout layout_;
};

// ---- the registry ---------------------------------------------------------------------------

// The rules every architecture's config obeys (positive sizes, heads that
// divide the width, a known rope_scaling type, ...); each ModelArch adds its
// own. Throws an Error naming the model.* key.
void check_model_config_common(const ModelConfig& cfg);

// The architecture for a config (validated first: every message names the
// model.* key). An unknown arch is an Error naming it and the known ones.
std::unique_ptr<ModelArch> make_model_arch(const ModelConfig& cfg);
std::vector<std::string> model_arch_names();            // "gpt2", "llama", "qwen2", "qwen3"
// The arch an HF model_type belongs to ("" when none does).
std::string arch_for_hf_model_type(const std::string& model_type);

// DIR/config.json -> ModelConfig. The model_type picks the arch; with
// `want_arch` non-empty it must be that one. Keys config.json leaves out take
// transformers' defaults, as from_pretrained would; what the arch does not
// implement is refused (the weights would compute another function).
// `what` prefixes every message ("model.init_from", "export").
ModelConfig read_hf_model_config(const std::string& dir, const std::string& what, const std::string& want_arch = "");

// The __metadata__ of one of our model files -> its config ("arch" absent:
// gpt2, the files before it was written). `path` names the file in messages.
ModelConfig config_from_file_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

// A checkpoint manifest's "model" block against the arch resuming from it:
// "" when they agree, else "model.<key> = <saved> but this job has <now>".
// A manifest without "arch" (format 2 before it had one) is gpt2.
std::string manifest_model_mismatch(const ModelArch& arch, const nlohmann::ordered_json& saved);

}  // namespace trainrun
