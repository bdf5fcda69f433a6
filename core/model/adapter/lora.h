// LoRA adapters (Hu et al. 2021, as Hugging Face peft implements them): a
// frozen base linear y = W x plus a trainable low-rank update
//
//   y += s * B A dropout(x),   A (r, in), B (out, r), s = alpha / r
//
// on every block linear a target list names (ModelArch::block_linears: HF
// module names, e.g. q_proj, or all-linear). The adapters are a model of
// their own for the rest of the system: a ParamLayout with one unit per
// block ("block l": its A and B tensors, named as peft names them without
// the "base_model.model." prefix), held by an ordinary ParamStore, so only
// they get gradients, AdamW state, master weights and checkpoint entries.
// The base keeps its own layout and store; AdaptedUnitAccess (below) joins
// the two for the Network, which calls LinearAdapters around each GEMM.
//
// Numerics match peft: A starts kaiming-uniform with a = sqrt(5) (U(-1/sqrt(in),
// 1/sqrt(in))), B zero, so the first forward is the base's. The products are
// not cached between forward and backward: the backward recomputes
// dropout(x) and x A^T (N x r, cheap), so the adapters keep no activations
// (activation checkpointing needs nothing more). Dropout is the backend's
// counter-based mask of (seed, step, global token row, feature), so N
// ranks draw what 1 rank draws.
//
// Tensor parallelism (Megatron-style, core/model/tensor_parallel.h): the
// adapters split with the linear they wrap. A column-parallel base (q/k/v,
// gate/up, c_attn, c_fc) keeps A (r, in) whole on every rank and splits B
// (out, r) (and DoRA's m) along out exactly like the base weight's rows, so
// each rank adds its own output columns. A row-parallel base (o_proj,
// down_proj, the c_projs) splits A along in and keeps B (and m) whole: a
// rank's s (x_local A_local^T) B^T is its share of the sum the base's
// all-reduce (or reduce-scatter) completes, so the forward needs no
// collective of its own. Every adapter element whose gradient several ranks
// compute (A of a column target, B and m of a row target, the rows of a KV
// head that T / n_kv ranks share) gets a partial sum on each: the backward
// computes a block's adapter gradients into a scratch and end_block sums
// those elements over the TP group (one all-reduce per block, as the TP
// store's replicated KV-head gradients are) before adding them to the
// store's gradient. The input gradient needs nothing: a column target's dx
// is a partial sum like the base's own and lands before the base reduces
// it. DoRA's row norm is local for a column target; a row-parallel one's is
// the square root of the group's summed partial squares. The layout
// (layout()) stays global, so checkpoints, PEFT files and init_from do not
// depend on the mesh; local_layout() is what a rank's store holds.
//
// DoRA (model.adapter.type: dora; peft's LoraConfig(use_dora=True)) adds a
// trainable magnitude m (out) per target, the third tensor of its unit
// ("<module>.lora_magnitude_vector", peft's file name), and rescales each
// output row of the adapted weight W + s B A to it:
//
//   y = W x + (g - 1) (W dropout(x)) + g s B A dropout(x),   g = m / ||W + s B A||_row
//
// with the row norm held constant (peft detaches it: no gradient reaches A
// or B through it). m starts at ||W||_row (B is zero), computed from the
// base's blocks one at a time (init_magnitudes). The hooks need W itself,
// so AdaptedUnitAccess tells the adapters where each base unit it hands out
// lies (base_acquired). core/model/adapter/dora.cpp holds that path.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/tensor_parallel.h"
#include "kernels/backend.h"

namespace trainrun {

struct LoraOptions {
  int rank = 8;
  double alpha = 16;
  double dropout = 0;
  std::string target_modules = "all-linear";  // comma-joined short names, or all-linear
  bool dora = false;  // model.adapter.type: dora (peft's use_dora): a magnitude vector per target
  static LoraOptions from_spec(const ModelSpec::AdapterSpec& a);
  float scaling() const { return float(alpha / rank); }
};

// One adapted linear.
struct LoraTarget {
  int layer = 0;
  BlockLinear linear;
  std::string module;    // the HF module: "model.layers.0.self_attn.q_proj"
  int a_tensor = 0, b_tensor = 0;  // indices into the adapter layout's tensors
  int64_t a_off = 0, b_off = 0;    // element offsets inside the layer's unit (local_layout())
  // This rank's share of the linear (the whole one without tensor
  // parallelism): its input and output features, its first column in the
  // GEMM's (local) output, and for a row-parallel target (input features
  // split) its first global input feature (dropout's key).
  int64_t in = 0, out = 0, out_begin = 0, in_begin = 0;
  bool row_parallel = false;
  // DoRA only (m_tensor -1 otherwise): the magnitude (out) in the adapter
  // unit, and the base weight W (out, in) inside the base's unit base_unit.
  int m_tensor = -1;
  int64_t m_off = 0;
  int base_unit = 0;
  int64_t w_off = 0;
};

// The short names target_modules asks for, resolved against the arch's
// block linears: all-linear = every one; a name matching none is an Error
// naming it, the key and the names there are.
std::vector<std::string> resolve_target_modules(const ModelArch& arch, const std::string& target_modules);

class LoraAdapters final : public LinearAdapters {
 public:
  // max_rows: the most rows (B*T tokens) one forward computes. tp: the
  // network's tensor parallelism (its plan and TP communicator), null or
  // one rank for none.
  LoraAdapters(const ModelArch& arch, const LoraOptions& opt, Backend* be, int max_rows,
               const TensorParallel* tp = nullptr);

