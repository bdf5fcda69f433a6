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
  // Keys left out take transformers' Qwen2Config defaults, as from_pretrained does.
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto get_int = [&](const char* key, int dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_number_integer(), what, ": '", path, "': ", key, " is not an integer: ", c[key].dump());
    return c[key].get<int>();
  };
  auto get_num = [&](const char* key, double dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_number(), what, ": '", path, "': ", key, " is not a number: ", c[key].dump());
    return c[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto unsupported = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Qwen2 needs ", need,
            ", so these weights would compute a different function");
  };
  ModelConfig cfg;
  cfg.arch = "qwen2";
  cfg.V = get_int("vocab_size", 151936);
  cfg.C = get_int("hidden_size", 4096);
  cfg.F = get_int("intermediate_size", 22016);
  cfg.L = get_int("num_hidden_layers", 32);
  cfg.NH = get_int("num_attention_heads", 32);
  cfg.NKV = get_int("num_key_value_heads", cfg.NH);
  cfg.T = get_int("max_position_embeddings", 32768);
  cfg.norm_eps = get_num("rms_norm_eps", 1e-6);
  cfg.rope_theta = get_num("rope_theta", 10000.0);
  cfg.init_std = get_num("initializer_range", 0.02);
  cfg.tied = get_bool("tie_word_embeddings", false);
  cfg.qkv_bias = true;
  TR_CHECK(cfg.V > 0 && cfg.C > 0 && cfg.F > 0 && cfg.L > 0 && cfg.NH > 0 && cfg.NKV > 0 && cfg.T > 0, what, ": '",
           path,
           "': vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
           "num_key_value_heads and max_position_embeddings must be positive");
  TR_CHECK(cfg.C % cfg.NH == 0, what, ": '", path, "': hidden_size (", cfg.C,
           ") is not divisible by num_attention_heads (", cfg.NH, ")");
  TR_CHECK(cfg.NH % cfg.NKV == 0, what, ": '", path, "': num_attention_heads (", cfg.NH,
           ") is not a multiple of num_key_value_heads (", cfg.NKV, ")");
  // transformers 4.44's Qwen2 derives the head size; a config that names
  // another one was written for a model that has it.
  if (has("head_dim") && get_int("head_dim", 0) != cfg.C / cfg.NH)
    unsupported("head_dim", c["head_dim"].dump(), "hidden_size / num_attention_heads = " + std::to_string(cfg.C / cfg.NH));
  if (has("hidden_act") && c["hidden_act"] != "silu")
    unsupported("hidden_act", c["hidden_act"].dump(), "\"silu\" (SwiGLU)");
  if (get_num("attention_dropout", 0.0) != 0.0)
    unsupported("attention_dropout", c["attention_dropout"].dump(), "0 (trainrun has no dropout)");
  if (get_bool("use_mrope", false)) unsupported("use_mrope", "true", "false (plain RoPE; M-RoPE is Qwen2-VL's)");
  // The sliding window: with use_sliding_window false Qwen2Config drops it
  // (the published Qwen2.5 configs name one and leave it off). On, it
  // applies to layers max_window_layers.. (transformers' flash-attention
  // path); it changes nothing when no such layer exists or the window is
  // the whole context, and is refused otherwise until the Llama network
  // has a window (ModelConfig::sliding_window).
  if (get_bool("use_sliding_window", false)) {
    const int window = get_int("sliding_window", 4096), first = get_int("max_window_layers", 28);
    if (first < cfg.L && window < cfg.T)
      unsupported("use_sliding_window", "true (sliding_window " + std::to_string(window) + " on layers " +
                                            std::to_string(first) + ".." + std::to_string(cfg.L - 1) +
                                            " of num_hidden_layers " + std::to_string(cfg.L) + ")",
                  "full causal attention (a sliding window is not implemented yet; set use_sliding_window false, "
                  "or sliding_window >= max_position_embeddings = " + std::to_string(cfg.T) + ")");
  }
  if (has("rope_scaling")) {
    const json& s = c["rope_scaling"];
    TR_CHECK(s.is_object(), what, ": '", path, "': rope_scaling is not an object: ", s.dump());
    const char* tkey = s.contains("rope_type") ? "rope_type" : "type";
    const std::string type = s.contains(tkey) && s[tkey].is_string() ? s[tkey].get<std::string>() : s.dump();
    if (type != "default")
      unsupported("rope_scaling." + std::string(tkey), "\"" + type + "\"",
                  "no rope_scaling (or \"default\"): RoPE scaling is not implemented for qwen2");
  }
  return cfg;
}

json Qwen2Arch::hf_config_json() const {
  const ModelConfig& cfg = config();
  json c;
  c["architectures"] = {"Qwen2ForCausalLM"};
  c["model_type"] = "qwen2";
  c["vocab_size"] = cfg.V;
  c["hidden_size"] = cfg.C;
  c["intermediate_size"] = cfg.F;
  c["num_hidden_layers"] = cfg.L;
  c["num_attention_heads"] = cfg.NH;
  c["num_key_value_heads"] = cfg.kv_heads();
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = cfg.norm_eps;
  c["rope_theta"] = cfg.rope_theta;
  c["tie_word_embeddings"] = cfg.tied;
  // Full attention on every layer, as the published Qwen2.5 configs say it.
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
  c["max_window_layers"] = cfg.L;
  c["attention_dropout"] = 0.0;
  // Our seq_len is the context we trained at; a fine-tune's export carries
  // the source's longer max_position_embeddings over (LlamaArch::hf_carry_over).
  c["max_position_embeddings"] = cfg.T;
  c["initializer_range"] = cfg.init_std;
  c["use_cache"] = true;
  // No known special tokens for a model trained here; a fine-tune carries its source's.
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["torch_dtype"] = "float32";
  return c;
}

}  // namespace trainrun
