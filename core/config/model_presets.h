// Named model shapes: the published configurations of the common models,
// as the model.* values that describe them. One table serves both
// `model.preset` in a job spec (core/model/model_spec.h fills the fields the
// spec did not set) and `trainrun plan --model NAME` (model_shape.h), so the
// two cannot disagree about what "llama3.1-8b" is.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

struct ModelPreset {
  const char* name;         // "llama3.1-8b"
  const char* source;       // what it is: the HF model whose config.json it copies
  ModelSpec spec;           // arch and every shape field; seq_len = the model's original context
  std::vector<const char*> aliases;  // older spellings that `plan --model` still accepts ("llama3-8b")
};

// In the order they are listed in docs and messages.
const std::vector<ModelPreset>& model_presets();
// By name or alias; nullptr when none is.
const ModelPreset* find_model_preset(const std::string& name);
// The names (no aliases), for the model.preset enum and help texts.
std::vector<std::string> model_preset_names();
// The table as markdown; docs/job-spec.md embeds it and a test keeps the two equal.
std::string model_presets_markdown();

}  // namespace trainrun