  // Global (logical) layout: files, checkpoints, init.
  const ParamLayout& layout() const { return layout_; }
  // What this rank holds (its TP slice; the global layout without TP), and
  // the plan between the two (null without TP).
  const ParamLayout& local_layout() const { return tp_plan_ ? tp_plan_->local_layout() : layout_; }
  const TensorParallelPlan* tp_plan() const { return tp_plan_.get(); }
  const std::vector<LoraTarget>& targets() const { return targets_; }
  const std::vector<std::string>& target_names() const { return names_; }
  const LoraOptions& options() const { return opt_; }
  float scaling() const { return scale_; }
  // Elements [begin, end) of the adapters' flat init (A kaiming-uniform from
  // (seed, index), B zero), like ModelArch::init_params. DoRA's magnitudes
  // are left zero here: they need the base (init_magnitudes).
  void init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const;
  // DoRA: block `layer`'s magnitudes as peft initialises them, the row norms
  // of W + s B A = ||W|| (a fresh adapter's B is zero), into `flat` (the
  // whole adapter on the host). base_unit: that block's base unit as
  // acquire_params returned it (act dtype, whole). The caller walks the
  // blocks in order on every rank, so a sharded base is gathered one block
  // at a time.
  // Under tensor parallelism the norms are summed over the TP group after
  // the last block: finish_magnitudes (collective over TP; nothing without).
  void init_magnitudes(int layer, const void* base_unit, float* flat);
  void finish_magnitudes(float* flat);
  // Where the base's unit `unit` lies while it is acquired (AdaptedUnitAccess
  // calls it on every acquire_params); DoRA's hooks read W from there.
  void base_acquired(int unit, const void* params) { base_units_[size_t(unit)] = params; }

  // Where the adapters' parameters and gradients are (their ParamStore, or a
  // FlatUnitAccess over the adapter layout). Unit l is block l's.
  void bind(UnitAccess* params) { params_ = params; }
  // Before each micro-batch's forward: the dropout stream (a function of
  // the run's seed and the step) and the global index of its first token
  // row (first sample * T), so a row's mask is the same on any rank layout.
  void set_dropout_rows(uint64_t seed, int64_t row0) {
    drop_seed_ = seed;
    row0_ = row0;
  }
  // Dropout applies to training forwards only (peft's nn.Dropout in train
  // mode); evaluation and sampling forwards run without it.
  void set_training(bool on) { training_ = on; }
  // Debug/tests: override the scale (the "break the scaling" mutation check).
  void set_scaling_for_test(float s) { scale_ = s; }
  // Tests: DoRA's weight norm ||W + s B A|| is detached, as peft's is (the
  // DoRA paper's section 4.3): A and B get no gradient through it, so their
  // gradients are not the loss's finite difference. Record keeps every
  // target's norms of the next passes; Replay uses those instead of
  // recomputing them, so a perturbed A or B leaves the norm where it was and
  // the finite difference is of the loss the gradients are of.
  enum class NormHold { Off, Record, Replay };
  void hold_dora_norms_for_test(NormHold h) { norm_hold_ = h; }

  void begin_block(int layer, bool backward) override;
  void end_block(int layer, bool backward) override;
  void forward(int layer, int gemm, const void* x, void* y, int ldy, int N) override;
  void backward(int layer, int gemm, const void* x, const void* dy, int ldy, void* dx, int N) override;

