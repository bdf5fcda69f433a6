// Host-side tables for rotary position embeddings (Backend::rope_forward).
//
// The frequencies are HF transformers' (modeling_rope_utils.py, 4.44):
//   f_i = theta^(-2i/HS), i < HS/2                       ("default")
// and, with Llama 3.1's rope_scaling {"rope_type": "llama3", ...}, each f_i
// rescaled by its wavelength w_i = 2 pi / f_i against the original context
// length L0 = original_max_position_embeddings:
//   w_i < L0 / high_freq_factor  -> f_i                   (high frequencies kept)
//   w_i > L0 / low_freq_factor   -> f_i / factor          (low frequencies stretched)
//   otherwise, with s = (L0 / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor),
//                                -> (1 - s) f_i / factor + s f_i
// (the blend is continuous at both edges). The attention factor of "llama3"
// is 1, so cos/sin are not rescaled.
//
// Phi-3's "longrope" (transformers 4.44's Phi3LongRoPEScaledRotaryEmbedding;
// "su" before): f_i = theta^(-2i/HS) / e_i with e = long_factor or
// short_factor (HS/2 each), and cos/sin both times the attention factor
//   sqrt(1 + ln(s) / ln(L0)),  s = max_position_embeddings / L0  (1 when s <= 1).
// transformers picks the list per forward call by max(position_ids) + 1 >
// L0; here the caller picks once (use_long): see core/model/phi3/phi3_arch.h.
#pragma once
#include <vector>

namespace trainrun {

// config.json's rope_scaling for rope_type "llama3" (defaults: Llama 3.1).
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position_embeddings = 8192;
  // longrope (non-empty short_factor; factor and the freq factors unused):
  std::vector<double> short_factor, long_factor;  // (HS/2) each
  int max_position_embeddings = 0;                // s's numerator
  bool use_long = false;                          // long_factor, else short_factor
  bool longrope() const { return !short_factor.empty(); }
};

// f_i (HS/2), in double. scaling null: plain RoPE.
std::vector<double> rope_inv_freq(int HS, double theta, const RopeScaling* scaling);

// The (maxT, HS/2, 2) fp32 table rope_forward reads: [(p*HS/2 + i)*2] =
// cos(p f_i), [.. + 1] = sin(p f_i). Copy it to device memory once per model.
std::vector<float> rope_table(int maxT, int HS, double theta, const RopeScaling* scaling);

}  // namespace trainrun
