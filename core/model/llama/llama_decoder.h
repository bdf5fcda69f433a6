// Incremental Llama forward for sampling, with a KV cache (LlamaArch::make_decoder).
//
// As GPT2Decoder (core/model/gpt2/gpt2_decoder.h): each layer keeps the
// rotated keys and the values of every position fed so far (kcache/vcache,
// (capacity, NKV*HS) each, act dtype: grouped-query attention caches only
// the NKV key/value heads); a prompt is fed in chunks of up to kChunk rows,
// then a token costs one row through every layer. RoPE rotates q and k at
// their absolute positions (pos0 = position()), from a cos/sin table of
// `capacity` rows. The ops are LlamaNetwork::forward's, in its order, so
// the two agree to rounding; only the last row's logits are computed.
// Parameters come through UnitAccess in the forward's order (a sharded run
// decodes on every rank together).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/model.h"
#include "kernels/backend.h"

namespace trainrun {

class MoeMlp;  // core/model/moe/moe_mlp.h

class LlamaDecoder final : public Decoder {
 public:
  static constexpr int kChunk = 256;
  // cfg: resolved (LlamaArch::config()); layout: LlamaArch::layout();
  // capacity: positions the cache holds, 1..cfg.T.
  LlamaDecoder(const ModelConfig& cfg, const ParamLayout& layout, Backend* be, int capacity);
  ~LlamaDecoder() override;
  static size_t bytes_needed(const ModelConfig& cfg, const Backend& be, int capacity);
  size_t bytes() const override;
  int capacity() const override { return cap_; }
  int position() const override { return pos_; }
  void reset() override { pos_ = 0; }
  void feed(UnitAccess& units, const int32_t* tokens, int n, std::vector<float>& logits) override;

 private:
  struct Bufs;
  void feed_chunk(UnitAccess& units, const int32_t* tokens, int n, bool last_chunk);

  ModelConfig cfg_;
  Backend* be_;
  int cap_, chunk_;
  int pos_ = 0;
  int ldv_ = 0;
  int HS_, Q_, KV_, QKV_;  // head size, NH*HS, NKV*HS, Q + 2*KV
  float eps_;
  int64_t lm_head_off_ = -1;             // untied: lm_head.weight's offset in the head unit
  DeviceBuffer arena_;
  std::unique_ptr<MoeMlp> moe_;  // ModelConfig::moe: the MLP's place (its own arena)
  std::vector<void*> kcache_, vcache_;   // per layer (cap, NKV*HS); a sliding layer's: a ring (window, NKV*HS)
  float* rope_ = nullptr;                // (cap, HS/2, 2) fp32
  void* qk_pre_ = nullptr;               // qk-norm: (chunk, (NH+NKV)*HS) q|k before it (unused after)
  float* qk_rstd_ = nullptr;             // qk-norm: (chunk, NH+NKV)
  void* zero_wpe_ = nullptr;             // (chunk, C) zeros: encoder_forward's position table
  int32_t* tokens_ = nullptr;            // (chunk)
  void* res_a_ = nullptr;                // (chunk, C) residual stream entering a block
  void* res_b_ = nullptr;                // (chunk, C) after its attention
  void* proj_ = nullptr;                 // (chunk, C) o_proj / down_proj output
  void* ln_ = nullptr;                   // (chunk, C)
  float wo_ = 0.f;                       // RMSNorm weight offset (Gemma 2: 1)
  AttentionOptions attn_;                // Gemma 2: softcap, scale (the window is per layer: cache_window)
  float* rstd_ = nullptr;                // (chunk)
  void* qkv_ = nullptr;                  // (chunk, C + 2 KV)
  void* atty_ = nullptr;                 // (chunk, C)
  void* gu_ = nullptr;                   // (chunk, 2F)
  void* h_ = nullptr;                    // (chunk, F)
  void* logits_ = nullptr;               // (1, ldv)
  float* logits_f32_ = nullptr;          // (V)
};

}  // namespace trainrun
