// Logits on both sides of a Hugging Face cross-check: trainrun's own for
// whole-model weights (CPU backend) and transformers' for a saved directory
// (the test venv running scripts/reference/hf_gpt2.py or hf_llama.py).
// Shared by the export tests, every test that exports a run and reloads
// it in transformers (test_export.cpp, test_pipeline_runtime.cpp), and the
// model families' cross-checks (below).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
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

// ---- What every model family's cross-check against transformers needs ----
// (test_qwen2/qwen3/phi3/gemma2/mistral/...: one copy here, not one per file.)

// A tensor of a reference file as fp32; FAILs naming the file when absent.
std::vector<float> tensor_f32(const SafeTensorFile& f, const std::string& name, const std::string& path);

// n uniform tokens in [0, V), from `seed`.
std::vector<int32_t> random_tokens(size_t n, int V, uint64_t seed);

// PATH: a safetensors file with int32 'inputs' and 'targets' (B, T): the
// --batch the reference scripts' `random` command reads.
void write_token_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tg,
                       int B, int T);

// The weights of a saved HF directory (DIR/model.safetensors) in the arch's
// flat layout, by ModelArch::hf_tensor (transposed tensors and row ranges of
// fused ones included). A missing or mis-shaped tensor fails the test,
// naming it.
std::vector<float> flat_from_hf(const ModelArch& arch, const std::string& dir);

// One fp32 pass of the arch's training network on the CPU backend: the
// logits of a forward-only pass (B, T, V; padded vocab rows cut off), then
// one forward + backward (dloss_scale 1/(B*T), i.e. the mean loss) into
// zeroed gradients: the per-token losses and every parameter's gradient.
struct NetworkRun {
  std::vector<float> logits, losses, grads;
  double loss = 0;  // the mean of `losses` (summed in double)
};
NetworkRun run_network(const ModelArch& arch, const std::vector<float>& flat, const std::vector<int32_t>& in,
                       const std::vector<int32_t>& tg, int B, int T, bool activation_checkpointing = false);

// Greedy decoding with the arch's KV-cached decoder: prompt `ids` then n
// tokens (argmax, first index on ties, as torch's).
std::vector<int32_t> greedy_ids(const ModelArch& arch, const std::vector<float>& flat, std::vector<int32_t> ids, int n);

// The trained run's `trainrun generate --checkpoint RUN/model.safetensors
// --top-k 1` of n tokens after PROMPT (ids) prints what SCRIPT's greedy
// `generate` (transformers, KV-cached) prints for HF_DIR.
void check_cli_generate_equals_hf(const std::string& script, const std::string& hf_dir, const std::string& run,
                                  const std::string& prompt, int n);

// `trainrun export` of RUN/model.safetensors into OUT, then transformers'
// from_pretrained(OUT) (through SCRIPT's `logits`) gives our logits of
// `trained` within 1e-5 (B 2, T 12, tokens below V). Returns OUT's
// config.json for the family's own checks.
nlohmann::json check_cli_export_equals_hf(const std::string& script, const ModelArch& arch,
                                          const std::vector<float>& trained, const std::string& run,
                                          const std::string& out, int V, const TempDir& tmp);

}  // namespace trainrun::test
