// The MoE tensors' names and order (moe_layout.h).
#include "core/model/moe/moe_layout.h"

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

}  // namespace trainrun
