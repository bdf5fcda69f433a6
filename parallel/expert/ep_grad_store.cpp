// Expert parallelism's dense-gradient sum over the ep group (ep_grad_store.h).
#include "parallel/expert/ep_grad_store.h"

#include <algorithm>

#include "core/common/error.h"

namespace trainrun {

namespace {

class ExpertGradStore final : public ParamStore {
 public:
  ExpertGradStore(std::unique_ptr<ParamStore> inner, const ParamLayout& layout,
                  std::vector<std::pair<int64_t, int64_t>> dense, Communicator* ep)
      : inner_(std::move(inner)), units_(layout.units), ep_(ep) {
    TR_CHECK(ep_ != nullptr, "expert parallelism: no ep communicator for the gradient sum (a bug)");
    replicated_ = inner_->strategy() == "no_shard";
    // The dense gradients are equal on every ep rank after the sum: ep rank
    // 0 counts them in the grad norm (the plan's owner). Set on the store
    // that computes the norm: set_grad_norm_skip is not virtual, so the
    // global-coordinate wrapper's call reaches this object only.
    if (ep_->rank() > 0) inner_->set_grad_norm_skip(dense);
    // Each unit's dense pieces, unit-relative, cut once here (not per step).
    pieces_.resize(units_.size());
    for (size_t u = 0; u < units_.size(); ++u) {
      const int64_t lo = units_[u].offset, hi = lo + units_[u].numel;
      for (const auto& [s, n] : dense) {
        const int64_t a = std::max(lo, s), b = std::min(hi, s + n);
        if (a < b) pieces_[u].push_back({a - lo, b - a});
      }
    }
  }

  const void* acquire_params(int unit) override { return inner_->acquire_params(unit); }
  void release_params(int unit) override { inner_->release_params(unit); }
  float* unit_grads(int unit) override { return inner_->unit_grads(unit); }
  void grads_done(int unit) override {
    if (!replicated_) sum_dense(unit);
    inner_->grads_done(unit);
  }
  void begin_pass(bool backward_pass, bool backward_follows) override {
    inner_->begin_pass(backward_pass, backward_follows);
  }
  void begin_pass_in_order(const std::vector<int>& units) override { inner_->begin_pass_in_order(units); }
  void init_params(const ModelArch& arch, uint64_t seed) override { inner_->init_params(arch, seed); }
  void zero_grads() override { inner_->zero_grads(); }
  void finish_grads() override {
    if (replicated_)
      for (int u = 0; u < int(units_.size()); ++u) sum_dense(u);
    inner_->finish_grads();
  }
  double grad_norm_squared() override { return inner_->grad_norm_squared(); }
  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    inner_->optimizer_step(p, step, grad_scale);
  }
  void load_full_params(const std::vector<float>& flat) override { inner_->load_full_params(flat); }
  std::vector<Range> held_ranges() const override { return inner_->held_ranges(); }
  std::vector<Range> write_ranges() const override { return inner_->write_ranges(); }
  std::vector<float> get_state(int kind) override { return inner_->get_state(kind); }
  void copy_state_range(int kind, const Range& r, float* out) override { inner_->copy_state_range(kind, r, out); }
  void write_state_range(int kind, const Range& r, const float* in) override {
    inner_->write_state_range(kind, r, in);
  }
  void params_updated() override { inner_->params_updated(); }
  void set_state(int kind, const std::vector<float>& host) override { inner_->set_state(kind, host); }
  void set_step(int64_t step) override { inner_->set_step(step); }
  void check_comms() override { inner_->check_comms(); }
  ShardMemory memory() const override { return inner_->memory(); }
  double take_comm_wait_seconds() override { return inner_->take_comm_wait_seconds(); }
  std::string strategy() const override { return inner_->strategy(); }

 private:
  void sum_dense(int unit) {
    float* g = inner_->unit_grads(unit);
    for (const auto& [s, n] : pieces_[size_t(unit)]) ep_->all_reduce(g + s, n, ReduceOp::Sum);
  }
  std::unique_ptr<ParamStore> inner_;
  std::vector<ParamUnit> units_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> pieces_;
  Communicator* ep_;
  bool replicated_ = false;
};

}  // namespace

std::unique_ptr<ParamStore> make_expert_grad_store(std::unique_ptr<ParamStore> inner, const ParamLayout& layout,
                                                   std::vector<std::pair<int64_t, int64_t>> dense, Communicator* ep) {
  return std::make_unique<ExpertGradStore>(std::move(inner), layout, std::move(dense), ep);
}

}  // namespace trainrun
