// A communicator that passes every call to another one: the base of the
// wrappers (enqueue_order.h's turns, comm_record.h's recorder), which
// override only the calls they change.
#pragma once
#include <memory>
#include <string>

#include "parallel/comm/communicator.h"

namespace trainrun {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {
    group_ = inner_->group();
    step_ = inner_->step();
    op_label_ = inner_->op_label();
  }
  Communicator& inner() { return *inner_; }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string name() const override { return inner_->name(); }
  void all_reduce(float* buf, int64_t count, ReduceOp op) override { inner_->all_reduce(buf, count, op); }
  void reduce_scatter(float* out, const float* in, int64_t count_per_rank, ReduceOp op) override {
    inner_->reduce_scatter(out, in, count_per_rank, op);
  }
  void all_gather(void* out, const void* in, size_t bytes_per_rank) override {
    inner_->all_gather(out, in, bytes_per_rank);
  }
  std::shared_ptr<void> compute_point() override { return inner_->compute_point(); }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes_per_rank,
                                                         const std::shared_ptr<void>& after) override {
    return inner_->all_gather_deferred(out, in, bytes_per_rank, after);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t count_per_rank,
                                                             ReduceOp op, const std::shared_ptr<void>& after) override {
    return inner_->reduce_scatter_deferred(out, in, count_per_rank, op, after);
  }
  void broadcast(void* buf, size_t bytes, int root) override { inner_->broadcast(buf, bytes, root); }
  void barrier() override { inner_->barrier(); }
  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    inner_->all_to_all(out, in, bytes_per_rank);
  }
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    inner_->all_to_all_v(out, recv_bytes, in, send_bytes);
  }
  void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) override { inner_->all_reduce_bf16(buf, count, op); }
  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t count_per_rank, ReduceOp op) override {
    inner_->reduce_scatter_bf16(out, in, count_per_rank, op);
  }
  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t tag) override {
    inner_->send_recv(send_buf, send_bytes, send_to, recv_buf, recv_bytes, recv_from, tag);
  }
  bool stream_ordered() const override { return inner_->stream_ordered(); }
  std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    return inner_->send_deferred(buf, bytes, to, tag, after);
  }
  std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    return inner_->recv_deferred(buf, bytes, from, tag, after);
  }
  void set_op_label(const std::string& label) override {
    op_label_ = label;
    inner_->set_op_label(label);
  }
  void check_health() override { inner_->check_health(); }
  void set_step(int64_t step) override {
    step_ = step;
    inner_->set_step(step);
  }
  void set_group(const std::string& group) override {
    group_ = group;
    inner_->set_group(group);
  }
  EnqueueOrder* enqueue_order() const override { return inner_->enqueue_order(); }

 protected:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace trainrun
