// parallel.offload: nvme's I/O engines; see offload_io.h.
#include "parallel/sharding/offload_io.h"

#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#ifdef TRAINRUN_HAVE_LIBURING
#include <liburing.h>
#endif

#include "core/common/error.h"

namespace trainrun {

namespace {

[[noreturn]] void fail_io(bool write, int err, const std::string& path, size_t bytes, uint64_t offset) {
  if (write && err == ENOSPC)
    TR_FAIL("parallel.offload: the disk of ", path, " is full (writing ", bytes, " bytes at offset ", offset,
            "); free space there or point parallel.offload_dir at a larger disk");
  TR_FAIL("parallel.offload: ", write ? "writing " : "reading ", bytes, " bytes at offset ", offset, " of ", path,
          " failed: ", err ? std::strerror(err) : "no progress");
}

}  // namespace

void pread_full(int fd, const std::string& path, void* buf, size_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(buf);
  while (bytes > 0) {
    const ssize_t got = ::pread(fd, p, bytes, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_io(false, errno, path, bytes, offset);
    TR_CHECK(got > 0, "parallel.offload: short read of ", path, " at offset ", offset, " (", bytes,
             " bytes missing): the state file was truncated or replaced; the run cannot continue, resume from the last "
             "checkpoint");
    p += got;
    bytes -= size_t(got);
    offset += uint64_t(got);
  }
}

void pwrite_full(int fd, const std::string& path, const void* buf, size_t bytes, uint64_t offset) {
  const char* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    const ssize_t put = ::pwrite(fd, p, bytes, off_t(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) fail_io(true, put < 0 ? errno : 0, path, bytes, offset);
    p += put;
    bytes -= size_t(put);
    offset += uint64_t(put);
  }
}

IoChoice parse_io_choice(const std::string& text) {
  if (text.empty() || text == "auto") return IoChoice::Auto;
  if (text == "uring" || text == "io_uring") return IoChoice::Uring;
  if (text == "pool") return IoChoice::Pool;
  TR_FAIL("TRAINRUN_OFFLOAD_IO: '", text, "' is not one of auto, uring, pool");
}

IoChoice io_choice_from_env() {
  const char* v = std::getenv("TRAINRUN_OFFLOAD_IO");
  return parse_io_choice(v ? v : "");
}

namespace {

// pread/pwrite jobs on a few threads, in order of submission; one batch is
// one job (its ops run in order on one thread).
class PoolEngine final : public IoEngine {
 public:
  PoolEngine(int fd, std::string path, int threads) : fd_(fd), path_(std::move(path)) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~PoolEngine() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();  // queued jobs finish first: their buffers are still alive
  }
  uint64_t submit(const std::vector<IoOp>& ops) override {
    std::packaged_task<void()> task([this, ops] {
      for (const IoOp& op : ops) {
        if (op.write) pwrite_full(fd_, path_, op.buf, op.bytes, op.offset);
        else pread_full(fd_, path_, op.buf, op.bytes, op.offset);
      }
    });
    const uint64_t t = next_++;
    futures_.emplace(t, task.get_future());
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(task));
    }
    cv_.notify_one();
    return t;
  }
  void wait(uint64_t ticket) override {
    auto it = futures_.find(ticket);
    TR_CHECK(it != futures_.end(), "offload I/O: unknown ticket ", ticket, " (a bug)");
    std::future<void> f = std::move(it->second);
    futures_.erase(it);
    f.get();  // rethrows the job's Error
  }
  const char* name() const override { return "pool"; }

 private:
  void loop() {
    for (;;) {
      std::packaged_task<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();  // exceptions land in the future
    }
  }
  int fd_;
  std::string path_;
  uint64_t next_ = 1;
  std::map<uint64_t, std::future<void>> futures_;  // the submitting thread's only
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

#ifdef TRAINRUN_HAVE_LIBURING
// One ring; ops beyond its depth wait in queued_ and go in as completions
// free slots. A short transfer (a signal, the end of the file) is finished
// with pread_full / pwrite_full, which also words the errors. Used from one
// thread at a time (the store's main thread).
class UringEngine final : public IoEngine {
 public:
  static constexpr unsigned kDepth = 32;
  UringEngine(int fd, std::string path) : fd_(fd), path_(std::move(path)) {
    // The kernel's refusal, simulated (core/common/debug_hooks.h).
    if (const char* v = std::getenv("TRAINRUN_DEBUG_OFFLOAD_NO_URING"); v && std::string(v) == "1")
      throw Error("io_uring_queue_init: Operation not permitted (TRAINRUN_DEBUG_OFFLOAD_NO_URING)");
    const int rc = io_uring_queue_init(kDepth, &ring_, 0);
    if (rc < 0) throw Error(std::string("io_uring_queue_init: ") + std::strerror(-rc));
  }
  ~UringEngine() override {
    queued_.clear();
    // In-flight ops write into buffers freed after us: reap them all first.
    while (in_flight_ > 0) reap_one();
    io_uring_queue_exit(&ring_);
  }
  uint64_t submit(const std::vector<IoOp>& ops) override {
    const uint64_t t = next_++;
    batches_[t].left = int(ops.size());
    for (const IoOp& op : ops) queued_.push_back({t, op});
    flush();
    return t;
  }
  void wait(uint64_t ticket) override {
    auto it = batches_.find(ticket);
    TR_CHECK(it != batches_.end(), "offload I/O: unknown ticket ", ticket, " (a bug)");
    while (batches_[ticket].left > 0) reap_one();
    const std::string err = batches_[ticket].error;
    batches_.erase(ticket);
    if (!err.empty()) throw Error(err);
  }
  const char* name() const override { return "io_uring"; }

