// Sampling from a trained model (`trainrun generate`, and the end of a run).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

class Tokenizer;

struct SampleOptions {
  int max_tokens = 200;
  double temperature = 1.0;   // 0 or top_k == 1: greedy
  int top_k = 0;              // 0 = full distribution
  uint64_t seed = 1;
  // Generation ends after any of these is sampled (kept in the output), as
  // transformers' generate stops at eos_token_id.
  std::vector<int32_t> stop_tokens;
  // > 0: only ids below it are sampled. `generate` sets the tokenizer's
  // size, so a model vocab padded past it (model.vocab_size 50304 for
  // GPT-2's 50257, as llm.c does) never yields an id with no text.
  int vocab_limit = 0;
};

// Autoregressive sampling with a KV cache (the arch's Decoder) on `be`,
// parameters through `units`. The cache holds min(T, prompt + 
// max_tokens) positions; a sequence that outgrows the model's T keeps its
// newest T/2 tokens and refills the cache from them (learned absolute
// positions cannot slide one step at a time). Returns prompt + sampled tokens.
// With `comm` (a sharded run: every rank calls, `units` gathers each unit
// for each step), rank 0 picks each token and broadcasts it, so every rank
// feeds the same sequence and the unit gathers stay in step; no rank waits
// in a collective for longer than one token's forward.
std::vector<int32_t> sample_tokens(Backend* be, UnitAccess& units, const ModelArch& arch,
                                   const std::vector<int32_t>& prompt, const SampleOptions& opts,
                                   Communicator* comm = nullptr);
// The same from whole-model fp32 weights (`trainrun generate`), on the CPU
// backend; with `adapter_dir` (a PEFT LoRA/DoRA directory for this model)
// the adapters are applied unmerged, as peft's PeftModel computes.
std::vector<int32_t> sample_tokens(const ModelArch& arch, const std::vector<float>& flat_params,
                                   const std::vector<int32_t>& prompt, const SampleOptions& opts,
                                   const std::string& adapter_dir = "");
// The KV-cache capacity sample_tokens uses for this prompt and options.
int sample_cache_positions(const ModelConfig& cfg, size_t prompt_tokens, const SampleOptions& opts);

// Byte-level when V == 256 (text <-> bytes), else whitespace-separated token ids.
std::vector<int32_t> encode_prompt(const std::string& text, int vocab);
std::string decode_tokens(const std::vector<int32_t>& tokens, int vocab);

// Text through a tokenizer, as `trainrun generate` and the end-of-run sample
// take a prompt: the post-processor's BOS (as HF's encode()), then the ids.
std::vector<int32_t> encode_text_prompt(const Tokenizer& tok, const std::string& text, bool allow_special = false);
// Sampled ids as HF's decode(skip_special_tokens=False) prints them: special
// tokens shown, a character split at the end as U+FFFD. An id outside the
// tokenizer's vocab is an error naming it.
std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids);

// The tokenizer.json a trainrun run directory holds for `model_file` (its
// model.safetensors or a checkpoint's): the copy the run made of its data's
// tokenizer (core/train/data_text.h); "" when there is none.
std::string run_tokenizer_of_model_file(const std::string& model_file);

// Resolve --checkpoint: a .safetensors file, a checkpoint directory (holding
// model.safetensors), or a run directory (its latest checkpoint, else its
// model.safetensors). Throws naming what was looked for.
std::string resolve_model_file(const std::string& path);

}  // namespace trainrun
