// The mixture-of-experts MLP of a Llama-shaped block (ModelConfig::moe;
// the maths and the router losses: moe_config.h). LlamaNetwork and
// LlamaDecoder call it in place of the dense gated MLP; it owns the MoE
// activations (placed in the caller's ArenaPlan, or an arena of its own)
// and the router statistics of the last forward.
//
// One layer's forward, N tokens, E experts, K chosen, F expert width:
//   logits (N,E) = x @ router^T             matmul_forward
//   probs, lse, idx, w                     moe_route_forward
//   xp (N*K,C) = x in expert order          moe_permute
//   gu (N*K,2F) = xp @ [gate|up]_e^T        moe_expert_matmul_forward (one GEMM per expert)
//   h = silu(gate) * up                     swiglu_forward
//   yp (N*K,C) = h @ down_e^T               moe_expert_matmul_forward
//   out (N,C) = sum_j w_tj yp[pos(t,j)]     moe_unpermute_forward
//   [+ sigmoid(x @ sgate^T) * shared MLP(x)]  matmul/swiglu + moe_sigmoid_gate_forward
// The backward runs the same ops' backwards in reverse; the router's takes
// the load-balancing loss's gradient (aux_grad, from every layer's counts,
// so it is known only after the whole forward: finish_forward).
//
// Expert parallelism (ep, parallel/expert/expert_dispatch.h): the routing
// and the permute stay local; the permuted rows go to their experts' ep
// ranks (all_to_all_v), this rank runs its n/ep experts over the rows of
// the whole group (xr), and the outputs come back before the unpermute.
// The received rows' buffers (xr, gu, h per set; the exchange scratch) are
// placed for the balanced case, N*K rows (ep ranks x N*K/ep: what the
// planner budgets, ep_exchange_bytes), and grow on demand: dropless, a rank
// may receive up to ep*N*K rows (a router that sends every token to its
// experts), ep times the balanced rows, for every layer; placing that worst
// case would cost (ep-1)*N*K*(C + 3F) act bytes per layer more for a load
// the aux loss exists to prevent. Growing is safe: every rank knows its
// recv_total from the count exchange before any row moves, and it
// allocates alone (no collective), before the all_to_all_v that needs it.
// A grown buffer is kept (the high-water mark), so a steady load does not
// allocate every step. The backward mirrors it. Every rank still holds every
// expert's weights; the ones it does not run get no gradient here, and the
// data-parallel reduction (a sum over ranks that include every ep rank)
// adds each expert's gradient from the one rank per ep group that ran it.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/arena_plan.h"
#include "core/model/model.h"
#include "core/model/moe/moe_config.h"
#include "kernels/backend.h"
#include "parallel/expert/expert_dispatch.h"

namespace trainrun {

class MoeMlp {
 public:
  // maxN: the most tokens of one call; sets: the per-layer activation sets
  // (L, or 1 with activation checkpointing or in a decoder); layers: the
  // MoE layers whose router losses add up (the network's L); training: the
  // backward's scratch and the router losses too.
  // ep: the expert-parallel group (null or size 1: every expert here).
  MoeMlp(const MoeConfig& m, int C, Backend* be, int64_t maxN, int sets, int layers, bool training,
         const ExpertParallel* ep = nullptr);
  ~MoeMlp();

  // Places the buffers in the caller's plan (the per-layer sets as kept, or
  // as transient with `sets_transient`: checkpointing's recompute set), or
  // in an arena of its own (allocate_own). Exactly one of the two.
  void plan(ArenaPlan& plan, bool sets_transient);
  void allocate_own();
  size_t own_bytes() const { return own_.bytes(); }
  // What plan() adds (the cost model's and decoders' sizes).
  static size_t bytes(const MoeConfig& m, int C, size_t act_bytes, int64_t maxN, int sets, int layers, bool training);
  // What expert parallelism at degree ep adds to plan() with balanced
  // routing (the received rows kept per set, the exchange scratch): the
  // planner's landing buffers. 0 at ep 1.
  static size_t ep_exchange_bytes(const MoeConfig& m, int C, size_t act_bytes, int64_t maxN, int sets, bool training,
                                  int ep);
  // ep: the allocations past the plan's balanced rows so far (each a new
  // high-water mark of some set or the scratch) and the bytes they hold now.
  int grow_count() const { return grows_; }
  size_t grown_bytes() const;

  // A forward starts: the statistics restart (with_stats: a real forward,
  // not activation checkpointing's recompute, whose routing is the same).
  // count_load: a training forward whose routing counts toward the step's
  // expert load (aux-loss-free balancing; not evaluation's forwards).
  void begin_forward(bool with_stats, bool count_load = false);
  // out(N,C) = the MoE MLP of x(N,C) for block `set`/`layer`; w: the
  // block's MoE region (MoeOffsets), act dtype.
  // layer: the block's index in this network (the expert bias's row; -1: set).
  void forward(int set, const void* w, const void* x, void* out, int N, int layer = -1);
  // After every layer's forward: the router losses added to the N per-token
  // losses (null: only computed), their gradient with the weight
  // grad_scale = the trainer's dloss_scale * N (each token's loss carries
  // its share, so the sum over tokens / the global target count is the
  // micro-batch mean's share of the step's mean).
  void finish_forward(float* losses, int N, float grad_scale);
  // dx(N,C) = d/dx (overwritten); dw: the block's MoE region gradient
  // (fp32, +=; null: no weight gradients, as a frozen base).
  void backward(int set, const void* w, float* dw, const void* x, const void* dout, void* dx, int N);

