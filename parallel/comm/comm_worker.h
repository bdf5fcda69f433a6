// A single background thread that runs collectives in submission order.
// Why: Gloo (and NCCL) calls block, and every rank must issue collectives in
// the same order; one FIFO thread keeps that order while the compute thread
// goes on (all-gather prefetch, reduce-scatter during backward). Exceptions
// (timeouts naming the op and peer) travel back through the futures.
// Destruction (or cancel_pending) drops the tasks that have not started:
// their futures report a broken promise. The owner drains what it needs
// first; a task queued behind a failed collective must never run against
// members the owner is already destroying, nor wait out another timeout.
//
// With an EnqueueOrder (set_order: the rank's cross-group call order,
// enqueue_order.h), submit() reserves the task's ticket on the submitting
// thread, so the task's collectives take their turn in that thread's
// program order, not whenever this thread gets to them; a dropped task
// releases its ticket.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "parallel/comm/enqueue_order.h"

namespace trainrun {

class CommWorker {
 public:
  CommWorker() : thread_([this] { loop(); }) {}
  ~CommWorker() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      drop_pending();  // not started: dropped (see the top)
    }
    cv_.notify_all();
    thread_.join();
  }
  // Drops every task that has not started yet; the running one finishes.
  void cancel_pending() {
    std::lock_guard<std::mutex> lk(mu_);
    drop_pending();
  }
  // Before the first submit.
  void set_order(EnqueueOrder* order) {
    std::lock_guard<std::mutex> lk(mu_);
    order_ = order;
  }
  std::shared_future<void> submit(std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::shared_future<void> fut = task.get_future().share();
    {
      std::lock_guard<std::mutex> lk(mu_);
      const uint64_t ticket = order_ ? order_->reserve() : 0;
      queue_.push_back(Task{std::move(task), ticket});
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void loop() {
    for (;;) {
      Task task;
      EnqueueOrder* order = nullptr;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_ || queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        order = order_;
      }
      EnqueueOrder::Turn turn(order, task.ticket);  // released when the task returns or throws
      task.fn();
    }
  }
  struct Task {
    std::packaged_task<void()> fn;
    uint64_t ticket = 0;
  };
  // Under mu_: a dropped task's ticket is done, or every later call would
  // wait for it forever.
  void drop_pending() {
    if (order_)
      for (const Task& t : queue_) order_->release(t.ticket);
    queue_.clear();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  EnqueueOrder* order_ = nullptr;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace trainrun
