// The mixture-of-experts keys of a Hugging Face config.json, read and
// written once for every MoE family: the typed key reader with its error
// messages, the router losses as transformers applies them, and the keys
// the Qwen MoE configs (Qwen2MoeConfig, Qwen3MoeConfig) share. A family's
// own file keeps only what is its own (its dense reader, defaults and
// refusals), so a new MoE family registers instead of copying.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/moe/moe_config.h"

namespace trainrun {

// Typed reads of config.json keys with defaults; a key that is present but
// of the wrong type, and a value trainrun cannot compute, fail naming the
// file, the key and the value. `what` is the caller's context ("model.init_from"),
// `family` the display name in refusals ("Qwen2-MoE").
class HfConfigKeys {
 public:
  HfConfigKeys(const nlohmann::ordered_json& c, std::string path, std::string what, std::string family)
      : c_(c), path_(std::move(path)), what_(std::move(what)), family_(std::move(family)) {}
  bool has(const char* key) const { return c_.contains(key) && !c_[key].is_null(); }
  int integer(const char* key, int dflt) const;
  bool flag(const char* key, bool dflt) const;
  double number(const char* key, double dflt) const;
  // "<what>: '<path>' has <key> = <have>; trainrun's <family> needs <need>, ..."
  [[noreturn]] void refuse(const std::string& key, const std::string& have, const std::string& need) const;
  // A failed check on a key's value that is not a refusal of the model.
  [[noreturn]] void fail(const std::string& message) const;
  const nlohmann::ordered_json& json() const { return c_; }

 private:
  const nlohmann::ordered_json& c_;
  std::string path_, what_, family_;
};

// transformers adds the load-balancing loss only with output_router_logits:
// router_aux_loss_coef (default 0.001) then, else 0.
double moe_aux_loss_coef_from_hf(const HfConfigKeys& k);
// The reverse: the loss trainrun trained with, as transformers reads it back.
void moe_write_aux_loss_hf(const MoeConfig& m, nlohmann::ordered_json& c);

// Qwen2MoeConfig / Qwen3MoeConfig: the MoE keys both have (the shared
// expert's width only in a family that has one), their defaults, and the
// layer rules trainrun does not implement (decoder_sparse_step != 1, a
// dense layer in mlp_only_layers), refused.
struct QwenMoeDefaults {
  int n_experts = 0, top_k = 0, ffn = 0;
  int shared_ffn = -1;  // -1: the family has no shared expert (the key is not read)
};
// The keys to erase before the dense family's reader sees the file.
std::vector<const char*> qwen_moe_hf_keys();
MoeConfig qwen_moe_from_hf(const HfConfigKeys& k, int n_layer, const QwenMoeDefaults& d);
void qwen_moe_to_hf(const MoeConfig& m, int n_layer, bool shared_expert, nlohmann::ordered_json& c);

}  // namespace trainrun
