// The MoE keys of a Hugging Face config.json (moe_hf_config.h).
#include "core/model/moe/moe_hf_config.h"

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

int HfConfigKeys::integer(const char* key, int dflt) const {
  if (!has(key)) return dflt;
  if (!c_[key].is_number_integer()) fail(std::string(key) + " is not an integer: " + c_[key].dump());
  return c_[key].get<int>();
}

bool HfConfigKeys::flag(const char* key, bool dflt) const {
  if (!has(key)) return dflt;
  if (!c_[key].is_boolean()) fail(std::string(key) + " is not true/false: " + c_[key].dump());
  return c_[key].get<bool>();
}

double HfConfigKeys::number(const char* key, double dflt) const {
  if (!has(key)) return dflt;
  if (!c_[key].is_number()) fail(std::string(key) + " is not a number: " + c_[key].dump());
  return c_[key].get<double>();
}

void HfConfigKeys::refuse(const std::string& key, const std::string& have, const std::string& need) const {
  TR_FAIL(what_, ": '", path_, "' has ", key, " = ", have, "; trainrun's ", family_, " needs ", need,
          ", so these weights would compute a different function");
}

void HfConfigKeys::fail(const std::string& message) const { TR_FAIL(what_, ": '", path_, "': ", message); }

double moe_aux_loss_coef_from_hf(const HfConfigKeys& k) {
  const double coef = k.number("router_aux_loss_coef", 0.001);
  return k.flag("output_router_logits", false) ? coef : 0.0;
}

void moe_write_aux_loss_hf(const MoeConfig& m, json& c) {
  c["output_router_logits"] = m.aux_loss_coef > 0;
  c["router_aux_loss_coef"] = m.aux_loss_coef > 0 ? m.aux_loss_coef : 0.001;
}

std::vector<const char*> qwen_moe_hf_keys() {
  return {"num_experts",      "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
          "norm_topk_prob",   "decoder_sparse_step", "mlp_only_layers",       "output_router_logits",
          "router_aux_loss_coef"};
}

MoeConfig qwen_moe_from_hf(const HfConfigKeys& k, int n_layer, const QwenMoeDefaults& d) {
  MoeConfig m;
  m.naming = "qwen";
  m.n_experts = k.integer("num_experts", d.n_experts);
  m.top_k = k.integer("num_experts_per_tok", d.top_k);
  m.ffn = k.integer("moe_intermediate_size", d.ffn);
  m.shared_ffn = d.shared_ffn < 0 ? 0 : k.integer("shared_expert_intermediate_size", d.shared_ffn);
  m.norm_topk_prob = k.flag("norm_topk_prob", false);
  if (m.n_experts < 1) k.refuse("num_experts", std::to_string(m.n_experts), "experts in every layer (>= 1)");
  if (m.top_k < 1 || m.top_k > m.n_experts)
    k.fail("num_experts_per_tok (" + std::to_string(m.top_k) + ") must be in 1..num_experts (" +
           std::to_string(m.n_experts) + ")");
  if (m.ffn < 1) k.fail("moe_intermediate_size must be positive (got " + std::to_string(m.ffn) + ")");
  if (m.shared_ffn < 0)
    k.fail("shared_expert_intermediate_size must be >= 0 (got " + std::to_string(m.shared_ffn) + ")");
  // Layer l is sparse when it is not in mlp_only_layers and (l+1) %
  // decoder_sparse_step == 0 (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer);
  // trainrun's blocks are all sparse. One layer is sparse at any step.
  const std::string all_sparse = "1 (every layer a mixture of experts; dense layers among them are not implemented)";
  const int step = k.integer("decoder_sparse_step", 1);
  if (step < 1) k.refuse("decoder_sparse_step", std::to_string(step), all_sparse);
  if (step != 1 && n_layer > 1) k.refuse("decoder_sparse_step", std::to_string(step), all_sparse);
  if (k.has("mlp_only_layers")) {
    const json& dense = k.json()["mlp_only_layers"];
    if (!dense.is_array()) k.fail("mlp_only_layers is not a list: " + dense.dump());
    for (const auto& v : dense)
      if (v.is_number_integer() && v.get<int>() >= 0 && v.get<int>() < n_layer)
        k.refuse("mlp_only_layers", dense.dump(),
                 "[] (every layer a mixture of experts; dense layers among them are not implemented)");
  }
  m.aux_loss_coef = moe_aux_loss_coef_from_hf(k);
  return m;
}

void qwen_moe_to_hf(const MoeConfig& m, int n_layer, bool shared_expert, json& c) {
  c["use_sliding_window"] = false;
  c["sliding_window"] = nullptr;
  c["max_window_layers"] = n_layer;
  c["num_experts"] = m.n_experts;
  c["num_experts_per_tok"] = m.top_k;
  c["moe_intermediate_size"] = m.ffn;
  if (shared_expert) c["shared_expert_intermediate_size"] = m.shared_ffn;
  c["norm_topk_prob"] = m.norm_topk_prob;
  c["decoder_sparse_step"] = 1;
  c["mlp_only_layers"] = json::array();
  moe_write_aux_loss_hf(m, c);
}

}  // namespace trainrun
