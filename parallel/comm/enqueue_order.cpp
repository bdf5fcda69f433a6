#include "parallel/comm/enqueue_order.h"

#include "parallel/comm/forwarding_communicator.h"

namespace trainrun {

namespace {
// The order whose turn this thread holds (one rank's threads take turns in
// one order; a thread never holds two).
thread_local const EnqueueOrder* t_held = nullptr;
}  // namespace

uint64_t EnqueueOrder::reserve() {
  std::lock_guard<std::mutex> lk(mu_);
  return next_ticket_++;
}

void EnqueueOrder::acquire(uint64_t t) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return next_turn_ == t; });
}

void EnqueueOrder::release(uint64_t t) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (t < next_turn_) return;
    done_.insert(t);
    while (!done_.empty() && *done_.begin() == next_turn_) {
      done_.erase(done_.begin());
      ++next_turn_;
    }
  }
  cv_.notify_all();
}

bool EnqueueOrder::held_by_this_thread() const { return t_held == this; }

uint64_t EnqueueOrder::tickets_issued() const {
  std::lock_guard<std::mutex> lk(mu_);
  return next_ticket_;
}

EnqueueOrder::Turn::Turn(EnqueueOrder* order) {
  if (!order || order->held_by_this_thread()) return;  // none, or nested in the caller's turn
  order_ = order;
  ticket_ = order->reserve();
  order->acquire(ticket_);
  outer_ = t_held;
  t_held = order;
}

EnqueueOrder::Turn::Turn(EnqueueOrder* order, uint64_t reserved) : order_(order), ticket_(reserved) {
  if (!order_) return;
  order_->acquire(ticket_);
  outer_ = t_held;
  t_held = order_;
}

EnqueueOrder::Turn::~Turn() {
  if (!order_) return;
  t_held = outer_;
  order_->release(ticket_);
}

namespace {

class OrderedCommunicator final : public ForwardingCommunicator {
 public:
  OrderedCommunicator(std::unique_ptr<Communicator> inner, EnqueueOrder* order)
      : ForwardingCommunicator(std::move(inner)), order_(order) {}
  EnqueueOrder* enqueue_order() const override { return order_; }

  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    EnqueueOrder::Turn t(order_);
    inner_->all_reduce(buf, count, op);
  }
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    EnqueueOrder::Turn t(order_);
    inner_->reduce_scatter(out, in, n, op);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    EnqueueOrder::Turn t(order_);
    inner_->all_gather(out, in, bytes);
  }
  void all_to_all(void* out, const void* in, size_t bytes) override {
    EnqueueOrder::Turn t(order_);
    inner_->all_to_all(out, in, bytes);
  }
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    EnqueueOrder::Turn t(order_);
    inner_->all_to_all_v(out, recv_bytes, in, send_bytes);
  }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes,
                                                         const std::shared_ptr<void>& after) override {
    EnqueueOrder::Turn t(order_);
    return inner_->all_gather_deferred(out, in, bytes, after);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t n, ReduceOp op,
                                                             const std::shared_ptr<void>& after) override {
    EnqueueOrder::Turn t(order_);
    return inner_->reduce_scatter_deferred(out, in, n, op, after);
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    EnqueueOrder::Turn t(order_);
    inner_->broadcast(buf, bytes, root);
  }
  void barrier() override {
    EnqueueOrder::Turn t(order_);
    inner_->barrier();
  }
  void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) override {
    EnqueueOrder::Turn t(order_);
    inner_->all_reduce_bf16(buf, count, op);
  }
  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t n, ReduceOp op) override {
    EnqueueOrder::Turn t(order_);
    inner_->reduce_scatter_bf16(out, in, n, op);
  }
  void send_recv(const void* sb, size_t sn, int to, void* rb, size_t rn, int from, uint32_t tag) override {
    EnqueueOrder::Turn t(order_);
    inner_->send_recv(sb, sn, to, rb, rn, from, tag);
  }
  std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    EnqueueOrder::Turn t(order_);
    return inner_->send_deferred(buf, bytes, to, tag, after);
  }
  std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    EnqueueOrder::Turn t(order_);
    return inner_->recv_deferred(buf, bytes, from, tag, after);
  }

 private:
  EnqueueOrder* order_;
};

}  // namespace

std::unique_ptr<Communicator> make_ordered_communicator(std::unique_ptr<Communicator> inner, EnqueueOrder* order) {
  if (!order) return inner;
  return std::make_unique<OrderedCommunicator>(std::move(inner), order);
}

}  // namespace trainrun
