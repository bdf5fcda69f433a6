// Gemma 2 (Gemma2ForCausalLM, model_type "gemma2") as a ModelArch: the Llama
// network (core/model/llama/) with ModelConfig's Gemma 2 features always on
// for it, as transformers 4.44's modeling_gemma2.py computes them:
//  - RMSNorm x * (1 + w) in fp32 (norm_offset; weights stored around 0);
//  - a norm before and after attention and before and after the MLP
//    (post_norms: input_layernorm, post_attention_layernorm,
//    pre_feedforward_layernorm, post_feedforward_layernorm);
//  - GeGLU, gelu with the tanh approximation (mlp_act gelu_tanh);
//  - the embedding's output times sqrt(hidden_size) (embed_scale);
//  - scores scaled by query_pre_attn_scalar^-0.5 (query_scale), soft-capped
//    by attn_logit_softcapping (attn_softcap), the logits by
//    final_logit_softcapping (final_softcap), the loss's gradient through it;
//  - a sliding window on the even layers (layer_idx % 2 == 0; window_period 2);
//  - head_dim independent of hidden_size / heads, the LM head tied.
// What is Gemma 2's own is here: config.json (Gemma2Config's keys and
// defaults, what it has that trainrun refuses) and the name. The tensor
// names are HF's.
//
// Not done yet (issue #26): the sliding window itself (the network refuses a
// seq_len above sliding_window until the attention ops have it), job-spec
// fields for these features (so model.arch gemma2 / model.init_from are not
// open yet: the registry marks it not implemented), the CUDA kernels of the
// new options, tensor parallelism with the final cap. The KV-cached decoder
// (LlamaDecoder) computes it.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Gemma2Arch final : public LlamaArch {
 public:
  explicit Gemma2Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "Gemma 2"; }
  std::string hf_model_type() const override { return "gemma2"; }
  nlohmann::ordered_json hf_config_json() const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_gemma2_arch(const ModelConfig& cfg);
ModelConfig gemma2_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);

}  // namespace trainrun
