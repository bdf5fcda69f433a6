// A mixture-of-experts MLP's shape (ModelConfig::moe), shared by the
// Llama-shaped MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE). With
// n_experts > 0 every block's dense gated MLP is replaced by:
//   router:  logits (N,E) = x @ gate^T; p = softmax(logits) (fp32)
//   top-k:   the k largest p per token (ties: the lower expert id, as
//            torch.topk), weights w = p[chosen], divided by their sum when
//            norm_topk_prob (Mixtral always; Qwen2-MoE's default is not)
//   experts: y_t = sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t), e = chosen_tj
//   shared:  (Qwen2-MoE) + sigmoid(x @ shared_gate^T) * MLP_shared(x)
// Dropless: every token reaches its k experts, whatever the load.
//
// The losses transformers adds with output_router_logits (what
// load_balancing_loss_func computes, over the router logits of every layer
// concatenated; counts are not differentiable, the mean probabilities are):
//   aux = E * sum_e f_e * P_e,  f_e = (#(token, slot) choosing e) / (L*N),
//                               P_e = sum over layers and tokens of p_e / (L*N)
//   z   = mean over layers and tokens of logsumexp(logits)^2 (ST-MoE's router z-loss)
// loss = cross-entropy + aux_loss_coef * aux + z_loss_coef * z, per micro-batch.
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

struct MoeConfig {
  int n_experts = 0;            // E (num_local_experts / num_experts); 0 = a dense MLP
  int top_k = 0;                // K (num_experts_per_tok)
  bool norm_topk_prob = true;   // the chosen weights renormalised to sum 1
  bool norm_topk_auto = false;  // the job spec said auto: the arch sets norm_topk_prob (its default)
  int ffn = 0;                  // each routed expert's MLP width (moe_intermediate_size; Mixtral: intermediate_size)
  int shared_ffn = 0;           // the shared expert's width (shared_expert_intermediate_size); 0 = none
  double aux_loss_coef = 0.0;   // router_aux_loss_coef; 0 = no load-balancing loss
  double z_loss_coef = 0.0;     // router z-loss; 0 = none
  // Aux-loss-free balancing (DeepSeek-V3; model.moe_balance: bias): a
  // per-layer, per-expert bias added to the probabilities for the top-k
  // choice only (the gate weights stay the probabilities), updated after
  // every optimizer step from the step's load (token, slot pairs per expert
  // over all micro-batches and data-parallel ranks):
  //   b_e += bias_rate * sign(mean_e load - load_e)
  // It is training state (the checkpoint's manifest), not a weight: the
  // Hugging Face classes have no such term, so export and `generate` route
  // without it. 0 = off.
  double bias_rate = 0.0;
  // The HF module names of a block's MoE tensors:
  //   "mixtral": block_sparse_moe.gate, block_sparse_moe.experts.J.{w1,w3,w2}
  //   "qwen":    mlp.gate, mlp.experts.J.{gate_proj,up_proj,down_proj}
  //              [, mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate]
  std::string naming = "mixtral";
  bool on() const { return n_experts > 0; }
};

// Element offsets of one block's MoE tensors from the start of its MoE
// region (LlamaBlockOffsets::moe). Every expert's gate|up is adjacent (one
// (2F,C) weight per expert, as the dense MLP's) and the experts are stacked,
// so expert e's weights sit at a fixed stride: the grouped GEMM reads
// (E, 2F, C) and (E, C, F) arrays.
struct MoeOffsets {
  int64_t router, gu, down, sgu = -1, sdown = -1, sgate = -1, total;
  // held: the experts this block stores (all, or an expert-parallel rank's
  // n_experts / ep: core/model/moe/expert_parallel_plan.h); the router keeps every expert's row.
  MoeOffsets(int64_t C, const MoeConfig& m, int held = -1) {
    const int64_t E = m.n_experts, H = held < 0 ? E : held, F = m.ffn, FS = m.shared_ffn;
    int64_t o = 0;
    router = o; o += E * C;        // gate / router (E,C)
    gu = o; o += H * 2 * F * C;    // experts' gate_proj (F,C) | up_proj (F,C), per expert (H,2F,C)
    down = o; o += H * C * F;      // experts' down_proj (H,C,F)
    if (FS > 0) {
      sgu = o; o += 2 * FS * C;    // shared_expert gate_proj (FS,C) | up_proj (FS,C)
      sdown = o; o += C * FS;      // shared_expert down_proj (C,FS)
      sgate = o; o += C;           // shared_expert_gate (1,C)
    }
    total = o;
  }
};

}  // namespace trainrun
