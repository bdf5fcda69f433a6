// Qwen3-MoE (transformers' Qwen3MoeForCausalLM, model_type "qwen3_moe",
// transformers >= 4.51): Qwen3's attention (heads head_dim wide, a per-head
// RMSNorm of q and k, no biases) with every block's MLP a mixture of
// experts (ModelConfig::moe; core/model/moe/): num_experts SwiGLU experts
// of moe_intermediate_size, num_experts_per_tok per token, their softmax
// weights renormalised with norm_topk_prob (Qwen3MoeConfig's default is
// false; the published checkpoints say true). No shared expert. HF's
// tensors: mlp.gate (E,C), mlp.experts.J.{gate,up,down}_proj.
//
// Not implemented, refused by name: dense layers among the sparse ones
// (decoder_sparse_step > 1 with more than one layer, mlp_only_layers
// naming a layer), num_experts 0, attention_bias, a sliding window that
// bites, rope_scaling, another activation.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Qwen3MoeArch final : public LlamaArch {
 public:
  explicit Qwen3MoeArch(const ModelConfig& cfg);

  std::string display_name() const override { return "Qwen3-MoE"; }
  std::string describe() const override;
  std::string hf_model_type() const override { return "qwen3_moe"; }
  nlohmann::ordered_json hf_config_json() const override;
  std::map<std::string, std::string> file_metadata() const override;
  nlohmann::ordered_json manifest_model() const override;
  std::vector<ShapeKey> shape_keys() const override;
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_qwen3_moe_arch(const ModelConfig& cfg);
ModelConfig qwen3_moe_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig qwen3_moe_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
