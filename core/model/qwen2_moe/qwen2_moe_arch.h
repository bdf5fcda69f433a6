// Qwen1.5-MoE / Qwen2-MoE (transformers' Qwen2MoeForCausalLM, model_type
// "qwen2_moe"): Qwen2's attention (q/k/v biases) with every block's MLP a
// mixture of experts (ModelConfig::moe; core/model/moe/): num_experts
// SwiGLU experts of moe_intermediate_size, num_experts_per_tok per token,
// their softmax weights renormalised only with norm_topk_prob (false by
// default), plus a shared expert of shared_expert_intermediate_size that
// every token passes through, scaled by sigmoid(shared_expert_gate(x)).
// HF's tensors: mlp.gate (E,C), mlp.experts.J.{gate,up,down}_proj,
// mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate (1,C).
//
// Not implemented, refused by name: dense layers among the sparse ones
// (decoder_sparse_step > 1, mlp_only_layers naming a layer), num_experts 0,
// and what Qwen2 refuses (a sliding window that bites, rope_scaling, another
// activation, attention_dropout).
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Qwen2MoeArch final : public LlamaArch {
 public:
  explicit Qwen2MoeArch(const ModelConfig& cfg);

  std::string display_name() const override { return "Qwen2-MoE"; }
  std::string describe() const override;
  std::string hf_model_type() const override { return "qwen2_moe"; }
  nlohmann::ordered_json hf_config_json() const override;
  std::map<std::string, std::string> file_metadata() const override;
  nlohmann::ordered_json manifest_model() const override;
  std::vector<ShapeKey> shape_keys() const override;
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_qwen2_moe_arch(const ModelConfig& cfg);
ModelConfig qwen2_moe_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig qwen2_moe_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
