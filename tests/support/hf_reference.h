// Logits on both sides of a Hugging Face cross-check: trainrun's own for
// whole-model weights (CPU backend) and transformers' for a saved directory
// (the test venv running scripts/reference/hf_gpt2.py or hf_llama.py).
// Shared by the export tests and every test that exports a run and reloads
// it in transformers (test_export.cpp, test_pipeline_runtime.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

// scripts/reference/SCRIPT with ARGS (shell syntax) in the test venv,
// offline, one OpenMP thread (the machine's cores belong to the test run).
RunResult run_reference_script(const std::string& script, const std::string& args);

// trainrun's logits (B, T, V; the padded vocab rows cut off) for the
// whole-model weights `flat` on the CPU backend.
std::vector<float> logits_of(const ModelArch& arch, const std::vector<float>& flat, const std::vector<int32_t>& in,
                             int B, int T);

// transformers' logits (B, T, V) of the model directory DIR through SCRIPT's
// `logits` command; from_pretrained must load it cleanly (the scripts fail on
// missing or unexpected keys). The batch and logits files go in `tmp`.
std::vector<float> hf_logits_of(const std::string& script, const std::string& dir, const std::vector<int32_t>& in,
                                int B, int T, const TempDir& tmp);

}  // namespace trainrun::test
