// Whole-model weights as safetensors: the layout's tensor names (HF-style,
// nn.Linear layout), fp32, with the architecture in __metadata__
// (ModelArch::file_metadata) so `generate` and the PyTorch reference can
// rebuild the model from the file alone.
#pragma once
#include <string>
#include <vector>

#include "core/model/model.h"

namespace trainrun {

// The safetensors header of a whole-model fp32 file: the layout's tensors in
// its order, so global element g sits at byte header.size() + 4 g. Files
// written by several ranks at once (checkpoints, the final weights) are this
// header followed by each rank's ranges at those offsets.
std::string model_file_header(const ModelArch& arch);

void save_model_safetensors(const std::string& path, const ModelConfig& cfg, const std::vector<float>& flat);
// Returns the config from the metadata and fills `flat` in the layout's order.
ModelConfig load_model_safetensors(const std::string& path, std::vector<float>& flat);

}  // namespace trainrun
