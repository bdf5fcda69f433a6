// dst[index[n], :] += src[n, :] for n = 0..N-1 (rows of C floats): the
// embedding backwards' scatter (dwte by token; dwpe by position under
// document masking, where many (b,t) share a position). Two rows with the
// same index would race if rows were split over threads, so the threads
// split the channels instead: each walks every row in order for its own
// channels, which gives a fixed summation order (bit-reproducible for any
// thread count).
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

}  // namespace trainrun::cpu
