// Tensor parallelism's view of a model: what one rank of a TP group of T
// ranks holds, and where every element of it sits in the global (logical)
// model. Megatron-style (facts from megatron/core/tensor_parallel):
//
//   Column   dim 0 (output features) split: q|k|v, gate|up (GPT-2: c_attn,
//            c_fc) and their biases. A tensor with split_blocks b is b equal
//            blocks of dim 0 (GPT-2's fused q|k|v), each split alike, so the
//            local tensor is again q_local | k_local | v_local.
//   Row      dim 1 (input features) split: o_proj / down_proj (attn.c_proj,
//            mlp.c_proj); their partial outputs are all-reduced over TP.
//   Vocab    dim 0 is the vocabulary, padded to a multiple of lcm(T, the
//            backend's row alignment: CUDA 64, CPU 1): rank t holds rows
//            [t*Vl, (t+1)*Vl) (Vl = V_pad / T). Padding rows are zero, never
//            read by the lookup or the loss, never in the grad norm, never
//            saved (checkpoints and model files have vocab_size rows).
//   Replicated  every rank holds all of it (norms, position tables, the
//            biases of row-parallel layers).
//
// Key/value heads: with n_kv % T == 0 they split like the query heads;
// with T % n_kv == 0 every rank holds the one KV head its query heads use,
// so T / n_kv ranks hold the same rows (Megatron's replicated query groups).
// A rank that holds an element another rank also holds is its "owner" only
// if it is the lowest such rank: only owners write checkpoints and count in
// the global grad norm, so every element counts once.
//
// The local layout has the global layout's tensors, units and order, with
// local shapes: the parameter store shards it over the data-parallel ranks
// as it would a whole model. Checkpoints, the final model file and
// model.init_from stay in global coordinates through the runs below.
#pragma once
#include <cstdint>
#include <vector>

#include "core/model/model.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

// A contiguous piece of the local flat parameter vector and where it is
// in the global one.
struct TpRun {
  int64_t local = 0;   // offset in the local flat vector
  int64_t global = 0;  // offset in the global flat vector; -1 for vocab padding
  int64_t count = 0;
  bool owner = true;   // this rank writes it and counts it in the grad norm
};

// The per-rank sizes the networks compute with.
struct TpLocalShape {
  int tp = 1, rank = 0;
  int NH = 0;            // query heads on this rank (n_head / T)
  int NKV = 0;           // key/value heads on this rank (n_kv / T, or 1 when replicated)
  int kv_replicas = 1;   // ranks holding the same KV head (T / n_kv when T > n_kv, else 1)
  int F = 0;             // MLP width on this rank (ffn / T)
  int V_local = 0;       // vocabulary rows on this rank, padding included (V_pad / T)
  int v_begin = 0;       // first global token id of this rank's rows
  int v_valid = 0;       // real (unpadded) rows on this rank
  int V_pad = 0;         // the padded vocabulary (a multiple of vocab_pad_multiple)
};

// What the vocabulary is padded to under tensor parallelism: lcm(tp, the
// backend's row alignment). The alignment is Backend::logits_stride(1)
// (CUDA: 64; CPU: 1, or what make_cpu_backend was given, so the CUDA rule
// runs on the CPU in tests).
int vocab_pad_multiple(int tp, int backend_align);

class TensorParallelPlan {
 public:
  // Throws an Error naming the model.* keys and parallel.tensor_parallel
  // when the model does not split over `tp` ranks.
  // backend_align: the backend's row alignment (see vocab_pad_multiple).
  TensorParallelPlan(const ModelArch& arch, int tp, int rank, int backend_align = 1);
  // Another layout split over the same group as a model's plan splits its
  // own (the LoRA adapters': their B rows follow the column-parallel base
  // weight's split, their A columns the row-parallel one's; shape() is the
  // model plan's).
  TensorParallelPlan(const ParamLayout& global, const TpLocalShape& shape);
  // A split another parallelism computed (expert parallelism's, whose rank
  // holds whole tensors: core/model/moe/expert_parallel_plan.h), so the same
  // global-coordinate store wrapper (parallel/tensor/tp_param_store.h)
  // serves it. `runs` cover `local` in local order; shape: tp and rank only.
  TensorParallelPlan(const ParamLayout& global, const ParamLayout& local, std::vector<TpRun> runs,
                     const TpLocalShape& shape);

  const TpLocalShape& shape() const { return shape_; }
  int size() const { return shape_.tp; }
  int rank() const { return shape_.rank; }
  const ParamLayout& local_layout() const { return local_; }
  const ParamLayout& global_layout() const { return global_; }
  // Every element of the local flat vector, in local order.
  const std::vector<TpRun>& runs() const { return runs_; }
  // The runs covering local [begin, begin+count), cut to it, in local order.
  std::vector<TpRun> runs_in(int64_t begin, int64_t count) const;
  // The local offset of global element g (-1 when this rank does not hold it).
  int64_t local_of(int64_t global) const;
  // Local ranges this rank is not the owner of (replicas, padding): the
  // grad norm skips them.
  std::vector<std::pair<int64_t, int64_t>> non_owner_ranges() const;