 private:
  struct Req {
    uint64_t ticket;
    IoOp op;
  };
  struct Batch {
    int left = 0;
    std::string error;
  };
  void flush() {
    bool any = false;
    while (!queued_.empty() && in_flight_ < int(kDepth)) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;
      Req* r = new Req(queued_.front());
      queued_.pop_front();
      if (r->op.write) io_uring_prep_write(sqe, fd_, r->op.buf, unsigned(r->op.bytes), r->op.offset);
      else io_uring_prep_read(sqe, fd_, r->op.buf, unsigned(r->op.bytes), r->op.offset);
      io_uring_sqe_set_data(sqe, r);
      ++in_flight_;
      any = true;
    }
    if (!any) return;
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR);
    TR_CHECK(rc >= 0, "parallel.offload: io_uring_submit on ", path_, " failed: ", std::strerror(-rc),
             "; TRAINRUN_OFFLOAD_IO=pool uses pread/pwrite threads instead");
  }
  void reap_one() {
    io_uring_cqe* cqe = nullptr;
    int rc;
    do rc = io_uring_wait_cqe(&ring_, &cqe);
    while (rc == -EINTR);
    TR_CHECK(rc == 0 && cqe, "parallel.offload: io_uring_wait_cqe on ", path_, " failed: ", std::strerror(-rc));
    Req* r = static_cast<Req*>(io_uring_cqe_get_data(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    --in_flight_;
    Batch& b = batches_[r->ticket];
    try {
      if (res < 0) fail_io(r->op.write, -res, path_, r->op.bytes, r->op.offset);
      if (size_t(res) < r->op.bytes) {
        char* p = static_cast<char*>(r->op.buf) + res;
        const size_t rest = r->op.bytes - size_t(res);
        if (r->op.write) pwrite_full(fd_, path_, p, rest, r->op.offset + uint64_t(res));
        else pread_full(fd_, path_, p, rest, r->op.offset + uint64_t(res));
      }
    } catch (const Error& e) {
      if (b.error.empty()) b.error = e.what();
    }
    --b.left;
    delete r;
    flush();
  }
  io_uring ring_{};
  int fd_;
  std::string path_;
  uint64_t next_ = 1;
  int in_flight_ = 0;
  std::deque<Req> queued_;
  std::map<uint64_t, Batch> batches_;
};
#endif

}  // namespace

bool io_uring_built_in() {
#ifdef TRAINRUN_HAVE_LIBURING
  return true;
#else
  return false;
#endif
}

std::unique_ptr<IoEngine> make_io_engine(int fd, const std::string& path, IoChoice choice,
                                         std::string* fallback_reason) {
  if (fallback_reason) fallback_reason->clear();
  if (choice == IoChoice::Pool) return std::make_unique<PoolEngine>(fd, path, 2);
#ifdef TRAINRUN_HAVE_LIBURING
  try {
    return std::make_unique<UringEngine>(fd, path);
  } catch (const Error& e) {
    TR_CHECK(choice != IoChoice::Uring, "TRAINRUN_OFFLOAD_IO=uring: the kernel refused an io_uring ring (", e.what(),
             "); allow io_uring (sysctl kernel.io_uring_disabled=0, the container's seccomp profile) or unset it");
    if (fallback_reason) *fallback_reason = std::string("the kernel refused a ring: ") + e.what();
  }
#else
  TR_CHECK(choice != IoChoice::Uring, "TRAINRUN_OFFLOAD_IO=uring: this trainrun was built without liburing "
           "(apt-get install liburing-dev, then rebuild)");
  if (fallback_reason) *fallback_reason = "liburing is not built in";
#endif
  return std::make_unique<PoolEngine>(fd, path, 2);
}

}  // namespace trainrun
