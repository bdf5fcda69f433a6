// `trainrun export --merge ADAPTER`: a Hugging Face directory of the base
// with a PEFT LoRA adapter merged in, W' = W + (alpha/r) B A on every
// adapted linear, as peft's merge_and_unload() computes it. The merged
// weights stream piece by piece through the same exporter as every export
// (hf_interop.h): the base is read range by range and each adapted tensor's
// rows get their update as they pass, so no whole model is ever in memory.
#pragma once
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"

namespace trainrun {

// base: what `trainrun export --checkpoint` takes (an HF directory, a run,
// a checkpoint or a model file); adapter_dir: a PEFT adapter directory
// whose r, alpha and targets are read from its adapter_config.json.
// Returns what was exported.
std::string export_merged_hf(const std::string& base, const std::string& adapter_dir, const std::string& out_dir,
                             const HfExportOptions& opt = {});

}  // namespace trainrun
