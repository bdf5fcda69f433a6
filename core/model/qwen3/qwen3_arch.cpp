// Qwen3 (qwen3_arch.h): the Llama network with head_dim and qk-norm, and
// Qwen3Config's side of config.json.
#include "core/model/qwen3/qwen3_arch.h"

#include <nlohmann/json.hpp>

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {
// Every Qwen3 normalises q and k per head: not a choice of the config.
ModelConfig with_qk_norm(ModelConfig c) {
  c.qk_norm = true;
  return c;
}
}  // namespace

Qwen3Arch::Qwen3Arch(const ModelConfig& cfg) : LlamaArch(with_qk_norm(cfg), "qwen3") {}

std::unique_ptr<ModelArch> make_qwen3_arch(const ModelConfig& cfg) { return std::make_unique<Qwen3Arch>(cfg); }

ModelConfig qwen3_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto flag = [&](const char* key) {
    if (!has(key)) return false;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto refuse = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Qwen3 needs ", need,
            ", so these weights would compute a different function");
  };
  // Qwen3Config's defaults where they are not LlamaConfig's; the rest of the
  // keys (and what Llama refuses: hidden_act, rope_scaling types) are read
  // as Llama reads them.
  json l = c;
  auto dflt = [&](const char* key, json v) {
    if (!has(key)) l[key] = std::move(v);
  };
  dflt("vocab_size", 151936);
  dflt("intermediate_size", 22016);
  dflt("head_dim", 128);
  dflt("max_position_embeddings", 32768);
  if (flag("attention_bias")) refuse("attention_bias", "true", "false (no q/k/v/o biases)");
  l.erase("attention_bias");
  // Qwen3Attention windows layer i when use_sliding_window, a sliding_window
  // and i >= max_window_layers (4.51); newer versions list layer_types.
  const int L = has("num_hidden_layers") && c["num_hidden_layers"].is_number_integer()
                    ? c["num_hidden_layers"].get<int>()
                    : 32;
  if (flag("use_sliding_window") && has("sliding_window")) {
    const int from = has("max_window_layers") && c["max_window_layers"].is_number_integer()
                         ? c["max_window_layers"].get<int>()
                         : 28;
    if (from < L)
      refuse("use_sliding_window", "true (sliding_window " + c["sliding_window"].dump() + " from layer " +
                                       std::to_string(from) + ")",
             "full attention in every layer (use_sliding_window false)");
  }
  if (has("layer_types")) {
    TR_CHECK(c["layer_types"].is_array(), what, ": '", path, "': layer_types is not a list: ", c["layer_types"].dump());
    for (size_t i = 0; i < c["layer_types"].size(); ++i)
      if (c["layer_types"][i] != "full_attention")
        refuse("layer_types[" + std::to_string(i) + "]", c["layer_types"][i].dump(),
               "\"full_attention\" in every layer (no sliding window)");
  }
  ModelConfig cfg = llama_config_from_hf(l, path, what);
  cfg.arch = "qwen3";
  cfg.qk_norm = true;
  return cfg;
}

json Qwen3Arch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c = LlamaArch::hf_config_json();
  c["architectures"] = {"Qwen3ForCausalLM"};
  c["model_type"] = "qwen3";
  c["head_dim"] = cfg.head_size();  // Qwen3Config's default is 128, not hidden_size / heads: always written
  c.erase("mlp_bias");
  c.erase("pretraining_tp");
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
  c["max_window_layers"] = cfg.L;
  return c;
}

ModelConfig qwen3_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);
  c.arch = "qwen3";
  c.qk_norm = true;
  return c;
}

}  // namespace trainrun
