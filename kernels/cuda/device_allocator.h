// A caching device allocator on cudaMalloc (never managed memory).
//
// Why caching: the sharded store gathers and frees every unit every step and
// the ops take scratch (LayerNorm partials, attention's D, the encoder's
// sort buffers) on every call; cudaMalloc/cudaFree synchronise the device,
// which would serialise the whole step.
//
// Policy (a small version of PyTorch's): sizes are rounded up to 512 bytes
// (small) or 2 MiB (>= 1 MiB, large) and freed blocks go into a size-ordered
// free list; a request takes the smallest cached block that fits and wastes
// at most a quarter of it (else a fresh cudaMalloc). When cudaMalloc runs
// out of memory, every cached block is released and the call is retried
// once; if it still fails, the Error says how much was asked, how much is
// live and cached, and what to do.
//
// The release before the retry waits, per block, for the event recorded on
// the compute stream when the block was last released (its last user's
// work), not for the whole device, and does so with the mutex released: a
// device sync under the mutex (as until 2026-12) could hang with an NCCL
// collective waiting for a peer while this rank's comm thread, which must
// enqueue the matching call, waits for the mutex to take its staging
// buffer. (Fixed by reasoning, not yet run on a GPU: docs/gpu-results.md.)
//
// Stream safety: a freed block is handed out again immediately, so it is
// correct only when all its readers and writers run in the compute stream's
// order (they do: every op is enqueued there) or have finished. NCCL
// collectives run on the comm stream and no longer finish before the call
// returns: the compute stream waits for each one (an event) before any op
// enqueued after the call, and a deferred one's buffers must stay out of
// this allocator until its order_compute_after() (the sharded store keeps
// them in its own pool until then).
//
// Thread-safe (the sharding layer's communication thread allocates too).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace trainrun::cuda {

class DeviceAllocator {
 public:
  explicit DeviceAllocator(int device);
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // 256-byte aligned (cudaMalloc's alignment), contents undefined.
  void* allocate(size_t bytes);
  void release(void* p);
  // Bytes handed out (as requested, not rounded) and their high-water mark.
  size_t in_use() const;
  size_t peak() const;
  void reset_peak();
  // Bytes held from cudaMalloc in total (live + cached).
  size_t reserved() const;
  // Returns every cached block to the driver (each once its last use is done).
  void empty_cache();
  // The stream a released block's last use is ordered on (the compute
  // stream); its event is recorded there at release. Null: none recorded.
  void set_release_stream(cudaStream_t s);

 private:
  struct Block {
    size_t size = 0;       // rounded size of the cudaMalloc'd block
    size_t requested = 0;  // what the caller asked for
  };
  struct Cached {
    void* p = nullptr;
    size_t size = 0;
  };
  void* device_malloc(size_t rounded, size_t requested, std::unique_lock<std::mutex>& lk);
  std::vector<Cached> take_cached_locked();
  void free_blocks(const std::vector<Cached>& blocks);  // without the mutex

  int device_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_;         // rounded size -> block
  std::unordered_map<void*, Block> live_;     // handed-out blocks
  std::unordered_map<void*, size_t> sizes_;   // every block we own -> rounded size
  std::unordered_map<void*, cudaEvent_t> last_use_;  // a cached block -> recorded at its release
  cudaStream_t release_stream_ = nullptr;
  size_t in_use_ = 0, peak_ = 0, reserved_ = 0;
};

}  // namespace trainrun::cuda
