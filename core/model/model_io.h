// Whole-model weights as safetensors: HF-GPT-2 tensor names (nn.Linear
// layout), fp32, with the architecture in __metadata__ so `generate` and the
// PyTorch reference can rebuild the model from the file alone.
#pragma once
#include <string>
#include <vector>

#include "core/model/gpt2.h"

namespace trainrun {

void save_model_safetensors(const std::string& path, const GPT2Config& cfg, const std::vector<float>& flat);
// Returns the config from the metadata and fills `flat` in make_gpt2_layout order.
GPT2Config load_model_safetensors(const std::string& path, std::vector<float>& flat);

}  // namespace trainrun
