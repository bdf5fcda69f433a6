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
// What is Gemma 2's own is here: config.json both ways (Gemma2Config's keys
// and defaults, what it has that trainrun refuses), the name, and the four
// values a job spec carries (model.attn_softcap, final_softcap, query_scale,
// sliding_window): shape keys (a preset or config.json fills them, a
// disagreeing job is an error naming both), our files' metadata and the
// checkpoint manifest. The tensor names are HF's. Tensor parallelism caps
// each rank's vocabulary columns and the vocab-parallel cross-entropy takes
// the cap (Backend::vocab_ce_finish).
//
// The window, soft-cap and scale are AttentionOptions of the attention ops
// (CPU; the CUDA flash and decode kernels compile, not yet run on a GPU);
// the decoder's even layers keep a ring of sliding_window rows. Not under
// context parallelism yet (the block ops refuse them by name).
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Gemma2Arch final : public LlamaArch {
 public:
  explicit Gemma2Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "Gemma 2"; }
  std::string describe() const override;
  std::string hf_model_type() const override { return "gemma2"; }
  nlohmann::ordered_json hf_config_json() const override;
  // Llama's, and Gemma 2's four values (model.attn_softcap, final_softcap,
  // query_scale, sliding_window): a preset or config.json fills them, and a
  // job spec that sets another is an error naming both.
  std::vector<ShapeKey> shape_keys() const override;
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
  std::map<std::string, std::string> file_metadata() const override;
  nlohmann::ordered_json manifest_model() const override;
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_gemma2_arch(const ModelConfig& cfg);
ModelConfig gemma2_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig gemma2_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
