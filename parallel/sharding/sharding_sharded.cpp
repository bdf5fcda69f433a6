// shard_grad_op (ZeRO-2), full_shard (ZeRO-3 / FSDP) and hybrid_shard.
//
// Each unit u (embeddings, block l, head) is one flat buffer of numel_u
// elements padded to P_u = G * S_u, where G is the shard-group size; group
// position g owns elements [g*S_u, (g+1)*S_u) of every unit: fp32 master
// weights, AdamW moments and the accumulated gradient, all in logical order
// (so a checkpoint can write them at global offsets).
//
// Per step:
//   forward   full_shard: all-gather unit u before use (the next unit's
//             gather is queued on the comm thread while u computes), free after.
//   backward  a full-size fp32 gradient buffer per unit, zeroed on first use;
//             when the unit is done it is reduce-scattered on the comm thread
//             (overlapping the next unit's backward) and added to the shard.
//   finish    wait for the reduce-scatters; hybrid: all-reduce the shards
//             across replica groups.
//   step      AdamW on the shard; shard_grad_op all-gathers the updated
//             shards into its replicated parameters.
// All collectives of the store run on one CommWorker thread, in the same
// order on every rank, and take their turns in the rank's cross-group order
// (parallel/comm/enqueue_order.h) where the compute thread submitted them.
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <map>
#include <mutex>

#include "core/common/error.h"
#include "core/common/log.h"
#include "parallel/comm/comm_worker.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/sharding/buffer_pool.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

struct Unit {
  int64_t offset = 0, numel = 0;  // in the whole-model layout
  int64_t shard = 0;              // S_u
  int64_t shard_off = 0;          // this rank's offset in the sharded buffers
  int64_t begin = 0, owned = 0;   // my slice within the unit: [begin, begin+owned) are real elements
  int64_t padded_off = 0;         // offset in the replicated padded params (shard_grad_op)
  void* full = nullptr;           // gathered params (full_shard), padded, act dtype
  std::shared_future<void> gathered;
  // Its all-gather, issued by the comm thread; the compute stream waits for
  // it when the unit is acquired (NCCL overlap; null for Gloo).
  std::shared_ptr<PendingCollective> gather_op;
  bool gathering = false;
  int holders = 0;
  float* full_grad = nullptr;     // padded fp32 gradient during backward
  std::shared_future<void> reduced;
  bool reducing = false;
};

