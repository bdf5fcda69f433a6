// A frozen model's parameters (the base under model.adapter): held and
// moved like any model's under the job's strategy, but with no gradients,
// no master weights beyond the act-dtype parameters themselves, no
// optimizer state and no collectives of its own in the backward.
//
//   no_shard, shard_grad_op  every rank holds the whole model (as DDP / ZeRO-2
//                            replicate parameters)
//   full_shard               rank r holds elements [r*S, (r+1)*S) of every
//                            unit (S = ceil(numel / world)); a unit is
//                            all-gathered when acquired and freed when released
//   hybrid_shard             the same inside groups of shard_group_size
//                            consecutive ranks; each group holds a whole copy
//                            (a frozen model needs nothing across groups)
//
// The gathers run synchronously on the caller's thread over `comm`, which
// nothing else uses from another thread. Checkpoint access (held/write
// ranges, kind 0) works as on any store, so model.init_from loads it range
// by range; kinds 1 and 2 (AdamW moments) do not exist and are refused.
// The NF4 base (model.base_dtype: nf4) shards each unit's byte image the
// same way (bytes instead of elements) and loads through load_from instead
// (below; nf4_frozen_store.cpp).
#pragma once
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// fp32 -> the nearest bf16 value (ties to even), as an fp32; NaN stays NaN:
// what model.base_dtype bf16 holds of each weight.
inline float bf16_value(float x) {
  if (std::isnan(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// How the frozen base is held (model.base_dtype, docs/fine-tuning.md):
//   fp32  as the act dtype (today's CPU backend: fp32)
//   bf16  every value rounded to bf16 (round to nearest even) as it is
//         written; held in the act dtype (on the CPU fp32 holding bf16's
//         values: the backend computes in fp32)
//   nf4   the tensors nf4_tensors names (bitsandbytes' Linear4bit weights:
//         the block linears) in NF4 (kernels/nf4_format.h), the rest in the
//         act dtype; parallel/sharding/nf4_frozen_store.cpp
// nf4: the quantizer's three steps that a store runs on its part of a
// tensor (core/model/adapter/nf4.h defines them and implements this:
// parallel/ does not include the model's folders).
class Nf4Codec {
 public:
  virtual ~Nf4Codec() = default;
  // max |x| over n values (subnormals as 0): a rank's part of a block's absmax.
  virtual float absmax_of(const float* x, int64_t n) const = 0;
  // offset, qabsmax (one per absmax) and absmax2 (one per 256) from all of a tensor's block absmaxes.
  virtual void quantize_absmax(const std::vector<float>& absmax, float& offset, std::vector<uint8_t>& qabsmax,
                               std::vector<float>& absmax2) const = 0;
  // Elements [first, first + count) of an n-element tensor (x holds just
  // those) into packed bytes from first/2 (packed points there); absmax:
  // the whole tensor's block absmaxes.
  virtual void encode(const float* x, int64_t first, int64_t count, int64_t n, const float* absmax,
                      uint8_t* packed) const = 0;
  virtual const float* dynamic_map() const = 0;  // (256) fp32, host
};

// nf4 under tensor parallelism: the store's layout is a TP rank's local one
// and each NF4 tensor there is a slice of a global tensor, made of whole
// 64-blocks of it (core/model/adapter/qlora.h checks that and refuses the
// rest). Its local blocks [local, local + count) are the global tensor's
// blocks [global, global + count) (tensor-relative block indices).
struct Nf4BlockRun {
  int64_t local = 0, global = 0, count = 0;
};
struct Nf4TpSlice {
  int64_t global_numel = 0;       // the whole tensor's elements
  std::vector<Nf4BlockRun> runs;  // every local block once, in local order
};

struct FrozenFormat {
  std::string dtype = "fp32";
  std::vector<int> nf4_tensors;  // indices into the layout's tensors (nf4 only)
  std::shared_ptr<const Nf4Codec> codec;  // nf4 only
  // nf4 with tensor parallelism (else empty / null): one slice per
  // nf4_tensors entry, and the TP group, over which the store's absmax
  // exchange runs after its own shard group's (the ranks that hold parts of
  // a tensor are the TP group x the dp shard group; max is associative, so
  // two steps give every one of them the whole tensor's absmaxes).
  std::vector<Nf4TpSlice> nf4_tp;
  Communicator* nf4_tp_comm = nullptr;
};

// world: the all-ranks communicator (full_shard's gathers use it; with
// hybrid_shard the groups come from `factory`, named "base_shard<i>").
std::unique_ptr<ParamStore> make_frozen_param_store(const std::string& strategy, const ParamLayout& layout,
                                                    Backend* be, Communicator* world, int shard_group_size,
                                                    const CommFactory& factory, const FrozenFormat& format = {});

// A frozen store that quantizes as it loads (nf4): it has no fp32 values to
// write range by range (write_state_range refuses), because an NF4 tensor's
// statistics are functions of the whole tensor. load_from is its loader:
// collective over the store's shard group, every rank calls it once with a
// reader of the whole model's flat values (global element offsets), of which
// it reads only the ranges its own bytes need. A reader that throws on one
// rank stops the load on every rank of its group at the next tensor; that
// rank rethrows, the others return with the store marked unloaded (an
// acquire then fails), so the caller's agreement on errors reports the
// reader's own message. A read is `reps` runs of `count` elements, `stride`
// apart from `global`, back to back into out (reps 1: one contiguous run):
// a tensor-parallel slice of a row-parallel weight is one run per row, and
// the reader (HfReader::read_runs) takes all of them in one call.
using FlatReader =
    std::function<void(int64_t global, int64_t count, int64_t stride, int64_t reps, float* out)>;
// A store that may load through a reader: a quantizing store, or one that
// wraps a quantizing store (the pipeline stage store over an NF4 stage,
// parallel/pipeline/stage_store.h, which maps its stage's offsets onto the
// model's; the tensor-parallel store over an NF4 slice). load_if_quantizing
// runs load_from and returns true where the store quantizes as it loads;
// false (nothing read) where it loads range by range (write_state_range),
// as every other store does.
class ReaderLoadable {
 public:
  virtual ~ReaderLoadable() = default;
  virtual bool load_if_quantizing(const FlatReader& read) = 0;
};
class LoadingParamStore : public ParamStore, public ReaderLoadable {
 public:
  virtual void load_from(const FlatReader& read) = 0;
  bool load_if_quantizing(const FlatReader& read) final {
    load_from(read);
    return true;
  }
};

// What every frozen store (frozen_store.cpp's, the NF4 store) is alike in:
// no gradients, no optimizer step, nothing to reduce or wait for after a
// step. Base: ParamStore or LoadingParamStore.
template <class Base>
class FrozenStoreBase : public Base {
 public:
  float* unit_grads(int u) override {
    TR_FAIL("frozen store: the frozen base has no gradients (unit ", u, "); a bug: the network must compute "
            "through AdaptedUnitAccess");
  }
  void grads_done(int) override {}
  void zero_grads() override {}
  void finish_grads() override {}
  double grad_norm_squared() override { return 0; }
  void optimizer_step(const AdamWParams&, int, float) override {
    TR_FAIL("frozen store: the frozen base takes no optimizer step (a bug)");
  }
  void params_updated() override {}
  double take_comm_wait_seconds() override { return 0; }
};

// The NF4 store (nf4_frozen_store.cpp); make_frozen_param_store builds it for format.dtype nf4.
std::unique_ptr<ParamStore> make_nf4_frozen_store(const std::string& strategy, const ParamLayout& layout, Backend* be,
                                                  Communicator* world, int shard_group_size,
                                                  const CommFactory& factory, const FrozenFormat& format);

}  // namespace trainrun
