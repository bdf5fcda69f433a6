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
#pragma once
#include <cstdint>
#include <vector>

#include "core/model/arena_plan.h"
#include "core/model/model.h"
#include "core/model/moe/moe_config.h"
#include "kernels/backend.h"

namespace trainrun {

class MoeMlp {
 public:
  // maxN: the most tokens of one call; sets: the per-layer activation sets
  // (L, or 1 with activation checkpointing or in a decoder); layers: the
  // MoE layers whose router losses add up (the network's L); training: the
  // backward's scratch and the router losses too.
  MoeMlp(const MoeConfig& m, int C, Backend* be, int64_t maxN, int sets, int layers, bool training);

  // Places the buffers in the caller's plan (the per-layer sets as kept, or
  // as transient with `sets_transient`: checkpointing's recompute set), or
  // in an arena of its own (allocate_own). Exactly one of the two.
  void plan(ArenaPlan& plan, bool sets_transient);
  void allocate_own();
  size_t own_bytes() const { return own_.bytes(); }
  // What plan() adds (the cost model's and decoders' sizes).
  static size_t bytes(const MoeConfig& m, int C, size_t act_bytes, int64_t maxN, int sets, int layers, bool training);

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
  };
  MoeMlp(const MoeConfig& m, int C, size_t es, int64_t maxN, int sets, int layers, bool training);
  MoeConfig m_;
  int C_;
  Backend* be_ = nullptr;
  size_t es_;
  int64_t maxN_;
  int layers_;
  bool training_;
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
  void* dh_ = nullptr;         // (N*K,F)
  void* dtmp_ = nullptr;       // (N,C) shared: a path's input gradient before it is added
  void* dsh_ = nullptr;        // (N,FS)
  void* dsy_ = nullptr;        // (N,C)
  void* dsg_ = nullptr;        // (N)
};

}  // namespace trainrun