  // Pipeline stages (the router losses span every stage's layers; the
  // network moves these through its stage messages): the MoE layers the
  // losses average over (the model's, not the stage's); the running (2E+1)
  // statistics taken over from the stage before (right after
  // begin_forward) and handed on (after the stage's layers); a stage
  // before the last's gradient scale (finish_forward's grad_scale, for the
  // z-loss's local gradient) and its aux gradient (E, from the last stage's
  // copy_aux_grad). All device fp32 pointers.
  void set_loss_layers(int layers) { loss_layers_ = layers; }
  void start_statistics_from(const float* partial);
  void copy_statistics(float* out) const;
  void set_stage_grad_scale(int N, float grad_scale);
  void copy_aux_grad(float* out) const;
  void set_aux_grad(const float* g);
  // Device fp32: [aux, z] of the last finish_forward; the per-layer router
  // statistics (layers, 2E+1) of the last forward (moe_router_stats).
  const float* losses_out() const { return loss_out_; }
  const float* layer_stats() const { return stats_; }
  int stats_stride() const { return 2 * m_.n_experts + 1; }
  // The figures of the last forward with statistics, copied to the host.
  Network::RouterReport report(Backend* be) const;

  // Aux-loss-free balancing (MoeConfig::bias_rate > 0): the expert bias
  // (layers, E) the top-k choice adds, and the load (token, slot pairs per
  // layer and expert) the training forwards counted since the last take,
  // which restarts it.
  void set_bias(const std::vector<float>& bias);
  std::vector<float> take_load();

 private:
  struct Acts {
    float* probs; float* lse; int32_t* idx; float* w;  // (N,E) (N) (N,K) (N,K) fp32 routing
    int32_t* pos; int32_t* offsets;                    // (N*K) (E+1) expert order
    void* xp; void* gu; void* h; void* yp;             // (N*K, C | 2F | F | C)
    void* sgu = nullptr; void* sh = nullptr; void* sy = nullptr; void* sg = nullptr;  // shared: (N,2FS) (N,FS) (N,C) (N)
    // ep: the received rows in local expert order (R,C), their expert
    // outputs (R,C), the local experts' offsets (El+1); gu and h are then (R, 2F | F)
    void* xr = nullptr; int32_t* loff = nullptr;
    int64_t rows = 0;  // ep: the rows xr, gu and h hold (the plan's N*K, or grown)
    DeviceBuffer grown;  // ep: xr|gu|h once a set received more than the plan's rows
  };
  MoeMlp(const MoeConfig& m, int C, size_t es, int64_t maxN, int sets, int layers, bool training, int ep_size);
  // Rows the experts of one call see as placed: N*K (under expert
  // parallelism the balanced case; more grows, ep_fit).
  int64_t expert_rows() const { return maxN_ * m_.top_k; }
  // ep: from a's permuted rows to the local experts' inputs (a.xr) and the
  // plan of the set's exchange; returns the rows received.
  int64_t ep_dispatch(int set, Acts& a);
  // ep: a's and the scratch's buffers hold at least R received rows (grows them).
  void ep_fit(Acts& a, int64_t R);
  MoeConfig m_;
  int C_;
  Backend* be_ = nullptr;
  size_t es_;
  int64_t maxN_;
  int layers_;
  int loss_layers_;  // the layers the router losses average over (layers_, or the whole pipeline's)
  bool training_;
  int ep_size_ = 1;
  int held_ = -1;          // experts in the parameters (-1: all; split storage: the local ones)
  int stored_first_ = 0;   // the first of them
  std::unique_ptr<ExpertDispatch> disp_;        // ep > 1
  std::vector<ExpertDispatch::Plan> plans_;     // per set: the last forward's exchange (its backward's too)
  std::vector<int32_t> host_off_;               // (E+1) the permute's offsets on the host
  // ep scratch of scratch_rows_ rows: the all_to_all_v side of a reorder
  // (R,C); the local experts' output, then its gradient, then their input
  // gradient (R,C); the backward's d h (R,F). Grown together (grown_scratch_).
  void* staging_ = nullptr;
  void* yr_ = nullptr;
  int64_t scratch_rows_ = 0;
  DeviceBuffer grown_scratch_;
  int grows_ = 0;
  std::vector<Acts> sets_;
  int layer_ = 0;            // the next forward's layer (statistics row)
  int last_n_ = 0;           // the tokens of the last forward with statistics
  bool stats_on_ = false;
  float z_scale_ = 0.f;
  DeviceBuffer own_;
  // fp32 statistics and losses
  float* stats_ = nullptr;     // (layers, 2E+1) per layer
  float* total_ = nullptr;     // (2E+1) over the layers
  float* loss_out_ = nullptr;  // (2) aux, z
  float* aux_grad_ = nullptr;  // (E)
  float* bias_ = nullptr;      // (layers, E) aux-loss-free balancing: the top-k choice's bias
  float* load_ = nullptr;      // (layers, 2E+1) moe_router_stats over the step's training forwards
  bool count_load_ = false;
  bool balance_ready_ = false;  // bias_ and load_ zeroed (the arena's memory is not)
  void ready_balance();
  // scratch
  void* logits_ = nullptr;     // (N,E) act: the router's logits, then their gradient
  float* dw_ = nullptr;        // (N,K) fp32
  void* dyp_ = nullptr;        // (N*K,C): d yp, then d xp
  void* dh_ = nullptr;         // (N*K,F); ep: (scratch_rows_,F)
  void* dtmp_ = nullptr;       // (N,C) shared: a path's input gradient before it is added
  void* dsh_ = nullptr;        // (N,FS)
  void* dsy_ = nullptr;        // (N,C)
  void* dsg_ = nullptr;        // (N)
};

}  // namespace trainrun
