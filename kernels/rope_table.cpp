// RoPE frequency and cos/sin tables: see rope_table.h.
#include "kernels/rope_table.h"

#include <cmath>

#include "core/common/error.h"

namespace trainrun {

std::vector<double> rope_inv_freq(int HS, double theta, const RopeScaling* scaling) {
  TR_CHECK(HS > 0 && HS % 2 == 0, "rope: head size ", HS, " must be even and positive (RoPE rotates pairs i, i+HS/2)");
  TR_CHECK(theta > 0.0, "rope: rope_theta ", theta, " must be > 0");
  std::vector<double> f(HS / 2);
  for (int i = 0; i < HS / 2; ++i) f[i] = 1.0 / std::pow(theta, double(2 * i) / HS);
  if (!scaling) return f;

  const RopeScaling& s = *scaling;
  if (s.longrope()) {
    const std::vector<double>& e = s.use_long ? s.long_factor : s.short_factor;
    TR_CHECK(int(e.size()) == HS / 2, "rope_scaling.", s.use_long ? "long" : "short", "_factor has ", e.size(),
             " values; the head size ", HS, " needs ", HS / 2);
    for (int i = 0; i < HS / 2; ++i) {
      TR_CHECK(e[size_t(i)] > 0.0, "rope_scaling.", s.use_long ? "long" : "short", "_factor[", i, "] = ", e[size_t(i)],
               " must be > 0");
      f[size_t(i)] /= e[size_t(i)];
    }
    return f;
  }
  TR_CHECK(s.factor > 0.0, "rope_scaling.factor ", s.factor, " must be > 0");
  TR_CHECK(s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor, "rope_scaling: need 0 < low_freq_factor (",
           s.low_freq_factor, ") < high_freq_factor (", s.high_freq_factor, ")");
  TR_CHECK(s.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings ",
           s.original_max_position_embeddings, " must be > 0");
  const double L0 = s.original_max_position_embeddings;
  const double low_freq_wavelen = L0 / s.low_freq_factor;    // longer waves than this: divided by factor
  const double high_freq_wavelen = L0 / s.high_freq_factor;  // shorter waves than this: kept
  const double two_pi = 2.0 * std::acos(-1.0);
  for (double& fi : f) {
    const double wavelen = two_pi / fi;
    if (wavelen < high_freq_wavelen) continue;
    if (wavelen > low_freq_wavelen) {
      fi /= s.factor;
    } else {
      const double smooth = (L0 / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      fi = (1.0 - smooth) * fi / s.factor + smooth * fi;
    }
  }
  return f;
}

// Why double, then one rounding to fp32: HF computes f_i, the angle p * f_i
// and cos/sin all in fp32 (forced even under autocast). The angle's rounding
// error grows with the position (|p f_i| * 2^-24: ~5e-4 rad at p = 8191,
// f_0 = 1), so an fp32 table drifts from the exact rotation at long context.
// Here every entry is the correctly rounded value of the exact rotation,
// independent of how a device evaluates sin/cos, so the CPU and CUDA
// backends read one identical table. It differs from HF's table by HF's own
// fp32 error (checked in tests/test_cpu_llama_ops.cpp).
std::vector<float> rope_table(int maxT, int HS, double theta, const RopeScaling* scaling) {
  TR_CHECK(maxT > 0, "rope: table length ", maxT, " must be positive (model.max_seq_len)");
  const std::vector<double> f = rope_inv_freq(HS, theta, scaling);
  const int half = HS / 2;
  double mscale = 1.0;  // longrope's attention factor (rope_table.h)
  if (scaling && scaling->longrope()) {
    const double L0 = scaling->original_max_position_embeddings;
    const double s = double(scaling->max_position_embeddings) / L0;
    if (s > 1.0) mscale = std::sqrt(1.0 + std::log(s) / std::log(L0));
  }
  std::vector<float> t(size_t(maxT) * HS);
  for (int p = 0; p < maxT; ++p)
    for (int i = 0; i < half; ++i) {
      const double a = double(p) * f[i];
      t[(size_t(p) * half + i) * 2] = float(mscale * std::cos(a));
      t[(size_t(p) * half + i) * 2 + 1] = float(mscale * std::sin(a));
    }
  return t;
}

}  // namespace trainrun
