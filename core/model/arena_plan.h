// One device allocation split into many buffers: a model's activations or a
// decoder's caches. Every buffer starts on a 64-byte boundary. Laying out the
// same plan with scratch slots gives the size without allocating (the
// planner's and the sampler's memory checks).
//
// A training network's plan has two parts. The kept buffers hold what one
// call leaves for a later one (a forward's activations for its backward,
// zero_bubble's kept output gradients for the weight step, the stage's
// input, output and their gradients, which the pipeline sends and receives
// asynchronously). The transient buffers are written and read within one
// forward / backward / backward_input / backward_weight call. A network of
// its own lays both out in one arena (allocate); the pipeline executor's
// stage networks each allocate only their kept part and share one transient
// scratch per rank (bind_transient), since a rank runs one compute call at
// a time.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace trainrun {

struct ArenaPlan {
  struct Slot {
    void** slot;
    size_t bytes;    // rounded up to 64
    bool transient;  // written and read within one call
  };
  std::vector<Slot> slots;
  size_t total = 0;            // every buffer, kept and transient
  size_t transient_total = 0;  // the transient ones
  static size_t round(size_t bytes) { return (bytes + 63) / 64 * 64; }
  void add(void** slot, size_t bytes, bool transient = false) {
    slots.push_back({slot, round(bytes), transient});
    total += round(bytes);
    if (transient) transient_total += round(bytes);
  }
  void add_transient(void** slot, size_t bytes) { add(slot, bytes, true); }
  size_t kept_total() const { return total - transient_total; }
  // Allocates the whole arena on `be` (zero-initialised) and points every
  // slot into it, in the order they were added.
  DeviceBuffer allocate(Backend* be) const {
    DeviceBuffer arena(be, total);
    lay_out(arena.as<char>(), true, true);
    return arena;
  }
  // The kept buffers only; the transient ones stay null until bind_transient.
  DeviceBuffer allocate_kept(Backend* be) const {
    DeviceBuffer arena(be, kept_total());
    lay_out(arena.as<char>(), true, false);
    return arena;
  }
  // Points the transient slots into `scratch` (transient_total bytes).
  void bind_transient(void* scratch) const { lay_out(static_cast<char*>(scratch), false, true); }

 private:
  void lay_out(char* base, bool kept, bool transient) const {
    for (const Slot& s : slots)
      if (s.transient ? transient : kept) {
        *s.slot = base;
        base += s.bytes;
      }
  }
};

}  // namespace trainrun
