// make_frozen_param_store (frozen_store.h).
#include "parallel/sharding/frozen_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/common/error.h"

namespace trainrun {

namespace {

class FrozenStore final : public FrozenStoreBase<ParamStore> {
 public:
  FrozenStore(const std::string& strategy, const ParamLayout& layout, Backend* be, Communicator* world, int group,
              const CommFactory& factory, bool round_bf16)
      : strategy_(strategy), layout_(layout), be_(be), es_(dtype_size(be->act_dtype())), round_bf16_(round_bf16) {
    const int W = world->world_size(), r = world->rank();
    sharded_ = strategy == "full_shard" || strategy == "hybrid_shard";
    G_ = !sharded_ ? 1 : strategy == "hybrid_shard" ? group : W;
    TR_CHECK(G_ >= 1 && W % G_ == 0, "parallel.shard_group_size (", G_, ") must divide the world size (", W, ")");
    g_ = r % G_;
    replica_ = r / G_;
    writes_ = sharded_ ? replica_ == 0 : r == 0;
    if (sharded_ && G_ == W) {
      comm_ = world;
    } else if (sharded_ && G_ > 1) {
      own_ = factory("base_shard" + std::to_string(replica_) + "/", g_, G_);
      comm_ = own_.get();
    }
    int64_t off = 0;
    for (const ParamUnit& pu : layout.units) {
      Unit u;
      u.shard = sharded_ ? (pu.numel + G_ - 1) / G_ : pu.numel;
      u.begin = sharded_ ? g_ * u.shard : 0;
      u.owned = std::max<int64_t>(0, std::min(u.shard, pu.numel - u.begin));
      u.local_off = off;
      off += (u.shard + 15) / 16 * 16;  // 64-byte aligned units (fp32)
      units_.push_back(std::move(u));
    }
    local_total_ = off;
    params_ = DeviceBuffer(be, size_t(std::max<int64_t>(1, local_total_)) * es_);
  }

  // ---- UnitAccess ----
  const void* acquire_params(int u) override {
    Unit& U = units_[size_t(u)];
    char* mine = params_.as<char>() + U.local_off * es_;
    if (!sharded_ || G_ == 1) return mine;
    if (U.holders++ == 0) {
      const size_t bytes = size_t(U.shard) * G_ * es_;
      auto& free = pool_[bytes];
      if (free.empty()) {
        free.push_back(DeviceBuffer(be_, bytes));
        alloc_bytes_ += bytes;
        peak_gather_bytes_ = std::max(peak_gather_bytes_, alloc_bytes_);
      }
      U.full = std::move(free.back());
      free.pop_back();
      comm_->all_gather(U.full.get(), mine, size_t(U.shard) * es_);
    }
    return U.full.get();
  }
  void release_params(int u) override {
    Unit& U = units_[size_t(u)];
    if (!sharded_ || G_ == 1) return;
    TR_CHECK(U.holders > 0, "frozen store: unit ", u, " released more often than acquired (a bug)");
    if (--U.holders == 0) pool_[U.full.bytes()].push_back(std::move(U.full));
  }

