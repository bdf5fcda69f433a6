// Phi-3 (Phi3ForCausalLM, model_type "phi3") as a ModelArch: Llama's network
// and layout (core/model/llama/) under Phi-3's Hugging Face side.
//
// What differs from Llama is only in the files and config.json:
//   - HF fuses self_attn.qkv_proj.weight ((NH + 2 NKV) HS, C) = q|k|v and
//     mlp.gate_up_proj.weight (2F, C) = gate|up (Phi3MLP: gate, up =
//     chunk(2)). Our layout keeps Llama's q/k/v and gate/up tensors, each
//     a row range of the fused one (HfTensor::fused_row), so import and
//     export stream by ranges like any tensor, and tensor parallelism splits
//     q, k and v by their heads and gate and up by their columns, never the
//     fused tensor as a whole.
//   - Phi3Config's keys and defaults (vocab 32064, rms_norm_eps 1e-5,
//     untied, original_max_position_embeddings, sliding_window).
//   - rope_scaling "longrope" (or its older name "su"; the 128k models):
//     per-frequency short/long factors and a cos/sin scale
//     (kernels/rope_table.h). transformers 4.44 picks the list per forward
//     call by max(position_ids) + 1 > original_max_position_embeddings;
//     trainrun picks it once per model: long when the model's context
//     (model.seq_len; a directory's max_position_embeddings) passes the
//     original one. A training run's forwards are full length, so they agree
//     with transformers; the KV-cached decoder uses the same table, which
//     agrees with transformers' generate unless a generation crosses the
//     original context (transformers then mixes keys rotated by both lists).
//     A job carries it as model.rope_scaling.{type: longrope, short_factor,
//     long_factor, original_max_position_embeddings, max_position_embeddings}
//     (model.init_from fills them from config.json), trainrun's own model
//     files and checkpoint manifests as their metadata, so a longrope model
//     trains, resumes and exports like any other.
// What trainrun does not implement is refused by name:
//   - rope_scaling "yarn" (transformers 4.44 reads it as "longrope", Phi-3's
//     YaRN class differs) and any other type.
// The sliding window (model.sliding_window, config.json's sliding_window) is
// applied on every layer as transformers 4.51.3's eager and SDPA attention
// apply it: keys t - W < j <= t (Mistral's rule; tests/test_phi3.cpp against
// 4.51.3). transformers 4.44 applies it only in its flash-attention path,
// and flash attention's window_size=(W, W) spans W + 1 keys: past the window
// the implementations differ (up to it they agree).
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/llama/llama_arch.h"

namespace trainrun {

class Phi3Arch final : public LlamaArch {
 public:
  explicit Phi3Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "Phi-3"; }
  std::map<std::string, std::string> file_metadata() const override;

  std::string hf_model_type() const override { return "phi3"; }
  nlohmann::ordered_json hf_config_json() const override;
  void hf_carry_over(const nlohmann::ordered_json& source, nlohmann::ordered_json& out) const override;
  HfTensor hf_tensor(const ParamTensor& t) const override;
  std::vector<const ParamTensor*> hf_save_order() const override;
  // Adapters name HF modules, and Phi-3's are the fused qkv_proj and
  // gate_up_proj: not wired yet (an adapter job is refused: no block linears).
  std::vector<BlockLinear> block_linears() const override { return {}; }
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
  // Llama's; a longrope model's are its lists and context lengths instead of llama3's factors.
  std::vector<ShapeKey> shape_keys() const override;
  nlohmann::ordered_json manifest_model() const override;
};

// longrope in the job spec (ModelConfig::from_spec / to_spec): the factor
// lists as text, every digit ("1,1.0500000000000000444,..." round-trips the
// doubles), and back with each value checked by name.
std::string longrope_factors_text(const std::vector<double>& v);
// m.rope_scaling (type longrope) into c: the lists (head_dim / 2 positive
// numbers each) and max_position_embeddings (0: m.seq_len); refused by the
// key's name otherwise, or on an arch other than phi3.
void longrope_from_spec(const ModelSpec& m, ModelConfig& c);

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_phi3_arch(const ModelConfig& cfg);
ModelConfig phi3_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig phi3_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
