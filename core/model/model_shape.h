// Model shapes as text, for `trainrun plan --model` (and presets for the
// common published shapes), so a model can be planned before its
// architecture trains (Llama):
//   gpt2:L=12,C=768,heads=12,V=50304,T=1024
//   llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096
//   llama3.1-70b          (a preset, the table of model.preset: core/config/model_presets.h;
//                          presets take overrides: llama3.1-70b:T=4096; a name that fits
//                          more than one release, such as llama3-70b, is refused
//                          with the exact names)
// Keys: L (layers), C (width), heads, kv_heads (llama; default heads), ffn
// (MLP width; gpt2 4C, llama required), V (vocab), T (context), tied (0/1:
// LM head shares the token embedding; gpt2 1, llama 0). HF / job-spec names
// work too (hidden_size, n_layer, ...).
#pragma once
#include <string>

#include "core/model/model.h"

namespace trainrun {

// Throws Error naming the offending key/value and what is accepted.
ModelConfig parse_model_shape(const std::string& text);
// Help text for --model (keys, presets).
std::string model_shape_help();

}  // namespace trainrun
