// Llama's Hugging Face side (llama_arch.h): config.json -> ModelConfig
// (LlamaConfig's keys and defaults), tensor names (HF's own, nn.Linear
// layout: no transpose, and q/k need no permutation since our RoPE pairs
// as HF's rotate_half) and the init_from check. The files themselves are
// read by core/checkpoint/hf_interop.cpp.
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/common/error.h"
#include "core/model/llama/llama_arch.h"
#include "core/model/moe/moe_layout.h"

using json = nlohmann::ordered_json;

namespace trainrun {

ModelConfig llama_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  // Keys left out take transformers' LlamaConfig defaults, as from_pretrained does.
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto get_int = [&](const json& o, const char* key, int dflt, const char* prefix = "") {
    if (!o.contains(key) || o[key].is_null()) return dflt;
    TR_CHECK(o[key].is_number_integer(), what, ": '", path, "': ", prefix, key, " is not an integer: ", o[key].dump());
    return o[key].get<int>();
  };
  auto get_num = [&](const json& o, const char* key, double dflt, const char* prefix = "") {
    if (!o.contains(key) || o[key].is_null()) return dflt;
    TR_CHECK(o[key].is_number(), what, ": '", path, "': ", prefix, key, " is not a number: ", o[key].dump());
    return o[key].get<double>();
  };
  auto get_bool = [&](const char* key, bool dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto unsupported = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Llama needs ", need,
            ", so these weights would compute a different function");
  };
  ModelConfig cfg;
  cfg.arch = "llama";
  cfg.V = get_int(c, "vocab_size", 32000);
  cfg.C = get_int(c, "hidden_size", 4096);
  cfg.F = get_int(c, "intermediate_size", 11008);
  cfg.L = get_int(c, "num_hidden_layers", 32);
  cfg.NH = get_int(c, "num_attention_heads", 32);
  cfg.NKV = get_int(c, "num_key_value_heads", cfg.NH);
  cfg.T = get_int(c, "max_position_embeddings", 2048);
  cfg.norm_eps = get_num(c, "rms_norm_eps", 1e-6);
  cfg.rope_theta = get_num(c, "rope_theta", 10000.0);
  cfg.init_std = get_num(c, "initializer_range", 0.02);
  cfg.tied = get_bool("tie_word_embeddings", false);
  TR_CHECK(cfg.V > 0 && cfg.C > 0 && cfg.F > 0 && cfg.L > 0 && cfg.NH > 0 && cfg.NKV > 0 && cfg.T > 0, what, ": '",
           path,
           "': vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
           "num_key_value_heads and max_position_embeddings must be positive");
  // transformers: head_dim, else hidden_size / num_attention_heads.
  cfg.head_dim = get_int(c, "head_dim", 0);
  TR_CHECK(has("head_dim") ? cfg.head_dim > 0 : cfg.C % cfg.NH == 0, what, ": '", path, "': ",
           has("head_dim") ? "head_dim must be positive (got " + std::to_string(cfg.head_dim) + ")"
                           : "hidden_size (" + std::to_string(cfg.C) + ") is not divisible by num_attention_heads (" +
                                 std::to_string(cfg.NH) + ") and there is no head_dim");
  TR_CHECK(cfg.NH % cfg.NKV == 0, what, ": '", path, "': num_attention_heads (", cfg.NH,
           ") is not a multiple of num_key_value_heads (", cfg.NKV, ")");
  const std::string act = has("hidden_act") && c["hidden_act"].is_string() ? c["hidden_act"].get<std::string>()
                          : has("hidden_act")                             ? c["hidden_act"].dump()
                                                                          : "silu";
  if (act != "silu") unsupported("hidden_act", "\"" + act + "\"", "\"silu\" (SwiGLU)");
  if (get_bool("attention_bias", false)) unsupported("attention_bias", "true", "false (no biases)");
  if (get_bool("mlp_bias", false)) unsupported("mlp_bias", "true", "false (no biases)");
  if (has("rope_scaling")) {
    const json& s = c["rope_scaling"];
    TR_CHECK(s.is_object(), what, ": '", path, "': rope_scaling is not an object: ", s.dump());
    // transformers reads rope_type, or the older "type".
    const char* tkey = s.contains("rope_type") ? "rope_type" : "type";
    TR_CHECK(s.contains(tkey) && s[tkey].is_string(), what, ": '", path,
             "': rope_scaling has no rope_type (or type): ", s.dump());
    const std::string type = s[tkey].get<std::string>();
    if (type == "llama3") {
      for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        TR_CHECK(s.contains(k) && !s[k].is_null(), what, ": '", path, "': rope_scaling (llama3) has no ", k);
      cfg.rope_scaling_type = "llama3";
      cfg.rope_scaling.factor = get_num(s, "factor", 0, "rope_scaling.");
      cfg.rope_scaling.low_freq_factor = get_num(s, "low_freq_factor", 0, "rope_scaling.");
      cfg.rope_scaling.high_freq_factor = get_num(s, "high_freq_factor", 0, "rope_scaling.");
      cfg.rope_scaling.original_max_position_embeddings =
          get_int(s, "original_max_position_embeddings", 0, "rope_scaling.");
    } else if (type != "default") {
      unsupported("rope_scaling." + std::string(tkey), "\"" + type + "\"",
                  "no rope_scaling, \"default\" or \"llama3\" (the only RoPE scaling it implements)");
    }
  }
  return cfg;
}

