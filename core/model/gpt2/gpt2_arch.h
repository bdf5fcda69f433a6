// GPT-2 as a ModelArch: the layout, init, network and decoder of gpt2.h /
// gpt2_decoder.h, its cost model, what our files record about it, and its
// Hugging Face side (gpt2_hf.cpp).
//
// Hugging Face GPT-2 directories hold config.json (GPT2Config: model_type
// "gpt2", n_layer, n_head, n_embd, vocab_size, n_positions, ...) and weights
// with HF's names AND layouts. The one difference from our own files is the
// layout of the four projection matrices: HF GPT-2 uses Conv1D, whose
// weight is (in, out), the transpose of our nn.Linear (out, in):
//   attn.c_attn.weight (C, 3C)   attn.c_proj.weight (C, C)
//   mlp.c_fc.weight    (C, 4C)   mlp.c_proj.weight  (4C, C)
// lm_head.weight is not written: GPT2LMHeadModel ties it to transformer.wte
// (tie_word_embeddings, the default), and save_pretrained omits it too
// (safetensors cannot hold two names for one storage). On import it is
// accepted when present only if it equals wte, since our head is always tied.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model/model.h"

namespace trainrun {

class GPT2Arch final : public ModelArch {
 public:
  // Checks what GPT-2 cannot be (grouped-query attention, another MLP width,
  // an untied head, another LayerNorm epsilon, RoPE scaling), naming the key.
  explicit GPT2Arch(const ModelConfig& cfg);

  std::string display_name() const override { return "GPT-2"; }
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

  std::string hf_model_type() const override { return "gpt2"; }
  nlohmann::ordered_json hf_config_json() const override;
  HfTensor hf_tensor(const ParamTensor& t) const override;
  std::vector<BlockLinear> block_linears() const override;
  std::string hf_block_prefix(int layer) const override;
  std::string hf_canonical_name(const std::string& file_name) const override;
  bool hf_ignored_buffer(const std::string& canonical_name) const override;
  std::string hf_shape_keys() const override { return "n_layer/n_embd/vocab_size"; }
  void check_init_from(const ModelConfig& hf, const std::string& dir) const override;
  std::vector<ShapeKey> shape_keys() const override {
    return {{"model.n_layer", "n_layer"}, {"model.n_head", "n_head"}, {"model.n_embd", "n_embd"},
            {"model.vocab_size", "vocab_size"}};
  }
  const char* hf_context_key() const override { return "n_positions"; }
};

// The registry's hooks (core/model/model.cpp).
std::unique_ptr<ModelArch> make_gpt2_arch(const ModelConfig& cfg);
// config.json (parsed) -> config; only the features our GPT-2 implements
// (tanh GELU, LayerNorm eps 1e-5, MLP width 4C, tied head, scaled
// attention). Keys config.json leaves out take transformers' GPT2Config
// defaults. `path` and `what` are for messages.
ModelConfig gpt2_config_from_hf(const nlohmann::ordered_json& c, const std::string& path, const std::string& what);
ModelConfig gpt2_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path);

}  // namespace trainrun
