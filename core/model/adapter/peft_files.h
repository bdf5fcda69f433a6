// PEFT's adapter directory, both ways: adapter_config.json +
// adapter_model.safetensors, as peft.PeftModel.save_pretrained writes them
// and PeftModel.from_pretrained(base, DIR) reads them. Tensor names are
// "base_model.model.<HF module>.lora_A.weight" / ".lora_B.weight" (peft
// drops the adapter's name, "default", when saving); A is (r, in), B is
// (out, r) on a Linear and on GPT-2's Conv1D alike. A DoRA adapter
// (use_dora: true) adds "<module>.lora_magnitude_vector" (out) per target.
#pragma once
#include <string>
#include <vector>

#include "core/model/adapter/lora.h"

namespace trainrun {

// The name peft gives an adapter tensor of our layout in its files.
inline std::string peft_tensor_name(const std::string& ours) { return "base_model.model." + ours; }

// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (each
// through a temporary file and a rename) from the whole adapter `flat`
// (adapters.layout() order, fp32). base_model: the base's directory
// (model.init_from) for base_model_name_or_path; "" = none.
void write_peft_adapter(const std::string& dir, const ModelArch& arch, const LoraAdapters& adapters,
                        const std::vector<float>& flat, const std::string& base_model);

// The LoRA options a PEFT adapter directory was trained with (r,
// lora_alpha, lora_dropout, target_modules, use_dora), for tools that take only the
// directory (export --merge); read_peft_adapter then checks the rest.
LoraOptions peft_adapter_options(const std::string& dir, const std::string& what);

// Reads a PEFT adapter directory into the adapter layout (fp32, whole).
// Its config must be a LoRA adapter with this job's r, lora_alpha, target
// modules and use_dora (model.adapter.type dora), and nothing trainrun does
// not implement (use_rslora, modules_to_save, bias, layers_to_transform, rank/alpha
// patterns); each tensor must be there with our shape. Every refusal is an
// Error naming the file, the key or tensor, and both values. `what`
// prefixes messages ("model.adapter.init_from").
std::vector<float> read_peft_adapter(const std::string& dir, const ModelArch& arch, const LoraAdapters& adapters,
                                     const std::string& what);

}  // namespace trainrun
