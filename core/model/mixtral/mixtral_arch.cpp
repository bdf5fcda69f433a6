// Mixtral (mixtral_arch.h): the MoE fields on top of Llama's, config.json
// both ways (transformers 4.44's MixtralConfig keys and defaults), and what
// our files record.
#include "core/model/mixtral/mixtral_arch.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/moe/moe_hf_config.h"
#include "core/model/moe/moe_layout.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

ModelConfig with_moe(ModelConfig c) {
  MoeConfig& m = c.moe;
  TR_CHECK(m.n_experts >= 1, "model.n_experts: mixtral needs its experts (num_local_experts; got ", m.n_experts,
           "); set model.n_experts");
  TR_CHECK(m.top_k >= 1 && m.top_k <= m.n_experts, "model.n_experts_per_tok: ", m.top_k, " must be in 1..",
           m.n_experts, " (model.n_experts)");
  TR_CHECK(m.shared_ffn == 0, "model.shared_expert_ffn_dim: ", m.shared_ffn,
           "; mixtral has no shared expert (0; qwen2_moe has one)");
  TR_CHECK(m.norm_topk_auto || m.norm_topk_prob,
           "model.norm_topk_prob: false; mixtral always renormalises the chosen weights (true or auto)");
  m.norm_topk_prob = true;
  m.norm_topk_auto = false;
  TR_CHECK(m.ffn == 0 || m.ffn == c.F, "model.moe_ffn_dim: ", m.ffn, "; mixtral's experts are model.ffn_dim = ", c.F,
           " wide (0 = that)");
  TR_CHECK(m.aux_loss_coef >= 0 && std::isfinite(m.aux_loss_coef), "model.router_aux_loss_coef must be >= 0 (got ",
           m.aux_loss_coef, ")");
  TR_CHECK(m.z_loss_coef >= 0 && std::isfinite(m.z_loss_coef), "model.router_z_loss_coef must be >= 0 (got ",
           m.z_loss_coef, ")");
  TR_CHECK(c.rope_scaling_type.empty(), "model.rope_scaling.type: ", c.rope_scaling_type,
           "; mixtral (transformers 4.44's MixtralConfig) has no RoPE scaling; use none");
  m.ffn = c.F;  // every expert is intermediate_size wide
  m.naming = "mixtral";
  return c;
}

}  // namespace

MixtralArch::MixtralArch(const ModelConfig& cfg) : LlamaArch(with_moe(cfg), "mixtral") {}

std::unique_ptr<ModelArch> make_mixtral_arch(const ModelConfig& cfg) { return std::make_unique<MixtralArch>(cfg); }

std::string MixtralArch::describe() const {
  const MoeConfig& m = cfg_.moe;
  return LlamaArch::describe() + " experts=" + std::to_string(m.n_experts) + " top_k=" + std::to_string(m.top_k);
}

