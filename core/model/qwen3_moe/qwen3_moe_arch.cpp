// Qwen3-MoE (qwen3_moe_arch.h): Qwen3's attention rules and a mixture of
// experts on top of Llama's network, config.json both ways (transformers
// 4.51's Qwen3MoeConfig keys and defaults) and what our files record.
#include "core/model/qwen3_moe/qwen3_moe_arch.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
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
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto integer = [&](const char* key, int dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_number_integer(), what, ": '", path, "': ", key, " is not an integer: ", c[key].dump());
    return c[key].get<int>();
  };
  auto flag = [&](const char* key, bool dflt) {
    if (!has(key)) return dflt;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto refuse = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's Qwen3-MoE needs ", need,
            ", so these weights would compute a different function");
  };
  // Qwen3MoeConfig's defaults where they are not Qwen3Config's; the
  // attention (and its refusals: attention_bias, a window) read as Qwen3
  // reads it. Unlike Qwen3Config it has no head_dim default: the attention
  // takes hidden_size / num_attention_heads when config.json has none.
  json q = c;
  auto dflt = [&](const char* key, json v) {
    if (!has(key)) q[key] = std::move(v);
  };
  dflt("hidden_size", 2048);
  dflt("intermediate_size", 6144);
  dflt("num_hidden_layers", 24);
  dflt("num_attention_heads", 32);
  dflt("num_key_value_heads", 4);
  dflt("rms_norm_eps", 1e-6);
  dflt("rope_theta", 10000.0);
  if (!has("head_dim") && q["hidden_size"].is_number_integer() && q["num_attention_heads"].is_number_integer() &&
      q["num_attention_heads"].get<int>() > 0)
    q["head_dim"] = q["hidden_size"].get<int>() / q["num_attention_heads"].get<int>();
  for (const char* k : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                        "decoder_sparse_step", "mlp_only_layers", "output_router_logits", "router_aux_loss_coef"})
    q.erase(k);
  ModelConfig cfg = qwen3_config_from_hf(q, path, what);
  cfg.arch = "qwen3_moe";
  MoeConfig& m = cfg.moe;
  m.n_experts = integer("num_experts", 128);
  m.top_k = integer("num_experts_per_tok", 8);
  m.ffn = integer("moe_intermediate_size", 768);
  m.shared_ffn = 0;
  m.norm_topk_prob = flag("norm_topk_prob", false);
  m.naming = "qwen";
  if (m.n_experts < 1) refuse("num_experts", std::to_string(m.n_experts), "experts in every layer (>= 1)");
  TR_CHECK(m.top_k >= 1 && m.top_k <= m.n_experts, what, ": '", path, "': num_experts_per_tok (", m.top_k,
           ") must be in 1..num_experts (", m.n_experts, ")");
  TR_CHECK(m.ffn >= 1, what, ": '", path, "': moe_intermediate_size must be positive (got ", m.ffn, ")");
  // Layer l is sparse when it is not in mlp_only_layers and (l+1) % decoder_sparse_step == 0
  // (Qwen3MoeDecoderLayer); trainrun's blocks are all sparse.
  const int step = integer("decoder_sparse_step", 1);
  if (step < 1) refuse("decoder_sparse_step", std::to_string(step), "1 (every layer a mixture of experts)");
  if (step != 1 && cfg.L > 1)
    refuse("decoder_sparse_step", std::to_string(step),
           "1 (every layer a mixture of experts; dense layers among them are not implemented)");
  if (has("mlp_only_layers")) {
    TR_CHECK(c["mlp_only_layers"].is_array(), what, ": '", path, "': mlp_only_layers is not a list: ",
             c["mlp_only_layers"].dump());
    for (const auto& v : c["mlp_only_layers"])
      if (v.is_number_integer() && v.get<int>() >= 0 && v.get<int>() < cfg.L)
        refuse("mlp_only_layers", c["mlp_only_layers"].dump(),
               "[] (every layer a mixture of experts; dense layers among them are not implemented)");
  }
  const double coef = has("router_aux_loss_coef") && c["router_aux_loss_coef"].is_number()
                          ? c["router_aux_loss_coef"].get<double>()
                          : 0.001;
  m.aux_loss_coef = flag("output_router_logits", false) ? coef : 0.0;
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
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
  c["max_window_layers"] = cfg.L;
  c["num_experts"] = m.n_experts;
  c["num_experts_per_tok"] = m.top_k;
  c["moe_intermediate_size"] = m.ffn;
  c["norm_topk_prob"] = m.norm_topk_prob;
  c["decoder_sparse_step"] = 1;
  c["mlp_only_layers"] = json::array();
  c["output_router_logits"] = m.aux_loss_coef > 0;
  c["router_aux_loss_coef"] = m.aux_loss_coef > 0 ? m.aux_loss_coef : 0.001;
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
