// Sharded parameter state: where parameters, gradients and AdamW state live
// across ranks, and the collectives that move them. Implements UnitAccess so
// the model never knows which strategy is in force.
//
//   no_shard       (DDP)     params, grads, optimizer state replicated; grads all-reduced
//   shard_grad_op  (ZeRO-2)  params replicated; grads reduce-scattered; optimizer state sharded;
//                            updated shards all-gathered into the replicated params
//   full_shard     (ZeRO-3)  params sharded too: each unit all-gathered before use, freed after
//   hybrid_shard             full_shard inside groups of shard_group_size ranks, replicated across
//
// Every unit is one flat buffer padded to a multiple of the shard-group size,
// so any world size works. Rank r of a group owns elements
// [r*S, (r+1)*S) of each unit (S = padded/world), in logical (global) order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model/model.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};

// Bytes held by this rank, for the log and the memory report.
struct ShardMemory {
  size_t params = 0, grads = 0, optimizer = 0, comm_buffers = 0;
  size_t host = 0;  // parallel.offload: host memory holding master weights, moments, gradient shard
  size_t disk = 0;  // parallel.offload nvme: bytes of state files under offload_dir
};

// sum(x^2) over n fp32 device values, returned to the host. `acc` is a
// 4-byte device scratch the store keeps, so the per-step grad norm does not
// allocate (a cudaMalloc-backed pool would otherwise see it every step).
inline float sum_squares_to_host(Backend* be, float* acc, const float* x, int64_t n) {
  be->zero(acc, 4);
  be->sum_squares(acc, x, n);
  float host = 0;
  be->copy_to_host(&host, acc, 4);
  return host;
}

// The (start, count) pieces of layout elements [lo, hi) outside the sorted
// (start, count) ranges of `skip`, ascending: what a gradient norm counts.
inline std::vector<std::pair<int64_t, int64_t>> unskipped_pieces(
    int64_t lo, int64_t hi, const std::vector<std::pair<int64_t, int64_t>>& skip) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = lo;
  for (const auto& [s0, n] : skip) {
    const int64_t s1 = s0 + n;
    if (s1 <= at) continue;
    if (s0 >= hi) break;
    if (s0 > at) out.push_back({at, std::min(s0, hi) - at});
    at = std::max(at, s1);
    if (at >= hi) return out;
  }
  if (at < hi) out.push_back({at, hi - at});
  return out;
}

// Adds sum(x^2) over layout elements [lo, hi) to acc[0], where x[0] is
// element lo, leaving out the (start, count) ranges of `skip` (sorted): one
// backend sum_squares per piece, in order (the offload path, which sums on
// the host, reproduces exactly this: HostOptimizerState::grad_sum_squares).
inline void sum_squares_skipping(Backend* be, float* acc, const float* x, int64_t lo, int64_t hi,
                                 const std::vector<std::pair<int64_t, int64_t>>& skip) {
  for (const auto& [s, n] : unskipped_pieces(lo, hi, skip)) be->sum_squares(acc, x + (s - lo), n);
}

class ParamStore : public UnitAccess {
 public:
  // Ranges (start, count) of the store's layout whose gradients
  // grad_norm_squared() leaves out: elements another rank holds too
  // (tensor parallelism's replicas and vocabulary padding), so every element
  // of the model counts once. Sorted; empty (the default) = count all.
  // Virtual for a store made of others (parallel/expert/ep_split_store.h),
  // which passes each part its share in the part's own layout.
  virtual void set_grad_norm_skip(std::vector<std::pair<int64_t, int64_t>> skip) { norm_skip_ = std::move(skip); }

