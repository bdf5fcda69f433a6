// The caching device allocator; see device_allocator.h for the policy.
#include "kernels/cuda/device_allocator.h"

#include <cuda_runtime.h>

#include "core/common/error.h"
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

namespace {
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeThreshold = size_t(1) << 20;
constexpr size_t kLargeRound = size_t(2) << 20;

size_t round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t r = bytes < kLargeThreshold ? kSmallRound : kLargeRound;
  return (bytes + r - 1) / r * r;
}

std::string mib(size_t b) { return detail::cat(b / (1024 * 1024), " MiB"); }
}  // namespace

DeviceAllocator::DeviceAllocator(int device) : device_(device) {}

DeviceAllocator::~DeviceAllocator() {
  // Best effort: the process may be exiting after a device error.
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : last_use_) cudaEventDestroy(kv.second);
  for (auto& kv : sizes_) cudaFree(kv.first);
}

void DeviceAllocator::set_release_stream(cudaStream_t s) {
  std::lock_guard<std::mutex> lk(mu_);
  release_stream_ = s;
}

void* DeviceAllocator::device_malloc(size_t rounded, size_t requested, std::unique_lock<std::mutex>& lk) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, rounded);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the (non-sticky) error before retrying
    // Out of the lists under the mutex, freed without it (see the header).
    const std::vector<Cached> blocks = take_cached_locked();
    lk.unlock();
    free_blocks(blocks);
    lk.lock();
    e = cudaMalloc(&p, rounded);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    TR_FAIL("cuda:", device_, ": out of device memory allocating ", requested, " bytes (", mib(in_use_),
            " in use by trainrun, ", mib(reserved_), " reserved, ", mib(free_b), " free of ", mib(total_b),
            "; ", cudaGetErrorName(e), "); reduce train.micro_batch_size, enable "
            "train.activation_checkpointing: blocks, or use parallel.sharding: full_shard");
  }
  reserved_ += rounded;
  sizes_[p] = rounded;
  return p;
}

// Every cached block leaves the lists (no one else can take it) with its
// last-use event; the caller frees them without the mutex.
std::vector<DeviceAllocator::Cached> DeviceAllocator::take_cached_locked() {
  std::vector<Cached> out;
  out.reserve(free_.size());
  for (auto& kv : free_) {
    out.push_back(Cached{kv.second, kv.first});
    sizes_.erase(kv.second);
    reserved_ -= kv.first;
  }
  free_.clear();
  return out;
}

void DeviceAllocator::free_blocks(const std::vector<Cached>& blocks) {
  for (const Cached& b : blocks) {
    cudaEvent_t ev = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = last_use_.find(b.p);
      if (it != last_use_.end()) {
        ev = it->second;
        last_use_.erase(it);
      }
    }
    // Its last user's kernels may still be enqueued: wait for them (only
    // them), then free. Without an event (no release stream) the whole
    // device, as before, but still without the mutex.
    if (ev) {
      cudaEventSynchronize(ev);
      cudaEventDestroy(ev);
    } else {
      cudaDeviceSynchronize();
    }
    cudaFree(b.p);
  }
}

void* DeviceAllocator::allocate(size_t bytes) {
  const size_t rounded = round_size(bytes);
  std::unique_lock<std::mutex> lk(mu_);
  void* p = nullptr;
  auto it = free_.lower_bound(rounded);
  if (it != free_.end() && it->first - rounded <= it->first / 4) {
    p = it->second;
    free_.erase(it);
  } else {
    p = device_malloc(rounded, bytes, lk);
  }
  live_[p] = Block{sizes_[p], bytes};
  in_use_ += bytes;
  if (in_use_ > peak_) peak_ = in_use_;
  return p;
}

void DeviceAllocator::release(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(p);
  TR_CHECK(it != live_.end(), "cuda:", device_, ": free() of a pointer this backend did not allocate (", p, ")");
  in_use_ -= it->second.requested;
  free_.emplace(it->second.size, p);
  live_.erase(it);
  if (release_stream_) {
    // The block's last use, in the compute stream's order: what a free
    // before the OOM retry waits for. One event per block, re-recorded.
    cudaEvent_t& ev = last_use_[p];
    if (!ev && cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      ev = nullptr;
      last_use_.erase(p);
      return;
    }
    if (cudaEventRecord(ev, release_stream_) != cudaSuccess) cudaGetLastError();
  }
}

size_t DeviceAllocator::in_use() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_use_;
}
size_t DeviceAllocator::peak() const {
  std::lock_guard<std::mutex> lk(mu_);
  return peak_;
}
void DeviceAllocator::reset_peak() {
  std::lock_guard<std::mutex> lk(mu_);
  peak_ = in_use_;
}
size_t DeviceAllocator::reserved() const {
  std::lock_guard<std::mutex> lk(mu_);
  return reserved_;
}
void DeviceAllocator::empty_cache() {
  std::unique_lock<std::mutex> lk(mu_);
  const std::vector<Cached> blocks = take_cached_locked();
  lk.unlock();
  free_blocks(blocks);
}

}  // namespace trainrun::cuda
