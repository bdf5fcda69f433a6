// dst[index[n], :] += src[n, :] for n = 0..N-1 (rows of C floats): the
// embedding backwards' scatter (dwte by token; dwpe by position under
// document masking, where many (b,t) share a position). Two rows with the
// same index would race if rows were split over threads, so the threads
// split the channels instead: each walks every row in order for its own
// channels, which gives a fixed summation order (bit-reproducible for any
// thread count).
//
// add_position_grads: the position-embedding gradient both embedding
// backwards (encoder_backward, vocab_embedding_backward) accumulate.
#pragma once
#include <omp.h>

#include <cstdint>

namespace trainrun::cpu {

inline void scatter_rows(float* dst, const float* src, const int32_t* index, int64_t N, int C) {
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int c0 = int(int64_t(C) * tid / nt), c1 = int(int64_t(C) * (tid + 1) / nt);
    for (int64_t n = 0; n < N; ++n) {
      float* d = dst + int64_t(index[n]) * C;
      const float* g = src + n * C;
      for (int c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

// dwpe[t] += sum_b dout[b, t] (dout (B, T, C), dwpe (T, C)); with `pos`
// (document masking: the (B*T) positions) dwpe[pos[n]] += dout[n] instead.
// Without pos no two threads share a row: positions split over the
// threads, and each sums its row over b in order.
inline void add_position_grads(float* dwpe, const float* dout, const int32_t* pos, int B, int T, int C) {
  if (!dwpe) return;  // no position table
  if (pos) {
    scatter_rows(dwpe, dout, pos, int64_t(B) * T, C);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; ++t) {
    float* d = dwpe + int64_t(t) * C;
    for (int b = 0; b < B; ++b) {
      const float* g = dout + (int64_t(b) * T + t) * C;
#pragma omp simd
      for (int c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

}  // namespace trainrun::cpu
