// Per-device launch facts for a kernel that comes in two variants (16-byte
// vectorised and scalar) and takes dynamic shared memory: the opt-in shared
// memory limit, and each variant's resident blocks per SM at each shared
// memory size. Queried once per device and size, not on every launch (the
// occupancy query costs microseconds, the norm backwards run per layer).
// Used by the LayerNorm and RMSNorm backwards, whose partial-sum buffers
// grow with C past the default 48 KiB at C >= 4096.
#pragma once
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

class SmemOccupancyCache {
 public:
  // `vec_kernel` / `scalar_kernel`: the two variants (as __global__ function
  // pointers); `threads`: the block size; `default_smem`: the limit without
  // opt-in (48 KiB), also the fallback when the attribute reads as 0.
  SmemOccupancyCache(const void* vec_kernel, const void* scalar_kernel, int threads, size_t default_smem)
      : kernels_{vec_kernel, scalar_kernel}, threads_(threads), default_smem_(default_smem) {}

  // Blocks per SM of the variant at `smem` bytes on the current device (0:
  // does not fit; *optin_out gets the device's limit for the error message).
  // `smem` above the default raises both variants' dynamic shared memory
  // limit to the opt-in one first, once per device.
  int blocks_per_sm(bool vec, size_t smem, int* optin_out) {
    int dev = 0;
    TR_CUDA_CHECK(cudaGetDevice(&dev));
    std::lock_guard<std::mutex> lk(mu_);
    Entry& e = entries_[dev];
    if (e.optin == 0) {
      TR_CUDA_CHECK(cudaDeviceGetAttribute(&e.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
      if (e.optin <= 0) e.optin = int(default_smem_);
    }
    *optin_out = e.optin;
    if (smem > size_t(e.optin)) return 0;
    if (smem > default_smem_ && !e.raised) {
      for (const void* k : kernels_)
        TR_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, e.optin));
      e.raised = true;
    }
    auto it = e.blocks_per_sm.find({vec, smem});
    if (it != e.blocks_per_sm.end()) return it->second;
    int n = 0;
    TR_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernels_[vec ? 0 : 1], threads_, smem));
    e.blocks_per_sm[{vec, smem}] = n;
    return n;
  }

 private:
  struct Entry {
    int optin = 0;        // cudaDevAttrMaxSharedMemoryPerBlockOptin
    bool raised = false;  // cudaFuncAttributeMaxDynamicSharedMemorySize set to optin for both variants
    std::map<std::pair<bool, size_t>, int> blocks_per_sm;
  };
  const void* kernels_[2];
  int threads_;
  size_t default_smem_;
  std::mutex mu_;
  std::map<int, Entry> entries_;
};

}  // namespace trainrun::cuda
