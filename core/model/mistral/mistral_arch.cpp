// Mistral (mistral_arch.h): the Llama network with a sliding window on every
// layer, and MistralConfig's side of config.json (transformers 4.44).
#include "core/model/mistral/mistral_arch.h"

#include <nlohmann/json.hpp>

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {
ModelConfig checked(const ModelConfig& c) {
  TR_CHECK(c.sliding_window >= 0, "model.sliding_window: ", c.sliding_window,
           " must be 0 (no window) or the window in tokens");
  TR_CHECK(c.window_period == 0, "mistral: every layer slides (window_period 0), not ", c.window_period, " (a bug)");
  return c;
}
}  // namespace

MistralArch::MistralArch(const ModelConfig& cfg) : LlamaArch(checked(cfg), "mistral") {}

std::unique_ptr<ModelArch> make_mistral_arch(const ModelConfig& cfg) { return std::make_unique<MistralArch>(cfg); }

std::string MistralArch::describe() const {
  return LlamaArch::describe() + (cfg_.sliding_window > 0 ? " window=" + std::to_string(cfg_.sliding_window) : "");
}

ModelConfig mistral_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto refuse = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Mistral needs ", need,
            ", so these weights would compute a different function");
  };
  // What Mistral reads otherwise than Llama first (in Mistral's name), then
  // MistralConfig's defaults where they are not LlamaConfig's; the rest is
  // read as Llama reads it (hidden_act, head_dim, the shape).
  if (has("attention_dropout")) {
    TR_CHECK(c["attention_dropout"].is_number(), what, ": '", path, "': attention_dropout is not a number: ",
             c["attention_dropout"].dump());
    if (c["attention_dropout"].get<double>() != 0.0)
      refuse("attention_dropout", c["attention_dropout"].dump(), "0 (trainrun has no dropout)");
  }
  if (has("rope_scaling"))
    refuse("rope_scaling", c["rope_scaling"].dump(),
           "none (transformers 4.44's MistralConfig has no RoPE scaling: the file was made for another model)");
  int window = 4096;  // MistralConfig's default; null: none
  if (c.contains("sliding_window")) {
    const json& w = c["sliding_window"];
    if (w.is_null()) {
      window = 0;
    } else {
      TR_CHECK(w.is_number_integer() && w.get<int64_t>() > 0 && w.get<int64_t>() < (int64_t(1) << 31), what, ": '",
               path, "': sliding_window is not a positive integer or null: ", w.dump());
      window = w.get<int>();
    }
  }
  json l = c;
  auto dflt = [&](const char* key, json v) {
    if (!has(key)) l[key] = std::move(v);
  };
  dflt("intermediate_size", 14336);
  dflt("num_key_value_heads", 8);
  dflt("max_position_embeddings", 4096 * 32);
  dflt("rms_norm_eps", 1e-6);
  // Not MistralConfig keys: transformers' Mistral has no biases whatever they say
  // (a file with bias tensors is refused at load as unexpected tensors).
  l.erase("attention_bias");
  l.erase("mlp_bias");
  ModelConfig cfg = llama_config_from_hf(l, path, what);
  cfg.arch = "mistral";
  cfg.sliding_window = window;
  return cfg;
}

json MistralArch::hf_config_json() const {
  json c = LlamaArch::hf_config_json();  // Llama's keys, less what MistralConfig has not
  c["architectures"] = {"MistralForCausalLM"};
  c["model_type"] = "mistral";
  for (const char* key : {"rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp"}) c.erase(key);
  c["sliding_window"] = cfg_.sliding_window > 0 ? json(cfg_.sliding_window) : json(nullptr);
  return c;
}

json MistralArch::manifest_model() const {
  json m = LlamaArch::manifest_model();
  m["sliding_window"] = cfg_.sliding_window;
  return m;
}

ModelConfig mistral_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);  // the window included (LlamaArch::file_metadata)
  c.arch = "mistral";
  return c;
}

std::vector<ShapeKey> MistralArch::shape_keys() const {
  std::vector<ShapeKey> k = LlamaArch::shape_keys();
  k.push_back({"model.sliding_window", "sliding_window"});
  return k;
}

}  // namespace trainrun
