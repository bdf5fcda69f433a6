// The performance model behind `trainrun plan` and the run's MFU (see planner.h).
#include "core/train/planner.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "core/common/error.h"
#include "core/model/tensor_parallel.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fixed(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of one buffer: the arenas start every buffer on 64 bytes.
double r64(double bytes) { return std::ceil(bytes / 64.0) * 64.0; }

// Elements of each sharding unit, in the order parallel/ moves them.
std::vector<int64_t> unit_numels(const ModelArch& m) {
  std::vector<int64_t> u;
  for (const auto& unit : m.layout().units) u.push_back(unit.numel);
  return u;
}

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

}  // namespace

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
  const std::string n = lower(name);
  for (const auto& g : gpu_specs())
    if (n == g.key || n.find(g.key) != std::string::npos) return &g;
  return nullptr;
}

double parse_bytes(const std::string& text, const std::string& what) {
  const std::string t = trim(text);
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  std::string unit = lower(trim(end ? std::string(end) : ""));
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

namespace {
// The memory model over a layout's units (the whole model's, or one TP
// rank's local layout) with a given activation arena.
MemoryBreakdown memory_of_units(const std::vector<int64_t>& units, int L, int T, const Sharding& s, int B,
                                double activations, const DeviceModel& d) {
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
    double S = 0, Ppad = 0, max_shard = 0;
    for (int64_t n : units) {
      const int64_t sh = ceil_div(n, G);
      S += double(sh);
      Ppad += double(sh * G);
      max_shard = std::max(max_shard, double(sh));
    }
    auto pad = [&](int64_t n) { return double(ceil_div(n, G) * G); };
    r.params = 4 * S + (extra_copy ? a * S : 0) + (s.strategy == "shard_grad_op" ? a * Ppad : 0);
    r.grads = 4 * S;
    r.optimizer = 8 * S;
    if (s.offload) {
      r.params = a * S + (s.strategy == "shard_grad_op" ? a * Ppad : 0);
      r.optimizer = 0;
      // hybrid_shard across replica groups sums the shards on the device.
      if (!(s.strategy == "hybrid_shard" && s.world / G > 1)) r.grads = 0;
    }
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

}  // namespace

MemoryBreakdown estimate_memory(const ModelArch& m, const Sharding& s, int B, bool ckpt, const DeviceModel& d) {
  return memory_of_units(unit_numels(m), m.config().L, m.config().T, s, B, estimate_activation_bytes(m, B, ckpt, d), d);
}


// ---- tensor parallelism --------------------------------------------------------------------

namespace {
double tp_activation_bytes(const ModelArch& m, const TpLocalShape& sh, bool sp, int B, bool ckpt, const DeviceModel& d);
MemoryBreakdown tp_memory(const ModelArch& m, const TensorParallelPlan& plan, bool sp, const Sharding& s, int B,
                          bool ckpt, const DeviceModel& d);
}  // namespace

double estimate_tp_activation_bytes(const ModelArch& m, int tp, bool sp, int B, bool ckpt, const DeviceModel& d) {
  if (tp <= 1) return estimate_activation_bytes(m, B, ckpt, d);
  return tp_activation_bytes(m, TensorParallelPlan(m, tp, 0).shape(), sp, B, ckpt, d);  // rank 0's sizes are every rank's
}

MemoryBreakdown estimate_tp_memory(const ModelArch& m, int tp, bool sp, const Sharding& s, int B, bool ckpt,
                                   const DeviceModel& d) {
  if (tp <= 1) return estimate_memory(m, s, B, ckpt, d);
  return tp_memory(m, TensorParallelPlan(m, tp, 0), sp, s, B, ckpt, d);
}

namespace {

double tp_activation_bytes(const ModelArch& m, const TpLocalShape& sh, bool sp, int B, bool ckpt, const DeviceModel& d) {
  const int tp = sh.tp;
  // Mirrors the networks' arenas under a TensorParallel context
  // (core/model/gpt2/gpt2.cpp, core/model/llama/llama.cpp): the same buffers
  // in the same sizes, each rounded up to 64 bytes.
  const ModelConfig& c = m.config();
  const bool llama = c.arch == "llama";
  const double es = d.act_bytes;
  const double N = double(B) * double(c.T), C = double(c.C), F = double(sh.F), HS = double(c.C / c.NH);
  const double NR = sp ? double(ceil_div(int64_t(N), tp)) : N;  // rows of the residual stream on this rank
  const double Q = sh.NH * HS;                                  // this rank's query width
  const double QKV = llama ? Q + 2.0 * sh.NKV * HS : 3 * Q;     // its q|k|v width
  const double saved = d.attention_probs ? double(B) * sh.NH * double(c.T) * double(c.T) : double(B) * sh.NH * double(c.T);
  const double ldv = std::ceil(double(sh.V_local) / d.logits_align) * d.logits_align;
  double layer = 0;
  layer += r64(NR * C * es);                                  // ln1 (rows; gathered into the shared buffer when read)
  layer += (llama ? 1 : 2) * r64(NR * 4);                     // its statistics (rows)
  layer += r64(N * QKV * es);                                 // q|k|v (heads / tp)
  layer += r64(N * Q * es);                                   // attention output (heads / tp)
  layer += r64(saved * 4);                                    // attention's saved state (heads / tp)
  layer += r64(NR * C * es);                                  // residual after attention (rows)
  layer += r64(NR * C * es);                                  // ln2 (rows)
  layer += (llama ? 1 : 2) * r64(NR * 4);                     // its statistics (rows)
  layer += llama ? r64(N * 2 * F * es) + r64(N * F * es)      // gate|up, silu(gate)*up (ffn / tp)
                 : 2 * r64(N * F * es);                       // fc, gelu(fc) (ffn / tp)
  double total = 0;
  if (llama) {
    total += r64(double(c.T) * HS * 4);                       // RoPE table
    total += r64(double(c.T) * C * es) + r64(double(c.T) * C * 4);  // zero position table, its gradient scratch
  }
  total += r64(NR * C * es);                                  // embeddings output (rows)
  total += double(c.L) * r64(NR * C * es);                    // block outputs (rows)
  total += double(ckpt ? 1 : c.L) * layer;
  total += r64(NR * C * es);                                  // final norm (rows)
  total += (llama ? 1 : 2) * r64(NR * 4);                     // its statistics
  total += r64(N * ldv * es);                                 // logits: this rank's vocab rows
  total += r64(N * 4);                                        // per-token losses
  total += r64(N * 4) + r64(2 * N * 4);                       // vocab-parallel cross-entropy: row max, sums
  total += r64(NR * C * es);                                  // backward: residual gradient (rows)
  if (sp) {
    total += r64(NR * C * es);                                // reduce-scattered rows
    total += r64(N * C * es);                                 // the gathered buffer: residual gradient, norm outputs
    total += r64((llama ? 1 : 2) * C * 4);                    // a norm's parameter gradients
  }
  total += r64(N * C * es);                                   // backward: dbuf_c
  total += r64(N * QKV * es);                                 // backward: dqkv
  total += r64(N * F * es);                                   // backward: the MLP hidden grad
  return total;
}

MemoryBreakdown tp_memory(const ModelArch& m, const TensorParallelPlan& plan, bool sp, const Sharding& s, int B,
                          bool ckpt, const DeviceModel& d) {
  std::vector<int64_t> units;
  for (const auto& u : plan.local_layout().units) units.push_back(u.numel);
  MemoryBreakdown r = memory_of_units(units, m.config().L, m.config().T, s, B,
                                      tp_activation_bytes(m, plan.shape(), sp, B, ckpt, d), d);
  // Replicated KV heads (tp > n_kv_head, Llama): fp32 scratch that sums the
  // replicas' q|k|v weight gradients (llama.cpp, outside the arena).
  const TpLocalShape& sh = plan.shape();
  if (m.config().arch == "llama" && sh.kv_replicas > 1) {
    const double HS = double(m.config().C / m.config().NH), C = double(m.config().C);
    const double QKV = sh.NH * HS + 2.0 * sh.NKV * HS;
    r.workspace += r64(QKV * C * 4) + r64(double(m.config().kv_heads()) * 2 * sh.NKV * HS * C * 4);
  }
  return r;
}

}  // namespace

// ---- pipeline parallelism ------------------------------------------------------------------

double pipeline_bubble_formula(const std::string& kind, int p, int v, int m) {
  TR_CHECK(p >= 1 && m >= 1 && v >= 1, "pipeline bubble: pp ", p, ", v ", v, " and microbatches ", m, " must be >= 1");
  const double idle = double(p - 1);
  if (kind == "gpipe" || kind == "1f1b") return idle / m;
  if (kind == "interleaved_1f1b") return idle / (double(v) * m);
  if (kind == "zero_bubble") return idle / (3.0 * m);
  TR_FAIL("--pp-schedule: unknown schedule '", kind, "' (use 1f1b, gpipe, interleaved_1f1b or zero_bubble)");
}

namespace {
// One microbatch's TP activation arena for a model of `layers` blocks
// (tp_activation_bytes on the same shape with L = layers).
double arena_of_layers(const ModelArch& m, int tp, bool sp, int layers, int B, bool ckpt, const DeviceModel& d) {
  ModelConfig c = m.config();
  c.L = layers;
  const std::unique_ptr<ModelArch> a = make_model_arch(c);
  return estimate_tp_activation_bytes(*a, tp, sp, B, ckpt, d);
}
}  // namespace

namespace {
// estimate_pipeline_memory with the TP plan built once by the caller (a
// 70B model's plan is costly to build, and the planner asks for every
// strategy of every mesh).
std::vector<PipelineStageMemory> pipeline_memory(const ModelArch& m, const TensorParallelPlan& tpp, bool sp, int pp,
                                                 const std::string& kind, int v, int mb_count, const Sharding& s,
                                                 int B, bool ckpt, const DeviceModel& d) {
  const ModelConfig& mc = m.config();
  const int tp = tpp.shape().tp;
  const PipelineSchedule sched = make_pipeline_schedule(kind, pp, v, mb_count);
  const PipelineStats stats = simulate_pipeline_schedule(sched);
  const std::vector<int> split = split_pipeline_layers(mc.L, pp * v, {});
  // The TP-local layout's units: embeddings, L blocks, head (tp 1: the model's).
  std::vector<int64_t> units;
  if (tp > 1) {
    for (const auto& u : tpp.local_layout().units) units.push_back(u.numel);
  } else {
    units = unit_numels(m);
  }
  // Activations: the executor holds one stage network per microbatch in
  // flight, each with its own arena: what its blocks add (per block: what
  // one more block adds to a microbatch's arena; with checkpointing only
  // its output) plus the rest (embedding output, backward scratch; the
  // final norm and logits only on the last stage).
  const double a1 = arena_of_layers(m, tp, sp, 1, B, ckpt, d), a2 = arena_of_layers(m, tp, sp, 2, B, ckpt, d);
  const double per_layer = a2 - a1, fixed_part = a1 - per_layer;
  // What a stage network without the head does not allocate: the final
  // norm and its statistics, the logits and the per-token losses (and the
  // vocab-parallel cross-entropy's row buffers under TP), as the arenas
  // of core/model/gpt2|llama size them.
  double head_part = 0;
  {
    const TpLocalShape sh = tpp.shape();
    const double N = double(B) * mc.T, es = d.act_bytes;
    const double NR = sp && tp > 1 ? double(ceil_div(int64_t(N), tp)) : N;
    const double V = tp > 1 ? double(sh.V_local) : double(mc.V);
    const double ldv = std::ceil(V / d.logits_align) * d.logits_align;
    head_part = r64(NR * mc.C * es) + (mc.arch == "llama" ? 1 : 2) * r64(NR * 4) + r64(N * ldv * es) + r64(N * 4);
    if (tp > 1) head_part += r64(N * 4) + r64(2 * N * 4);
  }
  // zero_bubble's kept output gradients (the networks' kept_ buffers):
  // every block of every microbatch network a rank holds keeps the output
  // gradients its deferred weight step reads: q|k|v, the attention
  // projection's and the MLP's outputs, and GPT-2's MLP hidden (Llama's
  // gate|up gradient stays in its activation).
  double kept_grads = 0;
  if (kind == "zero_bubble") {
    const TpLocalShape sh = tpp.shape();
    const double HS = double(mc.C / mc.NH), N = double(B) * mc.T, es = d.act_bytes;
    const bool llama = mc.arch == "llama";
    const double QKV = llama ? sh.NH * HS + 2.0 * sh.NKV * HS : 3.0 * sh.NH * HS;
    kept_grads = r64(N * QKV * es) + 2 * r64(N * mc.C * es) + (llama ? 0 : r64(N * sh.F * es));
  }
  std::vector<PipelineStageMemory> out;
  for (int r = 0; r < pp; ++r) {
    PipelineStageMemory st;
    st.rank = r;
    std::vector<int64_t> mine;
    int first_layer_of_rank_chunk = 0, max_chunk = 0;
    std::vector<int> starts(split.size(), 0);
    for (size_t i = 1; i < split.size(); ++i) starts[i] = starts[i - 1] + split[i - 1];
    for (int c = 0; c < v; ++c) {
      const int vs = r + c * pp;
      first_layer_of_rank_chunk = starts[size_t(vs)];
      max_chunk = std::max(max_chunk, split[size_t(vs)]);
      st.layers += split[size_t(vs)];
      if (vs == 0) mine.push_back(units.front());  // the embedding
      for (int l = 0; l < split[size_t(vs)]; ++l) mine.push_back(units[size_t(1 + first_layer_of_rank_chunk + l)]);
      if (vs == pp * v - 1) {
        mine.push_back(units.back());  // final norm and head
        // A tied head reads the embedding: the last stage holds a copy.
        if (mc.tied && r != 0) mine.push_back(units.front());
      }
    }
    // memory_of_units reads [0], [1] and back() for its gather buffers; a
    // stage of one block pads with empty units (which hold nothing).
    while (mine.size() < 3) mine.push_back(0);
    st.in_flight = stats.peak_in_flight[size_t(r)];
    // zero_bubble: microbatches whose input gradient is done and weight
    // gradient not, at most at once (ZB-H1 defers r of them on rank r).
    int open = 0;
    for (const auto& a : sched.actions[size_t(r)]) {
      if (a.op == PipeOp::BI) st.deferred = std::max(st.deferred, ++open);
      if (a.op == PipeOp::BW) --open;
    }
    const bool has_head = r == pp - 1;
    const double acts = st.in_flight * (max_chunk * (per_layer + kept_grads) + fixed_part - (has_head ? 0 : head_part));
    st.mem = memory_of_units(mine, st.layers, mc.T, s, B, acts, d);
    out.push_back(st);
  }
  return out;
}
}  // namespace

std::vector<PipelineStageMemory> estimate_pipeline_memory(const ModelArch& m, int tp, bool sp, int pp,
                                                          const std::string& kind, int v, int mb_count,
                                                          const Sharding& s, int B, bool ckpt, const DeviceModel& d) {
  return pipeline_memory(m, TensorParallelPlan(m, std::max(1, tp), 0), sp, pp, kind, v, mb_count, s, B, ckpt, d);
}

int tp_collectives_per_micro_batch(const ModelConfig& c, bool ckpt) {
  return 4 * c.L + 2 + (ckpt ? 2 * c.L : 0);
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

namespace {

struct CommVolume {
  double overlapped = 0, exposed = 0;  // seconds
};

// Offload's share of one row (tp1 or a TP mesh) with `units` the rank's
// layout: host memory per node (nvme: all four kinds on disk, streamed
// through a fixed set of I/O buffers per rank, parallel/sharding/offload.h;
// cpu: all of it in host memory), and the step time it adds. Per rank the
// state's elements are updated on the node's host threads shared by its
// ranks; the gradient comes down once per micro-batch (overlapped with
// backward, with the reduce-scatters), the act-dtype parameters go up once
// per step.
void add_offload(PlanRow& row, const std::vector<int64_t>& units, const PlanRequest& req, double act_bytes,
                 CommVolume& c) {
  const bool nvme = req.offload == "nvme";
  const double state = offload_state_bytes(units, row.sharding);
  row.host_bytes_per_node = req.gpus_per_node * (nvme ? double(offload_nvme_host_bytes()) : state);
  if (req.host_memory > 0 && row.host_bytes_per_node > req.host_memory) row.fits = false;
  const double elems = state / 16.0;
  if (nvme) row.nvme_bytes_per_step = req.gpus_per_node * offload_nvme_bytes_per_step(elems, row.accum);
  const double adamw_s = elems * req.gpus_per_node / req.host_adamw_params_per_s;
  const double up_s = elems * act_bytes / req.pcie_bytes_per_s;
  c.overlapped += row.accum * elems * 4 / req.pcie_bytes_per_s;
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

std::string gib(double b, int prec = 1) { return fixed(b / kGiB, prec); }

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

// 70553706496 -> "70.554B", 124439808 -> "124.4M", 27008 -> "27.0k".
std::string count_str(double n) {
  if (n >= 1e9) return fixed(n / 1e9, 3) + "B";
  if (n >= 1e6) return fixed(n / 1e6, 1) + "M";
  return fixed(n / 1e3, 1) + "k";
}

std::string pad_right(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }
std::string pad_left(const std::string& s, size_t w) { return s.size() >= w ? s : std::string(w - s.size(), ' ') + s; }


// Tensor-parallel meshes: tp 2, 4, 8 x the strategies over dp = W / tp.
// Every TP rank computes 1/tp of each GEMM; the TP collectives
// (tp_collectives_per_micro_batch) sit between GEMMs, so they add to the
// step rather than hide under it; the dp collectives are those of the
// TP-local layout over the dp group.
void plan_tensor_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra, double bw_inter,
                          double recompute, double fpt) {
  const PlanRequest& req = plan.req;
  const ModelConfig& mc = m.config();
  const int W = req.gpus_per_node * req.nodes;
  for (int tp : {2, 4, 8}) {
    auto skip = [&](const std::string& why) { plan.tp_not_offered.push_back({tp, why}); };
    if (tp > W) {
      skip("more than the " + std::to_string(W) + " GPUs");
      continue;
    }
    if (W % tp != 0) {
      skip("does not divide the " + std::to_string(W) + " GPUs");
      continue;
    }
    try {
      check_tensor_parallel(mc, tp);
    } catch (const Error& e) {
      skip(e.what());
      continue;
    }
    // The TP group's link: the topology's, else NVLink inside a node.
    std::string link = tp <= req.gpus_per_node ? "NVLink" : "cross-node";
    double bw = tp <= req.gpus_per_node ? plan.gpu.nvlink_bytes_per_s : plan.gpu.network_bytes_per_s;
    for (const auto& l : req.tp_links)
      if (l.tp == tp) link = l.kind, bw = l.bytes_per_s;
    const double bw_tp = bw * req.bus_efficiency;
    const int dp = W / tp;
    const TensorParallelPlan tp_plan(m, tp, 0);  // every rank's sizes are rank 0's
    std::vector<int64_t> units;
    for (const auto& u : tp_plan.local_layout().units) units.push_back(u.numel);
    const int hybrid_dp = req.shard_group_size > 0 ? req.shard_group_size : std::max(1, req.gpus_per_node / tp);
    for (const char* name : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
      const std::string strategy = name;
      PlanRow row;
      row.tp = tp;
      row.dp = dp;
      row.tp_link = link;
      row.sharding.strategy = strategy;
      row.sharding.world = dp;
      row.sharding.group = strategy == "no_shard" ? 1 : strategy == "hybrid_shard" ? hybrid_dp : dp;
      if (strategy == "hybrid_shard" && dp % hybrid_dp != 0) continue;  // no such mesh
      row.sharding.offload = req.offload != "none";
      row.mem = tp_memory(m, tp_plan, req.sequence_parallel, row.sharding, req.micro_batch, req.checkpointing, dev);
      row.fits = row.mem.total() <= plan.capacity;
      auto fits_at = [&](int b) {
        return tp_memory(m, tp_plan, req.sequence_parallel, row.sharding, b, req.checkpointing, dev).total() <=
               plan.capacity;
      };
      if (fits_at(1)) {
        int lo = 1, hi = 2;
        while (hi <= (1 << 20) && fits_at(hi)) lo = hi, hi *= 2;
        while (hi - lo > 1) {
          const int mid = lo + (hi - lo) / 2;
          (fits_at(mid) ? lo : hi) = mid;
        }
        row.max_micro_batch = lo;
      }
      row.accum = std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * dp)));
      const double tokens_dp = double(row.accum) * req.micro_batch * double(mc.T);  // per TP group
      row.compute_s = tokens_dp * (fpt + recompute) / tp / (plan.gpu.bf16_flops * req.compute_efficiency);
      const double act = double(req.micro_batch) * mc.T * mc.C * dev.act_bytes;
      row.tp_comm_s = row.accum * tp_collectives_per_micro_batch(mc, req.checkpointing) * 2.0 * (tp - 1) / tp * act / bw_tp;
      // A dp group of g ranks spans g * tp GPUs.
      const double bw_world = req.nodes > 1 ? bw_inter : bw_intra;
      const double bw_group = row.sharding.group * tp <= req.gpus_per_node ? bw_intra : bw_inter;
      CommVolume c = comm_time(units, row.sharding, row.accum, dev.act_bytes, bw_world, bw_group, bw_world);
      if (row.sharding.offload) add_offload(row, units, req, dev.act_bytes, c);  // the rank's TP slice
      row.comm_s = c.overlapped + c.exposed + row.tp_comm_s;
      row.exposed_comm_s = c.exposed + row.tp_comm_s;
      row.step_s = row.exposed_comm_s + std::max(row.compute_s, c.overlapped);
      row.tokens_per_s = tokens_dp * dp / row.step_s;
      row.mfu = tokens_dp * dp * fpt / W / row.step_s / plan.gpu.bf16_flops;
      plan.tp_rows.push_back(row);
    }
  }
}

// Pipeline meshes: tp (1 and the offered TP degrees) x pp x dp = W, pp
// outermost as parallel/mesh lays it out (so with more than one node some
// stage boundary crosses nodes). For each (tp, pp) the best strategy.
void plan_pipeline_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra,
                            double bw_inter, double recompute, double fpt) {
  const PlanRequest& req = plan.req;
  const ModelConfig& mc = m.config();
  const int W = req.gpus_per_node * req.nodes;
  const std::string kind = req.pp_schedule.empty() ? "1f1b" : req.pp_schedule;
  pipeline_bubble_formula(kind, 1, 1, 1);  // an unknown schedule is an error
  const int v = req.pp_virtual_stages > 0 ? req.pp_virtual_stages : kind == "interleaved_1f1b" ? 2 : 1;
  TR_CHECK(kind == "interleaved_1f1b" || v == 1, "--pp-virtual-stages ", v, ": only interleaved_1f1b has chunks (got --pp-schedule ", kind, ")");
  std::vector<int> degrees = {2, 4, 8};
  for (int p = 16; p <= W && p <= mc.L; p *= 2) degrees.push_back(p);
  if (req.nodes > 1) degrees.push_back(req.nodes);
  std::sort(degrees.begin(), degrees.end());
  degrees.erase(std::unique(degrees.begin(), degrees.end()), degrees.end());
  std::vector<int> tps = {1};
  for (const auto& r : plan.tp_rows)
    if (std::find(tps.begin(), tps.end(), r.tp) == tps.end()) tps.push_back(r.tp);
  const std::string L = std::to_string(mc.L), Ws = std::to_string(W);
  // One TP plan per degree, and its local layout's units.
  std::map<int, std::unique_ptr<TensorParallelPlan>> tp_plans;
  std::map<int, std::vector<int64_t>> tp_units;
  for (int tp : tps) {
    tp_plans[tp] = std::make_unique<TensorParallelPlan>(m, tp, 0);
    if (tp > 1) {
      for (const auto& u : tp_plans[tp]->local_layout().units) tp_units[tp].push_back(u.numel);
    } else {
      tp_units[tp] = unit_numels(m);
    }
  }
  for (int pp : degrees) {
    const std::string name = "pp" + std::to_string(pp);
    auto skip = [&](const std::string& n, const std::string& why) { plan.pp_not_offered.push_back({n, why}); };
    if (req.offload != "none") {
      skip(name, "parallel.offload does not run with pipeline parallelism (the loader refuses it)");
      continue;
    }
    if (pp > W) { skip(name, "more stages than the " + Ws + " GPUs"); continue; }
    if (W % pp != 0) { skip(name, "does not divide the " + Ws + " GPUs"); continue; }
    if (pp * v > mc.L) { skip(name, "more stages than the model's " + L + " layers"); continue; }
    if (kind == "zero_bubble" && req.checkpointing) {
      skip(name, "zero_bubble with train.activation_checkpointing: blocks is refused at load (the weight step needs "
                 "every block's inputs); use --pp-schedule 1f1b or checkpointing none");
      continue;
    }
    if (mc.L % (pp * v) != 0) {
      skip(name, "does not divide the model's " + L + " layers into " + std::to_string(pp * v) +
                     " equal stages (an uneven split runs with parallel.pipeline_layers; the planner plans even ones)");
      continue;
    }
    const std::string link = req.nodes > 1 ? "network" : "NVLink";
    const double bw_link = req.nodes > 1 ? bw_inter : bw_intra;
    for (int tp : tps) {
      const std::string mesh = "tp" + std::to_string(tp) + " x " + name;
      if (tp * pp > W) { skip(mesh, "tp x pp = " + std::to_string(tp * pp) + " is more than the " + Ws + " GPUs"); continue; }
      if (W % (tp * pp) != 0) { skip(mesh, "tp x pp does not divide the " + Ws + " GPUs"); continue; }
      const int dp = W / (tp * pp);
      const int accum = std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * dp)));
      try {
        make_pipeline_schedule(kind, pp, v, accum);
      } catch (const Error& e) {
        skip(mesh, std::string(e.what()) + " (" + std::to_string(accum) + " microbatches per step: raise --global-batch)");
        continue;
      }
      const int hybrid_dp = req.shard_group_size > 0 ? req.shard_group_size
                                                     : std::max(1, std::min(dp, req.gpus_per_node / tp));
      PlanRow best;
      bool have = false;
      for (const char* sname : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
        const std::string strategy = sname;
        PlanRow row;
        row.tp = tp, row.pp = pp, row.dp = dp, row.pp_schedule = kind, row.pp_v = v, row.pp_link = link;
        row.tp_link = tp == 1 ? "none" : tp <= req.gpus_per_node ? "NVLink" : "cross-node";
        for (const auto& l : req.tp_links)
          if (l.tp == tp) row.tp_link = l.kind;
        row.sharding.strategy = strategy;
        row.sharding.world = dp;
        row.sharding.group = strategy == "no_shard" ? 1 : strategy == "hybrid_shard" ? hybrid_dp : dp;
        if (strategy == "hybrid_shard" && dp % hybrid_dp != 0) continue;
        const auto stages = pipeline_memory(m, *tp_plans[tp], req.sequence_parallel, pp, kind, v, accum, row.sharding,
                                            req.micro_batch, req.checkpointing, dev);
        for (const auto& st : stages)
          if (st.mem.total() > row.mem.total()) row.mem = st.mem, row.worst_stage = st.rank, row.worst_in_flight = st.in_flight;
        row.fits = row.mem.total() <= plan.capacity;
        row.accum = accum;
        row.bubble = pipeline_bubble_formula(kind, pp, v, accum);
        const double tokens_dp = double(accum) * req.micro_batch * double(mc.T);  // per pipeline
        row.compute_s = tokens_dp * (fpt + recompute) / (double(tp) * pp) / (plan.gpu.bf16_flops * req.compute_efficiency);
        double bw_tp = (tp <= req.gpus_per_node ? plan.gpu.nvlink_bytes_per_s : plan.gpu.network_bytes_per_s);
        for (const auto& l : req.tp_links)
          if (l.tp == tp) bw_tp = l.bytes_per_s;
        bw_tp *= req.bus_efficiency;
        const double act = double(req.micro_batch) * mc.T * mc.C * dev.act_bytes;
        // A stage runs 1/pp of the blocks' TP collectives.
        row.tp_comm_s = tp > 1 ? accum * double(tp_collectives_per_micro_batch(mc, req.checkpointing)) / pp * 2.0 *
                                     (tp - 1) / tp * act / bw_tp
                               : 0;
        // p2p: per microbatch and chunk boundary an activation (b x t x d;
        // 1/tp of it per TP rank with sequence parallelism) forward and its
        // gradient back; counted as exposed (the schedules wait on them).
        const double msg = act / (req.sequence_parallel ? tp : 1);
        row.p2p_s = 2.0 * accum * v * msg / bw_link;
        // dp collectives of the worst stage's share (sharding_* over dp).
        const double stage_share = 1.0 / pp;
        std::vector<int64_t> units;
        for (int64_t n : tp_units[tp]) units.push_back(int64_t(double(n) * stage_share));
        const double bw_world = dp * tp <= req.gpus_per_node ? bw_intra : bw_inter;
        const double bw_group = row.sharding.group * tp <= req.gpus_per_node ? bw_intra : bw_inter;
        CommVolume c = comm_time(units, row.sharding, accum, dev.act_bytes, bw_world, bw_group, bw_world);
        row.comm_s = c.overlapped + c.exposed + row.tp_comm_s + row.p2p_s;
        row.exposed_comm_s = c.exposed + row.tp_comm_s + row.p2p_s;
        row.step_s = row.exposed_comm_s + std::max(row.compute_s * (1 + row.bubble), c.overlapped);
        row.tokens_per_s = tokens_dp * dp / row.step_s;
        row.mfu = tokens_dp * dp * fpt / W / row.step_s / plan.gpu.bf16_flops;
        const bool better = !have || (row.fits && !best.fits) ||
                            (row.fits == best.fits && (row.fits ? row.step_s < best.step_s : row.mem.total() < best.mem.total()));
        if (better) best = row, have = true;
      }
      if (have) plan.pp_rows.push_back(best);
    }
  }
}

