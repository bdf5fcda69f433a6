// The MoE tensors' names and order (moe_layout.h).
#include "core/model/moe/moe_layout.h"

#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/common/error.h"

namespace trainrun {

namespace {

struct Names {
  std::string module, gate, up, down;  // "block_sparse_moe.", "w1", "w3", "w2"
};
Names names_of(const MoeConfig& m) {
  if (m.naming == "mixtral") return {"block_sparse_moe.", "w1", "w3", "w2"};
  TR_CHECK(m.naming == "qwen", "model: MoE tensor naming '", m.naming, "' is not mixtral or qwen (a bug)");
  return {"mlp.", "gate_proj", "up_proj", "down_proj"};
}

}  // namespace

void add_moe_tensors(LayoutBuilder& b, const std::string& prefix, int64_t C, const MoeConfig& m) {
  using S = ParamTensor::Split;
  const Names n = names_of(m);
  const std::string p = prefix + n.module;
  const int64_t E = m.n_experts, F = m.ffn, FS = m.shared_ffn;
  // Replicated: tensor parallelism over a MoE block is refused until the
  // experts split (issue #28); expert parallelism will shard them by expert.
  b.add(p + "gate.weight", {E, C}, true, S::Replicated);
  for (int64_t e = 0; e < E; ++e) {  // gate|up adjacent per expert: one (2F,C) weight
    const std::string x = p + "experts." + std::to_string(e) + ".";
    b.add(x + n.gate + ".weight", {F, C}, true, S::Replicated);
    b.add(x + n.up + ".weight", {F, C}, true, S::Replicated);
  }
  for (int64_t e = 0; e < E; ++e)
    b.add(p + "experts." + std::to_string(e) + "." + n.down + ".weight", {C, F}, true, S::Replicated);
  if (FS > 0) {
    b.add(p + "shared_expert.gate_proj.weight", {FS, C}, true, S::Replicated);
    b.add(p + "shared_expert.up_proj.weight", {FS, C}, true, S::Replicated);
    b.add(p + "shared_expert.down_proj.weight", {C, FS}, true, S::Replicated);
    b.add(p + "shared_expert_gate.weight", {1, C}, true, S::Replicated);
  }
}

std::vector<std::string> moe_hf_save_order(const std::string& prefix, const MoeConfig& m) {
  const Names n = names_of(m);
  const std::string p = prefix + n.module;
  std::vector<std::string> out = {p + "gate.weight"};
  // Mixtral's MixtralBlockSparseTop2MLP registers w1, w2, w3; Qwen2-MoE's
  // MLP gate_proj, up_proj, down_proj.
  for (int e = 0; e < m.n_experts; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    if (m.naming == "mixtral")
      out.insert(out.end(), {x + "w1.weight", x + "w2.weight", x + "w3.weight"});
    else
      out.insert(out.end(), {x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"});
  }
  if (m.shared_ffn > 0)
    out.insert(out.end(), {p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight",
                           p + "shared_expert.down_proj.weight", p + "shared_expert_gate.weight"});
  return out;
}

bool moe_is_residual_projection(const std::string& name) {
  auto ends = [&](const char* s) {
    const std::string suf(s);
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return ends(".w2.weight") || ends("down_proj.weight");
}

namespace {
std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

void moe_add_metadata(const MoeConfig& m, std::map<std::string, std::string>& meta) {
  meta["n_experts"] = std::to_string(m.n_experts);
  meta["n_experts_per_tok"] = std::to_string(m.top_k);
  meta["norm_topk_prob"] = m.norm_topk_prob ? "true" : "false";
  meta["moe_ffn_dim"] = std::to_string(m.ffn);
  meta["shared_expert_ffn_dim"] = std::to_string(m.shared_ffn);
  meta["router_aux_loss_coef"] = exact(m.aux_loss_coef);
  meta["router_z_loss_coef"] = exact(m.z_loss_coef);
}

MoeConfig moe_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path, MoeConfig m) {
  auto text = [&](const char* key) -> const std::string& {
    auto it = meta.find(key);
    TR_CHECK(it != meta.end(), path, ": missing __metadata__ key '", key,
             "'; this mixture-of-experts file was not written by trainrun (or an older version)");
    return it->second;
  };
  auto num = [&](const char* key) {
    const std::string& v = text(key);
    try {
      size_t used = 0;
      const double d = std::stod(v, &used);
      if (used == v.size() && std::isfinite(d)) return d;
    } catch (...) {
    }
    TR_FAIL(path, ": __metadata__ key '", key, "' is not a number: '", v, "'");
  };
  auto integer = [&](const char* key) {
    const double d = num(key);
    TR_CHECK(d == std::floor(d) && d >= 0 && d < 2e9, path, ": __metadata__ key '", key, "' is not a count: '",
             text(key), "'");
    return int(d);
  };
  m.n_experts = integer("n_experts");
  m.top_k = integer("n_experts_per_tok");
  const std::string& norm = text("norm_topk_prob");
  TR_CHECK(norm == "true" || norm == "false", path, ": __metadata__ key 'norm_topk_prob' is not true/false: '", norm,
           "'");
  m.norm_topk_prob = norm == "true";
  m.ffn = integer("moe_ffn_dim");
  m.shared_ffn = integer("shared_expert_ffn_dim");
  m.aux_loss_coef = num("router_aux_loss_coef");
  m.z_loss_coef = num("router_z_loss_coef");
  return m;
}

void moe_check_init_from(const std::string& family, const MoeConfig& job, const MoeConfig& hf, const std::string& dir) {
  auto same = [&](const char* field, int mine, const char* key, int have) {
    TR_CHECK(mine == have, "model.init_from: '", dir, "' holds a ", family, " with ", key, " = ", have,
             " (config.json) but model.", field, " is ", mine, "; set model.", field, ": ", have,
             " (the job's model.* must describe the weights it starts from)");
  };
  same("n_experts", job.n_experts, "the experts (num_local_experts / num_experts)", hf.n_experts);
  same("n_experts_per_tok", job.top_k, "num_experts_per_tok", hf.top_k);
  same("moe_ffn_dim", job.ffn, "the experts' width", hf.ffn);
  same("shared_expert_ffn_dim", job.shared_ffn, "shared_expert_intermediate_size", hf.shared_ffn);
  TR_CHECK(job.norm_topk_prob == hf.norm_topk_prob, "model.init_from: '", dir, "' holds a ", family,
           " with norm_topk_prob = ", hf.norm_topk_prob ? "true" : "false", " (config.json) but model.norm_topk_prob is ",
           job.norm_topk_prob ? "true" : "false", "; set it to ", hf.norm_topk_prob ? "true" : "false", " or auto");
}

void moe_add_manifest(const MoeConfig& m, bool shared_expert, nlohmann::ordered_json& j) {
  j["n_experts"] = m.n_experts;
  j["n_experts_per_tok"] = m.top_k;
  if (m.naming == "qwen") {
    j["moe_ffn_dim"] = m.ffn;
    if (shared_expert) j["shared_expert_ffn_dim"] = m.shared_ffn;
    j["norm_topk_prob"] = m.norm_topk_prob;
  }
  j["router_aux_loss_coef"] = m.aux_loss_coef;
  j["router_z_loss_coef"] = m.z_loss_coef;
}

void moe_add_shape_keys(const MoeConfig& m, bool shared_expert, std::vector<ShapeKey>& k) {
  if (m.naming != "qwen") {
    k.insert(k.end(), {{"model.n_experts", "num_local_experts"}, {"model.n_experts_per_tok", "num_experts_per_tok"}});
    return;
  }
  k.insert(k.end(), {{"model.n_experts", "num_experts"},
                     {"model.n_experts_per_tok", "num_experts_per_tok"},
                     {"model.moe_ffn_dim", "moe_intermediate_size"}});
  if (shared_expert) k.push_back({"model.shared_expert_ffn_dim", "shared_expert_intermediate_size"});
  k.push_back({"model.norm_topk_prob", "norm_topk_prob"});
}

}  // namespace trainrun