 private:
  const void* dropped(const LoraTarget& t, const void* x, int N);  // dropout(x) or x
  // DoRA (dora.cpp): W of a target in the acquired base unit; norm_ =
  // ||W + s B A||_row; the forward and backward of one target.
  const void* base_weight(const LoraTarget& t) const;
  void dora_norms(const LoraTarget& t, const void* W, const void* A, const void* B);
  struct DoraPass {
    int r = 0, in = 0, out = 0;
    const void *A = nullptr, *B = nullptr, *m = nullptr, *W = nullptr, *xd = nullptr;
  };
  DoraPass dora_pass(const LoraTarget& t, const void* x, int N);
  void dora_forward(const LoraTarget& t, const void* x, void* ycols, int ldy, int N);
  void dora_backward(const LoraTarget& t, const void* x, const void* dycols, int ldy, void* dx, int N);
  uint64_t target_seed(const LoraTarget& t) const;
  bool dropout_on() const { return training_ && opt_.dropout > 0; }
  // Tensor parallelism: sums the open block's partial gradients over the
  // group into the store's (end_block of a backward).
  void reduce_block_grads(int layer);
  void localize(const ModelArch& arch);  // the constructor's TP part
  LoraOptions opt_;
  float scale_;
  const TensorParallel* tp_ = nullptr;  // null without tensor parallelism
  std::unique_ptr<TensorParallelPlan> tp_plan_;
  // Per block: where the elements several TP ranks hold lie in the unit's
  // gradient (local offset) and in the reduce buffer (their global place
  // in a region per tensor), so one all-reduce sums them.
  struct ReduceCopy {
    int64_t local = 0, buf = 0, count = 0;
  };
  std::vector<std::vector<ReduceCopy>> reduce_copies_;
  std::vector<int64_t> reduce_len_;
  DeviceBuffer grad_scratch_, reduce_buf_;  // fp32: a block's fresh gradients; the packed shared ones
  std::vector<float> msq_;                  // DoRA init under TP: squared magnitudes to sum (global)
  Backend* be_;
  int max_rows_;
  std::vector<std::string> names_;
  ParamLayout layout_;
  std::vector<LoraTarget> targets_;
  std::vector<std::vector<std::vector<int>>> by_gemm_;  // [layer][gemm] -> target indices
  UnitAccess* params_ = nullptr;
  int open_layer_ = -1;
  const char* unit_params_ = nullptr;  // the open block's adapter parameters
  float* unit_grads_ = nullptr;        // and gradients (backward)
  uint64_t drop_seed_ = 0;
  int64_t row0_ = 0;
  bool training_ = true;
  DeviceBuffer xd_, xa_, dxa_;  // (rows, max in) dropout(x) / scratch; (rows, r) x A^T; (rows, r) its gradient
  // DoRA only: the base units as last acquired; (rows, max out) dropout(x)
  // W^T and dropout(x) A^T B^T (then their gradients); (norm_rows_, max in)
  // rows of W + s B A; (max out) fp32 row norms.
  std::vector<const void*> base_units_;
  DeviceBuffer xw_, xba_, wd_, norm_;
  int norm_rows_ = 0;
  NormHold norm_hold_ = NormHold::Off;
  std::map<int, std::vector<float>> held_norms_;  // by a_tensor (tests only)
};

// The fp32 elements a network over a frozen base still writes as "base
// gradients" in one unit (AdaptedUnitAccess's scratch, which nobody reads):
// its norms' (and GPT-2's biases') at their offsets in a block or the head.
// The embedding (unit 0) and lm_head.weight, the largest tensors of a
// model with a big vocabulary, are never written (Network: frozen).
int64_t frozen_grad_scratch_elems(const ParamLayout& base_layout);

// The Network's view of an adapted model: the base's parameters from its
// store (frozen: its gradients land in a scratch that is thrown away and no
// base unit is ever reduced), the adapters' through LoraAdapters. begin_pass
// reaches both stores, so each prefetches in its own order.
class AdaptedUnitAccess final : public UnitAccess {
 public:
  AdaptedUnitAccess(UnitAccess& base, const ParamLayout& base_layout, LoraAdapters& adapters,
                    UnitAccess& adapter_params, Backend* be);
  const void* acquire_params(int unit) override;
  void release_params(int unit) override { base_.release_params(unit); }
  float* unit_grads(int unit) override;
  void grads_done(int) override {}
  void begin_pass(bool backward_pass, bool backward_follows) override;
  LinearAdapters* adapters() override { return &adapters_; }
  bool base_frozen() const override { return true; }
  // Under pipeline parallelism: the network computing through this is a
  // stage's, whose units are local (1..layers its blocks); DoRA finds W by
  // the model's unit (1 + global layer), so a block's is recorded there.
  void set_stage(const PipelineStage& s) {
    staged_ = true;
    first_layer_ = s.first_layer;
    stage_layers_ = s.layers;
  }

 private:
  UnitAccess& base_;
  bool staged_ = false;
  int first_layer_ = 0, stage_layers_ = 0;
  LoraAdapters& adapters_;
  UnitAccess& adapter_params_;
  Backend* be_;
  DeviceBuffer scratch_;  // fp32, the largest base unit: what the network writes as base gradients
  size_t scratch_bytes_ = 0;
};

}  // namespace trainrun
