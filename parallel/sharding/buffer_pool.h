// A pool of device buffers reused by size, with the peak of what was live
// (ShardMemory::comm_buffers). The sharded store gathers and frees units
// every step and the expert-parallel store assembles blocks as often;
// the backend's alloc() zero-fills, which would dominate on the CPU.
// Thread-safe: a store's comm thread and compute thread both take buffers.
#pragma once
#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#include "kernels/backend.h"

namespace trainrun {

class BufferPool {
 public:
  explicit BufferPool(Backend* be) : be_(be) {}
  ~BufferPool() {
    for (auto& [sz, v] : free_)
      for (void* p : v) be_->free(p);
  }
  void* get(size_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& v = free_[bytes];
    if (!v.empty()) {
      // A reused buffer counts toward the peak too: freed ones of other
      // sizes stay allocated, so live_ can pass every earlier peak here.
      void* p = v.back();
      v.pop_back();
      live_ += bytes;
      peak_ = std::max(peak_, live_);
      return p;
    }
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    return be_->alloc(bytes);
  }
  void put(void* p, size_t bytes) {
    if (!p) return;
    std::lock_guard<std::mutex> lk(mu_);
    free_[bytes].push_back(p);
    live_ -= bytes;
  }
  size_t peak() const { return peak_; }

 private:
  Backend* be_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  size_t live_ = 0, peak_ = 0;
};

}  // namespace trainrun
