// Qwen3 (Qwen3ForCausalLM, model_type "qwen3") as a ModelArch: the Llama
// network (core/model/llama/) with two of ModelConfig's shared features
// always on for it — heads model.head_dim wide (128 in every published
// size, so the attention width is not n_embd) and qk-norm (a per-head
// RMSNorm of q and of k before RoPE, weights self_attn.q_norm.weight and
// k_norm.weight of head_dim, Backend::qk_norm_forward) — no biases, tied
// head in the small sizes. What is Qwen3's own is here: config.json both
// ways (Qwen3Config's keys and defaults, and what it has that trainrun
// refuses: attention_bias, a sliding window on any layer), the name, and
// the files' "arch". The tensor names are HF's, as Llama's.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Qwen3Arch final : public LlamaArch {
 public:
  explicit Qwen3Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "Qwen3"; }
  std::string hf_model_type() const override { return "qwen3"; }
  nlohmann::ordered_json hf_config_json() const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_qwen3_arch(const ModelConfig& cfg);
ModelConfig qwen3_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig qwen3_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