std::string mesh_name(const PlanRow& r) {
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
  for (const PlanRow* r : all) {
    if (!r->fits || bad_link(*r)) continue;
    ++fitting;
    if (!best || r->step_s < best->step_s * (1 - 1e-9) ||
        (std::fabs(r->step_s - best->step_s) <= 1e-9 * best->step_s && r->mem.total() < best->mem.total()))
      best = r;
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
  const double fpt = m.flops_per_token();
  // Activation checkpointing reruns every block's forward once more in
  // backward: hardware FLOPs grow by the blocks' forward share.
  double block_params = 0;
  {
    auto u = unit_numels(m);
    for (size_t i = 1; i + 1 < u.size(); ++i) block_params += double(u[i]);
  }
  const double recompute = req.checkpointing ? 2 * block_params + 4.0 * mc.L * mc.C * mc.T : 0;

  for (const char* name : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    PlanRow row;
    row.dp = W;
    row.sharding.strategy = name;
    row.sharding.world = W;
    row.sharding.group = std::string(name) == "no_shard" ? 1 : std::string(name) == "hybrid_shard" ? hybrid_group : W;
    row.sharding.offload = offload;
    row.mem = estimate_memory(m, row.sharding, req.micro_batch, req.checkpointing, dev);
    row.fits = row.mem.total() <= plan.capacity;
    // Memory grows with the micro-batch (activations, inputs) and nothing
    // else: the largest that fits by bisection on the exact model.
    auto fits_at = [&](int b) {
      return estimate_memory(m, row.sharding, b, req.checkpointing, dev).total() <= plan.capacity;
    };
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
    CommVolume c = comm_time(unit_numels(m), row.sharding, row.accum, dev.act_bytes, bw_world, bw_group, bw_replica);
    if (offload) add_offload(row, unit_numels(m), req, dev.act_bytes, c);
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
  v << m.describe() << " (" << count_str(double(m.num_parameters())) << " parameters) with " << focus
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
    const double state = f->mem.params + f->mem.grads + f->mem.optimizer;
    v << " (parameters, gradients and optimizer state alone: " << gib(state) << " GiB).";
    if (f->max_micro_batch > 0) {
      v << " Micro-batch " << f->max_micro_batch << " fits.";
    } else {
      int need = 0;
      for (int nodes = req.nodes; nodes <= 4096 && !need; ++nodes) {
        Sharding s{"full_shard", nodes * req.gpus_per_node, nodes * req.gpus_per_node, offload};
        if (estimate_memory(m, s, 1, req.checkpointing, dev).total() <= plan.capacity) need = nodes;
      }
      if (need) {
        Sharding s{"full_shard", need * req.gpus_per_node, need * req.gpus_per_node, offload};
        v << " Smallest cluster of these nodes where full_shard fits at micro-batch 1: " << need << " x "
          << req.gpus_per_node << " = " << need * req.gpus_per_node << " GPUs ("
          << gib(estimate_memory(m, s, 1, req.checkpointing, dev).total()) << " GiB per GPU).";
      } else {
        v << " No cluster of up to 4096 such nodes holds it: the activations alone exceed one GPU.";
      }
    }
  }
  plan.verdict = v.str();
  plan_tensor_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  plan_pipeline_parallel(plan, m, dev, bw_intra, bw_inter, recompute, fpt);
  recommend_mesh(plan);
  return plan;
}

namespace {

// The tensor-parallel meshes: per-GPU memory and step time with the TP
// collectives and the TP group's link.
void render_tp_table(const Plan& p, std::ostringstream& o) {
  const auto& r = p.req;
  o << "\ntensor parallel (tp x dp = " << r.gpus_per_node * r.nodes << " GPUs; sharding over dp"
    << (r.sequence_parallel ? "; sequence parallel" : "; no sequence parallelism") << "); TP links "
    << (r.topology_source.empty() ? "assumed: NVLink inside a node (SXM on NVSwitch), the network across nodes"
                                  : "from " + r.topology_source)
    << "\n";
  for (const auto& l : r.tp_links)
    o << "  tp" << l.tp << ": " << l.kind << ", " << fixed(l.bytes_per_s / 1e9, 0) << " GB/s"
      << (l.detail.empty() ? "" : " (" + l.detail + ")") << "\n";
  const std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 11},   {"strategy", 15}, {"params", 8}, {"grads", 8},  {"optim", 8},  {"activ", 8},
      {"comm", 8},    {"total", 8},     {"fits", 5},   {"max mb", 7}, {"compute", 9}, {"tp comm", 9},
      {"dp comm", 9}, {"step", 9},      {"tok/s", 10}, {"MFU", 5},    {"tp link", 12}};
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i <= 1 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.tp_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.tp_rows) {
    const bool mark = row.tp == r.job_tp && row.sharding.strategy == r.job_strategy;
    std::vector<std::string> c = {
        "tp" + std::to_string(row.tp) + " x dp" + std::to_string(row.dp), row.sharding.strategy + (mark ? " *" : ""),
        gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.comm, 2), gib(row.mem.total(), 2), row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-", seconds(row.compute_s),
        seconds(row.tp_comm_s), seconds(row.comm_s - row.tp_comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%", row.tp_link};
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i <= 1 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    if (row.host_bytes_per_node > 0) line += "  host " + gib(row.host_bytes_per_node) + " GiB/node, +" + seconds(row.offload_s);
    o << line << "\n";
  }
  for (const auto& n : p.tp_not_offered) o << "tp" << n.first << ": not offered: " << n.second << "\n";
  if (r.job_tp > 1) o << "(* the job's parallel.tensor_parallel and parallel.sharding)\n";
}