 private:
  void split_layout();  // local_, runs_ and by_global_ from global_ and shape_
  TpLocalShape shape_;
  ParamLayout global_, local_;
  std::vector<TpRun> runs_;       // by local offset
  std::vector<size_t> by_global_;  // indices into runs_ of non-padding runs, by global offset
};

// The model's checks alone (the trainer's setup runs them through the plan;
// the job loader can run them before any worker starts).
void check_tensor_parallel(const ModelConfig& cfg, int tp);

// What a Network needs for tensor parallelism: this rank's plan and the TP
// group's communicator (collectives in compute-stream order: Gloo runs them
// synchronously, NCCL on its stream ordered by events).
struct TensorParallel {
  const TensorParallelPlan* plan = nullptr;
  Communicator* comm = nullptr;
  // parallel.sequence_parallel: between the blocks' linears the activations
  // are split along the rows (tokens); all-gather before each column layer,
  // reduce-scatter after each row layer, norm-weight gradients all-reduced.
  bool sequence_parallel = false;
  // In-place sum over the TP group of n act-dtype elements (fp32 or bf16).
  void all_reduce(void* buf, int64_t n, DType dt) const;
  // Host seconds spent inside the activation collectives issued through
  // this context (TpCollectives and all_reduce above), accumulated for the
  // step-time report (metrics.jsonl tp_comm_ms) and `bench comm`. One clock
  // read per collective, a few per layer: cheap next to the collective.
  // On Gloo the collectives are synchronous, so this is their time; NCCL
  // ones return once enqueued on the stream, so on CUDA it is the enqueue
  // cost only (a profiler shows the transfer). The vocab-parallel
  // cross-entropy's max/sum all-reduces of N values are in it too
  // (TpCollectives::vocab_cross_entropy). Single-threaded per rank, like
  // the network.
  mutable double comm_seconds = 0;
  mutable int64_t comm_calls = 0;
  double take_comm_seconds() const {
    const double s = comm_seconds;
    comm_seconds = 0;
    return s;
  }
};

// The collectives a network issues between its GEMMs under tensor (and
// sequence) parallelism, shared by the architectures. Without tensor
// parallelism every call is a pass-through, so the tp1 path runs the same
// ops on the same buffers as before. Without SP a row-parallel output and
// a column layer's input gradient are all-reduced in place; with SP they
// are reduce-scattered into this rank's rows (rows_buf), and a norm's
// output (forward, and again for the column layer's weight gradient in
// backward: only this rank's rows are kept) and the residual gradient
// (backward) are all-gathered before a column layer reads them; a norm's weight gradient, computed
// from this rank's rows only, is summed over the group.
struct TpCollectives {
  const TensorParallel* tp = nullptr;  // null: no tensor parallelism
  Backend* be = nullptr;
  int C = 0;
  bool sp = false;
  void* rows_buf = nullptr;      // (N/T, C) act dtype: reduce-scattered rows (SP)
  void* full_buf = nullptr;      // (N, C) act dtype: gathered rows (SP): the residual gradient, or a norm output
                                 // a column layer reads; valid until the next full_rows call
  float* norm_buf = nullptr;     // (norm_len) fp32: one norm's parameter gradients (SP)
  int norm_len = 0;              // C (RMSNorm) or 2C (LayerNorm weight | bias, adjacent)

  // The vocab-parallel cross-entropy (Megatron's): over this rank's logits
  // columns [v_begin, v_begin + v_valid) (row stride ldv), the row max and
  // then the sums of exponentials and the target's logit (from the rank
  // that holds it) are all-reduced over TP, so the full logits are never
  // gathered; losses (N) are every rank's, and with dlogits (may alias
  // logits) dloss_scale * (softmax - onehot) on this rank's columns.
  // rowmax (N) and stats (2N) are fp32 scratch. Needs `tp`. cap > 0: the
  // logits are soft-capped (each rank capped its columns) and dlogits is the
  // uncapped logits' gradient (Backend::vocab_ce_finish).
  void vocab_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets, float* rowmax,
                           float* stats, int v_begin, int N, int v_valid, int ldv, float dloss_scale,
                           float cap = 0.f) const;

  // This rank's rows of N (N without SP), and where they start in a full buffer.
  int rows(int N) const { return sp ? N / tp->plan->size() : N; }
  void* my_rows(void* full, int N) const;
  // In place: every rank's rows of `full` to every rank (SP; else nothing).
  void gather_rows(void* full, int N) const;
  // A row-parallel layer's (N, C) partial output, or a column layer's
  // partial input gradient, reduced: returns where the (rows(N), C) result is.
  const void* reduce_out(void* partial, int N) const;
  // (rows(N), C) of this rank -> all N rows (SP: full_buf; else `mine`).
  const void* full_rows(const void* mine, int N) const;
  // Where a norm's backward accumulates its parameter gradients, and the
  // step that sums them over the group into `dparams` (norm_len values).
  float* norm_grad(float* dparams) const;
  void norm_grad_done(float* dparams) const;
};

}  // namespace trainrun