  // ---- ParamStore ----
  void init_params(const ModelArch& arch, uint64_t seed) override {
    check_same_layout(arch, layout_);
    for (const Range& r : held_ranges()) {
      std::vector<float> host(size_t(r.count));
      arch.init_params(seed, r.global, r.global + r.count, host.data());
      write_state_range(0, r, host.data());
    }
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == layout_.total, "frozen store: ", flat.size(), " values for ", layout_.total);
    for (const Range& r : held_ranges()) write_state_range(0, r, flat.data() + r.global);
  }
  std::vector<Range> held_ranges() const override {
    std::vector<Range> out;
    for (size_t i = 0; i < units_.size(); ++i)
      if (units_[i].owned > 0) out.push_back({layout_.units[i].offset + units_[i].begin, units_[i].owned});
    return out;
  }
  std::vector<Range> write_ranges() const override { return writes_ ? held_ranges() : std::vector<Range>{}; }
  std::vector<float> get_state(int kind) override {
    check_kind(kind);
    std::vector<float> out;
    for (const Range& r : held_ranges()) {
      const size_t at = out.size();
      out.resize(at + size_t(r.count));
      copy_state_range(kind, r, out.data() + at);
    }
    return out;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    check_kind(kind);
    const int64_t at = local_at(r);
    if (be_->act_dtype() == DType::F32) {
      be_->copy_to_host(out, params_.as<char>() + at * es_, size_t(r.count) * 4);
    } else {
      DeviceBuffer staged(be_, size_t(r.count) * 4);
      be_->cast_to_f32(staged.as<float>(), params_.as<char>() + at * es_, r.count);
      be_->copy_to_host(out, staged.get(), size_t(r.count) * 4);
    }
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    check_kind(kind);
    const int64_t at = local_at(r);
    std::vector<float> rounded;
    if (round_bf16_) {
      // model.base_dtype bf16: the value bf16 holds (round to nearest even),
      // whatever the act dtype; on the CPU the backend then computes with it in fp32.
      rounded.resize(size_t(r.count));
      for (int64_t i = 0; i < r.count; ++i) rounded[size_t(i)] = bf16_value(in[i]);
      in = rounded.data();
    }
    if (be_->act_dtype() == DType::F32) {
      be_->copy_to_device(params_.as<char>() + at * es_, in, size_t(r.count) * 4);
    } else {
      DeviceBuffer staged(be_, size_t(r.count) * 4);
      be_->copy_to_device(staged.get(), in, size_t(r.count) * 4);
      be_->cast_from_f32(params_.as<char>() + at * es_, staged.as<float>(), r.count);
    }
  }
  void set_state(int kind, const std::vector<float>& host) override {
    check_kind(kind);
    size_t at = 0;
    for (const Range& r : held_ranges()) {
      write_state_range(kind, r, host.data() + at);
      at += size_t(r.count);
    }
  }
  void set_step(int64_t step) override {
    if (own_) own_->set_step(step);
  }
  void check_comms() override {
    if (own_) own_->check_health();
  }
  ShardMemory memory() const override {
    ShardMemory m;
    m.params = size_t(local_total_) * es_;
    m.comm_buffers = peak_gather_bytes_;
    return m;
  }
  std::string strategy() const override { return strategy_ + (round_bf16_ ? ", frozen bf16" : ", frozen"); }

 private:
  struct Unit {
    int64_t shard = 0, begin = 0, owned = 0, local_off = 0;
    int holders = 0;
    DeviceBuffer full;  // gathered while held (sharded)
  };
  void check_kind(int kind) const {
    TR_CHECK(kind == 0, "frozen store: the frozen base has only parameters (state kind ", kind,
             " is an optimizer moment); a bug");
  }
  // Where global range r (inside one held unit slice) lies in params_.
  int64_t local_at(const Range& r) const {
    TR_CHECK(r.reps == 1, "frozen store: strided ranges are not supported (a bug)");
    for (size_t i = 0; i < units_.size(); ++i) {
      const int64_t lo = layout_.units[i].offset + units_[i].begin;
      if (r.global >= lo && r.global + r.count <= lo + units_[i].owned) return units_[i].local_off + (r.global - lo);
    }
    TR_FAIL("frozen store: range [", r.global, ", ", r.global + r.count, ") is not held by this rank (a bug)");
  }
  std::string strategy_;
  const ParamLayout& layout_;
  Backend* be_;
  size_t es_;
  bool round_bf16_ = false;
  bool sharded_ = false, writes_ = false;
  int G_ = 1, g_ = 0, replica_ = 0;
  Communicator* comm_ = nullptr;
  std::unique_ptr<Communicator> own_;
  std::vector<Unit> units_;
  int64_t local_total_ = 0;
  DeviceBuffer params_;  // this rank's elements of every unit, act dtype
  std::map<size_t, std::vector<DeviceBuffer>> pool_;  // gather buffers by size
  size_t alloc_bytes_ = 0, peak_gather_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ParamStore> make_frozen_param_store(const std::string& strategy, const ParamLayout& layout,
                                                    Backend* be, Communicator* world, int shard_group_size,
                                                    const CommFactory& factory, const FrozenFormat& format) {
  if (format.dtype == "nf4")
    return make_nf4_frozen_store(strategy, layout, be, world, shard_group_size, factory, format);
  TR_CHECK(format.dtype == "fp32" || format.dtype == "bf16", "model.base_dtype: ", format.dtype,
           " is not a frozen base format (fp32, bf16 or nf4)");
  return std::make_unique<FrozenStore>(strategy, layout, be, world, shard_group_size, factory, format.dtype == "bf16");
}

}  // namespace trainrun
