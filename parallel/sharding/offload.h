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
#include "parallel/sharding/offload_io.h"

namespace trainrun {

enum class OffloadMode { None, Cpu, Nvme };
// "none" | "cpu" | "nvme"; anything else names parallel.offload.
OffloadMode parse_offload_mode(const std::string& text);
const char* offload_mode_name(OffloadMode m);

struct OffloadOptions {
  OffloadMode mode = OffloadMode::None;
  std::string dir;   // parallel.offload_dir (nvme)
  int threads = 0;   // host AdamW threads; 0 = OpenMP's (the CPU backend's) count
  // nvme: elements per I/O chunk and kind (a positive multiple of 1024, so
  // every read and write is whole 4 KiB pages). Tests make it small so that
  // a small model spans many chunks.
  int64_t chunk_elements = int64_t(1) << 20;
  IoChoice io = IoChoice::Auto;  // nvme: io_uring or the pread/pwrite pool (offload_io.h)
  // Micro-batches per optimizer step (gradient accumulation). nvme with
  // more than one keeps the fp32 gradient shard on the device, accumulates
  // there and lands it on disk once per step (offload_keeps_device_grad).
  int accum = 1;
};

// nvme with gradient accumulation: the gradient shard is summed on the
// device across micro-batches and written to disk once per step, instead
// of a read-modify-write of the disk's gradient per micro-batch (1.4 TB per
// rank and step at 70B dp8 with 16 micro-batches). It costs the device
// 4 bytes per element of the shard, which the planner counts; cpu offload
// adds in host memory, which is cheap, and keeps the device free of it.
inline bool offload_keeps_device_grad(OffloadMode mode, int accum) { return mode == OffloadMode::Nvme && accum > 1; }

// Bytes of host memory offload keeps per rank for a shard of n elements.
inline size_t offload_host_bytes(int64_t shard_elements) { return size_t(shard_elements) * 16; }
// nvme: the host memory of a rank is its I/O buffers only, whatever the
// shard (see HostOptimizerState): two step sets of 4 kinds, the gradient's
// landing chunk and its read-modify-write window (a chunk and 2 pages).
inline size_t offload_nvme_host_bytes(int64_t chunk_elements = int64_t(1) << 20) {
  return size_t(10 * chunk_elements + 2048) * 4;
}
// nvme: bytes read + written on disk per step for a shard of n elements,
// whatever the number of micro-batches: the gradient written once (one
// micro-batch: as its reductions land; more: summed on the device first,
// offload_keeps_device_grad), read by the norm (only when it is not on
// the device) and by the step; master and both moments read and written
// by the step.
inline double offload_nvme_bytes_per_step(double shard_elements, int accum) {
  return shard_elements * (4.0 + (accum > 1 ? 0.0 : 4.0) + 4 + 12 + 12);
}

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

// A piece of the shard updated with one weight decay (one tensor's slice).
struct OffloadSegment {
  int64_t off = 0, n = 0;
  float weight_decay = 0;
};

// One rank's offloaded optimizer state: n fp32 elements each of master
// weights, both moments and the gradient, outside the device.
//   cpu   all four in one host allocation;
//   nvme  all four in one file under offload_dir (regions of n elements
//         rounded up to 4 KiB: master | m | v | grad), unlinked as soon as it
//         is open, so it is gone when the process ends, even after kill -9.
//         Host memory is a fixed set of buffers (about 18 chunks, 72 MiB at
//         the default chunk), whatever the shard's size:
//           backward  each unit's gradient comes off the device a chunk at a
//                     time and is added into its pages of the grad region
//                     (read-modify-write of whole pages; pages not written
//                     since zero_grads() read as zero without a read);
//           norm      the grad region streamed once (double-buffered);
//           step      chunk by chunk: master, m, v and grad read, AdamW,
//                     master, m, v written, while the next chunk is read
//                     (two buffer sets).
//         Disk traffic per step and parameter, whatever the number of
//         micro-batches (the store sums them on the device first,
//         offload_keeps_device_grad): 4 bytes of gradient written, 4 read
//         by the norm (one micro-batch only) and 4 by the step, 12 read
//         and 12 written by the step. nvme_bytes_written() counts writes.
//         O_DIRECT where the filesystem takes it, else buffered I/O with a
//         logged fallback; io_uring or a pread/pwrite pool (offload_io.h).
class HostOptimizerState {
 public:
  HostOptimizerState(Backend* be, int64_t n, const OffloadOptions& opts);
  ~HostOptimizerState();
  HostOptimizerState(const HostOptimizerState&) = delete;
  HostOptimizerState& operator=(const HostOptimizerState&) = delete;

