// Mistral (transformers' MistralForCausalLM, model_type "mistral": v0.1 to
// v0.3, Nemo) as a ModelArch: Llama's network with two of ModelConfig's
// shared features — the sliding window (ModelConfig::sliding_window, on
// every layer: query t sees keys t - W < j <= t, transformers 4.44's eager
// mask; AttentionOptions::window in the attention ops, the decoder's cache a
// ring of W positions) and model.head_dim (Nemo's 128 with hidden 5120) —
// no biases, untied head. What is Mistral's own is here: config.json both
// ways (MistralConfig's keys and defaults; sliding_window may be null: no
// window), the window in its manifests and model.*'s sliding_window filled
// from config.json (Llama's file metadata and init_from check carry any
// family's window).
//
// Refused by name when config.json asks for it (the weights would compute
// another function): hidden_act other than silu, attention_dropout, any
// rope_scaling (MistralConfig 4.44 has none: it would be ignored by
// transformers and by us, so a file that names one was made for another
// model), a non-integer or non-positive sliding_window.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class MistralArch final : public LlamaArch {
 public:
  explicit MistralArch(const ModelConfig& cfg);

  std::string display_name() const override { return "Mistral"; }
  std::string describe() const override;
  std::string hf_model_type() const override { return "mistral"; }
  nlohmann::ordered_json hf_config_json() const override;
  nlohmann::ordered_json manifest_model() const override;
  std::vector<ShapeKey> shape_keys() const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_mistral_arch(const ModelConfig& cfg);
ModelConfig mistral_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig mistral_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
