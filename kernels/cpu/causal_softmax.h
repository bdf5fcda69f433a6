// Row kernels shared by the CPU attention ops (cpu_attention.cpp,
// cpu_attention_gqa.cpp), so that multi-head and grouped-query attention do
// the same arithmetic and agree bit for bit when NKV == NH.
#pragma once
#include <algorithm>
#include <cmath>

#include "kernels/cpu/fastmath.h"

namespace trainrun::cpu {

// row[first..last] <- softmax(row[first..last]) (max-subtracted), the rest
// of row[0..len) <- 0. first > 0 is document masking: the query's document
// starts at key `first` (data.document_mask); plain causal attention has 0.
inline void causal_softmax_row(float* row, int first, int last, int len) {
  for (int j = 0; j < first; ++j) row[j] = 0.0f;
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int j = first; j <= last; ++j) mx = std::max(mx, row[j]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = first; j <= last; ++j) {
    float e = fastmath::exp(row[j] - mx);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int j = first; j <= last; ++j) row[j] *= inv;
  for (int j = last + 1; j < len; ++j) row[j] = 0.0f;
}

// Softmax backward for one row p of probabilities: d[j] <- p[j] (d[j] -
// sum_k p[k] d[k]) * scale over [first..last], 0 elsewhere in [0, len). d
// holds dP on entry and dS on exit.
inline void causal_softmax_backward_row(float* d, const float* p, int first, int last, int len, float scale) {
  for (int j = 0; j < first; ++j) d[j] = 0.0f;
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int j = first; j <= last; ++j) dot += p[j] * d[j];
#pragma omp simd
  for (int j = first; j <= last; ++j) d[j] = p[j] * (d[j] - dot) * scale;
  for (int j = last + 1; j < len; ++j) d[j] = 0.0f;
}

}  // namespace trainrun::cpu