class ShardedStore final : public ParamStore {
 public:
  ShardedStore(const std::string& strategy, const ParamLayout& layout, Backend* be, Communicator* world,
               int group, const CommFactory& factory, const HybridComms* hybrid_comms,
               const OffloadOptions& offload)
      : strategy_(strategy), layout_(layout), be_(be), world_(world), pool_(be) {
    const int W = world->world_size();
    const int r = world->rank();
    shard_params_ = strategy != "shard_grad_op";
    G_ = strategy == "hybrid_shard" ? group : W;
    TR_CHECK(G_ >= 1 && W % G_ == 0, "parallel.shard_group_size (", G_, ") must divide the world size (", W,
             ") for hybrid_shard");
    g_ = r % G_;
    if (G_ == W) {
      shard_comm_ = world;
    } else if (hybrid_comms) {
      // The device mesh's groups (tensor parallelism: the dp groups of one
      // tp index); a size-1 group has no communicator.
      TR_CHECK(W / G_ == 1 || hybrid_comms->replica,
               "hybrid_shard: the mesh's dp_replicate communicator is missing (a bug)");
      if (!hybrid_comms->shard) own_shard_ = make_single_communicator();  // shard groups of one rank
      shard_comm_ = hybrid_comms->shard ? hybrid_comms->shard : own_shard_.get();
      replica_comm_ = W / G_ > 1 ? hybrid_comms->replica : nullptr;
    } else {
      // hybrid: shard inside consecutive groups of G ranks, replicate across
      // them: the mesh's dp_shard and dp_replicate groups (named for their
      // errors, "dp_shard0", "dp_replicate1").
      const DeviceMesh mesh(plan_mesh(W, 1, 1, "hybrid_shard", G_), r);
      TR_CHECK(mesh.coord(MeshDim::dp_shard) == g_, "hybrid_shard: mesh and store disagree on rank ", r);
      own_shard_ = factory(mesh.group_name(MeshDim::dp_shard) + "/", g_, G_);
      own_replica_ = factory(mesh.group_name(MeshDim::dp_replicate) + "/", mesh.coord(MeshDim::dp_replicate), W / G_);
      shard_comm_ = own_shard_.get();
      replica_comm_ = own_replica_.get();
    }
    // The comm thread's tasks take their turns in the rank's cross-group
    // order (enqueue_order.h) in the order this thread submits them.
    comm_.set_order(world->enqueue_order() ? world->enqueue_order() : shard_comm_->enqueue_order());
    es_ = dtype_size(be->act_dtype());
    // A tie to a tensor of the first unit (the token embedding).
    for (const ParamTie& t : layout.ties) {
      const ParamTensor& to = layout.get(t.tensor);
      if (!layout.units.empty() && to.offset >= layout.units[0].offset &&
          to.offset < layout.units[0].offset + layout.units[0].numel)
        head_reads_unit0_ = true;
    }
    int64_t soff = 0, poff = 0;
    for (const auto& pu : layout.units) {
      Unit u;
      u.offset = pu.offset;
      u.numel = pu.numel;
      u.shard = (pu.numel + G_ - 1) / G_;
      u.shard_off = soff;
      u.begin = g_ * u.shard;
      u.owned = std::max<int64_t>(0, std::min(u.shard, pu.numel - u.begin));
      u.padded_off = poff;
      soff += u.shard;
      // Each unit of the replicated params starts 128-byte aligned: its
      // tensors sit at their layout offsets from there, and the GPU's GEMMs
      // (bias epilogues included) want 16-byte aligned operands.
      poff += (u.shard * G_ + 63) / 64 * 64;
      units_.push_back(u);
    }
    shard_total_ = soff;
    padded_total_ = poff;
    norm_acc_ = DeviceBuffer(be, 4);
    if (offload.mode != OffloadMode::None) {
      // Offload (offload.h): master, moments and gradient shard on the host;
      // the device keeps its own act-dtype shard. hybrid_shard still sums
      // the shards across replicas on the device, so it keeps grad_ too;
      // so does nvme with accumulation (offload_keeps_device_grad): the
      // disk then sees the gradient once per step, not per micro-batch.
      host_ = std::make_unique<HostOptimizerState>(be, shard_total_, offload);
      shard_act_ = DeviceBuffer(be, shard_total_ * es_);
      if (replica_comm_ || offload_keeps_device_grad(offload.mode, offload.accum))
        grad_ = DeviceBuffer(be, shard_total_ * 4);
    } else {
      master_ = DeviceBuffer(be, shard_total_ * 4);
      m_ = DeviceBuffer(be, shard_total_ * 4);
      v_ = DeviceBuffer(be, shard_total_ * 4);
      grad_ = DeviceBuffer(be, shard_total_ * 4);
      if (be->act_dtype() != DType::F32) shard_act_ = DeviceBuffer(be, shard_total_ * es_);
    }
    if (!shard_params_) replicated_ = DeviceBuffer(be, padded_total_ * es_);
  }

  ~ShardedStore() override {
    // Unwinding (a collective failed, the trainer threw): the queued
    // collectives would only wait out their timeouts against peers that are
    // stopping too, so they are dropped; the one in progress finishes before
    // comm_ (the last member) is destroyed. Otherwise: finish what was queued.
    bool drained = false;
    if (std::uncaught_exceptions() == 0) {
      try {
        drain();
        drained = true;
      } catch (...) {
      }
    }
    if (!drained) comm_.cancel_pending();
    for (auto& u : units_) {
      pool_.put(u.full, u.shard * G_ * es_);
      pool_.put(u.full_grad, u.shard * G_ * 4);
    }
  }

  std::string strategy() const override { return strategy_; }
  void set_step(int64_t step) override {
    world_->set_step(step);
    if (own_shard_) own_shard_->set_step(step);
    if (own_replica_) own_replica_->set_step(step);
  }
  void check_comms() override {
    drain();  // everything queued has been issued (and Gloo has finished it)
    world_->check_health();
    if (own_shard_) own_shard_->check_health();
    if (own_replica_) own_replica_->check_health();
  }

