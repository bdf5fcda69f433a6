// Mixtral (transformers' MixtralForCausalLM, model_type "mixtral"): Llama's
// attention with every block's MLP a sparse mixture of experts
// (ModelConfig::moe; core/model/moe/): a router over num_local_experts
// SwiGLU experts of intermediate_size, each token to its
// num_experts_per_tok best, their softmax weights renormalised over the
// chosen (Mixtral always renormalises). HF's tensors:
//   block_sparse_moe.gate.weight (E,C), block_sparse_moe.experts.J.w1 (F,C)
//   gate, w3 (F,C) up, w2 (C,F) down.
// transformers adds router_aux_loss_coef times the load-balancing loss
// (moe_config.h) with output_router_logits; a trainrun job adds
// model.router_aux_loss_coef times it (0.001 unless set; 0 = off), whatever
// config.json says, and its export writes the coefficient it trained with.
//
// A sliding_window applies on every layer, as Mistral's. Not implemented,
// refused by name when config.json asks for it: router_jitter_noise (training-time
// multiplicative noise on the router input), attention_dropout, an
// activation other than silu, a head_dim other than hidden_size / heads,
// rope_scaling.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class MixtralArch final : public LlamaArch {
 public:
  explicit MixtralArch(const ModelConfig& cfg);

  std::string display_name() const override { return "Mixtral"; }
  std::string describe() const override;
  std::string hf_model_type() const override { return "mixtral"; }
  nlohmann::ordered_json hf_config_json() const override;
  std::map<std::string, std::string> file_metadata() const override;
  nlohmann::ordered_json manifest_model() const override;
  std::vector<ShapeKey> shape_keys() const override;
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_mixtral_arch(const ModelConfig& cfg);
ModelConfig mixtral_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig mixtral_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
