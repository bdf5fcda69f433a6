// Incremental GPT-2 forward for sampling, with a KV cache.
//
// Each layer keeps the keys and values of every position fed so far
// (kcache/vcache, (capacity, C) each, act dtype), so a new token costs one
// row through every layer (GEMVs over the weights, attention over the
// cache) instead of a forward over the whole window. A prompt is fed in
// chunks of up to kChunk rows (one GEMM per weight per chunk).
//
// Parameters come through UnitAccess exactly as in training (acquire /
// release per unit, in the forward's order): on a sharded run every rank
// runs the decoder together and each unit is all-gathered for the step and
// freed after it, so sampling needs no rank to hold the whole model.
// Memory: the caches (2 L capacity C act-dtype values) plus chunk-row
// activations; bytes() tells.
#pragma once
#include <cstdint>
#include <vector>

#include "core/model/gpt2/gpt2.h"
#include "kernels/backend.h"

namespace trainrun {

class GPT2Decoder final : public Decoder {
 public:
  static constexpr int kChunk = 256;
  // capacity: positions the cache holds, 1..cfg.T.
  GPT2Decoder(const GPT2Config& cfg, Backend* be, int capacity);
  // What a decoder of this capacity allocates on `be`.
  static size_t bytes_needed(const GPT2Config& cfg, const Backend& be, int capacity);
  size_t bytes() const override { return arena_.bytes(); }
  int capacity() const override { return cap_; }
  int position() const override { return pos_; }  // positions in the cache
  void reset() override { pos_ = 0; }             // forget the cache (positions restart at 0)

  // Feeds n tokens (host ids) at positions [position(), position()+n) and
  // returns the fp32 logits (V) of the last one in `logits`. Needs
  // position() + n <= capacity().
  void feed(UnitAccess& units, const int32_t* tokens, int n, std::vector<float>& logits) override;

 private:
  void feed_chunk(UnitAccess& units, const int32_t* tokens, int n, bool last_chunk);

  GPT2Config cfg_;
  Backend* be_;
  int cap_, chunk_;
  int pos_ = 0;
  int ldv_ = 0;
  DeviceBuffer arena_;
  std::vector<void*> kcache_, vcache_;   // per layer (cap, C)
  int32_t* tokens_ = nullptr;            // (chunk)
  void* res_a_ = nullptr;                // (chunk, C) the residual stream entering a block
  void* res_b_ = nullptr;                // (chunk, C) after its attention
  void* proj_ = nullptr;                 // (chunk, C) attention / MLP output projection
  void* ln_ = nullptr;                   // (chunk, C)
  float* mean_ = nullptr; float* rstd_ = nullptr;  // (chunk)
  void* qkv_ = nullptr;                  // (chunk, 3C)
  void* atty_ = nullptr;                 // (chunk, C)
  void* fch_ = nullptr;                  // (chunk, 4C)
  void* fch_gelu_ = nullptr;             // (chunk, 4C)
  void* logits_ = nullptr;               // (1, ldv)
  float* logits_f32_ = nullptr;          // (V)
};

}  // namespace trainrun
