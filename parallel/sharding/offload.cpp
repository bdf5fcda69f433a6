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

#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
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

namespace {

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
std::atomic<uint64_t> g_nvme_bytes_written{0};
void count_written(size_t bytes) { g_nvme_bytes_written.fetch_add(bytes, std::memory_order_relaxed); }
constexpr int64_t kPage = 1024;  // fp32 elements per 4 KiB page

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// OpenMP's schedule(static) split of n iterations over T threads (libgomp:
// the first n % T threads get one more): thread t's [begin, end).
std::pair<int64_t, int64_t> static_block(int64_t n, int T, int t) {
  const int64_t q = n / T, r = n % T;
  const int64_t b = q * t + std::min<int64_t>(t, r);
  return {b, b + q + (t < r ? 1 : 0)};
}

// The CPU backend's sum_squares over x[0, n) (reduce_into): same split, same
// per-thread double accumulation, same thread-order total.
float sum_squares_like_backend(const float* x, int64_t n, int threads) {
  std::vector<double> partial(threads, 0.0);
#pragma omp parallel num_threads(threads)
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

}  // namespace

// The nvme file and its buffers. The engine is the last member, so it is
// destroyed first: its in-flight I/O ends before the buffers go.
struct HostOptimizerState::Nvme {
  std::string path;
  int direct_fd = -1;    // the streaming I/O (O_DIRECT where possible)
  int buffered_fd = -1;  // checkpoint reads/writes at any offset
  bool o_direct = false;
  // Inside base_ (one pinned block): two step sets of master | m | v | grad
  // (chunk each), the gradient's device landing chunk and its
  // read-modify-write window (chunk + 2 pages: a range's first and last
  // pages may be partial).
  float* set[2] = {};
  float* grad_landing = nullptr;
  float* grad_window = nullptr;
  std::vector<char> written;  // per grad page: written since zero_grads()
  std::unique_ptr<IoEngine> engine;
  ~Nvme() {
    engine.reset();
    if (direct_fd >= 0 && direct_fd != buffered_fd) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
  }
};

HostOptimizerState::HostOptimizerState(Backend* be, int64_t n, const OffloadOptions& opts)
    : be_(be), n_(n), threads_(opts.threads > 0 ? opts.threads : omp_get_max_threads()) {
  nvme_ = opts.mode == OffloadMode::Nvme;
  if (nvme_) {
    TR_CHECK(opts.chunk_elements > 0 && opts.chunk_elements % kPage == 0, "parallel.offload: the nvme chunk (",
             opts.chunk_elements, " elements) must be a positive multiple of 1024");
    // A shard smaller than a chunk needs no more buffer than itself.
    chunk_ = std::min(opts.chunk_elements, round_up(std::max<int64_t>(n, 1), kPage));
  }
  // cpu: master | m | v | grad; nvme: the I/O buffers only (the state is on disk).
  alloc_bytes_ = nvme_ ? offload_nvme_host_bytes(chunk_) : std::max<size_t>(64, size_t(n) * 16);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, alloc_bytes_) != 0 || !p)
    TR_FAIL("parallel.offload: cannot allocate ", gb(double(alloc_bytes_)), " of host memory for the optimizer state (",
            n, " elements); use parallel.offload: nvme, more ranks or more nodes");
  base_ = static_cast<float*>(p);
  std::memset(base_, 0, alloc_bytes_);  // also the first touch: no page faults inside a step
  if (!nvme_) {
    for (int k = 0; k < 4; ++k) bufs_[k] = base_ + size_t(k) * size_t(n);
  } else {
    check_offload_dir(opts.dir);
    io_ = std::make_unique<Nvme>();
    io_->set[0] = base_;
    io_->set[1] = base_ + 4 * chunk_;
    io_->grad_landing = base_ + 8 * chunk_;
    io_->grad_window = base_ + 9 * chunk_;
    region_bytes_ = size_t(round_up(std::max<int64_t>(n, 1), kPage)) * 4;
    io_->written.assign(region_bytes_ / 4096, 0);
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
    const size_t file_bytes = 4 * region_bytes_;
    // fallocate(2), sparse where the filesystem cannot (reserve_file_size):
    // not posix_fallocate, which there emulates by writing every 4 KiB block
    // of a file of 100+ GB a rank, one syscall each.
    try {
      reserve_file_size(io_->buffered_fd, off_t(file_bytes), io_->path);
    } catch (const Error& e) {
      TR_FAIL("parallel.offload: the optimizer state needs ", gb(double(file_bytes)), " under ", opts.dir, ": ",
              e.what(), "; free space or point parallel.offload_dir at a larger disk");
    }
    const IoChoice choice = opts.io == IoChoice::Auto ? io_choice_from_env() : opts.io;
    std::string fallback;
    io_->engine = make_io_engine(io_->direct_fd, io_->path, choice, &fallback);
    static std::once_flag logged;
    std::call_once(logged, [&] {
      TR_LOG_INFO("parallel.offload: nvme state under ", opts.dir, " (", io_->o_direct ? "O_DIRECT" : "buffered",
                  ", ", io_->engine->name(), "; ", gb(double(alloc_bytes_)), " of I/O buffers per rank)");
      if (!fallback.empty())
        TR_LOG_WARN("parallel.offload: io_uring is not used (", fallback,
                    "); nvme I/O runs on a pread/pwrite thread pool instead");
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
  io_.reset();  // ends the I/O before the buffers go
  if (pinned_) be_->unpin_host(base_);
  std::free(base_);
}

size_t HostOptimizerState::host_bytes() const { return alloc_bytes_; }

const char* HostOptimizerState::io_engine() const { return io_ ? io_->engine->name() : ""; }

uint64_t HostOptimizerState::nvme_bytes_written() { return g_nvme_bytes_written.load(); }

void HostOptimizerState::read_state(int kind, int64_t off, float* out, int64_t n) {
  TR_CHECK(kind >= 0 && kind < 3 && off >= 0 && off + n <= n_, "offload: state range out of bounds");
  if (!nvme_) return void(std::copy(bufs_[kind] + off, bufs_[kind] + off + n, out));
  pread_full(io_->buffered_fd, io_->path, out, size_t(n) * 4, uint64_t(kind) * region_bytes_ + uint64_t(off) * 4);
}

void HostOptimizerState::write_state(int kind, int64_t off, const float* in, int64_t n) {
  TR_CHECK(kind >= 0 && kind < 3 && off >= 0 && off + n <= n_, "offload: state range out of bounds");
  if (!nvme_) return void(std::copy(in, in + n, bufs_[kind] + off));
  pwrite_full(io_->buffered_fd, io_->path, in, size_t(n) * 4, uint64_t(kind) * region_bytes_ + uint64_t(off) * 4);
  count_written(size_t(n) * 4);
}

void HostOptimizerState::zero_grads() {
  // nvme: no write; pages not written since then read as zero.
  if (nvme_) return void(std::fill(io_->written.begin(), io_->written.end(), 0));
  std::memset(bufs_[3], 0, size_t(n_) * 4);
}

void HostOptimizerState::zero_unwritten_grad_pages(float* buf, int64_t p0, int64_t p1) const {
  for (int64_t p = p0; p < p1; ++p)
    if (!io_->written[size_t(p)]) std::memset(buf + (p - p0) * kPage, 0, 4096);
}

void HostOptimizerState::add_grad_from_device(int64_t off, const float* dev_src, int64_t n,
                                              const std::shared_ptr<void>& ready) {
  TR_CHECK(off >= 0 && off + n <= n_, "offload: gradient range [", off, ", +", n, ") outside the shard of ", n_);
  if (!nvme_) {
    // Added as each chunk lands (the backend's chunks are whole floats).
    float* dst = bufs_[3] + off;
    be_->copy_to_host_chunks(dev_src, size_t(n) * 4, ready, [&](const void* chunk, size_t at, size_t bytes) {
      host_accumulate(dst + at / 4, static_cast<const float*>(chunk), int64_t(bytes / 4), threads_);
    });
    return;
  }
  // A chunk at a time through the landing buffer; whole pages of the grad
  // region read (only those written since zero_grads), added to, written.
  // On the comm thread, synchronously: it overlaps the backward of earlier
  // units, which is what the device does meanwhile.
  Nvme& io = *io_;
  const uint64_t grad_base = 3 * uint64_t(region_bytes_);
  for (int64_t i = 0; i < n; i += chunk_) {
    const int64_t len = std::min(chunk_, n - i), x = off + i;
    const int64_t p0 = x / kPage, p1 = (x + len + kPage - 1) / kPage;
    float* win = io.grad_window;
    for (int64_t p = p0; p < p1;) {
      int64_t q = p;
      const char w = io.written[size_t(p)];
      while (q < p1 && io.written[size_t(q)] == w) ++q;
      float* dst = win + (p - p0) * kPage;
      if (w) pread_full(io.direct_fd, io.path, dst, size_t(q - p) * 4096, grad_base + uint64_t(p) * 4096);
      else std::memset(dst, 0, size_t(q - p) * 4096);
      p = q;
    }
    be_->copy_to_host_chunks(dev_src + i, size_t(len) * 4, ready, [&](const void* chunk, size_t at, size_t bytes) {
      std::memcpy(reinterpret_cast<char*>(io.grad_landing) + at, chunk, bytes);
    });
    host_accumulate(win + (x - p0 * kPage), io.grad_landing, len, threads_);
    pwrite_full(io.direct_fd, io.path, win, size_t(p1 - p0) * 4096, grad_base + uint64_t(p0) * 4096);
    count_written(size_t(p1 - p0) * 4096);
    std::fill(io.written.begin() + p0, io.written.begin() + p1, 1);
  }
}

void HostOptimizerState::grad_from_device(const float* dev_src, int64_t n) {
  TR_CHECK(n <= n_, "offload: ", n, " gradient values for a shard of ", n_);
  if (!nvme_) return be_->copy_to_host(bufs_[3], dev_src, size_t(n) * 4);
  zero_grads();
  // The whole shard once per step (a replicated or device-summed gradient):
  // through the two step sets, 4 chunks each, one batch of 4 writes in
  // flight while the next 4 chunks come off the device (one 4 MiB pwrite
  // at a time left the disk idle between requests).
  Nvme& io = *io_;
  const int64_t K = 4 * chunk_;
  uint64_t ticket[2] = {0, 0};
  int b = 0;
  for (int64_t lo = 0; lo < n; lo += K, b ^= 1) {
    if (ticket[b]) io.engine->wait(ticket[b]), ticket[b] = 0;
    float* buf = io.set[b];
    const int64_t len = std::min(K, n - lo), pages = (len + kPage - 1) / kPage;
    std::memset(buf + len, 0, size_t(pages * kPage - len) * 4);  // the last page's tail
    be_->copy_to_host(buf, dev_src + lo, size_t(len) * 4);
    std::vector<IoOp> ops;
    for (int64_t at = 0; at < pages * kPage; at += chunk_)
      ops.push_back({true, buf + at, size_t(std::min(chunk_, pages * kPage - at)) * 4,
                     3 * uint64_t(region_bytes_) + uint64_t(lo + at) * 4});
    ticket[b] = io.engine->submit(ops);
    count_written(size_t(pages) * 4096);
    std::fill(io.written.begin() + lo / kPage, io.written.begin() + lo / kPage + pages, 1);
  }
  for (uint64_t& t : ticket)
    if (t) io.engine->wait(t), t = 0;
}

float HostOptimizerState::grad_sum_squares(const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  for (const auto& [s, c] : pieces)
    TR_CHECK(s >= 0 && c >= 0 && s + c <= n_, "offload: norm piece [", s, ", +", c, ") outside the shard of ", n_);
  float total = 0.0f;
  if (!nvme_) {
    for (const auto& [s, c] : pieces) total += sum_squares_like_backend(bufs_[3] + s, c, threads_);
    return total;
  }
  // Streamed a chunk at a time (double-buffered). Each thread's block of a
  // piece is summed in element order across chunks, so the partials, and
  // the float total, are those of sum_squares_like_backend on the piece.
  // A step set holds 4 chunks: the norm reads 4 chunks at a time, as 4
  // requests in flight (one 4 MiB request at a time leaves a disk idle
  // between requests).
  Nvme& io = *io_;
  const int64_t K = 4 * chunk_, chunks = (n_ + K - 1) / K;
  auto read = [&](int64_t c, float* buf) {
    std::vector<IoOp> ops;
    for (int64_t lo = c * K; lo < std::min(n_, (c + 1) * K); lo += chunk_)
      ops.push_back({false, buf + (lo - c * K), size_t(round_up(std::min(chunk_, n_ - lo), kPage)) * 4,
                     3 * uint64_t(region_bytes_) + uint64_t(lo) * 4});
    return io.engine->submit(ops);
  };
  const int T = threads_;
  std::vector<double> partial(size_t(T), 0.0);
  size_t piece = 0;
  uint64_t ticket[2] = {0, 0};
  float* buf[2] = {io.set[0], io.set[1]};
  if (chunks > 0) ticket[0] = read(0, buf[0]);
  for (int64_t c = 0; c < chunks && piece < pieces.size(); ++c) {
    const int b = int(c % 2);
    io.engine->wait(ticket[b]);
    ticket[b] = 0;
    if (c + 1 < chunks) ticket[1 - b] = read(c + 1, buf[1 - b]);
    const int64_t lo = c * K, hi = std::min(n_, lo + K);
    zero_unwritten_grad_pages(buf[b], lo / kPage, (hi + kPage - 1) / kPage);
    while (piece < pieces.size()) {
      const auto [ps, pc] = pieces[piece];
      const int64_t x = std::max(lo, ps), y = std::min(hi, ps + pc);
      if (x < y) {
        const float* data = buf[b] - lo;
#pragma omp parallel for num_threads(T) schedule(static, 1)
        for (int t = 0; t < T; ++t) {
          const auto [tb, te] = static_block(pc, T, t);
          const int64_t u = std::max(x, ps + tb), v = std::min(y, ps + te);
          double acc = partial[size_t(t)];
          for (int64_t i = u; i < v; ++i) acc += double(data[i]) * double(data[i]);
          partial[size_t(t)] = acc;
        }
      }
      if (ps + pc > hi) break;  // continues in the next chunk
      double sum = 0.0;
      for (double p : partial) sum += p;
      total += static_cast<float>(sum);
      std::fill(partial.begin(), partial.end(), 0.0);
      ++piece;
    }
  }
  // A prefetch the loop did not need (the pieces ended early) must land
  // before the buffer is reused.
  for (uint64_t& t : ticket)
    if (t) io.engine->wait(t), t = 0;
  return total;
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
  // nvme: chunk c of the shard is [c*K, min(n, (c+1)*K)); its kinds sit at
  // kind*region + c*K*4 in the file, always 4 KiB aligned, and reads and
  // writes are whole multiples of 4 KiB (the file is padded to them).
  std::vector<OffloadSegment> segments = segments_in;  // the chunk walk below needs them in order
  std::sort(segments.begin(), segments.end(),
            [](const OffloadSegment& x, const OffloadSegment& y) { return x.off < y.off; });
  const int64_t K = chunk_;
  const int64_t chunks = (n_ + K - 1) / K;
  Nvme& io = *io_;
  auto ops = [&](int64_t c, float* buf, bool write) {
    const size_t bytes = size_t(round_up(std::min(K, n_ - c * K), kPage)) * 4;
    std::vector<IoOp> v;
    for (int k = 0; k < (write ? 3 : 4); ++k)
      v.push_back({write, buf + k * K, bytes, uint64_t(k) * region_bytes_ + uint64_t(c * K) * 4});
    if (write) count_written(3 * bytes);
    return io.engine->submit(v);
  };
  uint64_t reads[2] = {0, 0}, writes[2] = {0, 0};
  if (chunks > 0) reads[0] = ops(0, io.set[0], false);
  size_t seg = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int b = int(c % 2);
    float* buf = io.set[b];
    io.engine->wait(reads[b]);
    // Prefetch the next chunk into the other set once its write is done.
    if (c + 1 < chunks) {
      if (writes[1 - b]) io.engine->wait(writes[1 - b]), writes[1 - b] = 0;
      reads[1 - b] = ops(c + 1, io.set[1 - b], false);
    }
    const int64_t lo = c * K, hi = std::min(n_, lo + K);
    zero_unwritten_grad_pages(buf + 3 * K, lo / kPage, (hi + kPage - 1) / kPage);
    while (seg < segments.size() && segments[seg].off + segments[seg].n <= lo) ++seg;
    for (size_t j = seg; j < segments.size() && segments[j].off < hi; ++j) {
      const int64_t x = std::max(lo, segments[j].off), y = std::min(hi, segments[j].off + segments[j].n);
      if (x >= y) continue;
      a.weight_decay = segments[j].weight_decay;
      host_adamw_update(buf + (x - lo), buf + 3 * K + (x - lo), buf + K + (x - lo), buf + 2 * K + (x - lo), y - x, a,
                        threads_);
    }
    writes[b] = ops(c, buf, true);
    if (c == 0) debug_offload_kill_hook(step);  // a write of this step is in flight
    to_device(dev_act, lo, buf, hi - lo);
  }
  for (uint64_t w : writes)
    if (w) io.engine->wait(w);
}

void HostOptimizerState::master_to_device(void* dev_act) {
  if (!nvme_) return to_device(dev_act, 0, bufs_[0], n_);
  float* buf = io_->set[0];
  for (int64_t lo = 0; lo < n_; lo += chunk_) {
    const int64_t len = std::min(chunk_, n_ - lo);
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
