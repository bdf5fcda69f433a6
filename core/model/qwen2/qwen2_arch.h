// Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM, model_type "qwen2"):
// Llama's network with biases on q_proj, k_proj and v_proj
// (ModelConfig::qkv_bias; not o_proj, not the MLP), the head tied to the
// embedding in the small ones, rope_theta 1e6 in the published configs.
//
// Everything but the Hugging Face side is LlamaArch's: the layout (the
// biases adjacent after the fused q|k|v weight, split over tensor
// parallelism by heads like it), the init (biases 0), the cost model, the
// network and the KV-cached decoder all honour qkv_bias.
//
// Not implemented, refused by name when config.json asks for it (the
// weights would compute another function): a sliding window that bites
// (use_sliding_window true with a window shorter than the context on some
// layer), rope_scaling of any type (transformers 4.44's Qwen2 has none),
// M-RoPE (use_mrope), a head_dim other than hidden_size / heads, an
// activation other than silu.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Qwen2Arch final : public LlamaArch {
 public:
  explicit Qwen2Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "Qwen2"; }
  std::string hf_model_type() const override { return "qwen2"; }
  nlohmann::ordered_json hf_config_json() const override;
};

// The registry's hooks (core/model/model.cpp); from_metadata is Llama's.
std::unique_ptr<ModelArch> make_qwen2_arch(const ModelConfig& cfg);
ModelConfig qwen2_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);

}  // namespace trainrun
