// The performance model behind `trainrun plan` and the run's MFU (see planner.h):
// hardware, the tp1 memory model, offload, the plan, its verdict and the
// recommended mesh. The tensor- and pipeline-parallel meshes are
// planner_tp.cpp and planner_pp.cpp.
#include "core/train/planner.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "core/common/error.h"
#include "core/common/text.h"
#include "core/train/planner_internal.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

namespace planner_detail {

std::string fixed(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

// Elements of each sharding unit, in the order parallel/ moves them.
std::vector<int64_t> unit_numels(const ModelArch& m) {
  std::vector<int64_t> u;
  for (const auto& unit : m.layout().units) u.push_back(unit.numel);
  return u;
}

}  // namespace planner_detail

using namespace planner_detail;

// ---- hardware ------------------------------------------------------------------------------

const std::vector<GpuSpec>& gpu_specs() {
  // NVIDIA datasheets (SXM parts): A100 312 TFLOP/s bf16 dense, NVLink 3
  // 600 GB/s total (300 per direction), no fp8; H100 989.4 TFLOP/s bf16 and
  // 1978.9 fp8 dense, NVLink 4 900 GB/s total (450 per direction); H200 the
  // H100's compute with 141 GB HBM3e. Memory is what nvidia-smi reports
  // (MiB). Network: a DGX A100 has one 200 Gb/s HDR port per GPU, DGX
  // H100/H200 one 400 Gb/s NDR port per GPU.
  static const std::vector<GpuSpec> t = {
      {"a100", "A100 SXM 80GB", 312e12, 0, 81920.0 * 1024 * 1024, 300e9, 25e9},
      {"h100", "H100 SXM 80GB", 989.4e12, 1978.9e12, 81559.0 * 1024 * 1024, 450e9, 50e9},
      {"h200", "H200 SXM 141GB", 989.4e12, 1978.9e12, 143771.0 * 1024 * 1024, 450e9, 50e9},
  };
  return t;
}

const GpuSpec* find_gpu_spec(const std::string& name) {
  const std::string n = ascii_lower(name);
  for (const auto& g : gpu_specs())
    if (n == g.key || n.find(g.key) != std::string::npos) return &g;
  return nullptr;
}

double parse_bytes(const std::string& text, const std::string& what) {
  const std::string t = trim_blanks(text);
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  std::string unit = ascii_lower(trim_blanks(end ? std::string(end) : ""));
  static const std::map<std::string, double> units = {
      {"b", 1},        {"kb", 1e3},     {"mb", 1e6},     {"gb", 1e9},     {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", kGiB}, {"tib", kGiB * 1024},
      {"k", 1024.0},   {"m", 1048576.0}, {"g", kGiB},    {"t", kGiB * 1024},
  };
  TR_CHECK(end != t.c_str() && std::isfinite(v), what, ": '", text, "' is not a size; write e.g. 80GiB or 80GB");
  TR_CHECK(!unit.empty(), what, ": '", text, "' has no unit; write e.g. 80GiB (2^30 bytes) or 80GB (10^9 bytes)");
  auto it = units.find(unit);
  TR_CHECK(it != units.end(), what, ": unknown unit '", unit, "' in '", text, "' (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)");
  TR_CHECK(v > 0, what, ": '", text, "' must be positive");
  return v * it->second;
}

std::string format_bytes(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::fabs(b) >= 1024 && i < 4) b /= 1024, ++i;
  return fixed(b, i ? 1 : 0) + " " + u[i];
}

DeviceModel DeviceModel::cpu() {
  DeviceModel d;
  d.act_bytes = 4;
  d.attention_probs = true;
  return d;
}

DeviceModel DeviceModel::gpu() {
  DeviceModel d;
  d.act_bytes = 2;
  d.attention_probs = false;
  // cuBLASLt's recommended workspace on Hopper is 32 MiB. The CUDA context
  // (~0.5 GiB), NCCL's channel buffers and the caching allocator's slack are
  // never cudaMalloc'd by us but still take device memory: 1 GiB, a
  // deliberately round assumption to be replaced by a measurement once the
  // CUDA backend runs.
  d.library_workspace = 32.0 * 1024 * 1024;
  d.runtime_reserve = kGiB;
  d.logits_align = 64;  // as the CUDA backend's logits_stride
  return d;
}

// ---- memory ----------------------------------------------------------------------------------

double estimate_activation_bytes(const ModelArch& m, int B, bool ckpt, const DeviceModel& d) {
  return m.activation_bytes(B, ckpt, d.activations());
}

namespace planner_detail {

// The memory model over a layout's units (the whole model's, or one TP
// rank's local layout) with a given activation arena.
MemoryBreakdown state_of_units(const std::vector<int64_t>& units, const Sharding& s, const DeviceModel& d) {
  MemoryBreakdown r;
  const double a = d.act_bytes;
  const bool extra_copy = d.act_bytes != 4;  // fp32 backends use the master weights directly
  if (s.strategy == "no_shard") {
    double P = 0;
    for (int64_t n : units) P += double(n);
    r.params = 4 * P + (extra_copy ? a * P : 0);
    r.grads = 4 * P;
    r.optimizer = 8 * P;
    // Offload: the act-dtype parameters (their own buffer, even in fp32)
    // and the all-reduce's gradient bucket stay.
    if (s.offload) r.params = a * P, r.optimizer = 0;
    // The all-reduce works in place; NCCL's / Gloo's own buffers are in the
    // runtime reserve (GPU) or outside the backend (CPU).
  } else {
    const int64_t G = std::max(1, s.group);
    double S = 0, Ppad = 0;
    for (int64_t n : units) {
      S += double(ceil_div(n, G));
      Ppad += double(ceil_div(n, G) * G);
    }
    r.params = 4 * S + (extra_copy ? a * S : 0) + (s.strategy == "shard_grad_op" ? a * Ppad : 0);
    r.grads = 4 * S;
    r.optimizer = 8 * S;
    if (s.offload) {
      r.params = a * S + (s.strategy == "shard_grad_op" ? a * Ppad : 0);
      r.optimizer = 0;
      // hybrid_shard across replica groups sums the shards on the device.
      if (!(s.strategy == "hybrid_shard" && s.world / G > 1) && !s.offload_grad_on_device) r.grads = 0;
    }
  }
  return r;
}

MemoryBreakdown memory_of_units(const std::vector<int64_t>& units, int L, int T, const Sharding& s, int B,
                                double activations, const DeviceModel& d) {
  MemoryBreakdown r = state_of_units(units, s, d);
  const double a = d.act_bytes;
  if (s.strategy != "no_shard") {
    const int64_t G = std::max(1, s.group);
    double max_shard = 0;
    for (int64_t n : units) max_shard = std::max(max_shard, double(ceil_div(n, G)));
    auto pad = [&](int64_t n) { return double(ceil_div(n, G) * G); };
    // parallel/sharding/sharding_sharded.cpp: a landing buffer for one reduce-scatter
    // shard; full-size fp32 gradient buckets for the embeddings (open for the
    // whole backward: the tied head writes into it first), the head, and two
    // blocks (the one computing, the one being reduce-scattered behind it);
    // full_shard / hybrid also gather parameters: embeddings (kept from the
    // end of forward into backward), head, and two blocks (the one in use and
    // the prefetched next one).
    const double nblk = double(std::min<int64_t>(2, L));
    const double unit_sum = pad(units.front()) + pad(units.back()) + nblk * pad(units[1]);
    r.comm = 4 * max_shard + 4 * unit_sum;
    if (s.strategy != "shard_grad_op") r.comm += a * unit_sum;
  }
  r.activations = activations;
  // Device copies of one micro-batch's inputs and targets (int32).
  r.workspace = 2 * r64(double(B) * double(T) * 4) + d.library_workspace + d.runtime_reserve;
  return r;
}

}  // namespace planner_detail

MemoryBreakdown estimate_memory(const ModelArch& m, const Sharding& s, int B, bool ckpt, const DeviceModel& d) {
  return memory_of_units(unit_numels(m), m.config().L, m.config().T, s, B, estimate_activation_bytes(m, B, ckpt, d), d);
}

namespace {
// The offloaded state of one rank over a layout's units (the whole model's,
// or a TP rank's local layout): fp32 master, two moments and the gradient
// shard, 16 bytes per element of its shard.
double offload_state_bytes(const std::vector<int64_t>& units, const Sharding& s) {
  const int64_t G = s.strategy == "no_shard" ? 1 : std::max(1, s.group);
  double S = 0;
  for (int64_t n : units) S += double(ceil_div(n, G));
  return 16.0 * S;
}
}  // namespace

double offload_host_bytes_per_rank(const ModelArch& m, const Sharding& s) {
  return offload_state_bytes(unit_numels(m), s);
}

// ---- the plan ------------------------------------------------------------------------------

namespace planner_detail {

// Offload's share of one row (tp1 or a TP mesh) with `units` the rank's
// layout: host memory per node (nvme: all four kinds on disk, streamed
// through a fixed set of I/O buffers per rank, parallel/sharding/offload.h;
// cpu: all of it in host memory), and the step time it adds. Per rank the
// state's elements are updated on the node's host threads shared by its
// ranks; the gradient comes down once per micro-batch (overlapped with
// backward, with the reduce-scatters; nvme with accumulation: once per
// step, summed on the device), the act-dtype parameters go up once per step.
void add_offload(PlanRow& row, const std::vector<int64_t>& units, const PlanRequest& req, double act_bytes,
                 CommVolume& c, const std::vector<int64_t>* more_units, const Sharding* more_sharding) {
  const bool nvme = req.offload == "nvme";
  double state = offload_state_bytes(units, row.sharding);
  if (more_units) state += offload_state_bytes(*more_units, *more_sharding);
  row.host_bytes_per_node = req.gpus_per_node * (nvme ? double(offload_nvme_host_bytes()) : state);
  if (req.host_memory > 0 && row.host_bytes_per_node > req.host_memory) row.fits = false;
  const double elems = state / 16.0;
  if (nvme) row.nvme_bytes_per_step = req.gpus_per_node * offload_nvme_bytes_per_step(elems, row.accum);
  const double adamw_s = elems * req.gpus_per_node / req.host_adamw_params_per_s;
  const double up_s = elems * act_bytes / req.pcie_bytes_per_s;
  // nvme with accumulation lands the device's summed shard once, after backward (exposed).
  if (row.sharding.offload_grad_on_device) c.exposed += elems * 4 / req.pcie_bytes_per_s;
  else c.overlapped += row.accum * elems * 4 / req.pcie_bytes_per_s;
  row.offload_s = adamw_s + up_s + row.nvme_bytes_per_step / req.nvme_bytes_per_s;
  c.exposed += row.offload_s;
}

// Seconds of collective traffic per step for one strategy, with ring
// algorithms (bytes * (n-1)/n for all-gather / reduce-scatter, 2x that for
// all-reduce, over the bus bandwidth as nccl-tests defines it), following
// when this code base issues each collective: no_shard all-reduces after
// backward (exposed); shard_grad_op reduce-scatters during backward
// (overlapped) and all-gathers the updated parameters after the optimizer
// (exposed); full_shard gathers each unit in forward and again in backward
// and reduce-scatters its gradient, all on the comm thread under compute;
// hybrid_shard does full_shard in its group and all-reduces the gradient
// shards across groups after backward (exposed).
CommVolume comm_time(const std::vector<int64_t>& units, const Sharding& s, int accum, double a, double bw_world,
                     double bw_group, double bw_replica) {
  CommVolume c;
  double P = 0;
  for (int64_t n : units) P += double(n);
  const int W = s.world;
  const int G = std::max(1, s.group);
  double S = 0, Ppad = 0;
  for (int64_t n : units) {
    S += double(ceil_div(n, G));
    Ppad += double(ceil_div(n, G) * G);
  }
  const double ring_g = G > 1 ? double(G - 1) / G : 0;
  if (s.strategy == "no_shard") {
    if (W > 1) c.exposed = 2.0 * (W - 1) / W * 4 * P / bw_world;
  } else if (s.strategy == "shard_grad_op") {
    c.overlapped = accum * ring_g * 4 * Ppad / bw_world;
    c.exposed = ring_g * a * Ppad / bw_world;
  } else {
    c.overlapped = accum * ring_g * (2 * a + 4) * Ppad / bw_group;
    const int R = W / G;
    if (R > 1) c.exposed = 2.0 * (R - 1) / R * 4 * S / bw_replica;
  }
  return c;
}

std::string gib(double b, int prec) { return fixed(b / kGiB, prec); }

std::string seconds(double s) {
  if (s <= 0) return "0";
  if (s < 1) return fixed(s * 1000, s < 0.01 ? 2 : 0) + " ms";
  return fixed(s, s < 10 ? 2 : 1) + " s";
}

std::string si(double v, const char* unit) {
  const char* p[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (std::fabs(v) >= 1000 && i < 5) v /= 1000, ++i;
  return fixed(v, v < 10 ? 2 : v < 100 ? 1 : 0) + " " + p[i] + unit;
}

std::string count_str(double n) {
  if (n >= 1e9) return fixed(n / 1e9, 3) + "B";
  if (n >= 1e6) return fixed(n / 1e6, 1) + "M";
  return fixed(n / 1e3, 1) + "k";
}

}  // namespace planner_detail

namespace {

std::string mesh_name(const PlanRow& r) {
  if (r.cp > 1)
    return "cp" + std::to_string(r.cp) + (r.tp > 1 ? " x tp" + std::to_string(r.tp) : "") + " x dp" +
           std::to_string(r.dp) + " full_shard over dp x cp";
  return "tp" + std::to_string(r.tp) + (r.pp > 1 ? " x pp" + std::to_string(r.pp) : "") + " x dp" +
         std::to_string(r.dp) + " " + r.sharding.strategy + (r.pp > 1 ? " (" + r.pp_schedule + ")" : "");
}

// The fastest mesh that fits (ties: the least memory), never with TP over
// PCIe when the node has NVLink, nor a TP group across nodes.
void recommend_mesh(Plan& plan) {
  const PlanRequest& req = plan.req;
  std::vector<const PlanRow*> all;
  for (const auto& r : plan.rows) all.push_back(&r);
  for (const auto& r : plan.tp_rows) all.push_back(&r);
  for (const auto& r : plan.pp_rows) all.push_back(&r);
  const PlanRow* best = nullptr;
  int fitting = 0;
  auto bad_link = [&](const PlanRow& r) {
    return r.tp_link == "cross-node" || (r.tp_link == "PCIe" && req.topology_has_nvlink);
  };
  auto pick = [&](const std::vector<const PlanRow*>& rows) {
    for (const PlanRow* r : rows) {
      if (!r->fits || bad_link(*r)) continue;
      ++fitting;
      // Ties: fewer cp ranks before more (less K/V traffic), then the least memory.
      const bool tie = best && std::fabs(r->step_s - best->step_s) <= 1e-9 * best->step_s;
      if (!best || r->step_s < best->step_s * (1 - 1e-9) ||
          (tie && (r->cp < best->cp || (r->cp == best->cp && r->mem.total() < best->mem.total()))))
        best = r;
    }
  };
  pick(all);
  // Context parallelism only when no mesh holds whole sequences: its step
  // time assumes the ring hides behind attention (NCCL's double buffering),
  // which has not been measured on a GPU yet.
  if (!best) {
    std::vector<const PlanRow*> cp;
    for (const auto& r : plan.cp_rows) cp.push_back(&r);
    pick(cp);
    all.insert(all.end(), cp.begin(), cp.end());
  }
  std::ostringstream o;
  if (!best) {
    o << "recommended: none; no mesh of tp 1/2/4/8, the pipeline degrees and the four strategies fits " << gib(plan.capacity)
      << " GiB per GPU here. Try " << (req.offload == "none" ? "--offload cpu, " : "") << "more nodes (--nodes)"
      << (req.checkpointing ? "" : ", --activation-checkpointing blocks") << " or a smaller micro-batch.";
    plan.recommendation = o.str();
    return;
  }
  // A faster mesh that fits but was set aside for its TP link is named.
  std::string passed;
  const PlanRow* faster = nullptr;
  for (const PlanRow* r : all)
    if (r->fits && bad_link(*r) && r->step_s < best->step_s && (!faster || r->step_s < faster->step_s)) faster = r;
  if (faster)
    passed = mesh_name(*faster) + " (" + seconds(faster->step_s) + " per step) would put TP over " + faster->tp_link +
             (faster->tp_link == "PCIe" ? " while this node has NVLink" : "");
  plan.has_recommendation = true;
  plan.recommended = *best;
  o << "recommended: " << mesh_name(*best) << (req.offload != "none" ? " with parallel.offload " + req.offload : "")
    << ": fits in " << gib(plan.capacity) << " GiB with " << gib(plan.capacity - best->mem.total()) << " GiB free, "
    << seconds(best->step_s) << " per step (" << fixed(best->mfu * 100, 0) << "% MFU), the fastest of the " << fitting
    << " meshes that fit; ";
  if (best->pp > 1)
    o << "pp" << best->pp << " stages over " << (best->pp_link == "network" ? "the network across nodes" : "NVLink")
      << " (bubble " << fixed(best->bubble * 100, 1) << "%, p2p " << seconds(best->p2p_s) << " per step), "
      << (best->tp > 1 ? "tp" + std::to_string(best->tp) + " inside an NVLink island (TP collectives " +
                             seconds(best->tp_comm_s) + " per step)"
                       : std::string("no tensor parallelism"))
      << ", dp" << best->dp << " " << best->sharding.strategy << " over the rest.";
  else if (best->cp > 1)
    o << "each sequence split over " << best->cp << " ranks (context parallelism, cp_mode " << req.cp_mode
      << "), the ring's K/V " << seconds(best->cp_ring_s) << " per step over " << best->cp_link << " ("
      << seconds(best->exposed_comm_s) << " exposed with the data-parallel collectives"
      << (best->tp > 1 ? " and tp" + std::to_string(best->tp) + "'s (" + seconds(best->tp_comm_s) + ")" : "")
      << ").";
  else if (best->tp == 1)
    o << "no tensor parallelism needed (TP would add activation collectives to every layer).";
  else if (best->tp_link == "NVLink")
    o << "tp stays inside an NVLink island (TP collectives " << seconds(best->tp_comm_s) << " per step).";
  else
    o << "tp runs over " << best->tp_link << " (this node has no NVLink; TP collectives " << seconds(best->tp_comm_s)
      << " per step).";
  if (!passed.empty()) o << " Not " << passed << ".";
  plan.recommendation = o.str();
}

}  // namespace

Plan make_plan(const PlanRequest& req) {
  Plan plan;
  plan.req = req;
  const GpuSpec* spec = find_gpu_spec(req.gpu);
  if (!spec) {
    std::string keys;
    for (const auto& g : gpu_specs()) keys += (keys.empty() ? "" : ", ") + g.key;
    TR_FAIL("--gpu: unknown GPU '", req.gpu, "' (known: ", keys,
            "); for one of these with another memory size, add --gpu-memory (e.g. --gpu a100 --gpu-memory 40GiB)");
  }
  plan.gpu = *spec;
  plan.capacity = req.gpu_memory > 0 ? req.gpu_memory : spec->memory_bytes;
  TR_CHECK(req.gpus_per_node >= 1, "--gpus: must be at least 1 (got ", req.gpus_per_node, ")");
  TR_CHECK(req.nodes >= 1, "--nodes: must be at least 1 (got ", req.nodes, ")");
  TR_CHECK(req.micro_batch >= 1, "micro-batch must be at least 1 (got ", req.micro_batch, ")");
  TR_CHECK(req.global_batch >= 1, "global batch must be at least 1 (got ", req.global_batch, ")");
  const int W = req.gpus_per_node * req.nodes;
  const int hybrid_group = req.shard_group_size > 0 ? req.shard_group_size : req.gpus_per_node;
  TR_CHECK(W % hybrid_group == 0, "parallel.shard_group_size (", hybrid_group, ") must divide the GPU count (", W, ")");
  const DeviceModel dev = DeviceModel::gpu();
  TR_CHECK(req.offload == "none" || req.offload == "cpu" || req.offload == "nvme", "--offload: '", req.offload,
           "' is not one of none, cpu, nvme");
  const bool offload = req.offload != "none", nvme = req.offload == "nvme";
  TR_CHECK(req.host_adamw_params_per_s > 0 && req.pcie_bytes_per_s > 0 && req.nvme_bytes_per_s > 0,
           "plan: --host-adamw, --pcie and --nvme-bandwidth must be positive");
  const double bw_intra = spec->nvlink_bytes_per_s * req.bus_efficiency;
  const double bw_inter = spec->network_bytes_per_s * req.bus_efficiency;
  const double bw_world = req.nodes > 1 ? bw_inter : bw_intra;
  const std::unique_ptr<ModelArch> arch = make_model_arch(req.model);
  const ModelArch& m = *arch;
  const ModelConfig& mc = m.config();
  // An adapter run: the frozen base computes its forward and input
  // gradient (4N), the adapters all three; what the step computes beyond
  // what MFU counts (DoRA's extra GEMMs, the head's unused weight gradient)
  // adds to its time, like the recompute below.
  const bool adapt = req.adapter.on();
  check_adapter_request(req.adapter, m);
  const AdapterUnits au = adapt ? adapter_units(m, m.layout(), req.adapter, dev) : AdapterUnits{};
  double adapter_total = 0;
  for (int64_t n : au.adapter) adapter_total += double(n);
  const double fpt = adapt ? adapter_flops_per_token(m, req.adapter) : m.flops_per_token();
  // Activation checkpointing reruns every block's forward once more in
  // backward: hardware FLOPs grow by the blocks' forward share (with
  // adapters: theirs too, and DoRA's recomputed x W^T).
  double block_params = 0;
  {
    auto u = unit_numels(m);
    for (size_t i = 1; i + 1 < u.size(); ++i) block_params += double(u[i]);
  }
  double recompute = req.checkpointing ? 2 * block_params + 4.0 * mc.L * mc.C * mc.T : 0;
  if (adapt) {
    const double extra = adapter_extra_flops_per_token(m, req.adapter);
    // DoRA's share of `extra` is 3 GEMMs per adapted linear, one of them
    // in the forward (x W^T again), which the recompute reruns.
    const double dora_forward = (extra - 2.0 * double(mc.V) * double(mc.C)) / 3;
    if (req.checkpointing) recompute += 2 * adapter_total + dora_forward;
    recompute += extra;
  }
  // What the optimizer trains (and the dp collectives reduce): the model,
  // or the adapters.
  const std::vector<int64_t> trained = adapt ? au.adapter : unit_numels(m);
  auto memory_at = [&](const Sharding& s, int b) {
    if (!adapt) return estimate_memory(m, s, b, req.checkpointing, dev);
    return adapter_memory_of_units(au, s, b, mc.T, estimate_activation_bytes(m, b, req.checkpointing, dev), dev, false);
  };

  for (const char* name : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    PlanRow row;
    row.dp = W;
    row.sharding.strategy = name;
    row.sharding.world = W;
    row.sharding.group = std::string(name) == "no_shard" ? 1 : std::string(name) == "hybrid_shard" ? hybrid_group : W;
    row.sharding.offload = offload;
    row.sharding.offload_grad_on_device = offload_keeps_device_grad(
        parse_offload_mode(req.offload), std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * W))));
    row.mem = memory_at(row.sharding, req.micro_batch);
    row.fits = row.mem.total() <= plan.capacity;
    // Memory grows with the micro-batch (activations, inputs) and nothing
    // else: the largest that fits by bisection on the exact model.
    auto fits_at = [&](int b) { return memory_at(row.sharding, b).total() <= plan.capacity; };
    if (fits_at(1)) {
      int lo = 1, hi = 2;
      while (hi <= (1 << 20) && fits_at(hi)) lo = hi, hi *= 2;
      while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        (fits_at(mid) ? lo : hi) = mid;
      }
      row.max_micro_batch = lo;
    }
    row.accum = std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * W)));
    const double tokens_gpu = double(row.accum) * req.micro_batch * double(mc.T);
    row.compute_s = tokens_gpu * (fpt + recompute) / (spec->bf16_flops * req.compute_efficiency);
    const double bw_group = row.sharding.group <= req.gpus_per_node ? bw_intra : bw_inter;
    const double bw_replica = req.nodes > 1 ? bw_inter : bw_intra;
    CommVolume c = comm_time(trained, row.sharding, row.accum, dev.act_bytes, bw_world, bw_group, bw_replica);
    if (adapt) c.overlapped += base_gather_seconds(au, row.sharding, row.accum, bw_group);
    if (offload) add_offload(row, trained, req, dev.act_bytes, c);
    row.comm_s = c.overlapped + c.exposed;
    row.exposed_comm_s = c.exposed;
    row.step_s = c.exposed + std::max(row.compute_s, c.overlapped);
    row.tokens_per_s = tokens_gpu * W / row.step_s;
    row.mfu = tokens_gpu * fpt / row.step_s / spec->bf16_flops;
    plan.rows.push_back(row);
  }

  // The verdict: the job's strategy (else full_shard, the one that holds
  // the least), and if it does not fit, the smallest number of nodes of this
  // size where full_shard fits at micro-batch 1.
  const std::string focus = req.job_strategy.empty() ? "full_shard" : req.job_strategy;
  const PlanRow* f = nullptr;
  for (const auto& r : plan.rows)
    if (r.sharding.strategy == focus) f = &r;
  TR_CHECK(f, "plan: unknown strategy '", focus, "'");
  std::ostringstream v;
  v << m.describe() << " (" << count_str(double(m.num_parameters())) << " parameters)";
  if (adapt)
    v << " with " << req.adapter.type << " adapters (r=" << req.adapter.rank << ", " << req.adapter.target_modules << ", "
      << count_str(adapter_total) << " trainable) on a frozen " << au.dtype << " base";
  v << " with " << focus
    << (req.checkpointing ? " and activation checkpointing" : " without activation checkpointing") << " on "
    << req.nodes << " x " << req.gpus_per_node << " " << spec->name << " (" << gib(plan.capacity) << " GiB each), micro-batch "
    << req.micro_batch << ": ";
  if (offload) v << "with parallel.offload: " << req.offload << ", ";
  if (f->fits) {
    v << "FITS, " << gib(f->mem.total()) << " of " << gib(plan.capacity) << " GiB per GPU; micro-batch up to "
      << f->max_micro_batch << "; about " << seconds(f->step_s) << " per step of " << req.global_batch
      << " sequences (" << fixed(f->mfu * 100, 0) << "% MFU).";
    if (offload)
      v << " Offload needs " << gib(f->host_bytes_per_node) << " GiB of host memory per node"
        << (nvme ? " (buffers; the state is on NVMe: " + gib(f->nvme_bytes_per_step) + " GiB read+written per step)"
                 : std::string(" (pinned where it can be)"))
        << " and adds " << seconds(f->offload_s) << " per step (host AdamW at " << si(req.host_adamw_params_per_s, "")
        << " params/s per node, PCIe " << fixed(req.pcie_bytes_per_s / 1e9, 0) << " GB/s per GPU).";
  } else if (offload && req.host_memory > 0 && f->host_bytes_per_node > req.host_memory &&
             f->mem.total() <= plan.capacity) {
    v << "DOES NOT FIT in host memory: offload needs " << gib(f->host_bytes_per_node) << " GiB per node, "
      << gib(req.host_memory) << " available; use --offload nvme or more nodes.";
  } else {
    v << "DOES NOT FIT: " << gib(f->mem.total()) << " GiB per GPU needed, " << gib(plan.capacity) << " available";
    const double state = f->mem.base + f->mem.params + f->mem.grads + f->mem.optimizer;
    v << " (" << (adapt ? "the frozen base, the adapters' parameters, gradients and optimizer state"
                        : "parameters, gradients and optimizer state")
      << " alone: " << gib(state) << " GiB).";
    if (f->max_micro_batch > 0) {
      v << " Micro-batch " << f->max_micro_batch << " fits.";
    } else {
      int need = 0;
      for (int nodes = req.nodes; nodes <= 4096 && !need; ++nodes) {
        Sharding s{"full_shard", nodes * req.gpus_per_node, nodes * req.gpus_per_node, offload};
        if (memory_at(s, 1).total() <= plan.capacity) need = nodes;
      }
      if (need) {
        Sharding s{"full_shard", need * req.gpus_per_node, need * req.gpus_per_node, offload};
        v << " Smallest cluster of these nodes where full_shard fits at micro-batch 1: " << need << " x "
          << req.gpus_per_node << " = " << need * req.gpus_per_node << " GPUs ("
          << gib(memory_at(s, 1).total()) << " GiB per GPU).";
      } else {
        v << " No cluster of up to 4096 such nodes holds it: the activations alone exceed one GPU.";
      }
    }
  }
  plan.verdict = v.str();
  plan_tensor_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  plan_pipeline_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  plan_context_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  plan_expert_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  // The verdict is about whole sequences on each rank; when only a split one fits, it says where.
  if (!f->fits)
    for (const PlanRow& r : plan.cp_rows)
      if (r.fits) {
        plan.verdict += " Split over " + std::to_string(r.cp) + " ranks (parallel.context_parallel: " +
                        std::to_string(r.cp) + ") the sequence fits: see the context-parallel rows.";
        break;
      }
  recommend_mesh(plan);
  return plan;
}

