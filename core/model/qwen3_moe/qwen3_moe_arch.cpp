// Qwen3-MoE (qwen3_moe_arch.h): Qwen3's attention rules and a mixture of
// experts on top of Llama's network, config.json both ways (transformers
// 4.51's Qwen3MoeConfig keys and defaults) and what our files record.
#include "core/model/qwen3_moe/qwen3_moe_arch.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/moe/moe_hf_config.h"
#include "core/model/moe/moe_layout.h"
#include "core/model/qwen3/qwen3_arch.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

ModelConfig with_moe(ModelConfig c) {
  MoeConfig& m = c.moe;
  TR_CHECK(m.n_experts >= 1, "model.n_experts: qwen3_moe needs its experts (num_experts; got ", m.n_experts,
           "); set model.n_experts");
  TR_CHECK(m.top_k >= 1 && m.top_k <= m.n_experts, "model.n_experts_per_tok: ", m.top_k, " must be in 1..",
           m.n_experts, " (model.n_experts)");
  TR_CHECK(m.ffn >= 1, "model.moe_ffn_dim: qwen3_moe needs its experts' width (moe_intermediate_size); set it");
  TR_CHECK(m.shared_ffn == 0, "model.shared_expert_ffn_dim: ", m.shared_ffn,
           "; qwen3_moe has no shared expert (0); use model.arch: qwen2_moe for one");
  TR_CHECK(m.aux_loss_coef >= 0 && std::isfinite(m.aux_loss_coef), "model.router_aux_loss_coef must be >= 0 (got ",
           m.aux_loss_coef, ")");
  TR_CHECK(c.rope_scaling_type.empty(), "model.rope_scaling.type: ", c.rope_scaling_type,
           "; qwen3_moe (as trainrun reads Qwen3MoeConfig) has no RoPE scaling; use none");
  TR_CHECK(!c.qkv_bias, "model.qkv_bias: qwen3_moe has no attention biases (attention_bias false)");
  if (m.norm_topk_auto) m.norm_topk_prob = false;  // Qwen3MoeConfig's default (the published configs say true)
  m.norm_topk_auto = false;
  m.naming = "qwen";
  c.qk_norm = true;  // Qwen3's attention: every layer normalises q and k per head
  return c;
}

}  // namespace

Qwen3MoeArch::Qwen3MoeArch(const ModelConfig& cfg) : LlamaArch(with_moe(cfg), "qwen3_moe") {}

std::unique_ptr<ModelArch> make_qwen3_moe_arch(const ModelConfig& cfg) { return std::make_unique<Qwen3MoeArch>(cfg); }

std::string Qwen3MoeArch::describe() const {
  const MoeConfig& m = cfg_.moe;
  return LlamaArch::describe() + " experts=" + std::to_string(m.n_experts) + " top_k=" + std::to_string(m.top_k) +
         " expert_ffn=" + std::to_string(m.ffn) + (m.norm_topk_prob ? " norm_topk" : "");
}

ModelConfig qwen3_moe_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  const HfConfigKeys k(c, path, what, "Qwen3-MoE");
  // Qwen3MoeConfig's defaults where they are not Qwen3Config's; the
  // attention (and its refusals: attention_bias, a window) read as Qwen3
  // reads it. Unlike Qwen3Config it has no head_dim default: the attention
  // takes hidden_size / num_attention_heads when config.json has none.
  json q = c;
  auto dflt = [&](const char* key, json v) {
    if (!k.has(key)) q[key] = std::move(v);
  };
  dflt("hidden_size", 2048);
  dflt("intermediate_size", 6144);
  dflt("num_hidden_layers", 24);
  dflt("num_attention_heads", 32);
  dflt("num_key_value_heads", 4);
  dflt("rms_norm_eps", 1e-6);
  dflt("rope_theta", 10000.0);
  if (!k.has("head_dim") && q["hidden_size"].is_number_integer() && q["num_attention_heads"].is_number_integer() &&
      q["num_attention_heads"].get<int>() > 0)
    q["head_dim"] = q["hidden_size"].get<int>() / q["num_attention_heads"].get<int>();
  for (const char* key : qwen_moe_hf_keys()) q.erase(key);
  ModelConfig cfg = qwen3_config_from_hf(q, path, what);
  cfg.arch = "qwen3_moe";
  cfg.moe = qwen_moe_from_hf(k, cfg.L, {/*n_experts=*/128, /*top_k=*/8, /*ffn=*/768, /*shared_ffn: none*/ -1});
  return cfg;
}

json Qwen3MoeArch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  const MoeConfig& m = cfg.moe;
  json c = LlamaArch::hf_config_json();  // Llama's keys, less what Qwen3MoeConfig has not
  c["architectures"] = {"Qwen3MoeForCausalLM"};
  c["model_type"] = "qwen3_moe";
  c["head_dim"] = cfg.head_size();  // no default of 128 here, but the attention reads it: always written
  for (const char* key : {"mlp_bias", "pretraining_tp"}) c.erase(key);
  c["attention_bias"] = false;
  qwen_moe_to_hf(m, cfg.L, /*shared_expert=*/false, c);
  return c;
}

std::map<std::string, std::string> Qwen3MoeArch::file_metadata() const {
  std::map<std::string, std::string> meta = LlamaArch::file_metadata();
  moe_add_metadata(cfg_.moe, meta);
  return meta;
}

ModelConfig qwen3_moe_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = qwen3_config_from_metadata(meta, path);
  c.arch = "qwen3_moe";
  MoeConfig m;
  m.naming = "qwen";
  c.moe = moe_from_metadata(meta, path, m);
  return c;
}

json Qwen3MoeArch::manifest_model() const {
  json j = LlamaArch::manifest_model();
  moe_add_manifest(cfg_.moe, /*shared_expert=*/false, j);
  return j;
}

std::vector<ShapeKey> Qwen3MoeArch::shape_keys() const {
  std::vector<ShapeKey> k = LlamaArch::shape_keys();
  moe_add_shape_keys(cfg_.moe, /*shared_expert=*/false, k);
  return k;
}

void Qwen3MoeArch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  LlamaArch::check_init_from(hf, dir);
  moe_check_init_from(display_name(), cfg_.moe, hf.moe, dir);
}

}  // namespace trainrun
