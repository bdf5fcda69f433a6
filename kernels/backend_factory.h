// Backend selection, and the seam between the trainrun binary and the CUDA
// backend library.
//
// Build design (why a plugin): the CUDA backend, its cuBLASLt GEMMs and the
// NCCL communicator are built into libtrainrun_cuda.so, which the binary
// dlopen()s at run time on the first request for a CUDA backend. So neither
// libcudart, cuBLASLt nor NCCL is a load-time dependency of `trainrun`: the
// same binary runs on a laptop without the CUDA libraries, on a build
// machine with the toolkit but no driver or GPU, and on an 8-GPU node.
// libcuda is never linked by anything (cudart, linked statically into the
// plugin, loads the driver itself).
//
// Where the plugin is looked for, in order: $TRAINRUN_CUDA_LIB (a path to the
// .so), next to the running executable, ../lib next to it, then the
// dynamic loader's search path.
//
// The plugin exports one C symbol, trainrun_cuda_plugin_v1, returning a
// CudaPluginApi whose abi field must equal kCudaPluginAbi: the two sides are
// compiled from the same tree with the same compiler, which is what makes
// passing C++ types (std::string, std::unique_ptr<Backend>, Store&) safe.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

// Picks the backend for `requested` ("auto", "cpu" or "cuda"):
//  - "cpu": the CPU backend (threads: OpenMP's default).
//  - "cuda": the CUDA backend on device `local_rank`; on a machine without a
//    usable GPU, or a binary without the CUDA library, an Error that says why.
//  - "auto": CUDA when a GPU is usable, else the CPU backend; the reason for
//    falling back ("no usable GPU: <reason>") is logged and written to *why.
// Never crashes on a machine without a driver or GPU (cudaGetDeviceCount
// errors such as 35 or 100 are reasons, not faults).
std::unique_ptr<Backend> make_backend(const std::string& requested, int local_rank, std::string* why);

// Number of usable GPUs (0 with *reason saying why: no CUDA library, no
// driver, no device, too old). Loads the plugin on first use; never throws.
int cuda_device_count(std::string* reason);

// True when `be` is a CUDA backend (its collectives need NCCL, not Gloo).
bool is_cuda_backend(const Backend* be);

// The communicator for ranks whose backend is CUDA: NCCL over the plugin.
// `store` may be null when world == 1 (no rendezvous needed). Buffers are in
// the backend's (device) memory; host pointers are staged. `own_stream`: its
// work runs on a CUDA stream of its own rather than the backend's comm
// stream (a pipeline link, parallel/pipeline/links.h), so it never queues
// behind, or holds up, the other communicators' collectives.
std::unique_ptr<Communicator> make_nccl_communicator(Backend* be, Store* store, const std::string& prefix, int rank,
                                                     int world, std::chrono::milliseconds timeout,
                                                     bool own_stream = false);

// What the CUDA side of this binary offers, for `trainrun --version`: the
// plugin's path and the versions of the CUDA runtime, driver, cuBLASLt,
// NCCL and cuDNN, or why the plugin is not available. Never throws.
std::string cuda_version_report();

// `trainrun bench kernels`: each kernel's achieved GB/s or TFLOP/s next to
// the card's measured copy bandwidth and large-GEMM rate; prints a table.
struct KernelBenchOptions {
  int device = 0;
  int repeats = 20;        // timed launches per kernel (median reported)
  bool quick = false;      // smaller sizes (a smoke run)
};
int run_kernel_bench(const KernelBenchOptions& opts);

// Self-check of the GEMM wrapper's epilogues (GELU+aux, dGELU, bias-grad,
// batched) against a host reference; one row per case with the norm-wise
// relative error. Used by tests/test_cuda_ops.cpp. Throws when CUDA is not
// usable.
struct GemmCheckRow {
  std::string name;
  double rel_err = 0;     // ||got - want|| / ||want||, want in double from the same bf16 inputs
  double tol = 0;         // what the case must meet (bf16 output: 1e-2; fp32 output: 1e-4)
  bool supported = true;  // false: cuBLASLt has no algorithm for it (reported, not failed)
};
std::vector<GemmCheckRow> run_gemm_epilogue_check(int device);

// P2P between every pair of visible GPUs, in CUDA's device order: bus_ids[i]
// is device i's PCI bus id (to match NVML/sysfs indices), ok[i][j] is 1 when
// cudaDeviceCanAccessPeer says yes AND a 1 MiB cudaMemcpyPeer from i to j
// arrives intact, else 0 (the diagonal is 1). False with *why when CUDA is
// unusable. Creates a context on every GPU: `trainrun probe-p2p` runs it in
// a child process so the agent never holds one (see parallel/topology/topology_nvml.cpp).
bool cuda_peer_probe(std::vector<std::string>* bus_ids, std::vector<std::vector<int>>* ok, std::string* why);

// ---- the plugin ABI (used by backend_factory.cpp and kernels/cuda/plugin.cpp) ----
// 5: make_nccl_communicator takes own_stream (pipeline links).
constexpr uint32_t kCudaPluginAbi = 5;

using LogFn = void (*)(int level, const char* msg);  // level as trainrun::LogLevel

struct CudaPluginApi {
  uint32_t abi;
  // Installs the host's logger (the plugin has no logging of its own).
  void (*set_logger)(LogFn fn);
  // Usable devices (>= 1), or 0 with *reason saying why (driver missing, no
  // device, ...). Never throws.
  int (*device_count)(std::string* reason);
  std::unique_ptr<Backend> (*make_backend)(int device);
  bool (*is_cuda_backend)(const Backend* be);
  std::unique_ptr<Communicator> (*make_nccl_communicator)(Backend* be, Store* store, const std::string& prefix,
                                                          int rank, int world, std::chrono::milliseconds timeout,
                                                          bool own_stream);
  std::string (*versions)();
  int (*run_kernel_bench)(const KernelBenchOptions& opts);
  std::vector<GemmCheckRow> (*run_gemm_epilogue_check)(int device);
  // Peer access between every pair of visible GPUs: see cuda_peer_probe.
  bool (*peer_probe)(std::vector<std::string>* bus_ids, std::vector<std::vector<int>>* ok, std::string* why);
};

}  // namespace trainrun

extern "C" {
// The plugin's one exported symbol.
using trainrun_cuda_plugin_fn = const trainrun::CudaPluginApi* (*)();
}
