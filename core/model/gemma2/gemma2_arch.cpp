// Gemma 2 (gemma2_arch.h): the Llama network with Gemma 2's features, and
// Gemma2Config's side of config.json.
#include "core/model/gemma2/gemma2_arch.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

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
  auto bad = [&](const char* key, double v, const char* need) {
    TR_FAIL(what, ": '", path, "': ", key, " = ", v, " must be ", need);
  };
  if (!(cfg.attn_softcap >= 0)) bad("attn_logit_softcapping", cfg.attn_softcap, ">= 0 (or null: off)");
  if (!(cfg.final_softcap >= 0)) bad("final_logit_softcapping", cfg.final_softcap, ">= 0 (or null: off)");
  if (!(cfg.query_scale > 0)) bad("query_pre_attn_scalar", cfg.query_scale, "> 0");
  if (!(window >= 0 && window < 2e9 && window == double(int(window))))
    bad("sliding_window", window, "a whole number >= 0 (or null: none)");
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

std::string Gemma2Arch::describe() const {
  const ModelConfig& c = cfg_;
  std::ostringstream o;
  o << LlamaArch::describe() << " attn_softcap=" << c.attn_softcap << " final_softcap=" << c.final_softcap
    << " query_scale=" << c.query_scale << " window=" << c.sliding_window;
  return o.str();
}

std::vector<ShapeKey> Gemma2Arch::shape_keys() const {
  std::vector<ShapeKey> k = LlamaArch::shape_keys();
  k.insert(k.end(), {{"model.attn_softcap", "attn_logit_softcapping"},
                     {"model.final_softcap", "final_logit_softcapping"},
                     {"model.query_scale", "query_pre_attn_scalar"},
                     {"model.sliding_window", "sliding_window"}});
  return k;
}

void Gemma2Arch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  LlamaArch::check_init_from(hf, dir);
  auto same = [&](const char* field, double job, const char* key, double have) {
    if (job == have) return;
    std::ostringstream o;
    o.precision(17);
    o << "model.init_from: '" << dir << "' holds a Gemma 2 with " << key << " = " << have
      << " (config.json) but model." << field << " is " << job << "; set model." << field << ": " << have
      << " (the job's model.* must describe the weights it starts from)";
    TR_FAIL(o.str());
  };
  same("attn_softcap", cfg_.attn_softcap, "attn_logit_softcapping", hf.attn_softcap);
  same("final_softcap", cfg_.final_softcap, "final_logit_softcapping", hf.final_softcap);
  // 0 = the head size's, as config.json's query_pre_attn_scalar = head_dim.
  auto scalar = [](const ModelConfig& c) { return c.query_scale > 0 ? c.query_scale : double(c.head_size()); };
  same("query_scale", scalar(cfg_), "query_pre_attn_scalar", scalar(hf));
  same("sliding_window", cfg_.sliding_window, "sliding_window", hf.sliding_window);
}

namespace {
std::string exact(double v) {  // every digit, so metadata reads back exactly
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

std::map<std::string, std::string> Gemma2Arch::file_metadata() const {
  std::map<std::string, std::string> m = LlamaArch::file_metadata();
  m["attn_softcap"] = exact(cfg_.attn_softcap);
  m["final_softcap"] = exact(cfg_.final_softcap);
  m["query_scale"] = exact(cfg_.query_scale);
  m["sliding_window"] = std::to_string(cfg_.sliding_window);
  return m;
}

ModelConfig gemma2_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);
  c.arch = "gemma2";
  auto num = [&](const char* key) {
    auto it = meta.find(key);
    TR_CHECK(it != meta.end(), path, ": missing __metadata__ key '", key,
             "' of a gemma2 model; this file was not written by trainrun (or an older version)");
    try {
      size_t used = 0;
      const double d = std::stod(it->second, &used);
      if (used == it->second.size() && std::isfinite(d) && d >= 0) return d;
    } catch (...) {
    }
    TR_FAIL(path, ": __metadata__ key '", key, "' is not a number >= 0: '", it->second, "'");
  };
  c.attn_softcap = float(num("attn_softcap"));
  c.final_softcap = float(num("final_softcap"));
  c.query_scale = num("query_scale");
  const double w = num("sliding_window");
  TR_CHECK(w == std::floor(w) && w < 2e9, path, ": __metadata__ key 'sliding_window' is not an integer: '",
           meta.at("sliding_window"), "'");
  c.sliding_window = int(w);
  return c;
}

json Gemma2Arch::manifest_model() const {
  json m = LlamaArch::manifest_model();
  m["attn_softcap"] = cfg_.attn_softcap;
  m["final_softcap"] = cfg_.final_softcap;
  m["query_scale"] = cfg_.query_scale;
  m["sliding_window"] = cfg_.sliding_window;
  return m;
}

}  // namespace trainrun
