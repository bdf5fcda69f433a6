#include "parallel/comm/fault_injection.h"

#include <cstdlib>
#include <algorithm>
#include <mutex>
#include <vector>
#include <string>

#include "core/common/error.h"
#include "core/common/log.h"

namespace trainrun {

namespace {

struct FaultSpec {
  std::string group;
  int rank = -1;
  int64_t step = -1;
  int call = 0;  // which call of that step fails (0: the first)
};

bool parse_fault(const char* s, FaultSpec* out) {
  const std::string v(s);
  const size_t a = v.find(':'), b = v.find(':', a == std::string::npos ? a : a + 1);
  TR_CHECK(a != std::string::npos && b != std::string::npos, "TRAINRUN_DEBUG_COMM_FAULT='", v,
           "': expected <group>:<rank>:<step>[:<call>], e.g. dp_replicate:1:3");
  out->group = v.substr(0, a);
  const size_t c = v.find(':', b + 1);
  try {
    out->rank = std::stoi(v.substr(a + 1, b - a - 1));
    out->step = std::stoll(v.substr(b + 1, c == std::string::npos ? std::string::npos : c - b - 1));
    if (c != std::string::npos) out->call = std::stoi(v.substr(c + 1));
  } catch (...) {
    TR_FAIL("TRAINRUN_DEBUG_COMM_FAULT='", v, "': rank, step and call must be integers");
  }
  return true;
}

class FaultyCommunicator final : public Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<Communicator> inner, int64_t fault_step, int fault_call)
      : inner_(std::move(inner)), fault_step_(fault_step), fault_call_(fault_call) {
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

  // The injected call still runs on the inner communicator (its peers are
  // not left waiting: on a GPU they see the collective complete), then this
  // rank's result is thrown away: a reduction's output gets its input back.
  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    std::vector<float> before;
    if (faulting()) before.assign(buf, buf + count);
    inner_->all_reduce(buf, count, op);
    if (!before.empty()) std::copy(before.begin(), before.end(), buf);
    after("all_reduce");
  }
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    const bool f = faulting();
    inner_->reduce_scatter(out, in, n, op);
    if (f) std::copy(in + int64_t(rank()) * n, in + int64_t(rank() + 1) * n, out);
    after("reduce_scatter");
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    faulting();
    inner_->all_gather(out, in, bytes);
    after("all_gather");
  }
  std::shared_ptr<void> compute_point() override { return inner_->compute_point(); }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes,
                                                         const std::shared_ptr<void>& after_point) override {
    faulting();
    auto op = inner_->all_gather_deferred(out, in, bytes, after_point);
    after("all_gather");
    return op;
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t n, ReduceOp op,
                                                             const std::shared_ptr<void>& after_point) override {
    const bool f = faulting();
    auto pending = inner_->reduce_scatter_deferred(out, in, n, op, after_point);
    if (f && !pending) std::copy(in + int64_t(rank()) * n, in + int64_t(rank() + 1) * n, out);
    after("reduce_scatter");
    return pending;
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    faulting();
    inner_->broadcast(buf, bytes, root);
    after("broadcast");
  }
  void barrier() override {
    faulting();
    inner_->barrier();
    after("barrier");
  }
  void all_to_all(void* out, const void* in, size_t bytes) override {
    faulting();
    inner_->all_to_all(out, in, bytes);
    after("all_to_all");
  }
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    faulting();
    inner_->all_to_all_v(out, recv_bytes, in, send_bytes);
    after("all_to_all_v");
  }
  void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) override {
    faulting();
    inner_->all_reduce_bf16(buf, count, op);
    after("all_reduce_bf16");
  }
  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t n, ReduceOp op) override {
    faulting();
    inner_->reduce_scatter_bf16(out, in, n, op);
    after("reduce_scatter_bf16");
  }
  void send_recv(const void* sbuf, size_t sbytes, int to, void* rbuf, size_t rbytes, int from,
                 uint32_t tag) override {
    faulting();
    inner_->send_recv(sbuf, sbytes, to, rbuf, rbytes, from, tag);
    after("send_recv");
  }
  bool stream_ordered() const override { return inner_->stream_ordered(); }
  std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag,
                                                   const std::shared_ptr<void>& after_point) override {
    faulting();
    auto pending = inner_->send_deferred(buf, bytes, to, tag, after_point);
    after("send_recv");
    return pending;
  }
  std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag,
                                                   const std::shared_ptr<void>& after_point) override {
    faulting();
    auto pending = inner_->recv_deferred(buf, bytes, from, tag, after_point);
    after("send_recv");
    return pending;
  }
  void set_op_label(const std::string& label) override {
    Communicator::set_op_label(label);
    inner_->set_op_label(label);
  }
  void check_health() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!broken_.empty()) TR_FAIL(describe("check_health"), ": an earlier collective failed: ", broken_);
    }
    inner_->check_health();
  }

 private:
  // Before a call: throws when an earlier one failed (as NCCL's aborted
  // communicator does); true when this call is the one to fail.
  bool faulting() {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_.empty()) TR_FAIL(describe("collective"), ": the communicator is unusable after an earlier failure: ",
                                  broken_);
    pending_fault_ = step_ == fault_step_ && !fired_ && calls_in_step_++ == fault_call_;
    return pending_fault_;
  }
  // After it: the failure is recorded, to surface at the next call or check.
  void after(const char* op) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!pending_fault_) return;
    pending_fault_ = false;
    fired_ = true;
    broken_ = describe(op) + ": injected failure (TRAINRUN_DEBUG_COMM_FAULT) after the call returned, as an NCCL "
              "collective that fails on the GPU";
    TR_LOG_WARN("fault injection: ", broken_);
  }

  std::unique_ptr<Communicator> inner_;
  int64_t fault_step_;
  int fault_call_, calls_in_step_ = 0;  // the calls made so far in the fault step
  std::mutex mu_;  // the comm thread and the trainer's thread both call in
  std::string broken_;
  bool pending_fault_ = false, fired_ = false;
};

}  // namespace

std::unique_ptr<Communicator> maybe_inject_faults(std::unique_ptr<Communicator> inner, int global_rank) {
  const char* s = std::getenv("TRAINRUN_DEBUG_COMM_FAULT");
  if (!s || !*s) return inner;
  FaultSpec f;
  parse_fault(s, &f);
  if (f.rank != global_rank || inner->group().rfind(f.group, 0) != 0) return inner;
  return std::make_unique<FaultyCommunicator>(std::move(inner), f.step, f.call);
}

}  // namespace trainrun
