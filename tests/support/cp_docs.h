// Document starts for the context-parallel tests (test_context_parallel,
// test_cp_training): sequence 0 has fixed lengths {4, 12, 1, 3, 8, 4} (T
// 32: boundaries on the chunk edges of cp2 and cp4, one document longer
// than a chunk of either), the others random lengths 1..13.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace trainrun::test {

inline std::vector<int32_t> make_cp_docs(int B, int T, uint64_t seed) {
  std::vector<int32_t> d(size_t(B) * T);
  std::mt19937_64 gen(seed);
  for (int b = 0; b < B; ++b) {
    std::vector<int> lens = b == 0 ? std::vector<int>{4, 12, 1, 3, 8, 4} : std::vector<int>{};
    if (b > 0)
      for (int left = T; left > 0;) {
        const int n = std::min(left, int(gen() % 13) + 1);
        lens.push_back(n);
        left -= n;
      }
    int start = 0;
    for (int n : lens) {
      for (int t = start; t < start + n && t < T; ++t) d[size_t(b) * T + t] = start;
      start += n;
    }
  }
  return d;
}

}  // namespace trainrun::test