  // Fill the parameters from the architecture's counter-based init (each
  // rank inits only what it holds). `arch` must have the store's layout.
  virtual void init_params(const ModelArch& arch, uint64_t seed) = 0;
  virtual void zero_grads() = 0;
  // After the last micro-batch's backward: finish every gradient reduction.
  virtual void finish_grads() = 0;
  // Sum of squares of the full (global) gradient, identical on every rank.
  virtual double grad_norm_squared() = 0;
  // AdamW on this rank's shard (decay mask from the layout), then make the
  // updated parameters visible where the strategy keeps them. `step` is 1-based.
  virtual void optimizer_step(const AdamWParams& p, int step, float grad_scale) = 0;
  // Replace all parameters from a whole-model host vector (every rank passes
  // the same). Tests and small models only: real loads go range by range
  // (write_state_range), so no rank holds a whole big model on the host.
  virtual void load_full_params(const std::vector<float>& flat) = 0;
  // ---- checkpoint access (logical layout) ----------------------------------
  // Ranges of the flat parameter vector [global, global+count) this rank
  // holds state for (what it must load), and the ranges it writes to a
  // checkpoint: a partition of the whole model across all ranks (replicas
  // of hybrid_shard / no_shard split the writing instead of repeating it).
  //
  // A range may be strided: `reps` runs of `count` elements, `stride`
  // apart (global + i*stride + [0, count), i < reps). Tensor parallelism's
  // slices of an inner dimension are one run per row; one strided range per
  // tensor keeps a 70B tp8 rank at a few hundred ranges (and manifest
  // entries) instead of ~1.3M. On the host side (get_state, copy/
  // write_state_range) the runs sit back to back. Every store other than the
  // tensor-parallel one returns reps == 1 only; every consumer handles both.
  struct Range {
    int64_t global = 0, count = 0;
    int64_t stride = 0, reps = 1;  // reps == 1: contiguous (stride unused)
    int64_t numel() const { return count * reps; }
    // One past the last element covered.
    int64_t end() const { return global + (reps - 1) * stride + count; }
    // Runs [first, first + n) of this range.
    Range rows(int64_t first, int64_t n) const { return {global + first * stride, count, stride, n}; }
  };
  virtual std::vector<Range> held_ranges() const = 0;
  virtual std::vector<Range> write_ranges() const = 0;
  // State kind: 0 fp32 master weights, 1 AdamW first moment, 2 second moment.
  // Host copies, concatenated in held_ranges() order.
  virtual std::vector<float> get_state(int kind) = 0;
  // One range (inside held_ranges()) of one kind straight into host memory:
  // the checkpoint snapshot, with no intermediate buffers.
  virtual void copy_state_range(int kind, const Range& r, float* out) = 0;
  // The reverse: one range (inside held_ranges()) of one kind from host
  // memory, so a loader streams a rank's state in bounded pieces. After the
  // last range of kind 0, call params_updated() (collective: shard_grad_op
  // re-gathers its replicated parameters) before the parameters are used.
  virtual void write_state_range(int kind, const Range& r, const float* in) = 0;
  virtual void params_updated() = 0;
  // Collective for kind 0 (parameters may be re-gathered): every rank calls
  // set_state in the same order.
  virtual void set_state(int kind, const std::vector<float>& host) = 0;

  // The step in progress, for the error messages of every communicator
  // the store uses (the world's and hybrid_shard's own groups).
  virtual void set_step(int64_t step) = 0;
  // Before the optimizer step and before a checkpoint commit: every
  // communicator the store uses reports a collective that failed after its
  // call returned (Communicator::check_health), so no update and no
  // checkpoint is ever made from a half-reduced gradient. Throws the Error,
  // which names the operation, group, rank and step.
  virtual void check_comms() = 0;

  // The units the coming pass acquires, in order, where the caller knows
  // them better than begin_pass's whole-layout order (a pipeline chunk's
  // network: parallel/pipeline/stage_store.cpp): a sharded store queues each
  // unit's all-gather while the one before it computes. Default: ignored.
  virtual void begin_pass_in_order(const std::vector<int>& units) {}

  virtual ShardMemory memory() const = 0;
  // Seconds spent waiting on collectives since the last call (and reset).
  virtual double take_comm_wait_seconds() = 0;
  virtual std::string strategy() const = 0;

 protected:
  std::vector<std::pair<int64_t, int64_t>> norm_skip_;
};

// init_params' check that the architecture is the one the store was built for.
inline void check_same_layout(const ModelArch& arch, const ParamLayout& store_layout) {
  TR_CHECK(arch.layout().total == store_layout.total && arch.layout().units.size() == store_layout.units.size(),
           "init_params: the model (", arch.layout().total, " parameters in ", arch.layout().units.size(),
           " units) is not the one the parameter store was built for (", store_layout.total, " in ",
           store_layout.units.size(), ")");
}

// Builds a communicator over a subset of ranks: `prefix` names the group in
// the rendezvous store, `rank`/`world` are the caller's place in it.
using CommFactory = std::function<std::unique_ptr<Communicator>(const std::string& prefix, int rank, int world)>;

// `world` is the all-ranks communicator (used from the caller's thread only
// while the store is idle: after finish_grads / between steps).
// shard_group_size: hybrid_shard's group (must divide the world size).
// hybrid_shard with a device mesh (tensor parallelism): `world` is the
// data-parallel group and the mesh's dp_shard / dp_replicate communicators
// are passed in (hybrid_comms), instead of the store building its own.
// offload: where the optimizer state lives (offload.h); none = the device.
struct HybridComms {
  Communicator* shard = nullptr;    // dp_shard group (null: size 1)
  Communicator* replica = nullptr;  // dp_replicate group (null: size 1)
};
std::unique_ptr<ParamStore> make_param_store(const std::string& strategy, const ParamLayout& layout,
                                             Backend* be, Communicator* world, int shard_group_size,
                                             const CommFactory& factory, const HybridComms* hybrid_comms = nullptr,
                                             const OffloadOptions& offload = {});

}  // namespace trainrun
