// Backend selection and the dlopen() seam to libtrainrun_cuda.so (see
// backend_factory.h for the build design).
#include "kernels/backend_factory.h"

#include <dlfcn.h>
#include <limits.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

#include "core/common/error.h"
#include "core/common/log.h"

namespace trainrun {

namespace {

constexpr const char* kPluginName = "libtrainrun_cuda.so";

struct Plugin {
  const CudaPluginApi* api = nullptr;
  std::string path;   // where it was loaded from
  std::string error;  // why it is not available (api == nullptr)
};

#if TRAINRUN_HAVE_CUDA
void host_log(int level, const char* msg) { log_line(static_cast<LogLevel>(level), msg); }

std::string exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  std::string p(buf, static_cast<size_t>(n));
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "" : p.substr(0, slash);
}
#endif

Plugin load_plugin() {
  Plugin pl;
#if !TRAINRUN_HAVE_CUDA
  pl.error = "this trainrun was built without the CUDA backend (no nvcc at build time, or TRAINRUN_CUDA=OFF)";
  return pl;
#else
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("TRAINRUN_CUDA_LIB"); env && *env) {
    if (access(env, F_OK) != 0) {
      pl.error = detail::cat("TRAINRUN_CUDA_LIB='", env, "' does not exist");
      return pl;
    }
    candidates.push_back(env);  // explicit: the only candidate
  } else {
    const std::string dir = exe_dir();
    if (!dir.empty()) {
      candidates.push_back(dir + "/" + kPluginName);
      candidates.push_back(dir + "/../lib/" + kPluginName);
    }
    candidates.push_back(kPluginName);  // the loader's search path
  }
  std::string errors;
  for (const auto& c : candidates) {
    // A path that does not exist is not worth a dlerror() in the report.
    if (c.find('/') != std::string::npos && access(c.c_str(), F_OK) != 0) continue;
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      errors += detail::cat(errors.empty() ? "" : "; ", e ? e : c.c_str());
      continue;
    }
    auto entry = reinterpret_cast<trainrun_cuda_plugin_fn>(dlsym(h, "trainrun_cuda_plugin_v1"));
    if (!entry) {
      errors += detail::cat(errors.empty() ? "" : "; ", c, " has no trainrun_cuda_plugin_v1 symbol");
      dlclose(h);
      continue;
    }
    const CudaPluginApi* api = entry();
    if (!api || api->abi != kCudaPluginAbi) {
      errors += detail::cat(errors.empty() ? "" : "; ", c, " was built from another trainrun version (plugin ABI ",
                            api ? api->abi : 0, ", expected ", kCudaPluginAbi, ")");
      dlclose(h);
      continue;
    }
    api->set_logger(&host_log);
    pl.api = api;
    pl.path = c;
    return pl;
  }
  pl.error = errors.empty() ? detail::cat("the CUDA backend library ", kPluginName,
                                          " was not found next to the executable (set TRAINRUN_CUDA_LIB)")
                            : detail::cat("the CUDA backend library could not be loaded: ", errors);
  return pl;
#endif
}

const Plugin& plugin() {
  static const Plugin p = load_plugin();
  return p;
}

}  // namespace

