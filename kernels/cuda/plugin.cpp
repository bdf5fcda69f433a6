// The one exported symbol of libtrainrun_cuda.so: trainrun_cuda_plugin_v1
// (see kernels/backend_factory.h for why the CUDA backend is a plugin).
// Everything else in the library has hidden visibility.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include "core/common/error.h"
#include "kernels/backend_factory.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/plugin_log.h"

namespace trainrun::cuda {

// Defined in parallel/comm/nccl_communicator.cpp, cuda_bench.cpp and gemm_check.cpp.
std::unique_ptr<Communicator> make_nccl_communicator_impl(Backend* be, Store* store, const std::string& prefix,
                                                          int rank, int world, std::chrono::milliseconds timeout,
                                                          bool own_stream);
int run_kernel_bench_impl(const KernelBenchOptions& opts);
std::vector<GemmCheckRow> run_gemm_epilogue_check_impl(int device);

namespace {

void set_logger(LogFn fn) { g_plugin_log = fn; }

int device_count(std::string* reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (reason)
      *reason = detail::cat("cudaGetDeviceCount returned error ", int(e), " (", cudaGetErrorName(e), ": ",
                            cudaGetErrorString(e), ")");
    cudaGetLastError();
    return 0;
  }
  if (n == 0) {
    if (reason) *reason = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)";
    return 0;
  }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      cudaGetLastError();
      if (reason) *reason = detail::cat("cannot read the properties of GPU ", d);
      return 0;
    }
    if (p.major < 8) {
      if (reason)
        *reason = detail::cat("GPU ", d, " (", p.name, ") is sm_", p.major, p.minor,
                              "; the CUDA backend needs sm_80 or newer");
      return 0;
    }
  }
  return n;
}

std::unique_ptr<Backend> make_backend(int device) { return std::make_unique<CudaBackend>(device); }

bool is_cuda_backend(const Backend* be) { return dynamic_cast<const CudaBackend*>(be) != nullptr; }

std::string version3(int v, int major_div, int minor_div) {
  return detail::cat(v / major_div, ".", (v % major_div) / minor_div, ".", v % minor_div);
}

std::string versions() {
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  cudaGetLastError();
  int nccl = 0;
  ncclGetVersion(&nccl);
  std::string cudnn = "not found";
  // cuDNN is optional (fused attention is not wired yet): looked up, never linked.
  if (void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL)) {
    using GetVersion = size_t (*)();
    if (auto f = reinterpret_cast<GetVersion>(dlsym(h, "cudnnGetVersion"))) {
      const size_t v = f();  // 90xyy for 9.x.y
      cudnn = detail::cat(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
    }
    dlclose(h);
  }
  const size_t lt = Gemm::library_version();
  return detail::cat("runtime ", rt / 1000, ".", (rt % 1000) / 10, " (static), driver ",
                     drv ? detail::cat(drv / 1000, ".", (drv % 1000) / 10) : std::string("none"), ", cuBLASLt ",
                     lt / 10000, ".", (lt % 10000) / 100, ".", lt % 100, ", NCCL ",
                     nccl >= 10000 ? version3(nccl, 10000, 100) : version3(nccl, 1000, 100), ", cuDNN ", cudnn,
                     "; kernels for sm_80 and sm_90");
}

// Every ordered pair: what the driver claims (cudaDeviceCanAccessPeer), then
// whether it is true: a 1 MiB pattern copied i -> j with peer access enabled
// must read back intact on j. Broken P2P (bad ACS/IOMMU setups) typically
// passes the first and corrupts or hangs the second, which is why NCCL's own
// tests copy data; a hang is bounded by the parent's timeout.
bool peer_probe(std::vector<std::string>* bus_ids, std::vector<std::vector<int>>* ok, std::string* why) {
  const int n = device_count(why);
  if (n == 0) return false;
  constexpr size_t kBytes = size_t(1) << 20;
  auto fail = [&](cudaError_t e, const char* what, int i, int j) {
    if (why) *why = detail::cat(what, " (GPU ", i, " -> ", j, "): ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    cudaGetLastError();
    return false;
  };
  bus_ids->assign(n, "");
  ok->assign(n, std::vector<int>(n, 0));
  std::vector<void*> buf(n, nullptr);
  for (int d = 0; d < n; ++d) {
    char id[32] = {};
    if (cudaError_t e = cudaDeviceGetPCIBusId(id, sizeof id, d); e != cudaSuccess) return fail(e, "cudaDeviceGetPCIBusId", d, d);
    (*bus_ids)[d] = id;
    if (cudaError_t e = cudaSetDevice(d); e != cudaSuccess) return fail(e, "cudaSetDevice", d, d);
    if (cudaError_t e = cudaMalloc(&buf[d], kBytes); e != cudaSuccess) return fail(e, "cudaMalloc", d, d);
    (*ok)[d][d] = 1;
  }
  std::vector<unsigned char> host(kBytes);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      if (cudaError_t e = cudaDeviceCanAccessPeer(&can, i, j); e != cudaSuccess) return fail(e, "cudaDeviceCanAccessPeer", i, j);
      if (!can) continue;
      cudaSetDevice(i);
      cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) e = cudaSuccess;
      cudaGetLastError();
      if (e != cudaSuccess) continue;  // claimed but not enabled: broken
      const unsigned char pattern = static_cast<unsigned char>(0x5A ^ (i * 16 + j));
      cudaSetDevice(j);
      if (cudaMemset(buf[j], 0, kBytes) != cudaSuccess) return fail(cudaGetLastError(), "cudaMemset", i, j);
      cudaSetDevice(i);
      if (cudaMemset(buf[i], pattern, kBytes) != cudaSuccess) return fail(cudaGetLastError(), "cudaMemset", i, i);
      if (cudaMemcpyPeer(buf[j], j, buf[i], i, kBytes) != cudaSuccess ||
          cudaDeviceSynchronize() != cudaSuccess) {
        cudaGetLastError();
        continue;  // the copy itself failed: broken
      }
      cudaSetDevice(j);
      if (cudaMemcpy(host.data(), buf[j], kBytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        return fail(cudaGetLastError(), "cudaMemcpy", j, j);
      bool intact = true;
      for (unsigned char c : host) intact = intact && c == pattern;
      (*ok)[i][j] = intact ? 1 : 0;
    }
  }
  for (int d = 0; d < n; ++d) {
    cudaSetDevice(d);
    cudaFree(buf[d]);
  }
  return true;
}

const CudaPluginApi kApi = {
    kCudaPluginAbi,       &set_logger, &device_count, &make_backend, &is_cuda_backend, &make_nccl_communicator_impl,
    &versions,           &run_kernel_bench_impl,     &run_gemm_epilogue_check_impl, &peer_probe,
};

}  // namespace
}  // namespace trainrun::cuda

extern "C" __attribute__((visibility("default"))) const trainrun::CudaPluginApi* trainrun_cuda_plugin_v1() {
  return &trainrun::cuda::kApi;
}
