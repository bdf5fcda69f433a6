// Counter-based random numbers for parameter init: a value is a function of
// (seed, index) only, so any shard computes its own slice and every world
// size starts from the same weights (ModelArch::init_params).
#pragma once
#include <cmath>
#include <cstdint>

namespace trainrun {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Standard normal from (seed, index) by Box-Muller on two hashed uniforms.
inline double normal_at(uint64_t seed, uint64_t i) {
  uint64_t a = splitmix64(seed ^ splitmix64(2 * i));
  uint64_t b = splitmix64(seed ^ splitmix64(2 * i + 1));
  double u1 = (double(a >> 11) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  double u2 = double(b >> 11) * (1.0 / 9007199254740992.0);          // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace trainrun
