// Where a topology description comes from. Each source is small, reads one
// thing, and can be pointed at test data:
//
//   saved file      `trainrun topo --save` output (topology.h: load_topology)
//   nvidia-smi      the text of `nvidia-smi topo -m` (tabs or spaces, GPU and
//                   NIC rows, optional CPU Affinity / NUMA Affinity / GPU NUMA
//                   ID columns, the "NIC Legend" of newer releases)
//   sysfs           /sys under a configurable root: PCI tree, numa_node,
//                   local_cpulist, class/vendor, ACS in PCI config space,
//                   /sys/class/infiniband, /sys/class/net, NUMA nodes
//   NVML            libnvidia-ml.so.1 through dlopen (never linked, absent is
//                   fine): names, memory, PCI levels, NVLink counts, NVSwitch
//   CUDA probe      peer access between GPUs, from the CUDA runtime
//
// As in NCCL, detection starts from the most trusted source and later ones
// only fill in what is missing (detect_topology).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "parallel/topology/topology.h"

namespace trainrun::topo {

class TopologySource {
 public:
  virtual ~TopologySource() = default;
  virtual std::string name() const = 0;
  // The description this source can give. A source that is not available
  // here (no NVML library, no CUDA) returns an empty description whose
  // notes say why; bad input (a malformed file) throws trainrun::Error.
  virtual Topology read() = 0;
};

// ---- nvidia-smi topo -m -------------------------------------------------------------------

// Parses the text; `name` (a file name) prefixes errors as "name:line: ...".
Topology parse_nvidia_smi_topo(const std::string& text, const std::string& name);
std::unique_ptr<TopologySource> make_nvidia_smi_source(const std::string& path);

// ---- a saved description ---------------------------------------------------------------------

std::unique_ptr<TopologySource> make_file_source(const std::string& path);

// ---- /sys -------------------------------------------------------------------------------------

// Reads <root>/sys/... ("/" for this machine, a fixture directory in tests).
Topology read_sysfs_topology(const std::string& root);
std::unique_ptr<TopologySource> make_sysfs_source(const std::string& root);
// The marketing name of an NVIDIA PCI device id ("NVIDIA H100 80GB HBM3"),
// and its compute capability ("9.0"); empty when not in our table.
std::string nvidia_device_name(unsigned device_id);
std::string nvidia_compute_capability(unsigned device_id);

// ---- NVML ---------------------------------------------------------------------------------------

// The NVML entry points we use, as plain function pointers so that tests can
// supply a fake machine. Types follow nvml.h (we do not need the header):
// handles are opaque pointers, enums are ints, return 0 means success.
struct NvmlPciInfo {  // nvmlPciInfo_t (v3)
  char busIdLegacy[16];
  unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
struct NvmlMemory {  // nvmlMemory_t (v1)
  unsigned long long total, free, used;
};
using NvmlDevice = void*;
struct NvmlApi {
  int (*init)() = nullptr;                                             // nvmlInit_v2
  int (*shutdown)() = nullptr;                                         // nvmlShutdown
  const char* (*error_string)(int) = nullptr;                          // nvmlErrorString
  int (*device_count)(unsigned*) = nullptr;                            // nvmlDeviceGetCount_v2
  int (*device_by_index)(unsigned, NvmlDevice*) = nullptr;             // nvmlDeviceGetHandleByIndex_v2
  int (*name)(NvmlDevice, char*, unsigned) = nullptr;                  // nvmlDeviceGetName
  int (*uuid)(NvmlDevice, char*, unsigned) = nullptr;                  // nvmlDeviceGetUUID (optional)
  int (*pci_info)(NvmlDevice, NvmlPciInfo*) = nullptr;                 // nvmlDeviceGetPciInfo_v3
  int (*memory)(NvmlDevice, NvmlMemory*) = nullptr;                    // nvmlDeviceGetMemoryInfo
  int (*cuda_cc)(NvmlDevice, int*, int*) = nullptr;                    // nvmlDeviceGetCudaComputeCapability
  int (*common_ancestor)(NvmlDevice, NvmlDevice, int*) = nullptr;      // nvmlDeviceGetTopologyCommonAncestor
  int (*nvlink_state)(NvmlDevice, unsigned, int*) = nullptr;           // nvmlDeviceGetNvLinkState
  int (*nvlink_remote_pci)(NvmlDevice, unsigned, NvmlPciInfo*) = nullptr;  // nvmlDeviceGetNvLinkRemotePciInfo_v2
  int (*nvlink_remote_type)(NvmlDevice, unsigned, int*) = nullptr;     // nvmlDeviceGetNvLinkRemoteDeviceType (optional)
};
// NVML's constants that matter here.
constexpr unsigned kNvmlMaxNvLinks = 18;      // NVML_NVLINK_MAX_LINKS
constexpr int kNvmlTopologySingle = 10;       // NVML_TOPOLOGY_SINGLE ... SYSTEM = 50
constexpr int kNvmlNvLinkDeviceSwitch = 2;    // NVML_NVLINK_DEVICE_TYPE_SWITCH

// dlopen()s libnvidia-ml.so.1 (or `library`). False with *why when it is not
// there or lacks a required symbol: machines without a driver are normal.
bool load_nvml(NvmlApi* api, std::string* why, const std::string& library = "libnvidia-ml.so.1");
// The GPUs as NVML sees them (init ... shutdown). Throws on NVML errors.
Topology read_nvml_topology(const NvmlApi& api);
// A source over the real library: unavailable (a note) when it cannot load.
std::unique_ptr<TopologySource> make_nvml_source();
std::unique_ptr<TopologySource> make_nvml_source(const NvmlApi& api);  // for tests

// ---- CUDA peer access probe -------------------------------------------------------------------

struct PeerProbe {
  bool ran = false;
  std::string why;                   // why it did not run
  std::vector<std::vector<int>> ok;  // G x G in topology GPU order: 1 = cudaDeviceCanAccessPeer and a copy round-trips
};
// Runs `<exe> probe-p2p` (a hidden trainrun command, kernels/backend_factory.h:
// cuda_peer_probe) as a child with every GPU visible and a timeout, and maps
// its CUDA device order onto `gpus` by PCI bus id. A child, because the probe
// creates a context on every GPU and the agent must never hold one. `exe`
// empty: this process's binary, when it is trainrun (else not probed).
// P2P is only ever disabled on its evidence, never on a guess: NVML's "P2P
// not supported" only means CUDA will not try.
PeerProbe probe_cuda_peer_access(const std::vector<Gpu>& gpus, const std::string& exe = "",
                                 int timeout_s = 60);
// The parent's half, for tests: `out` is probe-p2p's stdout:
//   bus <busid of CUDA device 0> <busid 1> ...
//   <n ints: row 0 of ok, in CUDA order>
//   ...
PeerProbe parse_peer_probe_output(const std::string& out, const std::vector<Gpu>& gpus);

// ---- detection ---------------------------------------------------------------------------------

// Fills what `base` lacks from `extra`: GPUs are matched by PCI bus id;
// NVLink from extra replaces a PCIe link (sysfs cannot see NVLink); names,
// memory, NUMA, NICs and P2P results are taken when base has none.
void merge_topology(Topology& base, const Topology& extra);

// Runs the sources in order (the first is the base) and merges them.
Topology detect_topology(std::vector<std::unique_ptr<TopologySource>> sources);

// This machine: /sys under `sysfs_root`, then NVML, then the CUDA probe.
Topology detect_local_topology(const std::string& sysfs_root = "/");

}  // namespace trainrun::topo
