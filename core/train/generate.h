// Sampling from a trained model (`trainrun generate`, and the end of a run).
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/gpt2.h"

#pragma once

namespace trainrun {

struct SampleOptions {
  int max_tokens = 200;
  double temperature = 1.0;   // 0 or top_k == 1: greedy
  int top_k = 0;              // 0 = full distribution
  uint64_t seed = 1;
};

// Autoregressive sampling with a sliding window of the model's T tokens.
std::vector<int32_t> sample_tokens(const GPT2Config& cfg, const std::vector<float>& flat_params,
                                   const std::vector<int32_t>& prompt, const SampleOptions& opts);

// Byte-level when V == 256 (text <-> bytes), else whitespace-separated token ids.
std::vector<int32_t> encode_prompt(const std::string& text, int vocab);
std::string decode_tokens(const std::vector<int32_t>& tokens, int vocab);

// Resolve --checkpoint: a .safetensors file, a checkpoint directory (holding
// model.safetensors), or a run directory (its latest checkpoint, else its
// model.safetensors). Throws naming what was looked for.
std::string resolve_model_file(const std::string& path);

}  // namespace trainrun
