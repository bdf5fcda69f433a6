// A pipeline link's sender thread (sender.h).
#include "parallel/pipeline/sender.h"

#include <exception>
#include <utility>

#include "core/common/error.h"
#include "parallel/pipeline/links.h"

namespace trainrun {

PipelineSender::PipelineSender(int global_rank, int tid)
    : rank_(global_rank), tid_(tid), th_([this] { loop(); }) {}

PipelineSender::~PipelineSender() {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    dropped.swap(q_);
  }
  cv_.notify_all();
  for (Job& j : dropped)
    j.done->set_exception(std::make_exception_ptr(Error(detail::cat(
        "pipeline: ", j.label, " to pp rank ", j.to, " was dropped unsent: the step is unwinding after an error"))));
  th_.join();
}

std::shared_future<void> PipelineSender::post(Communicator* link, int from, int to, const void* buf, size_t bytes,
                                              uint32_t tag, std::string label) {
  auto done = std::make_shared<std::promise<void>>();
  std::shared_future<void> f = done->get_future().share();
  {
    std::lock_guard<std::mutex> lk(mu_);
    q_.push_back({link, from, to, buf, bytes, tag, done, std::move(label)});
  }
  cv_.notify_all();
  return f;
}

void PipelineSender::loop() {
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (stop_ || q_.empty()) return;  // stopping: whatever is queued is the destructor's to drop
      j = q_.front();
      q_.pop_front();
    }
    try {
      StepTracer::Span span(tracer, j.label, "p2p", tid_);
      record_pipeline_link_use(rank_, j.from, j.to, true);
      j.link->send(j.buf, j.bytes, 1, j.tag);
      j.done->set_value();
    } catch (...) {
      j.done->set_exception(std::current_exception());
    }
  }
}

}  // namespace trainrun