  // ---- UnitAccess ----------------------------------------------------------------
  void begin_pass(bool backward_pass, bool backward_follows) override {
    seq_.clear();
    const int n = int(units_.size());
    // The order the model will acquire units in (UnitAccess), so that each
    // gather can be queued behind the previous one. A tied head reads the
    // embeddings' unit after the head unit (forward) and before it
    // (backward); an untied one does not, and predicting it would queue an
    // all-gather of the whole embedding (1 GB in bf16 for Llama 3 8B) that
    // nothing uses after an eval forward.
    if (!backward_pass) {
      for (int u = 0; u < n; ++u) seq_.push_back(u);
      if (head_reads_unit0_) seq_.push_back(0);
    } else {
      if (head_reads_unit0_) seq_.push_back(0);
      for (int u = n - 1; u >= 1; --u) seq_.push_back(u);
    }
    pos_ = 0;
    keep_embeddings_ = backward_follows;
  }

  void begin_pass_in_order(const std::vector<int>& units) override {
    seq_ = units;
    pos_ = 0;
    keep_embeddings_ = false;  // the caller's order says what comes next
  }

  const void* acquire_params(int u) override {
    if (!shard_params_) return static_cast<char*>(replicated_.get()) + units_[u].padded_off * es_;
    Unit& U = units_[u];
    start_gather(u);
    wait(U.gathered);
    order_compute_after_gather(U);
    U.holders++;
    // Advance the pass sequence and queue the next unit's gather behind this one.
    while (pos_ < seq_.size() && seq_[pos_] != u) ++pos_;
    if (pos_ < seq_.size()) ++pos_;
    if (pos_ < seq_.size()) start_gather(seq_[pos_]);
    return U.full;
  }

  void release_params(int u) override {
    if (!shard_params_) return;
    Unit& U = units_[u];
    U.holders--;
    const bool needed_again = pos_ < seq_.size() && seq_[pos_] == u;
    const bool head_of_backward = u == 0 && keep_embeddings_ && pos_ >= seq_.size();
    if (U.holders == 0 && !needed_again && !head_of_backward) {
      pool_.put(U.full, U.shard * G_ * es_);
      U.full = nullptr;
      U.gathering = false;
    }
  }

  float* unit_grads(int u) override {
    Unit& U = units_[u];
    if (!U.full_grad) {
      U.full_grad = static_cast<float*>(pool_.get(U.shard * G_ * 4));
      be_->zero(U.full_grad, U.shard * G_ * 4);
    }
    return U.full_grad;
  }

  void grads_done(int u) override {
    Unit& U = units_[u];
    if (!U.full_grad) return;
    float* full = U.full_grad;
    float* shard = grad_.get() ? grad_.as<float>() + U.shard_off : nullptr;  // null: offloaded (host_)
    const int64_t shard_off = U.shard_off;
    const int64_t S = U.shard;
    // Its own output buffer: the previous unit's may still be waiting to be
    // accumulated when this reduction starts on the GPU.
    float* tmp = static_cast<float*>(pool_.get(S * 4));
    U.full_grad = nullptr;
    // Bound the full-size gradient buffers waiting for their reduce-scatter
    // (FSDP's limit_all_gathers idea): a rank that runs ahead of the comm
    // thread would otherwise hold one per unit.
    while (in_flight_.size() >= kMaxPendingReduces) {
      wait(units_[in_flight_.front()].reduced);
      in_flight_.pop_front();
    }
    in_flight_.push_back(u);
    // No host sync: the communicator orders the collective after the
    // backward kernels that produced `full`. Deferred (NCCL): the compute
    // stream waits for it only when the comm thread takes the next unit's
    // reduction (or drain() flushes it), so it overlaps the next block's
    // backward; only then is it accumulated and `full` handed back.
    // It starts after this unit's backward (enqueued by now), not after
    // whatever the compute thread has enqueued by the time the comm thread
    // issues it.
    std::shared_ptr<void> after = shard_comm_->compute_point();
    U.reduced = comm_.submit([this, full, shard, shard_off, tmp, S, after] {
      finish_reduce();  // the previous unit's
      pending_reduce_ = {shard_comm_->reduce_scatter_deferred(tmp, full, S, ReduceOp::Sum, after), full, shard, tmp, S,
                         shard_off};
      if (!pending_reduce_.op) finish_reduce();  // it completed already (Gloo)
    });
    U.reducing = true;
    // The last unit of backward is the embeddings: everything is queued.
  }

