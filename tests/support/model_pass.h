// A model's numbers on the CPU backend for the family tests that compare
// with transformers (test_mixtral, test_qwen2_moe): random tokens, an HF
// directory's weights in our flat layout, and one forward + backward.
// (main's hf_reference.h grew the same helpers for every family while this
// was written: random_tokens, write_token_batch, flat_from_hf, run_network;
// these fold into them after the merge.)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/safetensors.h"
#include "core/model/model.h"

namespace trainrun::test {

std::vector<int32_t> seeded_tokens(size_t n, int V, uint64_t seed);
// A tensor of a reference file as fp32; FAILs naming the file when absent.
std::vector<float> tensor_f32(const SafeTensorFile& f, const std::string& name, const std::string& path);
// DIR/model.safetensors' tensors (HF names, nn.Linear layout) in arch's flat layout.
std::vector<float> hf_flat_params(const ModelArch& arch, const std::string& dir);
// One forward for the logits, then forward + backward with the mean loss's
// gradient (dloss_scale 1/N): the logits, the mean per-token loss and every gradient.
struct ModelPass {
  std::vector<float> logits, grads;
  double loss = 0;
};
ModelPass model_pass(const ModelArch& arch, const std::vector<float>& params, const std::vector<int32_t>& in,
                     const std::vector<int32_t>& tg, int B, int T, bool activation_checkpointing = false);
// Writes DIR/batch.safetensors ('inputs', 'targets' int32 (B,T)), the reference scripts' --batch.
void write_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tg, int B, int T);

}  // namespace trainrun::test
