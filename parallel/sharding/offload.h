// parallel.offload: the optimizer's state of a rank in host memory
// (ZeRO-Offload). What moves off the device, per rank:
//   fp32 master weights, AdamW first and second moments    12 bytes/param of the shard
//   the fp32 gradient shard                                   4 bytes/param of the shard
// The device keeps the act-dtype parameters (sharded per strategy) and its
// gradient buckets. Per step:
//   backward  each unit's reduce-scattered gradient is copied device->host as
//             soon as its reduction is done (on the comm thread, so it
//             overlaps the backward of earlier units) and accumulated there;
//   step      host AdamW (kernels/cpu/host_adamw.h) on the offload threads,
//             then the act-dtype parameters are copied host->device before
//             the next forward gathers them.
// The CPU backend runs the same path (separate host buffers, explicit copies
// through the backend), so the losses it gives are tested against offload
// none: bit-identical, since host AdamW is the backend's AdamW bit for bit.
//
// Pinning: a GPU backend DMAs only from page-locked memory at full speed;
// Backend::pin_host (cudaHostRegister on CUDA) is asked for it. When
// RLIMIT_MEMLOCK (ulimit -l, or a container's memlock limit) is below the
// bytes to pin, or pinning fails, the state stays in pageable memory with a
// warning that says what to raise: slower copies, never a crash.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace trainrun {

enum class OffloadMode { None, Cpu, Nvme };
// "none" | "cpu" | "nvme"; anything else names parallel.offload.
OffloadMode parse_offload_mode(const std::string& text);
const char* offload_mode_name(OffloadMode m);

struct OffloadOptions {
  OffloadMode mode = OffloadMode::None;
  std::string dir;   // parallel.offload_dir (nvme)
  int threads = 0;   // host AdamW threads; 0 = OpenMP's (the CPU backend's) count
};

// Bytes of host memory offload keeps per rank for a shard of n elements.
inline size_t offload_host_bytes(int64_t shard_elements) { return size_t(shard_elements) * 16; }

// The start-up check of a node's host memory: throws naming parallel.offload
// when `needed` (all ranks of the node) exceeds `available`.
void check_offload_host_memory(size_t needed, size_t available, int ranks_on_node);
// MemAvailable of /proc/meminfo, narrowed by the cgroup's memory.max; 0 when unknown.
size_t host_memory_available();
// Whether `bytes` may be page-locked under `memlock_limit` (RLIM_INFINITY
// counts as no limit); the warning to log when not (empty when it may).
std::string memlock_warning(size_t bytes, uint64_t memlock_limit);

// nvme: make `dir` if needed and prove it writable (a probe file is
// created and removed); the error names the directory and parallel.offload_dir.
void check_offload_dir(const std::string& dir);

// One rank's offloaded optimizer state: n fp32 elements each of master
// weights, moments and (optionally) the gradient, in host memory.
class HostOptimizerState {
 public:
  HostOptimizerState(Backend* be, int64_t n, const OffloadOptions& opts);
  ~HostOptimizerState();
  HostOptimizerState(const HostOptimizerState&) = delete;
  HostOptimizerState& operator=(const HostOptimizerState&) = delete;

  // kind 0 master, 1 first moment, 2 second moment, 3 gradient (host pointers).
  float* state(int kind) { return bufs_[kind]; }
  int64_t size() const { return n_; }
  void zero_grads();
  // grad[off, off+n) += the device's src[0, n): the device->host copy of one
  // reduce-scattered unit, then the add of the backend's accumulate().
  void add_grad_from_device(int64_t off, const float* dev_src, int64_t n);
  // grad[0, n) = the device's src (a replicated all-reduced gradient).
  void grad_from_device(const float* dev_src, int64_t n);
  // sum(grad^2) over the whole buffer, as the CPU backend's sum_squares
  // (per-thread double partials in thread order): the same bits.
  float grad_sum_squares() const;
  // Host AdamW on [off, off+n) (one tensor's piece: its own weight decay).
  void update(int64_t off, int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int step,
              float grad_scale);
  // The device's act-dtype params [0, n) from master[off, off+n): fp32
  // backends copy, others go through a bounded fp32 device staging buffer.
  void master_to_device(void* dev_act, int64_t off, int64_t n);
  size_t host_bytes() const { return size_t(n_) * 16; }
  bool pinned() const { return pinned_; }

 private:
  Backend* be_;
  int64_t n_;
  int threads_;
  bool pinned_ = false;
  float* base_ = nullptr;  // one allocation: master | m | v | grad
  float* bufs_[4] = {};
  std::vector<float> staging_host_;  // add_grad_from_device's landing buffer (comm thread)
  DeviceBuffer staging_dev_;         // master_to_device on non-fp32 backends
};

}  // namespace trainrun
