#include "parallel/fault_injection.h"

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/common/error.h"
#include "core/common/log.h"

namespace trainrun {

namespace {

struct FaultSpec {
  std::string group;
  int rank = -1;
  int64_t step = -1;
};

bool parse_fault(const char* s, FaultSpec* out) {
  const std::string v(s);
  const size_t a = v.find(':'), b = v.find(':', a == std::string::npos ? a : a + 1);
  TR_CHECK(a != std::string::npos && b != std::string::npos, "TRAINRUN_DEBUG_COMM_FAULT='", v,
           "': expected <group>:<rank>:<step>, e.g. replica:1:3");
  out->group = v.substr(0, a);
  try {
    out->rank = std::stoi(v.substr(a + 1, b - a - 1));
    out->step = std::stoll(v.substr(b + 1));
  } catch (...) {
    TR_FAIL("TRAINRUN_DEBUG_COMM_FAULT='", v, "': rank and step must be integers");
  }
  return true;
}

class FaultyCommunicator final : public Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<Communicator> inner, int64_t fault_step)
      : inner_(std::move(inner)), fault_step_(fault_step) {
    group_ = inner_->group();
  }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string name() const override { return inner_->name(); }
  void set_step(int64_t step) override {
    step_ = step;
    inner_->set_step(step);
  }
  void set_group(const std::string& g) override {
    group_ = g;
    inner_->set_group(g);
  }

  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    if (enter("all_reduce")) inner_->all_reduce(buf, count, op);
  }
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    if (enter("reduce_scatter")) inner_->reduce_scatter(out, in, n, op);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    if (enter("all_gather")) inner_->all_gather(out, in, bytes);
  }
  std::shared_ptr<void> compute_point() override { return inner_->compute_point(); }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes,
                                                         const std::shared_ptr<void>& after) override {
    if (!enter("all_gather")) return nullptr;
    return inner_->all_gather_deferred(out, in, bytes, after);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t n, ReduceOp op,
                                                             const std::shared_ptr<void>& after) override {
    if (!enter("reduce_scatter")) return nullptr;
    return inner_->reduce_scatter_deferred(out, in, n, op, after);
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    if (enter("broadcast")) inner_->broadcast(buf, bytes, root);
  }
  void barrier() override {
    if (enter("barrier")) inner_->barrier();
  }
  void check_health() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!broken_.empty()) TR_FAIL(describe("check_health"), ": an earlier collective failed: ", broken_);
    }
    inner_->check_health();
  }

 private:
  // false: this call is the injected failure (returns as if enqueued).
  // Throws for every call after it.
  bool enter(const char* op) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_.empty()) TR_FAIL(describe(op), ": the communicator is unusable after an earlier failure: ", broken_);
    if (step_ != fault_step_) return true;
    broken_ = describe(op) + ": injected failure (TRAINRUN_DEBUG_COMM_FAULT) after the call returned, as an NCCL "
              "collective that fails on the GPU";
    TR_LOG_WARN("fault injection: ", broken_);
    return false;
  }

  std::unique_ptr<Communicator> inner_;
  int64_t fault_step_;
  std::mutex mu_;  // the comm thread and the trainer's thread both call in
  std::string broken_;
};

}  // namespace

std::unique_ptr<Communicator> maybe_inject_faults(std::unique_ptr<Communicator> inner, int global_rank) {
  const char* s = std::getenv("TRAINRUN_DEBUG_COMM_FAULT");
  if (!s || !*s) return inner;
  FaultSpec f;
  parse_fault(s, &f);
  if (f.rank != global_rank || inner->group().rfind(f.group, 0) != 0) return inner;
  return std::make_unique<FaultyCommunicator>(std::move(inner), f.step);
}

}  // namespace trainrun
