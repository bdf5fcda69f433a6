// The MoE MLP's tensors in a Llama-shaped block's layout, in MoeOffsets'
// order, under the HF names MoeConfig::naming gives (moe_config.h).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/model/model.h"

namespace trainrun {

// Adds block `prefix`'s MoE tensors ("model.layers.3.") to the unit being built.
void add_moe_tensors(LayoutBuilder& b, const std::string& prefix, int64_t C, const MoeConfig& m);
// The HF names of one block's MoE tensors, in the order transformers'
// named_parameters() lists them (Mixtral: gate, then each expert's w1, w2, w3).
std::vector<std::string> moe_hf_save_order(const std::string& prefix, const MoeConfig& m);
// Whether a tensor name is a residual projection (an expert's down_proj / w2):
// init_std / sqrt(2L), as the dense down_proj.
bool moe_is_residual_projection(const std::string& name);

// What our files (safetensors __metadata__) record of a mixture of experts,
// and reading it back onto `base` (its naming kept): every MoE family's.
void moe_add_metadata(const MoeConfig& m, std::map<std::string, std::string>& meta);
MoeConfig moe_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path, MoeConfig base);
// model.init_from: the job's experts must be the directory's (names the model.* key and both values).
void moe_check_init_from(const std::string& family, const MoeConfig& job, const MoeConfig& hf, const std::string& dir);
// The checkpoint manifest's model.* MoE fields and the model.* <-> config.json
// keys `plan`/init_from compare, every MoE family's. Mixtral's naming has
// num_local_experts and no per-expert width or renormalisation key; Qwen's
// has num_experts, moe_intermediate_size and norm_topk_prob, plus the shared
// expert's width in a family that has one (`shared_expert`).
void moe_add_manifest(const MoeConfig& m, bool shared_expert, nlohmann::ordered_json& j);
void moe_add_shape_keys(const MoeConfig& m, bool shared_expert, std::vector<ShapeKey>& k);

}  // namespace trainrun