namespace {

// TRAINRUN_CPU_LOGITS_ALIGN=N (tests): the CPU backend pads logits rows
// and, under tensor parallelism, the vocabulary as the CUDA backend does
// (64), so that path runs without a GPU. Unset: 1 (no padding).
std::unique_ptr<Backend> cpu_backend_from_env() {
  const char* v = std::getenv("TRAINRUN_CPU_LOGITS_ALIGN");
  if (!v || !*v) return make_cpu_backend();
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TR_CHECK(end && *end == 0 && n >= 1 && n <= 4096, "TRAINRUN_CPU_LOGITS_ALIGN: '", v,
           "' is not a whole number in [1, 4096]; unset it or give e.g. 64 (the CUDA backend's alignment)");
  TR_LOG_INFO("backend: cpu: TRAINRUN_CPU_LOGITS_ALIGN=", n, ": logits rows (and a tensor-parallel vocabulary) padded to a multiple of ", n);
  return make_cpu_backend(0, int(n));
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& requested, int local_rank, std::string* why) {
  if (why) why->clear();
  if (requested == "cpu") return cpu_backend_from_env();
  TR_CHECK(requested == "auto" || requested == "cuda", "backend: '", requested,
           "' is not a backend; use auto, cpu or cuda");
  const Plugin& p = plugin();
  std::string reason;
  int n = 0;
  if (p.api) {
    n = p.api->device_count(&reason);
  } else {
    reason = p.error;
  }
  if (n > 0) {
    TR_CHECK(local_rank >= 0 && local_rank < n, "backend: ", requested, ": this worker (LOCAL_RANK ", local_rank,
             ") needs GPU ", local_rank, " but only ", n, " GPU", n == 1 ? " is" : "s are",
             " visible; run at most ", n, " workers per node (parallel.nproc_per_node) or check CUDA_VISIBLE_DEVICES");
    return p.api->make_backend(local_rank);
  }
  if (requested == "cuda")
    TR_FAIL("backend: 'cuda' was requested but there is no usable GPU: ", reason, "; use backend: cpu or auto");
  const std::string msg = "no usable GPU: " + reason;
  // Quiet for binaries built without CUDA: there was never a GPU to expect.
#if TRAINRUN_HAVE_CUDA
  TR_LOG_INFO("backend: auto: ", msg, "; using the CPU backend");
#else
  TR_LOG_DEBUG("backend: auto: ", msg, "; using the CPU backend");
#endif
  if (why) *why = msg;
  return cpu_backend_from_env();
}

int cuda_device_count(std::string* reason) {
  const Plugin& p = plugin();
  if (!p.api) {
    if (reason) *reason = p.error;
    return 0;
  }
  std::string r;
  const int n = p.api->device_count(&r);
  if (reason) *reason = r;
  return n;
}

bool is_cuda_backend(const Backend* be) { return be && be->name().rfind("cuda", 0) == 0; }

std::unique_ptr<Communicator> make_nccl_communicator(Backend* be, Store* store, const std::string& prefix, int rank,
                                                     int world, std::chrono::milliseconds timeout,
                                                     bool own_stream) {
  const Plugin& p = plugin();
  TR_CHECK(p.api, "nccl communicator: ", p.error);
  TR_CHECK(is_cuda_backend(be), "nccl communicator: needs the CUDA backend, got '", be ? be->name() : "null", "'");
  return p.api->make_nccl_communicator(be, store, prefix, rank, world, timeout, own_stream);
}

std::string cuda_version_report() {
  const Plugin& p = plugin();
  if (!p.api) return "cuda: not available (" + p.error + ")";
  std::string reason;
  const int n = p.api->device_count(&reason);
  std::string s = "cuda: " + p.api->versions() + "\n  library: " + p.path;
  s += n > 0 ? detail::cat("\n  GPUs: ", n, " usable") : "\n  GPUs: none usable (" + reason + ")";
  return s;
}

int run_kernel_bench(const KernelBenchOptions& opts) {
  const Plugin& p = plugin();
  TR_CHECK(p.api, "bench kernels: ", p.error);
  std::string reason;
  TR_CHECK(p.api->device_count(&reason) > 0, "bench kernels: no usable GPU: ", reason);
  return p.api->run_kernel_bench(opts);
}

std::vector<GemmCheckRow> run_gemm_epilogue_check(int device) {
  const Plugin& p = plugin();
  TR_CHECK(p.api, "gemm check: ", p.error);
  return p.api->run_gemm_epilogue_check(device);
}

}  // namespace trainrun

namespace trainrun {

bool cuda_peer_probe(std::vector<std::string>* bus_ids, std::vector<std::vector<int>>* ok, std::string* why) {
  const Plugin& p = plugin();
  if (!p.api) {
    if (why) *why = p.error;
    return false;
  }
  return p.api->peer_probe(bus_ids, ok, why);
}

}  // namespace trainrun
