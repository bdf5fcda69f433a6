// Logits of a base with a PEFT adapter on both sides: trainrun's (the base
// from its HF directory, the adapter read from its PEFT files, computed
// unmerged on the CPU backend) and peft's (scripts/reference/peft_lora.py).
// For tests that train adapters on some mesh and check that what the run
// wrote loads in peft and computes what trainrun computes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/adapter/lora.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

// (B, T, V) logits, the vocab padding cut off.
std::vector<float> adapted_logits_of(const std::string& base_dir, const std::string& adapter_dir,
                                     const LoraOptions& options, const std::vector<int32_t>& in, int B, int T);
// peft's: PeftModel.from_pretrained(base, adapter) in fp32; the batch and
// logits files go in `tmp`.
std::vector<float> peft_logits_of(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::vector<int32_t>& in, int B, int T, const TempDir& tmp);

}  // namespace trainrun::test
