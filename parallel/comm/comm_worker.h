// A single background thread that runs collectives in submission order.
// Why: Gloo (and NCCL) calls block, and every rank must issue collectives in
// the same order; one FIFO thread keeps that order while the compute thread
// goes on (all-gather prefetch, reduce-scatter during backward). Exceptions
// (timeouts naming the op and peer) travel back through the futures.
// Destruction (or cancel_pending) drops the tasks that have not started:
// their futures report a broken promise. The owner drains what it needs
// first; a task queued behind a failed collective must never run against
// members the owner is already destroying, nor wait out another timeout.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace trainrun {

class CommWorker {
 public:
  CommWorker() : thread_([this] { loop(); }) {}
  ~CommWorker() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      queue_.clear();  // not started: dropped (see the top)
    }
    cv_.notify_all();
    thread_.join();
  }
  // Drops every task that has not started yet; the running one finishes.
  void cancel_pending() {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.clear();
  }
  std::shared_future<void> submit(std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::shared_future<void> fut = task.get_future().share();
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_ || queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace trainrun
