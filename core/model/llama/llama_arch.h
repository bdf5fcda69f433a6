// Llama 3 as a ModelArch: the layout in sharding units with HF's names and
// the tensor-parallel splits, the counter-based init, the cost model
// (`trainrun plan` plans Llama shapes from it), what our files record, and
// the training Network (LlamaNetwork, llama.h), the KV-cached decoder
// (llama_decoder.h) and the Hugging Face side (llama_hf.cpp: config.json
// both ways; the files are read and written by core/checkpoint).
//
// Layout (nn.Linear (out, in), HS = head_dim or C/NH, Q = NH*HS, KV = NKV*HS):
//   unit 0 "embeddings": model.embed_tokens.weight (V,C)
//   unit 1+l "block l":  input_layernorm.weight (C), self_attn.q_proj (Q,C),
//                        k_proj (KV,C), v_proj (KV,C), o_proj (C,Q),
//                        post_attention_layernorm.weight (C),
//                        mlp.gate_proj (F,C), up_proj (F,C), down_proj (C,F)
//                        [self_attn.q_norm.weight (HS), k_norm.weight (HS) with qk_norm]
//   unit L+1 "head":     model.norm.weight (C) [, lm_head.weight (V,C) untied]
// q|k|v and gate|up are adjacent, so one GEMM reads each pair (or triple)
// as a fused weight; RoPE pairs as HF stores q/k (rotate_half), so HF's
// tensors need no permutation.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/model.h"

namespace trainrun {

// Not final: the Llama-shaped families (core/model/qwen3/, ...) derive from
// it and override their name, config.json and checks.
class LlamaArch : public ModelArch {
 public:
  explicit LlamaArch(const ModelConfig& cfg);  // model.arch llama

  std::string display_name() const override { return "Llama"; }
  bool llama_shaped() const override { return true; }
  std::string describe() const override;
  void init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const override;

  int64_t matmul_parameters() const override;
  double activation_bytes(int B, bool activation_checkpointing, const ActivationDevice& d) const override;

  std::map<std::string, std::string> file_metadata() const override;
  nlohmann::ordered_json manifest_model() const override;

  std::unique_ptr<Network> make_network(Backend* be, int maxB, bool activation_checkpointing,
                                        const TensorParallel* tp = nullptr,
                                        const PipelineStage* stage = nullptr,
                                        const ContextParallel* cp = nullptr,
                                        const ExpertParallel* ep = nullptr) const override;
  std::unique_ptr<Decoder> make_decoder(Backend* be, int capacity) const override;
  size_t decoder_bytes_needed(const Backend& be, int capacity) const override;

  std::string hf_model_type() const override { return "llama"; }
  nlohmann::ordered_json hf_config_json() const override;
  void hf_carry_over(const nlohmann::ordered_json& source, nlohmann::ordered_json& out) const override;
  HfTensor hf_tensor(const ParamTensor& t) const override { return {t.name, false, ""}; }
  std::vector<BlockLinear> block_linears() const override;
  std::string hf_block_prefix(int layer) const override;
  std::vector<const ParamTensor*> hf_save_order() const override;
  bool hf_ignored_buffer(const std::string& canonical_name) const override;
  std::string hf_shape_keys() const override {
    return "num_hidden_layers/hidden_size/num_attention_heads/num_key_value_heads/head_dim/intermediate_size/"
           "vocab_size";
  }
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
  std::vector<ShapeKey> shape_keys() const override;
  const char* hf_context_key() const override { return "max_position_embeddings"; }

 protected:
  // A family on the Llama network: cfg.arch must be `arch`.
  LlamaArch(const ModelConfig& cfg, const char* arch);
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_llama_arch(const ModelConfig& cfg);
ModelConfig llama_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig llama_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
