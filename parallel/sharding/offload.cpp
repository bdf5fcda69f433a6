// parallel.offload: host-resident optimizer state; see offload.h.
#include "parallel/sharding/offload.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/common/error.h"
#include "core/common/log.h"
#include "kernels/cpu/host_adamw.h"

namespace trainrun {

namespace {
std::string gb(double bytes) {
  std::ostringstream o;
  o.precision(bytes >= 100e9 ? 4 : 3);
  if (bytes >= 1e12) o << bytes / 1e12 << " TB";
  else o << bytes / 1e9 << " GB";
  return o.str();
}
// Elements per host->device staging chunk on non-fp32 backends (64 MB).
constexpr int64_t kStagingElements = int64_t(16) << 20;
}  // namespace

OffloadMode parse_offload_mode(const std::string& text) {
  if (text == "none" || text.empty()) return OffloadMode::None;
  if (text == "cpu") return OffloadMode::Cpu;
  if (text == "nvme") return OffloadMode::Nvme;
  TR_FAIL("parallel.offload: '", text, "' is not one of none, cpu, nvme");
}

const char* offload_mode_name(OffloadMode m) {
  return m == OffloadMode::Cpu ? "cpu" : m == OffloadMode::Nvme ? "nvme" : "none";
}

void check_offload_host_memory(size_t needed, size_t available, int ranks_on_node) {
  if (available == 0 || needed <= available) return;
  TR_FAIL("parallel.offload: cpu needs ", gb(double(needed)), " of host memory on this node (", ranks_on_node,
          " rank(s) x ", gb(double(needed) / std::max(1, ranks_on_node)), " of master weights, moments and gradient), "
          "it has ", gb(double(available)), " available: use parallel.offload: nvme or more nodes");
}

size_t host_memory_available() {
  size_t avail = 0;
  std::ifstream mi("/proc/meminfo");
  std::string key;
  size_t kb = 0;
  std::string unit;
  while (mi >> key >> kb) {
    std::getline(mi, unit);
    if (key == "MemAvailable:") {
      avail = kb * 1024;
      break;
    }
  }
  // A container's limit (cgroup v2) can be far below the machine's memory.
  std::ifstream cg("/sys/fs/cgroup/memory.max");
  std::string lim;
  if (cg >> lim && lim != "max") {
    const size_t l = std::strtoull(lim.c_str(), nullptr, 10);
    if (l > 0 && (avail == 0 || l < avail)) avail = l;
  }
  return avail;
}

std::string memlock_warning(size_t bytes, uint64_t memlock_limit) {
  if (memlock_limit == uint64_t(RLIM_INFINITY) || bytes <= memlock_limit) return "";
  std::ostringstream o;
  o << "parallel.offload: pinning " << gb(double(bytes)) << " of host memory exceeds RLIMIT_MEMLOCK ("
    << gb(double(memlock_limit)) << "); raise it (`ulimit -l unlimited`, Docker --ulimit memlock=-1, or "
    << "LimitMEMLOCK=infinity for a systemd unit); using unpinned host memory (slower device copies)";
  return o.str();
}

void check_offload_dir(const std::string& dir) {
  TR_CHECK(!dir.empty(), "parallel.offload_dir is required with parallel.offload: nvme");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TR_CHECK(!ec, "parallel.offload_dir '", dir, "': cannot create it (", ec.message(),
           "); name a writable directory on a local disk");
  const std::string probe = dir + "/.trainrun_offload_probe." + std::to_string(getpid());
  const int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  TR_CHECK(fd >= 0, "parallel.offload_dir '", dir, "' is not writable (", std::strerror(errno),
           "); fix its permissions or name another directory");
  ::close(fd);
  ::unlink(probe.c_str());
}

void pread_full(int fd, const std::string& path, void* buf, size_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(buf);
  while (bytes > 0) {
    const ssize_t got = ::pread(fd, p, bytes, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    TR_CHECK(got >= 0, "parallel.offload: reading ", bytes, " bytes at offset ", offset, " of ", path, " failed: ",
             std::strerror(errno));
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
    if (put < 0 && errno == ENOSPC)
      TR_FAIL("parallel.offload: the disk of ", path, " is full (writing ", bytes, " bytes at offset ", offset,
              "); free space there or point parallel.offload_dir at a larger disk");
    TR_CHECK(put > 0, "parallel.offload: writing ", bytes, " bytes at offset ", offset, " of ", path, " failed: ",
             put < 0 ? std::strerror(errno) : "no progress");
    p += put;
    bytes -= size_t(put);
    offset += uint64_t(put);
  }
}

namespace {

// A few threads that run pread/pwrite jobs in order of submission.
class IoPool {
 public:
  explicit IoPool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~IoPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  std::future<void> submit(std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::future<void> f = task.get_future();
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(task));
    }
    cv_.notify_one();
    return f;
  }

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
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

struct AlignedBlock {
  float* p = nullptr;
  explicit AlignedBlock(size_t bytes) {
    void* q = nullptr;
    TR_CHECK(posix_memalign(&q, 4096, bytes) == 0 && q, "parallel.offload: cannot allocate ", bytes,
             " bytes of I/O buffers");
    p = static_cast<float*>(q);
    std::memset(p, 0, bytes);
  }
  ~AlignedBlock() { std::free(p); }
  AlignedBlock(const AlignedBlock&) = delete;
  AlignedBlock& operator=(const AlignedBlock&) = delete;
};

std::atomic<int> g_file_counter{0};

}  // namespace

struct HostOptimizerState::Nvme {
  std::string path;
  int direct_fd = -1;    // the streaming I/O (O_DIRECT where possible)
  int buffered_fd = -1;  // checkpoint reads/writes at any offset
  bool o_direct = false;
  IoPool pool{2};
  // Two buffer sets, each master | m | v of kChunk elements.
  std::unique_ptr<AlignedBlock> set[2];
  ~Nvme() {
    if (direct_fd >= 0 && direct_fd != buffered_fd) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
  }
};

HostOptimizerState::HostOptimizerState(Backend* be, int64_t n, const OffloadOptions& opts)
    : be_(be), n_(n), threads_(opts.threads > 0 ? opts.threads : omp_get_max_threads()) {
  nvme_ = opts.mode == OffloadMode::Nvme;
  // cpu: master | m | v | grad; nvme: the gradient only (the rest is on disk).
  alloc_bytes_ = std::max<size_t>(64, size_t(n) * (nvme_ ? 4 : 16));
  void* p = nullptr;
  if (posix_memalign(&p, 64, alloc_bytes_) != 0 || !p)
    TR_FAIL("parallel.offload: cannot allocate ", gb(double(alloc_bytes_)), " of host memory for the optimizer state (",
            n, " elements); use parallel.offload: nvme, more ranks or more nodes");
  base_ = static_cast<float*>(p);
  std::memset(base_, 0, alloc_bytes_);  // also the first touch: no page faults inside a step
  if (nvme_) {
    bufs_[3] = base_;
  } else {
    for (int k = 0; k < 4; ++k) bufs_[k] = base_ + size_t(k) * size_t(n);
  }
  if (nvme_) {
    check_offload_dir(opts.dir);
    io_ = std::make_unique<Nvme>();
    region_bytes_ = (size_t(n) * 4 + 4095) / 4096 * 4096;
    io_->path = opts.dir + "/trainrun-offload-" + std::to_string(getpid()) + "-" + std::to_string(g_file_counter++) +
                ".state";
    io_->buffered_fd = ::open(io_->path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    TR_CHECK(io_->buffered_fd >= 0, "parallel.offload_dir: cannot create ", io_->path, ": ", std::strerror(errno));
    io_->direct_fd = ::open(io_->path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
    if (io_->direct_fd >= 0) {
      io_->o_direct = true;
    } else {
      io_->direct_fd = io_->buffered_fd;
      TR_LOG_INFO("parallel.offload: ", opts.dir, " does not take O_DIRECT (", std::strerror(errno),
                  "); streaming through the page cache instead");
    }
    // Gone from the directory at once: the space is returned when the
    // process ends, however it ends.
    ::unlink(io_->path.c_str());
    const int rc = posix_fallocate(io_->buffered_fd, 0, off_t(3 * region_bytes_));
    if (rc == ENOSPC)
      TR_FAIL("parallel.offload: the disk of ", opts.dir, " is full: the optimizer state needs ",
              gb(double(3 * region_bytes_)), " there; free space or point parallel.offload_dir at a larger disk");
    if (rc != 0) TR_CHECK(::ftruncate(io_->buffered_fd, off_t(3 * region_bytes_)) == 0, "parallel.offload: cannot size ",
                          io_->path, ": ", std::strerror(errno));
    for (auto& b : io_->set) b = std::make_unique<AlignedBlock>(size_t(3 * kChunk) * 4);
    static std::once_flag logged;
    std::call_once(logged, [&] {
      TR_LOG_INFO("parallel.offload: nvme state under ", opts.dir, " (", io_->o_direct ? "O_DIRECT" : "buffered",
                  "), pread/pwrite on 2 I/O threads per rank (io_uring not used: liburing is not built in)");
    });
  }
  if (be->wants_pinned_host()) {
    struct rlimit rl {};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    const std::string warn = memlock_warning(alloc_bytes_, uint64_t(rl.rlim_cur));
    if (!warn.empty()) TR_LOG_WARN(warn);
    else if (!(pinned_ = be->pin_host(base_, alloc_bytes_)))
      TR_LOG_WARN("parallel.offload: the ", be->name(), " backend could not pin ", gb(double(alloc_bytes_)),
                  " of host memory; using unpinned memory (slower device copies)");
  }
}

HostOptimizerState::~HostOptimizerState() {
  io_.reset();  // joins the I/O threads before the buffers go
  if (pinned_) be_->unpin_host(base_);
  std::free(base_);
}

size_t HostOptimizerState::host_bytes() const {
  return alloc_bytes_ + (nvme_ ? size_t(2 * 3 * kChunk) * 4 : 0);
}

void HostOptimizerState::read_state(int kind, int64_t off, float* out, int64_t n) {
  TR_CHECK(kind >= 0 && kind < 3 && off >= 0 && off + n <= n_, "offload: state range out of bounds");
  if (!nvme_) return void(std::copy(bufs_[kind] + off, bufs_[kind] + off + n, out));
  pread_full(io_->buffered_fd, io_->path, out, size_t(n) * 4, uint64_t(kind) * region_bytes_ + uint64_t(off) * 4);
}

void HostOptimizerState::write_state(int kind, int64_t off, const float* in, int64_t n) {
  TR_CHECK(kind >= 0 && kind < 3 && off >= 0 && off + n <= n_, "offload: state range out of bounds");
  if (!nvme_) return void(std::copy(in, in + n, bufs_[kind] + off));
  pwrite_full(io_->buffered_fd, io_->path, in, size_t(n) * 4, uint64_t(kind) * region_bytes_ + uint64_t(off) * 4);
}

void HostOptimizerState::zero_grads() { std::memset(bufs_[3], 0, size_t(n_) * 4); }

void HostOptimizerState::add_grad_from_device(int64_t off, const float* dev_src, int64_t n) {
  TR_CHECK(off >= 0 && off + n <= n_, "offload: gradient range [", off, ", +", n, ") outside the shard of ", n_);
  if (int64_t(staging_host_.size()) < n) staging_host_.resize(size_t(n));
  be_->copy_to_host(staging_host_.data(), dev_src, size_t(n) * 4);
  host_accumulate(bufs_[3] + off, staging_host_.data(), n, threads_);
}

void HostOptimizerState::grad_from_device(const float* dev_src, int64_t n) {
  TR_CHECK(n <= n_, "offload: ", n, " gradient values for a shard of ", n_);
  be_->copy_to_host(bufs_[3], dev_src, size_t(n) * 4);
}

float HostOptimizerState::grad_sum_squares() const {
  // The loop of the CPU backend's sum_squares, thread count included.
  const float* x = bufs_[3];
  const int64_t n = n_;
  std::vector<double> partial(threads_, 0.0);
#pragma omp parallel num_threads(threads_)
  {
    const int tid = omp_get_thread_num();
    double acc = 0.0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
    partial[tid] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return static_cast<float>(total);
}

void HostOptimizerState::step(const std::vector<OffloadSegment>& segments_in, float lr, float beta1, float beta2,
                              float eps, int step, float grad_scale, void* dev_act) {
  HostAdamWArgs a;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.step = step;
  a.grad_scale = grad_scale;
  if (!nvme_) {
    for (const OffloadSegment& s : segments_in) {
      TR_CHECK(s.off >= 0 && s.off + s.n <= n_, "offload: segment outside the shard");
      a.weight_decay = s.weight_decay;
      host_adamw_update(bufs_[0] + s.off, bufs_[3] + s.off, bufs_[1] + s.off, bufs_[2] + s.off, s.n, a, threads_);
    }
    return to_device(dev_act, 0, bufs_[0], n_);
  }
  // nvme: chunk c of the shard is [c*K, min(n, (c+1)*K)); its three kinds
  // sit at kind*region + c*K*4 in the file, always 4 KiB aligned, and reads
  // and writes are whole multiples of 4 KiB (the file is padded to them).
  std::vector<OffloadSegment> segments = segments_in;  // the chunk walk below needs them in order
  std::sort(segments.begin(), segments.end(),
            [](const OffloadSegment& x, const OffloadSegment& y) { return x.off < y.off; });
  const int64_t K = kChunk;
  const int64_t chunks = (n_ + K - 1) / K;
  Nvme& io = *io_;
  auto io_bytes = [&](int64_t c) {
    const int64_t len = std::min(K, n_ - c * K);
    return (size_t(len) * 4 + 4095) / 4096 * 4096;
  };
  auto read_chunk = [&](int64_t c, float* buf) {
    return io.pool.submit([&io, this, c, buf, bytes = io_bytes(c)] {
      for (int k = 0; k < 3; ++k)
        pread_full(io.direct_fd, io.path, buf + k * kChunk, bytes, uint64_t(k) * region_bytes_ + uint64_t(c) * kChunk * 4);
    });
  };
  auto write_chunk = [&](int64_t c, const float* buf) {
    return io.pool.submit([&io, this, c, buf, bytes = io_bytes(c)] {
      for (int k = 0; k < 3; ++k)
        pwrite_full(io.direct_fd, io.path, buf + k * kChunk, bytes, uint64_t(k) * region_bytes_ + uint64_t(c) * kChunk * 4);
    });
  };
  std::future<void> reads[2], writes[2];
  if (chunks > 0) reads[0] = read_chunk(0, io.set[0]->p);
  size_t seg = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int b = int(c % 2);
    float* buf = io.set[b]->p;
    reads[b].get();
    // Prefetch the next chunk into the other set once its write is done.
    if (c + 1 < chunks) {
      if (writes[1 - b].valid()) writes[1 - b].get();
      reads[1 - b] = read_chunk(c + 1, io.set[1 - b]->p);
    }
    const int64_t lo = c * K, hi = std::min(n_, lo + K);
    while (seg < segments.size() && segments[seg].off + segments[seg].n <= lo) ++seg;
    for (size_t j = seg; j < segments.size() && segments[j].off < hi; ++j) {
      const int64_t x = std::max(lo, segments[j].off), y = std::min(hi, segments[j].off + segments[j].n);
      if (x >= y) continue;
      a.weight_decay = segments[j].weight_decay;
      host_adamw_update(buf + (x - lo), bufs_[3] + x, buf + kChunk + (x - lo), buf + 2 * kChunk + (x - lo), y - x, a,
                        threads_);
    }
    writes[b] = write_chunk(c, buf);
    to_device(dev_act, lo, buf, hi - lo);
  }
  for (auto& w : writes)
    if (w.valid()) w.get();
}

void HostOptimizerState::master_to_device(void* dev_act) {
  if (!nvme_) return to_device(dev_act, 0, bufs_[0], n_);
  float* buf = io_->set[0]->p;
  for (int64_t lo = 0; lo < n_; lo += kChunk) {
    const int64_t len = std::min(kChunk, n_ - lo);
    read_state(0, lo, buf, len);
    to_device(dev_act, lo, buf, len);
  }
}

void HostOptimizerState::to_device(void* dev_act, int64_t off, const float* host, int64_t n) {
  if (n == 0) return;
  const size_t es = dtype_size(be_->act_dtype());
  char* dst = static_cast<char*>(dev_act) + size_t(off) * es;
  if (be_->act_dtype() == DType::F32) return be_->copy_to_device(dst, host, size_t(n) * 4);
  if (!staging_dev_.get()) staging_dev_ = DeviceBuffer(be_, size_t(std::min(n_, kStagingElements)) * 4);
  const int64_t chunk = int64_t(staging_dev_.bytes() / 4);
  // Stream order keeps the staging buffer safe: each copy is enqueued after
  // the cast that read the previous chunk.
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t c = std::min(chunk, n - i);
    be_->copy_to_device(staging_dev_.get(), host + i, size_t(c) * 4);
    be_->cast_from_f32(dst + size_t(i) * es, staging_dev_.as<float>(), c);
  }
}

}  // namespace trainrun
