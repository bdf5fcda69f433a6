// no_shard (DDP): every rank holds the whole model, its gradient and the
// optimizer state; gradients are all-reduced (sum: the loss scale already
// divides by the global token count). The single-rank case is this with a
// world of one.
#include <chrono>
#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

namespace {

class ReplicatedStore final : public ParamStore {
 public:
  ReplicatedStore(const ParamLayout& layout, Backend* be, Communicator* comm, const OffloadOptions& offload)
      : layout_(layout), be_(be), comm_(comm) {
    const int64_t n = layout.total;
    grads_ = DeviceBuffer(be, n * 4);  // the all-reduce's bucket, on the device either way
    norm_acc_ = DeviceBuffer(be, 4);
    if (offload.mode != OffloadMode::None) {
      // Offload (offload.h): the device keeps only its act-dtype parameters.
      host_ = std::make_unique<HostOptimizerState>(be, n, offload);
      params_ = DeviceBuffer(be, n * dtype_size(be->act_dtype()));
      return;
    }
    // On fp32 backends the master copy doubles as the parameters.
    master_ = DeviceBuffer(be, n * 4);
    if (be->act_dtype() != DType::F32) params_ = DeviceBuffer(be, n * dtype_size(be->act_dtype()));
    m_ = DeviceBuffer(be, n * 4);
    v_ = DeviceBuffer(be, n * 4);
  }
  void* params() { return params_.get() ? params_.get() : master_.get(); }

  const void* acquire_params(int unit) override {
    return static_cast<char*>(params()) + layout_.units[unit].offset * dtype_size(be_->act_dtype());
  }
  void release_params(int) override {}
  float* unit_grads(int unit) override { return grads_.as<float>() + layout_.units[unit].offset; }
  void grads_done(int) override {}

  void init_params(const ModelArch& arch, uint64_t seed) override {
    check_same_layout(arch, layout_);
    std::vector<float> host(layout_.total);
    arch.init_params(seed, 0, layout_.total, host.data());
    load_full_params(host);
  }
  void zero_grads() override {
    be_->zero(grads_.get(), grads_.bytes());
    if (host_) host_->zero_grads();
  }
  void finish_grads() override {
    if (comm_->world_size() > 1) {
      auto t0 = std::chrono::steady_clock::now();
      // Ordered after the backward by the communicator itself (no host sync).
      comm_->all_reduce(grads_.as<float>(), layout_.total, ReduceOp::Sum);
      wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (host_) host_->grad_from_device(grads_.as<float>(), layout_.total);
  }
  double grad_norm_squared() override {
    if (host_) {
      // Offloaded: the host holds the gradient; the same pieces as below
      // (tensor parallelism's replicas left out), summed to the same bits.
      return host_->grad_sum_squares(norm_skip_.empty() ? std::vector<std::pair<int64_t, int64_t>>{{0, layout_.total}}
                                                        : unskipped_pieces(0, layout_.total, norm_skip_));
    }
    if (norm_skip_.empty()) return sum_squares_to_host(be_, norm_acc_.as<float>(), grads_.as<float>(), layout_.total);
    be_->zero(norm_acc_.get(), 4);
    sum_squares_skipping(be_, norm_acc_.as<float>(), grads_.as<float>(), 0, layout_.total, norm_skip_);
    float host = 0;
    be_->copy_to_host(&host, norm_acc_.get(), 4);
    return host;
  }
  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    const size_t es = dtype_size(be_->act_dtype());
    if (host_) {
      std::vector<OffloadSegment> segments;
      for (const auto& t : layout_.tensors) segments.push_back({t.offset, t.numel, t.decay ? p.weight_decay : 0.0f});
      host_->step(segments, p.lr, p.beta1, p.beta2, p.eps, step, grad_scale, params_.get());
      return;
    }
    for (const auto& t : layout_.tensors) {
      be_->adamw_update(master_.as<float>() + t.offset, static_cast<char*>(params()) + t.offset * es,
                        grads_.as<float>() + t.offset, m_.as<float>() + t.offset, v_.as<float>() + t.offset,
                        t.numel, p.lr, p.beta1, p.beta2, p.eps, t.decay ? p.weight_decay : 0.0f, step,
                        grad_scale);
    }
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == layout_.total, "load_full_params: got ", flat.size(),
             " values for a model of ", layout_.total);
    from_host(0, 0, flat.data(), layout_.total);
    params_updated();
  }
  std::vector<Range> held_ranges() const override { return {{0, layout_.total}}; }
  std::vector<Range> write_ranges() const override {
    // Every rank holds everything: split the writing evenly.
    const int W = comm_->world_size(), r = comm_->rank();
    const int64_t b = layout_.total * r / W, e = layout_.total * (r + 1) / W;
    if (e <= b) return {};
    return {{b, e - b}};
  }
  std::vector<float> get_state(int kind) override {
    std::vector<float> host(layout_.total);
    to_host(kind, 0, host.data(), layout_.total);
    return host;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    TR_CHECK(r.global >= 0 && r.global + r.count <= layout_.total, "copy_state_range: out of range");
    to_host(kind, r.global, out, r.count);
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    TR_CHECK(r.global >= 0 && r.global + r.count <= layout_.total, "write_state_range: out of range");
    from_host(kind, r.global, in, r.count);
  }
  void params_updated() override {
    if (host_) host_->master_to_device(params_.get());
    else if (params_.get()) be_->cast_from_f32(params_.get(), master_.as<float>(), layout_.total);
  }
  void set_state(int kind, const std::vector<float>& host) override {
    if (kind == 0) return load_full_params(host);
    TR_CHECK(int64_t(host.size()) == layout_.total, "set_state: size mismatch");
    from_host(kind, 0, host.data(), layout_.total);
  }
  float* state(int kind) { return kind == 0 ? master_.as<float>() : kind == 1 ? m_.as<float>() : v_.as<float>(); }
  // State kind [off, off+n) to / from host memory, wherever it lives.
  void to_host(int kind, int64_t off, float* out, int64_t n) {
    if (host_) host_->read_state(kind, off, out, n);
    else be_->copy_to_host(out, state(kind) + off, size_t(n) * 4);
  }
  void from_host(int kind, int64_t off, const float* in, int64_t n) {
    if (host_) host_->write_state(kind, off, in, n);
    else be_->copy_to_device(state(kind) + off, in, size_t(n) * 4);
  }

  ShardMemory memory() const override {
    ShardMemory m;
    m.params = master_.bytes() + params_.bytes();
    m.grads = grads_.bytes();
    m.optimizer = m_.bytes() + v_.bytes();
    if (host_) m.host = host_->host_bytes(), m.disk = host_->disk_bytes();
    return m;
  }
  double take_comm_wait_seconds() override {
    double w = wait_;
    wait_ = 0;
    return w;
  }
  std::string strategy() const override { return "no_shard"; }
  void set_step(int64_t step) override { comm_->set_step(step); }
  void check_comms() override { comm_->check_health(); }

 private:
  const ParamLayout& layout_;
  Backend* be_;
  Communicator* comm_;
  DeviceBuffer master_, params_, grads_, m_, v_, norm_acc_;
  std::unique_ptr<HostOptimizerState> host_;  // parallel.offload; null = state on the device
  double wait_ = 0;
};

}  // namespace

std::unique_ptr<ParamStore> make_replicated_param_store(const ParamLayout& layout, Backend* be,
                                                        Communicator* comm, const OffloadOptions& offload) {
  return std::make_unique<ReplicatedStore>(layout, be, comm, offload);
}

}  // namespace trainrun
