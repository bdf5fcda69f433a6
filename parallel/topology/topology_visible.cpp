// CUDA_VISIBLE_DEVICES against a topology description: which of its GPUs a
// CUDA process started with this environment would see, in which order.
// See topology_decide.h for the rules.
//
// CUDA itself is lenient: it reads the list up to the first entry it cannot
// use and silently drops that entry and the rest ("0,9,1" on an 8-GPU node
// is one device). A launcher that counted workers that way would start fewer
// than the user meant without a word, so every entry here must name a GPU of
// the description, or the launch stops with the entry named.
#include <algorithm>
#include <cctype>
#include <set>

#include "core/common/error.h"
#include "core/common/text.h"
#include "parallel/topology/topology_decide_internal.h"

namespace trainrun::topo {

namespace {

bool starts_with_nocase(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && ascii_lower(s.substr(0, prefix.size())) == ascii_lower(prefix);
}

}  // namespace

VisibleGpus resolve_visible_gpus(const Topology& t, const char* value, const std::string& described) {
  const int G = t.gpu_count();
  VisibleGpus v;
  if (!value) {
    v.count = G;
    for (int g = 0; g < G; ++g) v.gpus.push_back(g);
    return v;
  }
  v.set = true;
  const std::string all = trim_space(value);
  // What CUDA reads as "no device", and what Slurm / Grid Engine set for a
  // job that was given no GPU.
  if (all.empty() || all == "-1" || all == "NoDevFiles") return v;

  const std::string var = "CUDA_VISIBLE_DEVICES=" + std::string(value);
  const std::string range = G == 0 ? "none" : G == 1 ? "index 0" : "indices 0-" + std::to_string(G - 1);
  const bool have_uuids =
      G > 0 && std::all_of(t.gpus.begin(), t.gpus.end(), [](const Gpu& g) { return !g.uuid.empty(); });
  std::vector<std::string> entries;
  for (size_t start = 0;;) {
    const size_t comma = all.find(',', start);
    entries.push_back(trim_space(all.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  int by_uuid_unchecked = 0, mig = 0;
  std::set<int> seen;
  for (const std::string& e : entries) {
    TR_CHECK(!e.empty(), var, ": an empty entry; list GPU indices or UUIDs separated by single commas");
    int g = -1;
    if (std::all_of(e.begin(), e.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      TR_CHECK(e.size() <= 6 && std::stoi(e) < G, var, ": '", e, "' names no GPU: ", described, " has ", G,
               G == 1 ? " GPU" : " GPUs", " (", range,
               "); list only those, or unset CUDA_VISIBLE_DEVICES to use every GPU");
      g = std::stoi(e);
    } else if (starts_with_nocase(e, "MIG-")) {
      ++mig;
      continue;
    } else if (starts_with_nocase(e, "GPU-")) {
      if (!have_uuids) {
        ++by_uuid_unchecked;
        continue;
      }
      // CUDA accepts any unique prefix of a UUID.
      std::vector<int> match;
      for (const Gpu& gpu : t.gpus)
        if (starts_with_nocase(gpu.uuid, e)) match.push_back(gpu.index);
      TR_CHECK(!match.empty(), var, ": '", e, "' names no GPU: no GPU of ", described,
               " has that UUID; `trainrun topo` (or nvidia-smi -L) lists them");
      TR_CHECK(match.size() == 1, var, ": '", e, "' is the start of the UUIDs of GPUs ", detail::join(match),
               "; give enough of the UUID to name one");
      g = match[0];
    } else {
      TR_FAIL(var, ": '", e, "' is neither a GPU index (", range, " in ", described,
              ") nor a GPU UUID (GPU-...) or MIG instance (MIG-...)");
    }
    TR_CHECK(seen.insert(g).second, var, ": GPU ", g, " is listed twice; list each GPU once");
    v.gpus.push_back(g);
  }
  if (mig > 0) {
    // A CUDA process enumerates a single MIG instance, whatever the list holds.
    v.count = 1;
    v.gpus.clear();
    v.unmapped = "it names MIG instances, of which a CUDA process uses one, and the description has whole GPUs only";
  } else if (by_uuid_unchecked > 0) {
    v.count = int(entries.size());
    v.gpus.clear();
    v.unmapped = "it names GPUs by UUID and " + described + " has no UUIDs to match them with (a description "
                 "detected through NVML has them)";
  } else {
    v.count = int(v.gpus.size());
  }
  return v;
}

}  // namespace trainrun::topo
