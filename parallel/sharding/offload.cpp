// parallel.offload: host-resident optimizer state; see offload.h.
#include "parallel/sharding/offload.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

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

HostOptimizerState::HostOptimizerState(Backend* be, int64_t n, const OffloadOptions& opts)
    : be_(be), n_(n), threads_(opts.threads > 0 ? opts.threads : omp_get_max_threads()) {
  const size_t bytes = std::max<size_t>(64, host_bytes());
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes) != 0 || !p)
    TR_FAIL("parallel.offload: cannot allocate ", gb(double(bytes)), " of host memory for the optimizer state (",
            n, " elements); use parallel.offload: nvme, more ranks or more nodes");
  base_ = static_cast<float*>(p);
  std::memset(base_, 0, bytes);  // also the first touch: no page faults inside a step
  for (int k = 0; k < 4; ++k) bufs_[k] = base_ + size_t(k) * size_t(n);
  if (be->wants_pinned_host()) {
    struct rlimit rl {};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    const std::string warn = memlock_warning(bytes, uint64_t(rl.rlim_cur));
    if (!warn.empty()) TR_LOG_WARN(warn);
    else if (!(pinned_ = be->pin_host(base_, bytes)))
      TR_LOG_WARN("parallel.offload: the ", be->name(), " backend could not pin ", gb(double(bytes)),
                  " of host memory; using unpinned memory (slower device copies)");
  }
}

HostOptimizerState::~HostOptimizerState() {
  if (pinned_) be_->unpin_host(base_);
  std::free(base_);
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

void HostOptimizerState::update(int64_t off, int64_t n, float lr, float beta1, float beta2, float eps,
                                float weight_decay, int step, float grad_scale) {
  TR_CHECK(off >= 0 && off + n <= n_, "offload: update range [", off, ", +", n, ") outside the shard of ", n_);
  HostAdamWArgs a;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.step = step;
  a.grad_scale = grad_scale;
  host_adamw_update(bufs_[0] + off, bufs_[3] + off, bufs_[1] + off, bufs_[2] + off, n, a, threads_);
}

void HostOptimizerState::master_to_device(void* dev_act, int64_t off, int64_t n) {
  TR_CHECK(off >= 0 && off + n <= n_, "offload: parameter range [", off, ", +", n, ") outside the shard of ", n_);
  if (n == 0) return;
  if (be_->act_dtype() == DType::F32) return be_->copy_to_device(dev_act, bufs_[0] + off, size_t(n) * 4);
  if (!staging_dev_.get()) staging_dev_ = DeviceBuffer(be_, size_t(std::min(n_, kStagingElements)) * 4);
  const int64_t chunk = int64_t(staging_dev_.bytes() / 4);
  const size_t es = dtype_size(be_->act_dtype());
  // Stream order keeps the staging buffer safe: each copy is enqueued after
  // the cast that read the previous chunk.
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t c = std::min(chunk, n - i);
    be_->copy_to_device(staging_dev_.get(), bufs_[0] + off + i, size_t(c) * 4);
    be_->cast_from_f32(static_cast<char*>(dev_act) + size_t(i) * es, staging_dev_.as<float>(), c);
  }
}

}  // namespace trainrun
