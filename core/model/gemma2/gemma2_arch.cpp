// Gemma 2 (gemma2_arch.h): the Llama network with Gemma 2's features, and
// Gemma2Config's side of config.json.
#include "core/model/gemma2/gemma2_arch.h"

#include <nlohmann/json.hpp>

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {
// What every Gemma 2 computes (not a choice of its config.json).
ModelConfig with_gemma2_maths(ModelConfig c) {
  c.norm_offset = true;
  c.post_norms = true;
  c.mlp_act = "gelu_tanh";
  c.embed_scale = true;
  c.window_period = 2;  // transformers 4.44: layer_idx % 2 == 0 slides
  TR_CHECK(c.tied, "model.tie_embeddings: false; Gemma 2's LM head is always the token embedding");
  return c;
}
}  // namespace

Gemma2Arch::Gemma2Arch(const ModelConfig& cfg) : LlamaArch(with_gemma2_maths(cfg), "gemma2") {}

std::unique_ptr<ModelArch> make_gemma2_arch(const ModelConfig& cfg) { return std::make_unique<Gemma2Arch>(cfg); }

ModelConfig gemma2_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto refuse = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Gemma 2 needs ", need,
            ", so these weights would compute a different function");
  };
  auto number = [&](const char* key, double dflt) {  // null: 0 (off)
    if (!c.contains(key)) return dflt;
    if (c[key].is_null()) return 0.0;
    TR_CHECK(c[key].is_number(), what, ": '", path, "': ", key, " is not a number: ", c[key].dump());
    return c[key].get<double>();
  };
  // Gemma2Config's defaults (transformers 4.44) where they are not LlamaConfig's.
  json l = c;
  auto dflt = [&](const char* key, json v) {
    if (!has(key)) l[key] = std::move(v);
  };
  dflt("vocab_size", 256000);
  dflt("hidden_size", 3072);
  dflt("intermediate_size", 24576);
  dflt("num_hidden_layers", 28);
  dflt("num_attention_heads", 16);
  dflt("num_key_value_heads", 16);
  dflt("head_dim", 256);
  dflt("max_position_embeddings", 8192);
  dflt("tie_word_embeddings", true);
  // Gemma2MLP reads hidden_activation (hidden_act is a leftover key of the config).
  const json act = has("hidden_activation") ? c["hidden_activation"] : json("gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh") refuse("hidden_activation", act.dump(), "\"gelu_pytorch_tanh\" (GeGLU, tanh GELU)");
  l.erase("hidden_act");
  l.erase("hidden_activation");
  ModelConfig cfg = llama_config_from_hf(l, path, what);  // the shapes, eps, rope, and Llama's refusals
  cfg.arch = "gemma2";
  cfg.attn_softcap = float(number("attn_logit_softcapping", 50.0));
  cfg.final_softcap = float(number("final_logit_softcapping", 30.0));
  cfg.query_scale = number("query_pre_attn_scalar", 224);
  const double window = number("sliding_window", 4096);
  TR_CHECK(cfg.attn_softcap >= 0 && cfg.final_softcap >= 0 && cfg.query_scale > 0 && window >= 0 &&
               window == double(int(window)),
           what, ": '", path, "': attn_logit_softcapping (", cfg.attn_softcap, "), final_logit_softcapping (",
           cfg.final_softcap, ") and sliding_window (", window, ") must be >= 0 and query_pre_attn_scalar (",
           cfg.query_scale, ") > 0");
  cfg.sliding_window = int(window);
  if (!cfg.tied) refuse("tie_word_embeddings", "false", "true (the LM head is the token embedding)");
  return cfg;
}

json Gemma2Arch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c = LlamaArch::hf_config_json();
  c["architectures"] = {"Gemma2ForCausalLM"};
  c["model_type"] = "gemma2";
  c["head_dim"] = cfg.head_size();  // Gemma2Config's default is 256: always written
  c.erase("hidden_act");
  c["hidden_activation"] = "gelu_pytorch_tanh";
  c.erase("mlp_bias");
  c.erase("pretraining_tp");
  c.erase("rope_scaling");
  auto or_null = [](double v) { return v > 0 ? json(v) : json(nullptr); };
  c["attn_logit_softcapping"] = or_null(cfg.attn_softcap);
  c["final_logit_softcapping"] = or_null(cfg.final_softcap);
  c["query_pre_attn_scalar"] = cfg.query_scale > 0 ? json(cfg.query_scale) : json(cfg.head_size());
  c["sliding_window"] = cfg.sliding_window > 0 ? json(cfg.sliding_window) : json(nullptr);
  return c;
}

}  // namespace trainrun
