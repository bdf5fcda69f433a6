// Whole-model weights as safetensors: HF-GPT-2 tensor names (nn.Linear
// layout), fp32, with the architecture in __metadata__ so `generate` and the
// PyTorch reference can rebuild the model from the file alone.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/model/gpt2.h"

namespace trainrun {

// The __metadata__ that describes the architecture (shared with checkpoints,
// whose model.safetensors is a model file too).
std::map<std::string, std::string> gpt2_safetensors_metadata(const GPT2Config& cfg);

// The safetensors header of a whole-model fp32 file: the layout's tensors in
// its order, so global element g sits at byte header.size() + 4 g. Files
// written by several ranks at once (checkpoints, the final weights) are this
// header followed by each rank's ranges at those offsets.
std::string gpt2_model_file_header(const GPT2Config& cfg);

void save_model_safetensors(const std::string& path, const GPT2Config& cfg, const std::vector<float>& flat);
// Returns the config from the metadata and fills `flat` in make_gpt2_layout order.
GPT2Config load_model_safetensors(const std::string& path, std::vector<float>& flat);

}  // namespace trainrun
