// CPU backend: DoRA's per-output-row ops (kernels/backend.h states the math).
//
//   row_norms:     out (rows) = ||w[o, :]||, summed in double so the norm of a
//                  long row (8192+ features) keeps fp32's last bits
//   row_sum_squares, sqrt_in_place: the same norm in two steps, for rows
//                  split over a TP group (the partial squares are summed between)
//   dora_forward:  y[:, o] += (g_o - 1) xw[:, o] + g_o s xba[:, o]
//   dora_backward: dmag[o] += sum_n dy (xw + s xba) / norm_o; xw := (g-1) dy;
//                  xba := g s dy
// with g = mag / norm. Threads split the output columns, so no two write one
// dmag element.
#include <cmath>

#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

void CpuBackend::row_norms(float* out, const void* w_, int rows, int cols) {
  const float* w = static_cast<const float*>(w_);
#pragma omp parallel for schedule(static)
  for (int o = 0; o < rows; ++o) {
    const float* row = w + int64_t(o) * cols;
    double s = 0;
    for (int i = 0; i < cols; ++i) s += double(row[i]) * double(row[i]);
    out[o] = float(std::sqrt(s));
  }
}

void CpuBackend::row_sum_squares(float* out, const void* w_, int rows, int cols) {
  const float* w = static_cast<const float*>(w_);
#pragma omp parallel for schedule(static)
  for (int o = 0; o < rows; ++o) {
    const float* row = w + int64_t(o) * cols;
    double s = 0;
    for (int i = 0; i < cols; ++i) s += double(row[i]) * double(row[i]);
    out[o] = float(s);
  }
}

void CpuBackend::sqrt_in_place(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::sqrt(x[i]);
}

void CpuBackend::dora_forward(void* y_, int ldy, const void* xw_, const void* xba_, const void* mag_,
                              const float* norm, float s, int N, int out) {
  float* y = static_cast<float*>(y_);
  const float* xw = static_cast<const float*>(xw_);
  const float* xba = static_cast<const float*>(xba_);
  const float* mag = static_cast<const float*>(mag_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* yr = y + int64_t(n) * ldy;
    const float* a = xw + int64_t(n) * out;
    const float* b = xba + int64_t(n) * out;
    for (int o = 0; o < out; ++o) {
      const float g = mag[o] / norm[o];
      yr[o] += (g - 1.0f) * a[o] + g * b[o] * s;  // peft's order: (g - 1) * base + g * lora * s
    }
  }
}

void CpuBackend::dora_backward(float* dmag, void* xw_, void* xba_, const void* dy_, int ldy, const void* mag_,
                               const float* norm, float s, int N, int out) {
  float* xw = static_cast<float*>(xw_);
  float* xba = static_cast<float*>(xba_);
  const float* dy = static_cast<const float*>(dy_);
  const float* mag = static_cast<const float*>(mag_);
#pragma omp parallel for schedule(static)
  for (int o = 0; o < out; ++o) {
    const float g = mag[o] / norm[o];
    double acc = 0;
    for (int n = 0; n < N; ++n) {
      const int64_t i = int64_t(n) * out + o;
      const float d = dy[int64_t(n) * ldy + o];
      acc += double(d) * (double(xw[i]) + double(s) * double(xba[i]));
      xw[i] = (g - 1.0f) * d;
      xba[i] = g * s * d;
    }
    dmag[o] += float(acc / double(norm[o]));
  }
}

}  // namespace trainrun
