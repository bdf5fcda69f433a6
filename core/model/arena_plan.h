// One device allocation split into many buffers: a model's activations or a
// decoder's caches. Every buffer starts on a 64-byte boundary. Laying out the
// same plan with scratch slots gives the size without allocating (the
// planner's and the sampler's memory checks).
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace trainrun {

struct ArenaPlan {
  std::vector<std::pair<void**, size_t>> slots;
  size_t total = 0;
  void add(void** slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    slots.push_back({slot, bytes});
    total += bytes;
  }
  // Allocates the arena on `be` and points every slot into it.
  DeviceBuffer allocate(Backend* be) const {
    DeviceBuffer arena(be, total);
    char* base = arena.as<char>();
    for (const auto& [slot, bytes] : slots) {
      *slot = base;
      base += bytes;
    }
    return arena;
  }
};

}  // namespace trainrun
