// GPT-2: token + learned position embeddings, L pre-LayerNorm blocks
// (causal multi-head attention, GELU(tanh) MLP of width 4C), a final
// LayerNorm and an LM head tied to the token embedding.
//
// Parameters live in one contiguous buffer, grouped into the units that
// sharding (parallel/) moves as one flat parameter:
//   unit 0 "embeddings": wte (V,C), wpe (T,C)
//   unit 1+l "block l":  ln1w (C), ln1b (C), qkvw (3C,C), qkvb (3C),
//                        attprojw (C,C), attprojb (C), ln2w (C), ln2b (C),
//                        fcw (4C,C), fcb (4C), fcprojw (C,4C), fcprojb (C)
//   unit L+1 "head":     lnfw (C), lnfb (C)   (the LM head reuses wte)
// External names (safetensors, the PyTorch reference) follow HF GPT-2 with
// nn.Linear layout (out, in): transformer.wte.weight, transformer.h.{l}.attn.c_attn.weight, ...
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

struct GPT2Config {
  int L = 4, NH = 4, C = 128, V = 256, T = 128;  // maxT = position table size
  double init_std = 0.02;
  static GPT2Config from_spec(const ModelSpec& m);
  int64_t num_parameters() const;
};

struct ParamTensor {
  std::string name;            // external (HF-style) name
  std::vector<int64_t> shape;
  int64_t offset = 0;          // element offset in the whole-model flat buffer
  int64_t numel = 0;
  int unit = 0;                // which sharding unit owns it
  bool decay = false;          // AdamW weight decay applies (matrices yes, biases/LN no)
};

struct ParamUnit {
  std::string name;            // "embeddings", "block 3", "head"
  int64_t offset = 0;          // element offset of the unit in the flat buffer
  int64_t numel = 0;
};

struct ParamLayout {
  std::vector<ParamTensor> tensors;
  std::vector<ParamUnit> units;
  int64_t total = 0;
  const ParamTensor& get(const std::string& name) const;
};

ParamLayout make_gpt2_layout(const GPT2Config& cfg);

}  // namespace trainrun
