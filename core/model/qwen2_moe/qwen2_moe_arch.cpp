// Qwen2-MoE (qwen2_moe_arch.h): its rules on top of Llama's, config.json
// both ways (transformers 4.44's Qwen2MoeConfig keys and defaults) and what
// our files record.
#include "core/model/qwen2_moe/qwen2_moe_arch.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/moe/moe_hf_config.h"
#include "core/model/moe/moe_layout.h"
#include "core/model/qwen2/qwen2_arch.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

ModelConfig with_moe(ModelConfig c) {
  MoeConfig& m = c.moe;
  TR_CHECK(m.n_experts >= 1, "model.n_experts: qwen2_moe needs its experts (num_experts; got ", m.n_experts,
           "); set model.n_experts");
  TR_CHECK(m.top_k >= 1 && m.top_k <= m.n_experts, "model.n_experts_per_tok: ", m.top_k, " must be in 1..",
           m.n_experts, " (model.n_experts)");
  TR_CHECK(m.ffn >= 1, "model.moe_ffn_dim: qwen2_moe needs its experts' width (moe_intermediate_size); set it");
  TR_CHECK(m.aux_loss_coef >= 0 && std::isfinite(m.aux_loss_coef), "model.router_aux_loss_coef must be >= 0 (got ",
           m.aux_loss_coef, ")");
  TR_CHECK(c.rope_scaling_type.empty(), "model.rope_scaling.type: ", c.rope_scaling_type,
           "; qwen2_moe (transformers 4.44's Qwen2MoeConfig) has no RoPE scaling; use none");
  if (m.norm_topk_auto) m.norm_topk_prob = false;  // Qwen2MoeConfig's default
  m.norm_topk_auto = false;
  m.naming = "qwen";
  c.qkv_bias = true;  // Qwen2's attention
  return c;
}

}  // namespace

Qwen2MoeArch::Qwen2MoeArch(const ModelConfig& cfg) : LlamaArch(with_moe(cfg), "qwen2_moe") {}

std::unique_ptr<ModelArch> make_qwen2_moe_arch(const ModelConfig& cfg) { return std::make_unique<Qwen2MoeArch>(cfg); }

std::string Qwen2MoeArch::describe() const {
  const MoeConfig& m = cfg_.moe;
  return LlamaArch::describe() + " experts=" + std::to_string(m.n_experts) + " top_k=" + std::to_string(m.top_k) +
         " expert_ffn=" + std::to_string(m.ffn) + " shared_ffn=" + std::to_string(m.shared_ffn) +
         (m.norm_topk_prob ? " norm_topk" : "");
}

ModelConfig qwen2_moe_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  const HfConfigKeys k(c, path, what, "Qwen2-MoE");
  // Qwen2MoeConfig's defaults where they are not Qwen2Config's; the
  // attention (and its refusals) read as Qwen2 reads it.
  json q = c;
  auto dflt = [&](const char* key, json v) {
    if (!k.has(key)) q[key] = std::move(v);
  };
  dflt("hidden_size", 2048);
  dflt("intermediate_size", 5632);
  dflt("num_hidden_layers", 24);
  dflt("num_attention_heads", 16);
  dflt("num_key_value_heads", 16);
  dflt("rope_theta", 10000.0);
  for (const char* key : qwen_moe_hf_keys()) q.erase(key);
  ModelConfig cfg = qwen2_config_from_hf(q, path, what);
  cfg.arch = "qwen2_moe";
  cfg.moe = qwen_moe_from_hf(k, cfg.L, {/*n_experts=*/60, /*top_k=*/4, /*ffn=*/1408, /*shared_ffn=*/5632});
  return cfg;
}

json Qwen2MoeArch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  const MoeConfig& m = cfg.moe;
  json c = LlamaArch::hf_config_json();  // Llama's keys, less what Qwen2MoeConfig has not
  c["architectures"] = {"Qwen2MoeForCausalLM"};
  c["model_type"] = "qwen2_moe";
  for (const char* key : {"head_dim", "rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp"}) c.erase(key);
  qwen_moe_to_hf(m, cfg.L, /*shared_expert=*/true, c);
  return c;
}

std::map<std::string, std::string> Qwen2MoeArch::file_metadata() const {
  std::map<std::string, std::string> meta = LlamaArch::file_metadata();
  moe_add_metadata(cfg_.moe, meta);
  return meta;
}

ModelConfig qwen2_moe_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);
  c.arch = "qwen2_moe";
  c.qkv_bias = true;
  MoeConfig m;
  m.naming = "qwen";
  c.moe = moe_from_metadata(meta, path, m);
  return c;
}

json Qwen2MoeArch::manifest_model() const {
  json j = LlamaArch::manifest_model();
  moe_add_manifest(cfg_.moe, /*shared_expert=*/true, j);
  return j;
}

std::vector<ShapeKey> Qwen2MoeArch::shape_keys() const {
  std::vector<ShapeKey> k = LlamaArch::shape_keys();
  moe_add_shape_keys(cfg_.moe, /*shared_expert=*/true, k);
  return k;
}

void Qwen2MoeArch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  LlamaArch::check_init_from(hf, dir);
  moe_check_init_from(display_name(), cfg_.moe, hf.moe, dir);
}

}  // namespace trainrun
