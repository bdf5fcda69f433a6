// Qwen2's description (qwen2_arch.h): its rules on top of Llama's, and its
// config.json both ways (transformers 4.44's Qwen2Config keys and defaults).
#include "core/model/qwen2/qwen2_arch.h"

#include <nlohmann/json.hpp>

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

ModelConfig with_bias(ModelConfig c) {
  // transformers 4.44's Qwen2 applies no RoPE scaling (it has no rope_scaling key).
  TR_CHECK(c.rope_scaling_type.empty(), "model.rope_scaling.type: ", c.rope_scaling_type,
           "; qwen2 (transformers' Qwen2Config) has no RoPE scaling trainrun implements; use none");
  c.qkv_bias = true;  // every Qwen2 has them
  return c;
}

}  // namespace

Qwen2Arch::Qwen2Arch(const ModelConfig& cfg) : LlamaArch(with_bias(cfg), "qwen2") {}

std::unique_ptr<ModelArch> make_qwen2_arch(const ModelConfig& cfg) { return std::make_unique<Qwen2Arch>(cfg); }

ModelConfig qwen2_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto flag = [&](const char* key) {
    if (!has(key)) return false;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto integer = [&](const char* key, int dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_number_integer(), what, ": '", path, "': ", key, " is not an integer: ", c[key].dump());
    return c[key].get<int>();
  };
  auto unsupported = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Qwen2 needs ", need,
            ", so these weights would compute a different function");
  };
  // What only Qwen2 has, or reads otherwise than Llama, first (with Qwen2's
  // name in the message); then Qwen2Config's defaults where they are not
  // LlamaConfig's, and the rest read as Llama reads it.
  if (has("hidden_act") && c["hidden_act"] != "silu")
    unsupported("hidden_act", c["hidden_act"].dump(), "\"silu\" (SwiGLU)");
  if (has("attention_dropout")) {
    TR_CHECK(c["attention_dropout"].is_number(), what, ": '", path, "': attention_dropout is not a number: ",
             c["attention_dropout"].dump());
    if (c["attention_dropout"].get<double>() != 0.0)
      unsupported("attention_dropout", c["attention_dropout"].dump(), "0 (trainrun has no dropout)");
  }
  if (flag("use_mrope")) unsupported("use_mrope", "true", "false (plain RoPE; M-RoPE is Qwen2-VL's)");
  if (has("rope_scaling")) {
    const json& s = c["rope_scaling"];
    TR_CHECK(s.is_object(), what, ": '", path, "': rope_scaling is not an object: ", s.dump());
    const char* tkey = s.contains("rope_type") ? "rope_type" : "type";
    const std::string type = s.contains(tkey) && s[tkey].is_string() ? s[tkey].get<std::string>() : s.dump();
    if (type != "default")
      unsupported("rope_scaling." + std::string(tkey), "\"" + type + "\"",
                  "no rope_scaling (or \"default\"): RoPE scaling is not implemented for qwen2");
  }
  json l = c;
  auto dflt = [&](const char* key, json v) {
    if (!has(key)) l[key] = std::move(v);
  };
  dflt("vocab_size", 151936);
  dflt("intermediate_size", 22016);
  dflt("max_position_embeddings", 32768);
  l.erase("rope_scaling");
  l.erase("attention_bias");  // not a Qwen2Config key: every Qwen2 has its q/k/v biases
  ModelConfig cfg = llama_config_from_hf(l, path, what);
  cfg.arch = "qwen2";
  cfg.qkv_bias = true;
  // transformers 4.44's Qwen2 derives the head size; a config that names
  // another one was written for a model that has it.
  if (has("head_dim") && integer("head_dim", 0) != cfg.C / cfg.NH)
    unsupported("head_dim", c["head_dim"].dump(), "hidden_size / num_attention_heads = " + std::to_string(cfg.C / cfg.NH));
  TR_CHECK(cfg.C % cfg.NH == 0, what, ": '", path, "': hidden_size (", cfg.C,
           ") is not divisible by num_attention_heads (", cfg.NH, ")");
  cfg.head_dim = 0;
  // The sliding window: with use_sliding_window false Qwen2Config drops it
  // (the published Qwen2.5 configs name one and leave it off). On, Qwen's
  // rule (transformers' flash-attention path) windows the layers from
  // max_window_layers on. It changes nothing when no such layer exists or
  // the window is the whole context, and is refused otherwise: the
  // attention ops have the window now (Mistral), but no eager
  // transformers computes Qwen's rule to test it against — 4.44's eager
  // Qwen2 ignores the window on every layer, 4.51.3's applies
  // config.sliding_window to every layer whatever use_sliding_window and
  // max_window_layers say (checked on a 2-layer model: max_window_layers 0
  // or not, use_sliding_window true or false, the same logits) — so these
  // weights would compute different functions in different tools.
  if (flag("use_sliding_window")) {
    const int window = integer("sliding_window", 4096), first = integer("max_window_layers", 28);
    if (first < cfg.L && window < cfg.T)
      unsupported("use_sliding_window", "true (sliding_window " + std::to_string(window) + " on layers " +
                                            std::to_string(first) + ".." + std::to_string(cfg.L - 1) +
                                            " of num_hidden_layers " + std::to_string(cfg.L) + ")",
                  "full causal attention (Qwen2's per-layer window is not implemented: transformers' eager "
                  "attention computes it differently in each version; set use_sliding_window false, "
                  "or sliding_window >= max_position_embeddings = " + std::to_string(cfg.T) + ")");
  }
  return cfg;
}

json Qwen2Arch::hf_config_json() const {
  const ModelConfig& cfg = config();
  json c = LlamaArch::hf_config_json();  // Llama's keys, less what Qwen2Config has not
  c["architectures"] = {"Qwen2ForCausalLM"};
  c["model_type"] = "qwen2";
  for (const char* key : {"head_dim", "rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp"}) c.erase(key);
  // Full attention on every layer, as the published Qwen2.5 configs say it.
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
  c["max_window_layers"] = cfg.L;
  return c;
}

}  // namespace trainrun