  // ---- ParamStore -------------------------------------------------------------------
  // Unit by unit, through one host buffer the size of the largest owned
  // slice: a rank never holds its whole shard twice (device + host).
  void init_params(const ModelArch& arch, uint64_t seed) override {
    check_same_layout(arch, layout_);
    int64_t most = 0;
    for (const auto& u : units_) most = std::max(most, u.shard);
    std::vector<float> host(size_t(most), 0.0f);
    for (const auto& u : units_) {
      std::fill(host.begin(), host.begin() + u.shard, 0.0f);  // padding stays zero
      if (u.owned > 0)
        arch.init_params(seed, u.offset + u.begin, u.offset + u.begin + u.owned, host.data());
      state_from_host(0, u.shard_off, host.data(), u.shard);
    }
    master_to_params();
  }

  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == layout_.total, "load_full_params: got ", flat.size(), " values for a model of ",
             layout_.total);
    std::vector<float> host(shard_total_, 0.0f);
    for (const auto& u : units_)
      std::copy(flat.begin() + u.offset + u.begin, flat.begin() + u.offset + u.begin + u.owned,
                host.begin() + u.shard_off);
    set_master(host);
  }

  void zero_grads() override {
    if (grad_.get()) be_->zero(grad_.get(), grad_.bytes());
    if (host_) host_->zero_grads();
  }

  void finish_grads() override {
    drain();
    if (replica_comm_) run([&] { replica_comm_->all_reduce(grad_.as<float>(), shard_total_, ReduceOp::Sum); });
    if (host_ && grad_.get()) host_->grad_from_device(grad_.as<float>(), shard_total_);
  }

  double grad_norm_squared() override {
    // Padding is zero, so the shard's sum is exact.
    float local = 0;
    if (host_ && !grad_.get()) {  // a device copy (hybrid, nvme accumulation) is summed there, unread from disk
      // The device path's pieces below, in shard offsets: summed on the host to the same bits.
      std::vector<std::pair<int64_t, int64_t>> pieces;
      if (norm_skip_.empty()) pieces.push_back({0, shard_total_});
      for (const auto& u : units_)
        if (!norm_skip_.empty() && u.owned > 0)
          for (const auto& [s, n] : unskipped_pieces(u.offset + u.begin, u.offset + u.begin + u.owned, norm_skip_))
            pieces.push_back({u.shard_off + (s - (u.offset + u.begin)), n});
      local = host_->grad_sum_squares(pieces);
    } else if (norm_skip_.empty()) {
      local = sum_squares_to_host(be_, norm_acc_.as<float>(), grad_.as<float>(), shard_total_);
    } else {
      be_->zero(norm_acc_.get(), 4);
      for (const auto& u : units_)
        if (u.owned > 0)
          sum_squares_skipping(be_, norm_acc_.as<float>(), grad_.as<float>() + u.shard_off, u.offset + u.begin,
                               u.offset + u.begin + u.owned, norm_skip_);
      be_->copy_to_host(&local, norm_acc_.get(), 4);
    }
    run([&] { shard_comm_->all_reduce(&local, 1, ReduceOp::Sum); });
    return local;
  }

  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    void* act = shard_act_.get() ? shard_act_.get() : master_.get();
    std::vector<OffloadSegment> segments;  // offload: the same pieces, updated on the host
    for (const auto& u : units_) {
      if (u.owned == 0) continue;
      const int64_t lo = u.offset + u.begin, hi = lo + u.owned;
      for (const auto& t : layout_.tensors) {
        const int64_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel);
        if (a >= b) continue;
        const int64_t s = u.shard_off + (a - lo);
        if (host_) {
          segments.push_back({s, b - a, t.decay ? p.weight_decay : 0.0f});
          continue;
        }
        be_->adamw_update(master_.as<float>() + s, static_cast<char*>(act) + s * es_, grad_.as<float>() + s,
                          m_.as<float>() + s, v_.as<float>() + s, b - a, p.lr, p.beta1, p.beta2, p.eps,
                          t.decay ? p.weight_decay : 0.0f, step, grad_scale);
      }
    }
    if (host_) host_->step(segments, p.lr, p.beta1, p.beta2, p.eps, step, grad_scale, shard_act_.get());
    if (!shard_params_) gather_replicated();
  }

  std::vector<Range> held_ranges() const override {
    std::vector<Range> out;
    for (const auto& u : units_)
      if (u.owned > 0) out.push_back({u.offset + u.begin, u.owned});
    return out;
  }
  // hybrid_shard: only the first replica group writes (the others hold copies).
  std::vector<Range> write_ranges() const override {
    if (world_->rank() >= G_) return {};
    return held_ranges();
  }
  std::vector<float> get_state(int kind) override {
    std::vector<float> shard(shard_total_), out;
    state_to_host(kind, 0, shard.data(), shard_total_);
    for (const auto& u : units_)
      out.insert(out.end(), shard.begin() + u.shard_off, shard.begin() + u.shard_off + u.owned);
    return out;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    state_to_host(kind, shard_offset_of(r, "copy_state_range"), out, r.count);
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    state_from_host(kind, shard_offset_of(r, "write_state_range"), in, r.count);
  }
  void params_updated() override { master_to_params(); }
  void set_state(int kind, const std::vector<float>& host) override {
    std::vector<float> shard(shard_total_, 0.0f);
    size_t pos = 0;
    for (const auto& u : units_) {
      TR_CHECK(pos + u.owned <= host.size(), "set_state: too few values");
      std::copy(host.begin() + pos, host.begin() + pos + u.owned, shard.begin() + u.shard_off);
      pos += u.owned;
    }
    TR_CHECK(pos == host.size(), "set_state: ", host.size(), " values for ", pos, " held");
    if (kind == 0) return set_master(shard);
    state_from_host(kind, 0, shard.data(), shard_total_);
  }

  ShardMemory memory() const override {
    ShardMemory m;
    m.params = master_.bytes() + shard_act_.bytes() + replicated_.bytes();
    m.grads = grad_.bytes();
    m.optimizer = m_.bytes() + v_.bytes();
    m.comm_buffers = pool_.peak();
    if (host_) m.host = host_->host_bytes(), m.disk = host_->disk_bytes();
    return m;
  }

  double take_comm_wait_seconds() override {
    double w = wait_s_;
    wait_s_ = 0;
    return w;
  }

 private:
  float* state(int kind) { return kind == 0 ? master_.as<float>() : kind == 1 ? m_.as<float>() : v_.as<float>(); }
  // State kind [off, off+n) of the shard to / from host memory, wherever it lives.
  void state_to_host(int kind, int64_t off, float* out, int64_t n) {
    if (host_) host_->read_state(kind, off, out, n);
    else be_->copy_to_host(out, state(kind) + off, size_t(n) * 4);
  }
  void state_from_host(int kind, int64_t off, const float* in, int64_t n) {
    if (host_) host_->write_state(kind, off, in, n);
    else be_->copy_to_device(state(kind) + off, in, size_t(n) * 4);
  }
  // Where a range of the flat layout sits in this rank's shard buffers; it
  // must lie inside one unit's owned slice.
  int64_t shard_offset_of(const Range& r, const char* what) const {
    for (const auto& u : units_) {
      const int64_t lo = u.offset + u.begin;
      if (r.global >= lo && r.global + r.count <= lo + u.owned) return u.shard_off + (r.global - lo);
    }
    TR_FAIL(what, ": [", r.global, ", +", r.count, ") is not held by rank ", world_->rank());
  }
  void set_master(const std::vector<float>& host) {
    state_from_host(0, 0, host.data(), int64_t(host.size()));
    master_to_params();
  }
  // The act-dtype parameters from the fp32 master shard.
  void master_to_params() {
    if (host_) host_->master_to_device(shard_act_.get());
    else if (shard_act_.get()) be_->cast_from_f32(shard_act_.get(), master_.as<float>(), shard_total_);
    if (!shard_params_) gather_replicated();
  }
  // shard_grad_op: every rank's updated shard into the replicated params.
  void gather_replicated() {
    const void* act = shard_act_.get() ? shard_act_.get() : master_.get();
    for (auto& u : units_) {
      char* dst = static_cast<char*>(replicated_.get()) + u.padded_off * es_;
      const char* src = static_cast<const char*>(act) + u.shard_off * es_;
      run([&] { shard_comm_->all_gather(dst, src, u.shard * es_); });
    }
  }
  void start_gather(int u) {
    Unit& U = units_[u];
    if (U.gathering) return;
    if (!U.full) U.full = pool_.get(U.shard * G_ * es_);
    const void* src = static_cast<const char*>(shard_act_.get() ? shard_act_.get() : master_.get()) +
                      U.shard_off * es_;
    void* dst = U.full;
    const size_t bytes = U.shard * es_;
    // Deferred: compute enqueued until the unit is acquired overlaps it.
    // (Its output is a pool block nobody else touches until then.) It
    // starts after the compute enqueued so far, which includes the last
    // use of that block before it went back to the pool (see BufferPool).
    Unit* up = &U;
    std::shared_ptr<void> after = shard_comm_->compute_point();
    U.gathered = comm_.submit([this, up, dst, src, bytes, after] {
      up->gather_op = shard_comm_->all_gather_deferred(dst, src, bytes, after);
    });
    U.gathering = true;
  }
  // After U.gathered: what the compute stream must wait for before reading
  // U.full or handing it back to the pool (set by the comm thread, visible
  // here through the future).
  void order_compute_after_gather(Unit& U) {
    if (!U.gather_op) return;
    U.gather_op->order_compute_after();
    U.gather_op.reset();
  }
  // On the comm thread only: wait (on the GPU) for the last deferred
  // reduce-scatter, accumulate its shard and return its full buffer.
  void finish_reduce() {
    PendingReduce& p = pending_reduce_;
    if (!p.full) return;
    // Offload's copy waits for the reduce-scatter itself (its ready point),
    // not for the compute stream, which has queued later units' backward.
    const std::shared_ptr<void> ready = p.op ? p.op->ready_point() : nullptr;
    if (p.op) p.op->order_compute_after();
    if (p.shard) be_->accumulate(p.shard, p.tmp, p.S);
    else host_->add_grad_from_device(p.shard_off, p.tmp, p.S, ready);  // offload: device -> host, added there
    // Back to the pool once every use is enqueued on the compute stream: a
    // later user enqueues there after it, or (a deferred collective) starts
    // after a compute_point() taken after getting the block.
    pool_.put(p.full, p.S * G_ * 4);
    pool_.put(p.tmp, p.S * 4);
    p = PendingReduce{};
  }
  void wait(const std::shared_future<void>& f) {
    auto t0 = Clock::now();
    f.get();  // rethrows the collective's Error (timeout, dead peer)
    wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  void run(const std::function<void()>& fn) { wait(comm_.submit(fn)); }
  // Wait for every queued collective (reduce-scatters, stray prefetches).
  void drain() {
    in_flight_.clear();
    run([this] { finish_reduce(); });  // through the comm thread: it owns pending_reduce_
    for (auto& u : units_) {
      if (u.reducing) {
        u.reducing = false;
        wait(u.reduced);
      }
      if (u.gathering && u.holders == 0) {
        wait(u.gathered);
        order_compute_after_gather(u);  // before its buffer can be reused
        pool_.put(u.full, u.shard * G_ * es_);
        u.full = nullptr;
        u.gathering = false;
      }
    }
  }

  std::string strategy_;
  const ParamLayout& layout_;
  Backend* be_;
  Communicator* world_;
  Communicator* shard_comm_ = nullptr;
  Communicator* replica_comm_ = nullptr;
  std::unique_ptr<Communicator> own_shard_, own_replica_;
  bool shard_params_ = true;
  bool head_reads_unit0_ = false;  // the LM head is tied to the embeddings' unit
  int G_ = 1, g_ = 0;
  size_t es_ = 4;
  std::vector<Unit> units_;
  int64_t shard_total_ = 0, padded_total_ = 0;
  DeviceBuffer master_, m_, v_, grad_, shard_act_, replicated_, norm_acc_;
  std::unique_ptr<HostOptimizerState> host_;  // parallel.offload; null = state on the device
  BufferPool pool_;
  static constexpr size_t kMaxPendingReduces = 2;
  struct PendingReduce {
    std::unique_ptr<PendingCollective> op;
    float* full = nullptr;
    float* shard = nullptr;
    float* tmp = nullptr;
    int64_t S = 0;
    int64_t shard_off = 0;
  };
  PendingReduce pending_reduce_;  // the comm thread's; see finish_reduce()
  std::deque<int> in_flight_;  // units whose reduce-scatter is queued, oldest first
  std::vector<int> seq_;
  size_t pos_ = 0;
  bool keep_embeddings_ = false;
  double wait_s_ = 0;
  // Last, so destroyed first: its thread is joined while every member a
  // task touches (pending_reduce_, the pool, the buffers) is still alive.
  CommWorker comm_;
};

}  // namespace

std::unique_ptr<ParamStore> make_sharded_param_store(const std::string& strategy, const ParamLayout& layout,
                                                     Backend* be, Communicator* world, int group,
                                                     const CommFactory& factory, const HybridComms* hybrid_comms,
                                                     const OffloadOptions& offload) {
  return std::make_unique<ShardedStore>(strategy, layout, be, world, group, factory, hybrid_comms, offload);
}

}  // namespace trainrun