  int64_t size() const { return n_; }
  // Kind 0 master, 1 first moment, 2 second moment: [off, off+n) to / from
  // host memory (checkpoints, init, loads).
  void read_state(int kind, int64_t off, float* out, int64_t n);
  void write_state(int kind, int64_t off, const float* in, int64_t n);
  void zero_grads();
  // grad[off, off+n) += the device's src[0, n): the device->host copy of one
  // reduce-scattered unit, then the add of the backend's accumulate(). The
  // copy starts once `ready` has passed (Backend::copy_to_host_chunks: the
  // reduce-scatter's PendingCollective::ready_point; null: the compute
  // stream's work so far) and is added chunk by chunk as it lands: the comm
  // thread waits for this copy, never for the compute stream's backlog.
  void add_grad_from_device(int64_t off, const float* dev_src, int64_t n,
                            const std::shared_ptr<void>& ready = nullptr);
  // grad[0, n) = the device's src (a replicated all-reduced gradient).
  void grad_from_device(const float* dev_src, int64_t n);
  // The gradient's sum of squares over `pieces` ((start, count) of the
  // shard, ascending), as the device path computes it: each piece summed
  // as the CPU backend's sum_squares does (per-thread double partials over
  // OpenMP's static split, in thread order), cast to float and added to a
  // float total in piece order. The same bits as the device path, with or
  // without tensor parallelism's skipped (replicated) ranges.
  float grad_sum_squares(const std::vector<std::pair<int64_t, int64_t>>& pieces);
  // Host AdamW on every segment, then the updated master weights into the
  // device's act-dtype shard dev_act[0, n).
  void step(const std::vector<OffloadSegment>& segments, float lr, float beta1, float beta2, float eps, int step,
            float grad_scale, void* dev_act);
  // The device's act-dtype shard from the master weights (after a load).
  void master_to_device(void* dev_act);
  // Host bytes this rank holds (cpu: the state; nvme: the I/O buffers)
  // and bytes on disk (nvme).
  size_t host_bytes() const;
  size_t disk_bytes() const { return nvme_ ? size_t(4) * region_bytes_ : 0; }
  bool pinned() const { return pinned_; }
  // nvme: "io_uring" or "pool"; "" for cpu.
  const char* io_engine() const;
  // Bytes written to nvme state files by every HostOptimizerState of this
  // process so far (all ranks run in-process in tests): what the tests
  // and the bench hold "once per step, not per micro-batch" with.
  static uint64_t nvme_bytes_written();

 private:
  struct Nvme;
  void to_device(void* dev_act, int64_t off, const float* host, int64_t n);
  // nvme: grad pages [p0, p1) not written since zero_grads() set to zero in
  // buf (which holds the grad from page p0 on).
  void zero_unwritten_grad_pages(float* buf, int64_t p0, int64_t p1) const;
  Backend* be_;
  int64_t n_;
  int threads_;
  int64_t chunk_ = 0;  // nvme: elements per chunk (OffloadOptions::chunk_elements)
  bool pinned_ = false;
  bool nvme_ = false;
  size_t alloc_bytes_ = 0;
  size_t region_bytes_ = 0;  // nvme: one kind's bytes in the file, 4 KiB aligned
  float* base_ = nullptr;    // cpu: master | m | v | grad; nvme: the I/O buffers
  float* bufs_[4] = {};      // cpu: the four kinds
  DeviceBuffer staging_dev_;         // to_device on non-fp32 backends
  std::unique_ptr<Nvme> io_;
};

}  // namespace trainrun