ModelConfig mixtral_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  const HfConfigKeys k(c, path, what, "Mixtral");
  // Mixtral's own keys and refusals first (in its name); then MixtralConfig's
  // defaults where they are not LlamaConfig's, the rest read as Llama reads it.
  if (k.has("hidden_act") && c["hidden_act"] != "silu") k.refuse("hidden_act", c["hidden_act"].dump(), "\"silu\" (SwiGLU)");
  if (k.number("attention_dropout", 0.0) != 0.0)
    k.refuse("attention_dropout", c["attention_dropout"].dump(), "0 (trainrun has no dropout)");
  if (k.number("router_jitter_noise", 0.0) != 0.0)
    k.refuse("router_jitter_noise", c["router_jitter_noise"].dump(),
           "0 (the router's training-time input noise is not implemented)");
  if (k.has("rope_scaling")) k.refuse("rope_scaling", c["rope_scaling"].dump(), "none (MixtralConfig has no RoPE scaling)");
  json l = c;
  auto dflt = [&](const char* key, json v) {
    if (!k.has(key)) l[key] = std::move(v);
  };
  dflt("vocab_size", 32000);
  dflt("hidden_size", 4096);
  dflt("intermediate_size", 14336);
  dflt("num_hidden_layers", 32);
  dflt("num_attention_heads", 32);
  dflt("num_key_value_heads", 8);
  dflt("max_position_embeddings", 4096 * 32);
  dflt("rms_norm_eps", 1e-5);
  dflt("rope_theta", 1e6);
  l.erase("head_dim");  // checked below: 4.44's Mixtral derives it
  ModelConfig cfg = llama_config_from_hf(l, path, what);
  cfg.arch = "mixtral";
  if (k.has("head_dim") && k.integer("head_dim", 0) != cfg.C / cfg.NH)
    k.refuse("head_dim", c["head_dim"].dump(), "hidden_size / num_attention_heads = " + std::to_string(cfg.C / cfg.NH));
  // The window applies on every layer with Mistral's rule (query t sees
  // keys t - W < j <= t). transformers 4.44 applies Mixtral's only in its
  // flash-attention path (its eager mask ignores it); the published
  // Mixtral configs have none (null).
  if (k.has("sliding_window")) cfg.sliding_window = k.integer("sliding_window", 0);
  MoeConfig& m = cfg.moe;
  m.n_experts = k.integer("num_local_experts", 8);
  m.top_k = k.integer("num_experts_per_tok", 2);
  TR_CHECK(m.n_experts >= 1 && m.top_k >= 1 && m.top_k <= m.n_experts, what, ": '", path,
           "': num_experts_per_tok (", m.top_k, ") must be in 1..num_local_experts (", m.n_experts, ")");
  m.norm_topk_prob = true;
  m.ffn = cfg.F;
  m.naming = "mixtral";
  m.aux_loss_coef = moe_aux_loss_coef_from_hf(k);
  return cfg;
}

json MixtralArch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c = LlamaArch::hf_config_json();  // Llama's keys, less what MixtralConfig has not
  c["architectures"] = {"MixtralForCausalLM"};
  c["model_type"] = "mixtral";
  for (const char* key : {"head_dim", "rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp"}) c.erase(key);
  c["sliding_window"] = cfg.sliding_window > 0 ? json(cfg.sliding_window) : json(nullptr);
  c["num_local_experts"] = cfg.moe.n_experts;
  c["num_experts_per_tok"] = cfg.moe.top_k;
  // The load-balancing loss trainrun trained with, as transformers reads it.
  moe_write_aux_loss_hf(cfg.moe, c);
  c["router_jitter_noise"] = 0.0;
  return c;
}

std::map<std::string, std::string> MixtralArch::file_metadata() const {
  std::map<std::string, std::string> m = LlamaArch::file_metadata();
  moe_add_metadata(cfg_.moe, m);
  if (cfg_.sliding_window > 0) m["sliding_window"] = std::to_string(cfg_.sliding_window);
  return m;
}

ModelConfig mixtral_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);
  c.arch = "mixtral";
  MoeConfig m;
  m.naming = "mixtral";
  c.moe = moe_from_metadata(meta, path, m);
  auto it = meta.find("sliding_window");
  if (it != meta.end()) c.sliding_window = std::atoi(it->second.c_str());
  return c;
}

json MixtralArch::manifest_model() const {
  json m = LlamaArch::manifest_model();
  moe_add_manifest(cfg_.moe, /*shared_expert=*/false, m);
  return m;
}

std::vector<ShapeKey> MixtralArch::shape_keys() const {
  std::vector<ShapeKey> k = LlamaArch::shape_keys();
  moe_add_shape_keys(cfg_.moe, /*shared_expert=*/false, k);
  return k;
}

void MixtralArch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  LlamaArch::check_init_from(hf, dir);
  moe_check_init_from(display_name(), cfg_.moe, hf.moe, dir);
}

}  // namespace trainrun