json LlamaArch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c;
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["vocab_size"] = cfg.V;
  c["hidden_size"] = cfg.C;
  c["intermediate_size"] = cfg.F;
  c["num_hidden_layers"] = cfg.L;
  c["num_attention_heads"] = cfg.NH;
  c["num_key_value_heads"] = cfg.kv_heads();
  // transformers (4.44 too) reads it when present, else hidden_size / num_attention_heads.
  c["head_dim"] = cfg.head_size();
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = cfg.norm_eps;
  c["rope_theta"] = cfg.rope_theta;
  if (cfg.rope_scaling_type == "llama3") {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", cfg.rope_scaling.factor},
                         {"low_freq_factor", cfg.rope_scaling.low_freq_factor},
                         {"high_freq_factor", cfg.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", cfg.rope_scaling.original_max_position_embeddings}};
  } else {
    c["rope_scaling"] = nullptr;
  }
  c["tie_word_embeddings"] = cfg.tied;
  c["attention_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["mlp_bias"] = false;
  c["pretraining_tp"] = 1;
  // Our seq_len is the context we trained at; RoPE has no table, so an
  // export of a fine-tune carries the source's longer max_position_embeddings
  // over (hf_carry_over).
  c["max_position_embeddings"] = cfg.T;
  c["initializer_range"] = cfg.init_std;
  c["use_cache"] = true;
  // A model trained here from scratch has no known special tokens (LlamaConfig's
  // defaults 1/2 would name arbitrary ids); a fine-tune carries its source's.
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["torch_dtype"] = "float32";
  return c;
}

void LlamaArch::hf_carry_over(const json& source, json& out) const {
  ModelArch::hf_carry_over(source, out);
  // Only a longer context than we trained at: a shorter one would be a
  // model that claims less than it was trained for (and than check_init_from allowed).
  if (source.contains("max_position_embeddings") && source["max_position_embeddings"].is_number_integer() &&
      source["max_position_embeddings"].get<int64_t>() >= cfg_.T)
    out["max_position_embeddings"] = source["max_position_embeddings"];
}

// LlamaDecoderLayer registers self_attn, mlp, then the two norms; ours puts
// each norm before the matrices it feeds.
std::vector<const ParamTensor*> LlamaArch::hf_save_order() const {
  std::vector<const ParamTensor*> order = {&layout_.get("model.embed_tokens.weight")};
  for (int l = 0; l < cfg_.L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    // An nn.Linear registers its weight, then its bias (qkv_bias).
    for (const char* n : {"self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                          "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                          "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                          "input_layernorm.weight", "post_attention_layernorm.weight",
                          "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"})  // (post_norms)
    {
      if (const ParamTensor* t = layout_.find(p + n)) order.push_back(t);  // q/k_norm, biases: with qk_norm, qkv_bias
      if (cfg_.moe.on() && std::strcmp(n, "self_attn.k_norm.weight") == 0)  // the MoE block's place: after self_attn
        for (const std::string& m : moe_hf_save_order(p, cfg_.moe)) order.push_back(&layout_.get(m));
    }
  }
  order.push_back(&layout_.get("model.norm.weight"));
  if (!cfg_.tied) order.push_back(&layout_.get("lm_head.weight"));
  TR_CHECK(order.size() == layout_.tensors.size(), name(), ": hf_save_order misses a layout tensor (a bug)");
  return order;
}

// The RoPE inverse frequencies older transformers versions saved with the weights.
bool LlamaArch::hf_ignored_buffer(const std::string& key) const {
  const char* suf = ".rotary_emb.inv_freq";
  const size_t n = std::strlen(suf);
  return key.size() >= n && key.compare(key.size() - n, n, suf) == 0;
}

std::vector<ShapeKey> LlamaArch::shape_keys() const {
  std::vector<ShapeKey> k = {{"model.n_layer", "num_hidden_layers"},
                             {"model.n_head", "num_attention_heads"},
                             {"model.n_kv_head", "num_key_value_heads"},
                             {"model.n_embd", "hidden_size"},
                             {"model.ffn_dim", "intermediate_size"},
                             {"model.head_dim", "head_dim"},
                             {"model.vocab_size", "vocab_size"},
                             {"model.norm_eps", "rms_norm_eps"},
                             {"model.rope_theta", "rope_theta"},
                             {"model.tie_embeddings", "tie_word_embeddings"},
                             {"model.rope_scaling.type", "rope_scaling.rope_type"}};
  // Unscaled, the factors mean nothing (and config.json has none to compare).
  if (!cfg_.rope_scaling_type.empty())
    k.insert(k.end(), {{"model.rope_scaling.factor", "rope_scaling.factor"},
                       {"model.rope_scaling.low_freq_factor", "rope_scaling.low_freq_factor"},
                       {"model.rope_scaling.high_freq_factor", "rope_scaling.high_freq_factor"},
                       {"model.rope_scaling.original_max_position_embeddings",
                        "rope_scaling.original_max_position_embeddings"}});
  return k;
}

void LlamaArch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  const std::string what = "model.init_from";
  auto fail = [&](const char* field, const std::string& job, const char* key, const std::string& have,
                  const std::string& fix) {
    TR_FAIL(what, ": '", dir, "' holds a ", display_name(), " with ", key, " = ", have, " (config.json) but model.", field, " is ",
            job, "; set model.", field, ": ", fix, " (the job's model.* must describe the weights it starts from)");
  };
  auto same = [&](const char* field, int job, const char* key, int have) {
    if (job != have) fail(field, std::to_string(job), key, std::to_string(have), std::to_string(have));
  };
  auto num = [](double v) {
    std::ostringstream o;
    o.precision(17);
    o << v;
    return o.str();
  };
  auto same_num = [&](const char* field, double job, const char* key, double have) {
    if (job != have) fail(field, num(job), key, num(have), num(have));
  };
  const ModelConfig& m = cfg_;
  same("n_layer", m.L, "num_hidden_layers", hf.L);
  same("n_head", m.NH, "num_attention_heads", hf.NH);
  same("n_kv_head", m.kv_heads(), "num_key_value_heads", hf.kv_heads());
  same("n_embd", m.C, "hidden_size", hf.C);
  same("ffn_dim", m.F, "intermediate_size", hf.F);
  same("head_dim", m.head_size(), "head_dim", hf.head_size());
  same("vocab_size", m.V, "vocab_size", hf.V);
  same_num("norm_eps", m.norm_eps, "rms_norm_eps", hf.norm_eps);
  same_num("rope_theta", m.rope_theta, "rope_theta", hf.rope_theta);
  if (m.tied != hf.tied)
    fail("tie_embeddings", m.tied ? "true" : "false", "tie_word_embeddings", hf.tied ? "true" : "false",
         hf.tied ? "true" : "false");
  const std::string mt = m.rope_scaling_type.empty() ? "none" : m.rope_scaling_type;
  const std::string ht = hf.rope_scaling_type.empty() ? "none" : hf.rope_scaling_type;
  if (mt != ht) fail("rope_scaling.type", mt, "rope_scaling.rope_type", ht, ht);
  if (!hf.rope_scaling_type.empty()) {
    same_num("rope_scaling.factor", m.rope_scaling.factor, "rope_scaling.factor", hf.rope_scaling.factor);
    same_num("rope_scaling.low_freq_factor", m.rope_scaling.low_freq_factor, "rope_scaling.low_freq_factor",
             hf.rope_scaling.low_freq_factor);
    same_num("rope_scaling.high_freq_factor", m.rope_scaling.high_freq_factor, "rope_scaling.high_freq_factor",
             hf.rope_scaling.high_freq_factor);
    same("rope_scaling.original_max_position_embeddings", m.rope_scaling.original_max_position_embeddings,
         "rope_scaling.original_max_position_embeddings", hf.rope_scaling.original_max_position_embeddings);
  }
  // The window is the model's (mistral, phi3: model.sliding_window; 0 = none).
  if (m.sliding_window != hf.sliding_window)
    fail("sliding_window", std::to_string(m.sliding_window), "sliding_window",
         hf.sliding_window ? std::to_string(hf.sliding_window) : std::string("null"),
         std::to_string(hf.sliding_window));
  // RoPE has no table: a shorter context is the same model; a longer one
  // is past what it was trained for.
  TR_CHECK(m.T <= hf.T, what, ": '", dir, "' holds a ", display_name(), " with max_position_embeddings = ", hf.T,
           " (config.json) but model.seq_len is ", m.T, "; set model.seq_len to at most ", hf.T);
}

}  // namespace trainrun