std::string render_plan(const Plan& p) {
  const auto& r = p.req;
  const std::unique_ptr<ModelArch> arch = make_model_arch(r.model);
  const ModelArch& m = *arch;
  std::ostringstream o;
  o << "model     " << m.describe() << ": " << count_str(double(m.num_parameters())) << " parameters, "
    << si(m.flops_per_token(), "FLOP") << " per token (6N + 12*L*C*T, N = " << count_str(double(m.matmul_parameters()))
    << ")\n";
  o << "hardware  " << r.nodes << " node" << (r.nodes == 1 ? "" : "s") << " x " << r.gpus_per_node << " " << p.gpu.name
    << ": " << gib(p.capacity) << " GiB, " << fixed(p.gpu.bf16_flops / 1e12, 0) << " TFLOP/s bf16 dense; bus "
    << fixed(p.gpu.nvlink_bytes_per_s * r.bus_efficiency / 1e9, 0) << " GB/s in a node";
  if (r.nodes > 1) o << ", " << fixed(p.gpu.network_bytes_per_s * r.bus_efficiency / 1e9, 0) << " GB/s between nodes";
  o << " (" << fixed(r.bus_efficiency * 100, 0) << "% of nominal)\n";
  o << "batch     micro-batch " << r.micro_batch << " x " << m.config().T << " tokens, " << r.global_batch
    << " sequences per step, activation checkpointing " << (r.checkpointing ? "on (blocks)" : "off") << "\n";
  // The launcher refuses a batch that does not split into whole
  // micro-batches on every GPU; the figures below round it up.
  const int64_t split = int64_t(r.micro_batch) * r.gpus_per_node * r.nodes;
  if (r.global_batch % split != 0)
    o << "note      " << r.global_batch << " sequences do not split into micro-batches of " << r.micro_batch
      << " over " << r.gpus_per_node * r.nodes << " GPUs: a job would be refused at launch; the figures assume "
      << ceil_div(r.global_batch, split) * split << " (use a multiple of " << split << ")\n";
  if (r.offload != "none")
    o << "offload   " << r.offload << ": fp32 master weights, moments and gradient shard off the GPU; host AdamW "
      << si(r.host_adamw_params_per_s, "") << " params/s per node, PCIe " << fixed(r.pcie_bytes_per_s / 1e9, 0)
      << " GB/s per GPU" << (r.offload == "nvme" ? ", NVMe " + fixed(r.nvme_bytes_per_s / 1e9, 0) + " GB/s per node" : "")
      << (r.host_memory > 0 ? ", " + gib(r.host_memory) + " GiB host memory per node" : "") << "\n";
  const bool adapt = r.adapter.on();
  if (adapt) render_adapter_line(r.adapter, m, o);
  if (adapt)
    o << "assumes   bf16 activations and adapter copies; the adapters' fp32 master weights, gradients and AdamW moments; "
      << "flash attention, " << fixed(r.compute_efficiency * 100, 0) << "% of peak in compute, 1 GiB runtime reserve\n\n";
  else
    o << "assumes   bf16 parameters/activations, fp32 master weights, gradients and AdamW moments, flash attention, "
      << fixed(r.compute_efficiency * 100, 0) << "% of peak in compute, 1 GiB runtime reserve\n\n";
  std::vector<std::pair<std::string, size_t>> cols = {
      {"strategy", 15}, {"shard", 6},  {"params", 8},   {"grads", 8}, {"optim", 8},     {"activ", 8},
      {"comm", 8},      {"work", 7},   {"total", 8},    {"fits", 5},  {"max mb", 7},    {"compute", 9},
      {"comm t", 9},    {"step", 9},   {"tok/s", 10},   {"MFU", 5}};
  if (adapt) cols.insert(cols.begin() + 2, {"base", 8});
  o << "per-GPU memory in GiB; times per optimizer step (comm t: collectives, overlapped or not)"
    << (adapt ? "; base: the frozen base; params, grads, optim: the adapters'" : "") << "\n";
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i == 0 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.rows) {
    const bool mark = row.sharding.strategy == r.job_strategy;
    std::vector<std::string> c = {
        row.sharding.strategy + (mark ? " *" : ""),
        std::to_string(row.sharding.group),
        adapt ? gib(row.mem.base, 2) : "",
        gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.comm, 2), gib(row.mem.workspace, 2), gib(row.mem.total(), 2),
        row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-",
        seconds(row.compute_s), seconds(row.comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%"};
    if (!adapt) c.erase(c.begin() + 2);
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i)
      line += i == 0 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    if (row.host_bytes_per_node > 0) line += "  host " + gib(row.host_bytes_per_node) + " GiB/node, +" + seconds(row.offload_s);
    o << line << "\n";
  }
  if (!r.job_strategy.empty()) o << "(* the job's parallel.sharding)\n";
  render_tp_table(p, o);
  render_pp_table(p, o);
  render_cp_table(p, o);
  render_ep_table(p, o);
  o << "\n" << p.verdict << "\n";
  o << p.recommendation << "\n";
  if (!p.ep_recommendation.empty()) o << p.ep_recommendation << "\n";
  return o.str();
}

}  // namespace trainrun
