// The NVML source (the CUDA peer probe is in topology_probe.cpp).
//
// NVML is loaded with dlopen, never linked: the same binary runs on machines
// without a driver (this one, CI) and on GPU nodes. The entry points we use
// are collected into NvmlApi so that the logic below (link levels, NVLink
// counting, NVSwitch detection) runs in tests against a fake machine.
//
// NVLink counting follows what nvidia-smi prints: for each GPU, each active
// link goes either to a peer GPU (counted for that pair) or to an NVSwitch
// (counted for the GPU). Through NVSwitch every pair of switch-attached GPUs
// talks over all of their switch links, so the pair shows NV<min(a, b)>
// (NV12 on DGX A100, NV18 on DGX H100).
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "core/common/error.h"
#include "core/common/log.h"
#include "parallel/topology/topology_sources.h"

namespace trainrun::topo {

namespace {

std::string nvml_error(const NvmlApi& api, int rc) {
  const char* s = api.error_string ? api.error_string(rc) : nullptr;
  return s ? std::string(s) + " (" + std::to_string(rc) + ")" : "NVML error " + std::to_string(rc);
}

// nvmlGpuTopologyLevel_t -> nvidia-smi's code.
Link level_to_link(int level) {
  if (level <= kNvmlTopologySingle) return Link{LinkKind::PIX, 0};  // INTERNAL (one board) or SINGLE
  if (level <= 20) return Link{LinkKind::PXB, 0};                   // MULTIPLE
  if (level <= 30) return Link{LinkKind::PHB, 0};                   // HOSTBRIDGE
  if (level <= 40) return Link{LinkKind::Node, 0};                  // NODE
  return Link{LinkKind::Sys, 0};                                    // SYSTEM
}

}  // namespace

bool load_nvml(NvmlApi* api, std::string* why, const std::string& library) {
  // RTLD_LOCAL: NVML's symbols must not leak into what later dlopens see.
  void* h = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    *why = std::string("cannot load ") + library + ": " + (e ? e : "unknown error") + " (no NVIDIA driver here?)";
    return false;
  }
  // The handle is kept for the life of the process: NVML is cheap to keep
  // and unloading a driver library while it may have threads is not.
  bool ok = true;
  std::string missing;
  auto sym = [&](auto& fn, const char* name, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
    if (!fn && required) ok = false, missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(api->init, "nvmlInit_v2", true);
  sym(api->shutdown, "nvmlShutdown", true);
  sym(api->error_string, "nvmlErrorString", false);
  sym(api->device_count, "nvmlDeviceGetCount_v2", true);
  sym(api->device_by_index, "nvmlDeviceGetHandleByIndex_v2", true);
  sym(api->name, "nvmlDeviceGetName", true);
  sym(api->uuid, "nvmlDeviceGetUUID", false);
  sym(api->pci_info, "nvmlDeviceGetPciInfo_v3", true);
  sym(api->memory, "nvmlDeviceGetMemoryInfo", true);
  sym(api->cuda_cc, "nvmlDeviceGetCudaComputeCapability", false);
  sym(api->common_ancestor, "nvmlDeviceGetTopologyCommonAncestor", false);
  sym(api->nvlink_state, "nvmlDeviceGetNvLinkState", false);
  sym(api->nvlink_remote_pci, "nvmlDeviceGetNvLinkRemotePciInfo_v2", false);
  sym(api->nvlink_remote_type, "nvmlDeviceGetNvLinkRemoteDeviceType", false);
  if (!ok) *why = library + " lacks " + missing + " (driver too old?)";
  return ok;
}

Topology read_nvml_topology(const NvmlApi& api) {
  int rc = api.init();
  TR_CHECK(rc == 0, "NVML: nvmlInit failed: ", nvml_error(api, rc));
  struct Shutdown {
    const NvmlApi& api;
    ~Shutdown() { api.shutdown(); }
  } shutdown{api};

  Topology t;
  t.sources.push_back("nvml");
  unsigned count = 0;
  rc = api.device_count(&count);
  TR_CHECK(rc == 0, "NVML: nvmlDeviceGetCount failed: ", nvml_error(api, rc));
  std::vector<NvmlDevice> dev(count);
  std::map<std::string, int> by_bus;
  for (unsigned i = 0; i < count; ++i) {
    rc = api.device_by_index(i, &dev[i]);
    TR_CHECK(rc == 0, "NVML: cannot open GPU ", i, ": ", nvml_error(api, rc));
    Gpu g;
    g.index = int(i);
    char name[96] = {};
    if (api.name(dev[i], name, sizeof name) == 0) g.name = name;
    // What CUDA_VISIBLE_DEVICES=GPU-... names (parallel/topology/topology_visible.cpp).
    char uuid[96] = {};
    if (api.uuid && api.uuid(dev[i], uuid, sizeof uuid) == 0) g.uuid = uuid;
    NvmlPciInfo pci{};
    if (api.pci_info(dev[i], &pci) == 0) g.pci_bus_id = normalize_bus_id(pci.busId);
    NvmlMemory mem{};
    if (api.memory(dev[i], &mem) == 0) g.memory_mib = int64_t(mem.total >> 20);
    int major = 0, minor = 0;
    if (api.cuda_cc && api.cuda_cc(dev[i], &major, &minor) == 0)
      g.compute_capability = std::to_string(major) + "." + std::to_string(minor);
    by_bus[g.pci_bus_id] = int(i);
    t.gpus.push_back(g);
  }

  const size_t G = count;
  t.links.assign(G, std::vector<Link>(G));
  for (size_t i = 0; i < G; ++i)
    for (size_t j = 0; j < G; ++j) {
      int level = 0;
      if (i == j) t.links[i][j] = Link{LinkKind::Self, 0};
      else if (api.common_ancestor && api.common_ancestor(dev[i], dev[j], &level) == 0) t.links[i][j] = level_to_link(level);
    }

  // NVLink: direct links per pair, switch links per GPU.
  std::vector<std::vector<int>> direct(G, std::vector<int>(G, 0));
  std::vector<int> to_switch(G, 0);
  if (api.nvlink_state) {
    for (size_t i = 0; i < G; ++i)
      for (unsigned l = 0; l < kNvmlMaxNvLinks; ++l) {
        int active = 0;
        if (api.nvlink_state(dev[i], l, &active) != 0 || active != 1) continue;  // absent or down
        int type = -1;
        if (api.nvlink_remote_type && api.nvlink_remote_type(dev[i], l, &type) == 0 && type == kNvmlNvLinkDeviceSwitch) {
          ++to_switch[i];
          continue;
        }
        NvmlPciInfo remote{};
        if (!api.nvlink_remote_pci || api.nvlink_remote_pci(dev[i], l, &remote) != 0) continue;
        auto it = by_bus.find(normalize_bus_id(remote.busId));
        if (it != by_bus.end()) ++direct[i][size_t(it->second)];
        else if (!api.nvlink_remote_type) ++to_switch[i];  // not a GPU: on old drivers, a switch
      }
  }
  for (size_t i = 0; i < G; ++i)
    for (size_t j = 0; j < G; ++j) {
      if (i == j) continue;
      const int n = std::min(direct[i][j], direct[j][i]) + std::min(to_switch[i], to_switch[j]);
      if (n > 0) t.links[i][j] = Link{LinkKind::NVLink, n};
    }
  t.nvswitch = std::any_of(to_switch.begin(), to_switch.end(), [](int n) { return n > 0; });
  if (t.nvswitch) t.notes.push_back("NVML: NVLinks end on NVSwitch");
  validate_topology(t, "NVML");
  return t;
}

namespace {

class NvmlSource : public TopologySource {
 public:
  NvmlSource() = default;
  explicit NvmlSource(const NvmlApi& api) : api_(api), injected_(true) {}
  std::string name() const override { return "nvml"; }
  Topology read() override {
    Topology t;
    std::string why;
    if (!injected_ && !load_nvml(&api_, &why)) {
      t.notes.push_back("NVML: " + why);
      return t;
    }
    try {
      return read_nvml_topology(api_);
    } catch (const Error& e) {
      // A driver that is installed but not working (no GPU, version
      // mismatch after an upgrade) is a note, not a reason to fail a job.
      t.notes.push_back(e.what());
      return t;
    }
  }

 private:
  NvmlApi api_;
  bool injected_ = false;
};

}  // namespace

std::unique_ptr<TopologySource> make_nvml_source() { return std::make_unique<NvmlSource>(); }
std::unique_ptr<TopologySource> make_nvml_source(const NvmlApi& api) { return std::make_unique<NvmlSource>(api); }

}  // namespace trainrun::topo
