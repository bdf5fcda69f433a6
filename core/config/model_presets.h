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

// A preset is named exactly for the release whose config.json it copies
// ("llama3.1-8b" is meta-llama/Llama-3.1-8B); no alias stands for it. A
// name that fits more than one release ("llama3-8b": Llama 3 and Llama 3.1
// share the shape but not the RoPE scaling; "llama3": every size) is
// refused with the exact names it could mean (ambiguous_preset_message).
struct ModelPreset {
  const char* name;         // "llama3.1-8b"
  const char* source;       // what it is: the HF model whose config.json it copies
  ModelSpec spec;           // arch and every shape field; seq_len = the model's original context
};

// In the order they are listed in docs and messages.
const std::vector<ModelPreset>& model_presets();
// By its exact name; nullptr otherwise.
const ModelPreset* find_model_preset(const std::string& name);
// When `name` is not a preset but reads as a family (and size) that more
// than one preset or release answers to ("llama3-8b", "llama3", "llama3.1"):
// the error text naming each exact preset it could mean; else "".
std::string ambiguous_preset_message(const std::string& name);
// The names, for the model.preset enum and help texts.
std::vector<std::string> model_preset_names();
// The table as markdown; docs/job-spec.md embeds it and a test keeps the two equal.
std::string model_presets_markdown();

}  // namespace trainrun