// The pipeline meshes: one row per (tp, pp), its best strategy, the worst
// stage's memory, bubble and p2p.
void render_pp_table(const Plan& p, std::ostringstream& o) {
  const auto& r = p.req;
  o << "\npipeline parallel (tp x pp x dp = " << r.gpus_per_node * r.nodes << " GPUs; schedule "
    << (p.pp_rows.empty() ? r.pp_schedule : p.pp_rows.front().pp_schedule)
    << "; pp outermost, stages over " << (r.nodes > 1 ? "the network" : "NVLink")
    << "; memory of the worst stage; the best strategy per mesh)\n";
  const std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 17}, {"strategy", 15}, {"stage", 6}, {"inflt", 6}, {"params", 8}, {"grads", 8}, {"optim", 8},
      {"activ", 8}, {"total", 8},     {"fits", 5},  {"mb/step", 8}, {"bubble", 7}, {"compute", 9}, {"p2p", 9},
      {"tp comm", 9}, {"step", 9},    {"tok/s", 10}, {"MFU", 5}};
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i <= 1 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.pp_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.pp_rows) {
    const bool mark = row.pp == r.job_pp && (r.job_tp <= 1 ? row.tp == 1 : row.tp == r.job_tp);
    std::vector<std::string> c = {
        "tp" + std::to_string(row.tp) + " x pp" + std::to_string(row.pp) + " x dp" + std::to_string(row.dp),
        row.sharding.strategy + (mark ? " *" : ""), std::to_string(row.worst_stage), std::to_string(row.worst_in_flight),
        gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.total(), 2), row.fits ? "yes" : "NO", std::to_string(row.accum), fixed(row.bubble * 100, 1) + "%",
        seconds(row.compute_s), seconds(row.p2p_s), seconds(row.tp_comm_s), seconds(row.step_s),
        si(row.tokens_per_s, ""), fixed(row.mfu * 100, 0) + "%"};
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i <= 1 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    o << line << "\n";
  }
  for (const auto& n : p.pp_not_offered) o << n.first << ": not offered: " << n.second << "\n";
  if (r.job_pp > 1) o << "(* the job's parallel.pipeline_parallel)\n";
}

}  // namespace

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
  o << "assumes   bf16 parameters/activations, fp32 master weights, gradients and AdamW moments, flash attention, "
    << fixed(r.compute_efficiency * 100, 0) << "% of peak in compute, 1 GiB runtime reserve\n\n";
  const std::vector<std::pair<std::string, size_t>> cols = {
      {"strategy", 15}, {"shard", 6},  {"params", 8},   {"grads", 8}, {"optim", 8},     {"activ", 8},
      {"comm", 8},      {"work", 7},   {"total", 8},    {"fits", 5},  {"max mb", 7},    {"compute", 9},
      {"comm t", 9},    {"step", 9},   {"tok/s", 10},   {"MFU", 5}};
  o << "per-GPU memory in GiB; times per optimizer step (comm t: collectives, overlapped or not)\n";
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i == 0 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.rows) {
    const bool mark = row.sharding.strategy == r.job_strategy;
    std::vector<std::string> c = {
        row.sharding.strategy + (mark ? " *" : ""),
        std::to_string(row.sharding.group),
        gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.comm, 2), gib(row.mem.workspace, 2), gib(row.mem.total(), 2),
        row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-",
        seconds(row.compute_s), seconds(row.comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%"};
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i)
      line += i == 0 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    if (row.host_bytes_per_node > 0) line += "  host " + gib(row.host_bytes_per_node) + " GiB/node, +" + seconds(row.offload_s);
    o << line << "\n";
  }
  if (!r.job_strategy.empty()) o << "(* the job's parallel.sharding)\n";
  render_tp_table(p, o);
  render_pp_table(p, o);
  o << "\n" << p.verdict << "\n";
  o << p.recommendation << "\n";
  return o.str();
}

}  // namespace trainrun
