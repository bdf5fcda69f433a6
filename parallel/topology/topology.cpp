// The topology description: link codes, CPU lists, structural checks and the
// JSON form. See topology.h for the model.
#include "parallel/topology/topology.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/common/error.h"

namespace trainrun::topo {

using json = nlohmann::json;

// ---- links ----------------------------------------------------------------------------

std::string link_code(const Link& l) {
  switch (l.kind) {
    case LinkKind::Self: return "X";
    case LinkKind::NVLink: return "NV" + std::to_string(l.nvlinks);
    case LinkKind::PIX: return "PIX";
    case LinkKind::PXB: return "PXB";
    case LinkKind::PHB: return "PHB";
    case LinkKind::Node: return "NODE";
    case LinkKind::Sys: return "SYS";
    case LinkKind::Unknown: break;
  }
  return "?";
}

bool parse_link_code(const std::string& code, Link* out) {
  static const std::pair<const char*, LinkKind> kFixed[] = {
      {"X", LinkKind::Self},   {"PIX", LinkKind::PIX},  {"PXB", LinkKind::PXB}, {"PHB", LinkKind::PHB},
      {"NODE", LinkKind::Node}, {"SYS", LinkKind::Sys}, {"SOC", LinkKind::Sys}, {"?", LinkKind::Unknown}};
  for (const auto& [text, kind] : kFixed)
    if (code == text) return *out = Link{kind, 0}, true;
  // NV<n>: n bonded NVLinks, 1..99 (18 per GPU on Hopper; a bigger number is a typo).
  if (code.size() >= 3 && code.size() <= 4 && code.compare(0, 2, "NV") == 0 &&
      std::all_of(code.begin() + 2, code.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
    const int n = std::stoi(code.substr(2));
    if (n < 1) return false;
    return *out = Link{LinkKind::NVLink, n}, true;
  }
  return false;
}

int link_distance(const Link& l) {
  switch (l.kind) {
    case LinkKind::Self: return 0;
    case LinkKind::NVLink: return 100 - std::min(l.nvlinks, 99);  // more links: closer
    case LinkKind::PIX: return 200;
    case LinkKind::PXB: return 300;
    case LinkKind::PHB: return 400;
    case LinkKind::Node: return 500;
    case LinkKind::Sys: return 600;
    case LinkKind::Unknown: break;
  }
  return 1000;
}

bool is_pcie(LinkKind k) {
  return k == LinkKind::PIX || k == LinkKind::PXB || k == LinkKind::PHB || k == LinkKind::Node || k == LinkKind::Sys;
}

// ---- CPU sets -------------------------------------------------------------------------

CpuList parse_cpulist(const std::string& text_in) {
  std::string text;
  for (char c : text_in)
    if (!std::isspace(static_cast<unsigned char>(c))) text += c;
  CpuList out;
  if (text.empty() || text == "N/A") return out;
  std::istringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    const auto dash = part.find('-');
    auto number = [&](const std::string& s) {
      TR_CHECK(!s.empty() && s.size() <= 6 && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(c); }),
               "'", text_in, "' is not a CPU list (expected e.g. 0-3,8,10-11)");
      return std::stoi(s);
    };
    const int lo = number(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : number(part.substr(dash + 1));
    TR_CHECK(lo <= hi, "'", text_in, "' is not a CPU list (range ", lo, "-", hi, " runs backwards)");
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string format_cpulist(const CpuList& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(cpus[i]);
    if (j > i) s += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return s;
}

CpuList intersect(const CpuList& a, const CpuList& b) {
  CpuList out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// ---- the description --------------------------------------------------------------------

std::string nic_kind_name(NicKind k) {
  switch (k) {
    case NicKind::InfiniBand: return "infiniband";
    case NicKind::RoCE: return "roce";
    case NicKind::Rdma: return "rdma";
    case NicKind::Ethernet: return "ethernet";
    case NicKind::Unknown: break;
  }
  return "unknown";
}

bool is_rdma(NicKind k) { return k == NicKind::InfiniBand || k == NicKind::RoCE || k == NicKind::Rdma; }

const NumaNode* Topology::numa(int id) const {
  for (const NumaNode& n : numa_nodes)
    if (n.id == id) return &n;
  return nullptr;
}

const PciBridge* Topology::bridge(const std::string& bus_id) const {
  for (const PciBridge& b : bridges)
    if (b.pci_bus_id == bus_id) return &b;
  return nullptr;
}

void validate_topology(const Topology& t, const std::string& where) {
  const size_t G = t.gpus.size();
  for (size_t i = 0; i < G; ++i)
    TR_CHECK(t.gpus[i].index == int(i), where, ": gpus[", i, "] has index ", t.gpus[i].index,
             "; GPUs must be listed in index order 0..", G - 1);
  TR_CHECK(t.links.size() == G, where, ": the link matrix has ", t.links.size(), " rows for ", G,
           " GPUs; it must be square (one row and one column per GPU)");
  for (size_t i = 0; i < G; ++i) {
    TR_CHECK(t.links[i].size() == G, where, ": row GPU", i, " of the link matrix has ", t.links[i].size(),
             " entries, expected ", G, " (the matrix must be square)");
    for (size_t j = 0; j < G; ++j) {
      const Link& l = t.links[i][j];
      TR_CHECK((l.kind == LinkKind::Self) == (i == j), where, ": link GPU", i, "-GPU", j, " is ", link_code(l),
               "; X belongs exactly on the diagonal");
    }
  }
  for (size_t i = 0; i < G; ++i)
    for (size_t j = i + 1; j < G; ++j)
      TR_CHECK(t.links[i][j] == t.links[j][i], where, ": link GPU", i, "-GPU", j, " is ", link_code(t.links[i][j]),
               " but GPU", j, "-GPU", i, " is ", link_code(t.links[j][i]), "; the matrix must be symmetric");
  for (const Nic& n : t.nics) {
    TR_CHECK(n.gpu_links.size() == G, where, ": NIC ", n.name, " has ", n.gpu_links.size(), " GPU links for ", G,
             " GPUs");
    TR_CHECK(n.nic_links.empty() || n.nic_links.size() == t.nics.size(), where, ": NIC ", n.name, " has ",
             n.nic_links.size(), " NIC links for ", t.nics.size(), " NICs");
  }
  // CUDA_VISIBLE_DEVICES=GPU-<uuid> must name one GPU.
  std::set<std::string> uuids;
  for (const Gpu& g : t.gpus)
    TR_CHECK(g.uuid.empty() || uuids.insert(g.uuid).second, where, ": GPU", g.index, " has uuid ", g.uuid,
             ", which another GPU has too; every GPU's uuid must be unique");
  std::set<int> ids;
  for (const NumaNode& n : t.numa_nodes)
    TR_CHECK(ids.insert(n.id).second, where, ": NUMA node ", n.id, " is listed twice");
  if (!t.p2p.empty()) {
    TR_CHECK(t.p2p.size() == G, where, ": the p2p matrix has ", t.p2p.size(), " rows for ", G, " GPUs");
    for (const auto& row : t.p2p) TR_CHECK(row.size() == G, where, ": the p2p matrix must be ", G, " x ", G);
  }
}

std::vector<std::vector<int>> nvlink_islands(const Topology& t) {
  const int G = t.gpu_count();
  std::vector<int> island(size_t(G), -1);
  std::vector<std::vector<int>> out;
  for (int s = 0; s < G; ++s) {
    if (island[size_t(s)] >= 0) continue;
    std::vector<int> members, stack = {s};
    island[size_t(s)] = int(out.size());
    while (!stack.empty()) {
      const int g = stack.back();
      stack.pop_back();
      members.push_back(g);
      for (int h = 0; h < G; ++h)
        if (island[size_t(h)] < 0 && t.links[size_t(g)][size_t(h)].kind == LinkKind::NVLink)
          island[size_t(h)] = int(out.size()), stack.push_back(h);
    }
    std::sort(members.begin(), members.end());
    out.push_back(members);
  }
  return out;
}

std::vector<int> nearest_gpus(const Nic& nic) {
  int best = 1 << 30;
  for (const Link& l : nic.gpu_links) best = std::min(best, link_distance(l));
  std::vector<int> out;
  for (size_t g = 0; g < nic.gpu_links.size(); ++g)
    if (link_distance(nic.gpu_links[g]) == best && nic.gpu_links[g].kind != LinkKind::Unknown) out.push_back(int(g));
  return out;
}

std::string normalize_bus_id(const std::string& id_in) {
  std::string id;
  for (char c : id_in) id += char(std::tolower(static_cast<unsigned char>(c)));
  const auto colon = id.find(':');
  if (colon == std::string::npos) return id;
  if (id.find(':', colon + 1) == std::string::npos) return "0000:" + id;  // "18:00.0": domain 0
  std::string domain = id.substr(0, colon);
  // NVML writes an 8-digit domain ("00000000:18:00.0"); sysfs writes 4.
  while (domain.size() > 4 && domain[0] == '0') domain.erase(0, 1);
  while (domain.size() < 4) domain = "0" + domain;
  return domain + id.substr(colon);
}

// ---- JSON -------------------------------------------------------------------------------

namespace {

json links_to_json(const std::vector<Link>& row) {
  json out = json::array();
  for (const Link& l : row) out.push_back(link_code(l));
  return out;
}

std::string acs_name(AcsState s) {
  return s == AcsState::Enabled ? "enabled" : s == AcsState::Disabled ? "disabled" : "unknown";
}

// Reads fields of one JSON object; every error names the file and the JSON
// path of the field ("gpus[2].numa_node").
class Reader {
 public:
  Reader(const json& obj, std::string where, std::string path)
      : obj_(obj), where_(std::move(where)), path_(std::move(path)) {
    TR_CHECK(obj_.is_object(), where_, ": ", path_.empty() ? "the top level" : path_, " must be a JSON object");
  }
  std::string at(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  const json* find(const char* key, bool required) const {
    auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) {
      TR_CHECK(!required, where_, ": ", at(key), " is missing");
      return nullptr;
    }
    return &*it;
  }
  template <typename T>
  T get(const char* key, T fallback, bool required = false) const {
    const json* v = find(key, required);
    if (!v) return fallback;
    if constexpr (std::is_same_v<T, bool>) {
      TR_CHECK(v->is_boolean(), where_, ": ", at(key), ": expected true or false, got ", v->dump());
    } else if constexpr (std::is_arithmetic_v<T>) {
      TR_CHECK(v->is_number_integer(), where_, ": ", at(key), ": expected an integer, got ", v->dump());
    } else {
      TR_CHECK(v->is_string(), where_, ": ", at(key), ": expected a string, got ", v->dump());
    }
    return v->get<T>();
  }
  CpuList cpus(const char* key) const {
    const std::string s = get<std::string>(key, "");
    try {
      return parse_cpulist(s);
    } catch (const Error& e) {
      TR_FAIL(where_, ": ", at(key), ": ", e.what());
    }
  }
  const json& array(const char* key, bool required) const {
    static const json empty = json::array();
    const json* v = find(key, required);
    if (!v) return empty;
    TR_CHECK(v->is_array(), where_, ": ", at(key), ": expected an array, got ", v->dump());
    return *v;
  }
  std::vector<Link> links(const json& arr, const std::string& path) const {
    TR_CHECK(arr.is_array(), where_, ": ", path, ": expected an array of link codes");
    std::vector<Link> out;
    for (size_t i = 0; i < arr.size(); ++i) {
      Link l;
      TR_CHECK(arr[i].is_string() && parse_link_code(arr[i].get<std::string>(), &l), where_, ": ", path, "[", i,
               "]: unknown link ", arr[i].dump(), "; expected X, NV<n>, PIX, PXB, PHB, NODE or SYS");
      out.push_back(l);
    }
    return out;
  }
  const std::string& where() const { return where_; }

 private:
  const json& obj_;
  std::string where_, path_;
};

std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

}  // namespace

json topology_to_json(const Topology& t) {
  json j;
  j["format"] = kTopologyFormat;
  j["version"] = kTopologyVersion;
  j["host"] = t.host;
  j["sources"] = t.sources;
  j["notes"] = t.notes;
  j["numa_nodes"] = json::array();
  for (const NumaNode& n : t.numa_nodes) {
    json o = {{"id", n.id}, {"cpus", format_cpulist(n.cpus)}, {"memory_mib", n.memory_mib}};
    if (!n.cores.empty()) {
      o["cores"] = json::array();
      for (const CpuList& c : n.cores) o["cores"].push_back(format_cpulist(c));
    }
    j["numa_nodes"].push_back(o);
  }
  j["gpus"] = json::array();
  for (const Gpu& g : t.gpus) {
    json o = {{"index", g.index},           {"name", g.name},
              {"pci_bus_id", g.pci_bus_id}, {"memory_mib", g.memory_mib},
              {"numa_node", g.numa_node},   {"cpus", format_cpulist(g.cpus)},
              {"compute_capability", g.compute_capability}};
    if (!g.uuid.empty()) o["uuid"] = g.uuid;
    if (!g.root_complex.empty()) o["root_complex"] = g.root_complex;
    if (!g.pci_path.empty()) o["pci_path"] = g.pci_path;
    j["gpus"].push_back(o);
  }
  j["links"] = json::array();
  for (const auto& row : t.links) j["links"].push_back(links_to_json(row));
  j["nvswitch"] = t.nvswitch;
  j["nvswitch_devices"] = t.nvswitch_devices;
  j["nics"] = json::array();
  for (const Nic& n : t.nics)
    j["nics"].push_back({{"name", n.name},
                         {"pci_bus_id", n.pci_bus_id},
                         {"numa_node", n.numa_node},
                         {"kind", nic_kind_name(n.kind)},
                         {"speed_mbps", n.speed_mbps},
                         {"netdev", n.netdev},
                         {"state", n.state},
                         {"gpu_links", links_to_json(n.gpu_links)},
                         {"nic_links", links_to_json(n.nic_links)},
                         // Derived from gpu_links, written for readers; ignored on load.
                         {"nearest_gpus", nearest_gpus(n)}});
  j["pci_bridges"] = json::array();
  for (const PciBridge& b : t.bridges)
    j["pci_bridges"].push_back({{"pci_bus_id", b.pci_bus_id}, {"acs", acs_name(b.acs)}, {"acs_detail", b.acs_detail}});
  if (!t.p2p.empty()) j["p2p"] = {{"source", t.p2p_source}, {"ok", t.p2p}};
  return j;
}

Topology topology_from_json(const json& j, const std::string& where) {
  Reader top(j, where, "");
  const std::string format = top.get<std::string>("format", "", true);
  TR_CHECK(format == kTopologyFormat, where, ": format is '", format, "', expected '", kTopologyFormat,
           "' (a file written by `trainrun topo --save`)");
  const int version = top.get<int>("version", 0, true);
  TR_CHECK(version == kTopologyVersion, where, ": version ", version, " is not supported (this build reads version ",
           kTopologyVersion, ")");
  Topology t;
  t.host = top.get<std::string>("host", "");
  for (size_t i = 0; i < top.array("sources", false).size(); ++i) {
    const json& s = top.array("sources", false)[i];
    TR_CHECK(s.is_string(), where, ": ", item("sources", i), ": expected a string");
    t.sources.push_back(s.get<std::string>());
  }
  for (const json& s : top.array("notes", false))
    if (s.is_string()) t.notes.push_back(s.get<std::string>());
  const json& numa = top.array("numa_nodes", false);
  for (size_t i = 0; i < numa.size(); ++i) {
    Reader r(numa[i], where, item("numa_nodes", i));
    NumaNode n;
    n.id = r.get<int>("id", 0, true);
    n.cpus = r.cpus("cpus");
    n.memory_mib = r.get<int64_t>("memory_mib", 0);
    const json& cores = r.array("cores", false);
    for (size_t c = 0; c < cores.size(); ++c) {
      TR_CHECK(cores[c].is_string(), where, ": ", r.at("cores"), "[", c, "]: expected a CPU list string");
      n.cores.push_back(parse_cpulist(cores[c].get<std::string>()));
    }
    t.numa_nodes.push_back(n);
  }
  const json& gpus = top.array("gpus", true);
  for (size_t i = 0; i < gpus.size(); ++i) {
    Reader r(gpus[i], where, item("gpus", i));
    Gpu g;
    g.index = r.get<int>("index", int(i));
    g.name = r.get<std::string>("name", "");
    g.pci_bus_id = r.get<std::string>("pci_bus_id", "");
    g.uuid = r.get<std::string>("uuid", "");
    g.memory_mib = r.get<int64_t>("memory_mib", 0);
    g.numa_node = r.get<int>("numa_node", -1);
    g.cpus = r.cpus("cpus");
    g.compute_capability = r.get<std::string>("compute_capability", "");
    g.root_complex = r.get<std::string>("root_complex", "");
    for (const json& p : r.array("pci_path", false))
      if (p.is_string()) g.pci_path.push_back(p.get<std::string>());
    t.gpus.push_back(g);
  }
  const json& links = top.array("links", true);
  for (size_t i = 0; i < links.size(); ++i) t.links.push_back(top.links(links[i], item("links", i)));
  t.nvswitch = top.get<bool>("nvswitch", false);
  t.nvswitch_devices = top.get<int>("nvswitch_devices", 0);
  const json& nics = top.array("nics", false);
  for (size_t i = 0; i < nics.size(); ++i) {
    Reader r(nics[i], where, item("nics", i));
    Nic n;
    n.name = r.get<std::string>("name", "", true);
    n.pci_bus_id = r.get<std::string>("pci_bus_id", "");
    n.numa_node = r.get<int>("numa_node", -1);
    const std::string kind = r.get<std::string>("kind", "unknown");
    bool known = false;
    for (NicKind k : {NicKind::InfiniBand, NicKind::RoCE, NicKind::Rdma, NicKind::Ethernet, NicKind::Unknown})
      if (kind == nic_kind_name(k)) n.kind = k, known = true;
    TR_CHECK(known, where, ": ", r.at("kind"), ": '", kind, "' is not one of infiniband, roce, rdma, ethernet, unknown");
    n.speed_mbps = r.get<int64_t>("speed_mbps", 0);
    n.netdev = r.get<std::string>("netdev", "");
    n.state = r.get<std::string>("state", "");
    n.gpu_links = r.links(r.array("gpu_links", true), r.at("gpu_links"));
    n.nic_links = r.links(r.array("nic_links", false), r.at("nic_links"));
    t.nics.push_back(n);
  }
  const json& bridges = top.array("pci_bridges", false);
  for (size_t i = 0; i < bridges.size(); ++i) {
    Reader r(bridges[i], where, item("pci_bridges", i));
    PciBridge b;
    b.pci_bus_id = r.get<std::string>("pci_bus_id", "", true);
    const std::string acs = r.get<std::string>("acs", "unknown");
    TR_CHECK(acs == "enabled" || acs == "disabled" || acs == "unknown", where, ": ", r.at("acs"), ": '", acs,
             "' is not one of enabled, disabled, unknown");
    b.acs = acs == "enabled" ? AcsState::Enabled : acs == "disabled" ? AcsState::Disabled : AcsState::Unknown;
    b.acs_detail = r.get<std::string>("acs_detail", "");
    t.bridges.push_back(b);
  }
  if (const json* p2p = top.find("p2p", false)) {
    Reader r(*p2p, where, "p2p");
    t.p2p_source = r.get<std::string>("source", "");
    const json& ok = r.array("ok", true);
    for (size_t i = 0; i < ok.size(); ++i) {
      TR_CHECK(ok[i].is_array(), where, ": p2p.ok[", i, "]: expected an array of 0/1");
      std::vector<int> row;
      for (const json& v : ok[i]) {
        TR_CHECK(v.is_number_integer(), where, ": p2p.ok[", i, "]: expected 0 or 1, got ", v.dump());
        row.push_back(v.get<int>());
      }
      t.p2p.push_back(row);
    }
  }
  validate_topology(t, where);
  return t;
}

Topology parse_topology_json(const std::string& text, const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // e.byte is 1-based; turn it into line:column so an editor can jump there.
    size_t line = 1, col = 1;
    for (size_t i = 0; i + 1 < e.byte && i < text.size(); ++i) {
      if (text[i] == '\n') ++line, col = 1;
      else ++col;
    }
    std::string what = e.what();
    const auto colon = what.find(": ", what.find("parse error"));
    if (colon != std::string::npos) what = what.substr(colon + 2);
    TR_FAIL(name, ":", line, ":", col, ": malformed JSON (", what,
            "); expected a topology description written by `trainrun topo --save`");
  }
  return topology_from_json(j, name);
}

Topology load_topology(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TR_CHECK(f, "topology: cannot open '", path, "': no such file or not readable");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_topology_json(ss.str(), path);
}

void save_topology(const Topology& t, const std::string& path) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  TR_CHECK(f, "topology: cannot write '", path, "'; check that the directory exists and is writable");
  f << topology_to_json(t).dump(2) << "\n";
  TR_CHECK(f.good(), "topology: cannot write '", path, "' (disk full?)");
}

}  // namespace trainrun::topo
