// The `nvidia-smi topo -m` source: a parser for the matrix as engineers
// paste it. What it accepts, because real outputs differ:
//   - cells separated by tabs (what nvidia-smi writes) or by runs of spaces
//     (what a copy from a web page or a terminal leaves), line by line;
//   - GPU rows and NIC rows, NICs named directly (mlx5_0, older releases) or
//     as NIC<n> with a "NIC Legend:" section mapping them to names (525+);
//   - optional trailing columns "CPU Affinity", "NUMA Affinity" and
//     "GPU NUMA ID" (Grace systems), each possibly "N/A"; CPU and NUMA
//     Affinity may be blank (VMs) when GPU NUMA ID still ends the row;
//   - text before the header (a shell prompt) and the Legend after the rows.
// What it rejects, naming the line: ragged rows, unknown link codes, a
// matrix that is not square or not symmetric, X off the diagonal.
//
// The matrix says nothing about GPU models, memory or PCI addresses; those
// stay unknown (the sysfs/NVML sources fill them on a live machine).
#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "core/common/text.h"
#include "parallel/topology/topology_sources.h"

namespace trainrun::topo {

namespace {

const char* const kExtraColumns[] = {"CPU Affinity", "NUMA Affinity", "GPU NUMA ID"};

bool is_extra(const std::string& s) {
  return std::find(std::begin(kExtraColumns), std::end(kExtraColumns), s) != std::end(kExtraColumns);
}

// The non-empty cells of one line. Tabs are the real separator; a line
// without tabs is split on whitespace. nvidia-smi pads with extra tabs where
// a header is wider than its values, so empty cells carry no meaning.
std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> out;
  if (line.find('\t') != std::string::npos) {
    std::istringstream in(line);
    for (std::string c; std::getline(in, c, '\t');)
      if (!trim_space(c).empty()) out.push_back(trim_space(c));
    return out;
  }
  std::istringstream in(line);
  for (std::string c; in >> c;) out.push_back(c);
  return out;
}

// Whitespace splitting cuts "CPU Affinity" in two: put the known names back.
std::vector<std::string> join_header_words(const std::vector<std::string>& in) {
  std::vector<std::string> out;
  for (size_t i = 0; i < in.size(); ++i) {
    if (i + 2 < in.size() && in[i] == "GPU" && in[i + 1] == "NUMA" && in[i + 2] == "ID") {
      out.push_back("GPU NUMA ID"), i += 2;
    } else if (i + 1 < in.size() && (in[i] == "CPU" || in[i] == "NUMA") && in[i + 1] == "Affinity") {
      out.push_back(in[i] + " Affinity"), ++i;
    } else {
      out.push_back(in[i]);
    }
  }
  return out;
}

// "GPU3" -> 3; -1 for anything else.
int gpu_number(const std::string& s) {
  if (s.size() < 4 || s.compare(0, 3, "GPU") != 0) return -1;
  if (!std::all_of(s.begin() + 3, s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
    return -1;
  return std::stoi(s.substr(3));
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

struct Row {
  int line = 0;
  std::vector<Link> links;          // one per device column
  std::vector<std::string> extras;  // one per extra column, or none (NIC rows)
};

// NVSwitch or direct links? The matrix only says NV<n>. No GPU has more than
// 18 NVLinks (Hopper/Blackwell; A100 has 12, V100 6), so when every GPU
// shows NV<n> to every other GPU and n x (peers) exceeds 18, the links
// cannot be point to point: they go through NVSwitch.
bool infer_nvswitch(const std::vector<std::vector<Link>>& links) {
  const size_t G = links.size();
  if (G < 3) return false;
  for (size_t i = 0; i < G; ++i) {
    int total = 0;
    for (size_t j = 0; j < G; ++j) {
      if (i == j) continue;
      if (links[i][j].kind != LinkKind::NVLink) return false;
      total += links[i][j].nvlinks;
    }
    if (total <= 18) return false;
  }
  return true;
}

}  // namespace

Topology parse_nvidia_smi_topo(const std::string& text, const std::string& name) {
  std::vector<std::string> lines;
  {
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) {
      if (!l.empty() && l.back() == '\r') l.pop_back();
      lines.push_back(l);
    }
  }
  auto fail_at = [&](size_t idx, const std::string& msg) { TR_FAIL(name, ":", idx + 1, ": ", msg); };

  // 1. The header: the first line whose first cell is GPU0.
  size_t header = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto c = cells_of(lines[i]);
    if (!c.empty() && c[0] == "GPU0") {
      header = i;
      break;
    }
  }
  TR_CHECK(header < lines.size(), name,
           ": no header line starting with GPU0; expected the output of `nvidia-smi topo -m` "
           "(a matrix with GPU0 GPU1 ... columns)");
  const std::vector<std::string> head = join_header_words(cells_of(lines[header]));
  std::vector<std::string> devices, extras;
  for (const std::string& h : head) {
    if (is_extra(h)) {
      extras.push_back(h);
    } else {
      if (!extras.empty()) fail_at(header, "column '" + h + "' comes after '" + extras.back() + "'; device columns (GPU<n>, NIC<n>, mlx5_<n>) must come first");
      if (std::find(devices.begin(), devices.end(), h) != devices.end()) fail_at(header, "column '" + h + "' appears twice");
      devices.push_back(h);
    }
  }
  // GPU columns are GPU0..GPU<G-1>, first and in order.
  size_t G = 0;
  while (G < devices.size() && gpu_number(devices[G]) == int(G)) ++G;
  for (size_t k = G; k < devices.size(); ++k)
    if (gpu_number(devices[k]) >= 0)
      fail_at(header, "column " + devices[k] + " is out of order; GPU columns must be GPU0, GPU1, ... before any NIC");

  // 2. The rows, up to a blank line or the legend.
  std::map<std::string, Row> rows;
  std::vector<std::string> blank_rows;  // GPU rows with blank CPU/NUMA Affinity
  size_t i = header + 1;
  for (; i < lines.size(); ++i) {
    const std::string t = trim_space(lines[i]);
    if (t.empty()) {
      if (rows.empty()) continue;
      break;
    }
    if (t.rfind("Legend", 0) == 0) break;
    std::vector<std::string> c = cells_of(lines[i]);
    const std::string label = c[0];
    c.erase(c.begin());
    if (std::find(devices.begin(), devices.end(), label) == devices.end())
      fail_at(i, "row '" + label + "' does not match any column (columns: " + join(devices, " ") + ")");
    if (rows.count(label)) fail_at(i, "row " + label + " appears twice");
    const bool is_gpu = gpu_number(label) >= 0;
    const size_t want = devices.size() + (is_gpu ? extras.size() : 0);
    // NIC rows end after the device columns; tolerate a padded one too.
    bool ok = c.size() == want || (!is_gpu && c.size() == devices.size() + extras.size());
    // nvidia-smi leaves CPU Affinity and NUMA Affinity blank where it cannot
    // tell (seen in VMs) but always fills GPU NUMA ID (a node or N/A): all
    // device cells, then fewer extras, the last of them GPU NUMA ID.
    bool blank_affinity = false;
    if (!ok && is_gpu && !extras.empty() && extras.back() == "GPU NUMA ID" && c.size() > devices.size() &&
        c.size() < want && (c.back() == "N/A" || std::all_of(c.back().begin(), c.back().end(), [](char ch) {
                              return std::isdigit(static_cast<unsigned char>(ch));
                            }))) {
      Link l;
      blank_affinity = std::all_of(c.begin(), c.begin() + long(devices.size()),
                                   [&](const std::string& cell) { return parse_link_code(cell, &l); });
      ok = blank_affinity;
    }
    if (!ok) {
      std::string expect = std::to_string(want) + " (" + std::to_string(devices.size()) + " device columns";
      if (is_gpu && !extras.empty()) expect += " + " + join(extras, ", ");
      fail_at(i, "row " + label + " has " + std::to_string(c.size()) + " cells, expected " + expect +
                     "); is the row cut short or does a cell contain a space?");
    }
    Row r;
    r.line = int(i);
    for (size_t k = 0; k < devices.size(); ++k) {
      Link l;
      if (!parse_link_code(c[k], &l) || l.kind == LinkKind::Unknown)
        fail_at(i, "row " + label + ", column " + devices[k] + ": unknown link code '" + c[k] +
                       "'; expected X, NV<n>, PIX, PXB, PHB, NODE or SYS");
      if ((l.kind == LinkKind::Self) != (devices[k] == label))
        fail_at(i, "row " + label + ", column " + devices[k] + ": '" + c[k] + "'; X belongs exactly on the diagonal");
      r.links.push_back(l);
    }
    r.extras.assign(c.begin() + long(devices.size()), c.end());
    if (blank_affinity) {  // the present extras fill from the left; GPU NUMA ID is the last cell
      const std::string numa_id = r.extras.back();
      r.extras.pop_back();
      r.extras.resize(extras.size() - 1);
      r.extras.push_back(numa_id);
      blank_rows.push_back(label);
    }
    rows[label] = r;
  }
  std::vector<std::string> missing;
  for (const std::string& d : devices)
    if (!rows.count(d)) missing.push_back(d);
  if (!missing.empty())
    fail_at(header, "the matrix is not square: " + std::to_string(devices.size()) + " columns but " +
                        std::to_string(rows.size()) + " rows (no row for " + join(missing, ", ") + ")");
  TR_CHECK(G > 0, name, ":", header + 1, ": no GPU columns");

  // 3. The NIC legend (newer releases): "  NIC0: mlx5_0".
  std::map<std::string, std::string> nic_names;
  for (; i < lines.size(); ++i) {
    const std::string t = trim_space(lines[i]);
    const auto colon = t.find(':');
    if (t.rfind("NIC", 0) == 0 && colon != std::string::npos && colon > 3 && colon + 1 < t.size())
      nic_names[t.substr(0, colon)] = trim_space(t.substr(colon + 1));
  }

  // 4. Symmetry: nvidia-smi prints both halves; a mismatch means a damaged paste.
  for (size_t a = 0; a < devices.size(); ++a)
    for (size_t b = a + 1; b < devices.size(); ++b) {
      const Row& ra = rows[devices[a]];
      const Row& rb = rows[devices[b]];
      const Link& ab = ra.links[b];
      const Link& ba = rb.links[a];
      if (ab != ba)
        fail_at(size_t(std::max(ra.line, rb.line)),
                "the matrix is not symmetric: " + devices[a] + "-" + devices[b] + " is " + link_code(ab) + " but " +
                    devices[b] + "-" + devices[a] + " is " + link_code(ba));
    }

  // 5. The description.
  Topology t;
  t.sources.push_back("nvidia-smi topo -m: " + name);
  std::map<int, CpuList> numa_cpus;
  for (size_t g = 0; g < G; ++g) {
    const Row& r = rows[devices[g]];
    Gpu gpu;
    gpu.index = int(g);
    for (size_t e = 0; e < extras.size(); ++e) {
      const std::string& v = r.extras[e];
      if (extras[e] == "CPU Affinity") {
        try {
          gpu.cpus = parse_cpulist(v);
        } catch (const Error& err) {
          fail_at(size_t(r.line), devices[g] + ", CPU Affinity: " + err.what());
        }
      } else if (extras[e] == "NUMA Affinity" && v != "N/A") {
        const CpuList nodes = [&] {
          try {
            return parse_cpulist(v);  // same syntax: "0" or "0-1"
          } catch (const Error&) {
            fail_at(size_t(r.line), devices[g] + ", NUMA Affinity: '" + v + "' is not a NUMA node number");
          }
          return CpuList{};
        }();
        if (nodes.size() == 1) gpu.numa_node = nodes[0];
      }
    }
    if (gpu.numa_node >= 0) {
      CpuList& u = numa_cpus[gpu.numa_node];
      CpuList merged;
      std::set_union(u.begin(), u.end(), gpu.cpus.begin(), gpu.cpus.end(), std::back_inserter(merged));
      u = merged;
    }
    t.gpus.push_back(gpu);
    t.links.emplace_back(r.links.begin(), r.links.begin() + long(G));
  }
  for (const auto& [id, cpus] : numa_cpus) {
    NumaNode n;
    n.id = id;
    n.cpus = cpus;
    t.numa_nodes.push_back(n);
  }
  if (!numa_cpus.empty())
    t.notes.push_back("NUMA nodes and their CPUs inferred from the GPUs' CPU/NUMA Affinity; nodes without a GPU "
                      "are not listed");
  for (size_t k = G; k < devices.size(); ++k) {
    Nic nic;
    nic.name = nic_names.count(devices[k]) ? nic_names[devices[k]] : devices[k];
    // nvidia-smi lists verbs (RDMA) devices; whether each is InfiniBand or
    // RoCE is not in the matrix.
    nic.kind = NicKind::Rdma;
    for (size_t g = 0; g < G; ++g) nic.gpu_links.push_back(rows[devices[g]].links[k]);
    nic.nic_links.assign(rows[devices[k]].links.begin() + long(G), rows[devices[k]].links.end());
    t.nics.push_back(nic);
  }
  if (!blank_rows.empty())
    t.notes.push_back(join(blank_rows, ", ") + ": CPU Affinity/NUMA Affinity left blank by nvidia-smi (it could not "
                      "tell, e.g. in a VM); their CPUs and NUMA node are unknown");
  std::vector<std::string> unnamed;
  for (size_t k = G; k < devices.size(); ++k)
    if (!nic_names.count(devices[k]) && devices[k].rfind("NIC", 0) == 0) unnamed.push_back(devices[k]);
  if (!unnamed.empty())
    t.notes.push_back(join(unnamed, ", ") + ": no \"NIC Legend\" entry, so their device names (mlx5_0, ...) are "
                      "unknown");
  t.nvswitch = infer_nvswitch(t.links);
  if (t.nvswitch)
    t.notes.push_back("NVSwitch inferred: every GPU shows NV" + std::to_string(t.links[0][1].nvlinks) +
                      " to all " + std::to_string(G - 1) +
                      " others, more NVLinks than any GPU has (18), so they go through NVSwitch");
  validate_topology(t, name);
  return t;
}

namespace {

class NvidiaSmiSource : public TopologySource {
 public:
  explicit NvidiaSmiSource(std::string path) : path_(std::move(path)) {}
  std::string name() const override { return "nvidia-smi topo -m (" + path_ + ")"; }
  Topology read() override {
    std::ifstream f(path_, std::ios::binary);
    TR_CHECK(f, "topology: cannot open '", path_, "': no such file or not readable");
    std::stringstream ss;
    ss << f.rdbuf();
    return parse_nvidia_smi_topo(ss.str(), path_);
  }

 private:
  std::string path_;
};

}  // namespace

std::unique_ptr<TopologySource> make_nvidia_smi_source(const std::string& path) {
  return std::make_unique<NvidiaSmiSource>(path);
}

}  // namespace trainrun::topo
