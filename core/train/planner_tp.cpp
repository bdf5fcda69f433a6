// The planner's tensor-parallel part (see planner.h): one TP rank's
// activation arena and memory, the tp 2/4/8 rows of `trainrun plan` and
// their table.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/common/error.h"
#include "core/model/tensor_parallel.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

using namespace planner_detail;

namespace planner_detail {

double tp_activation_bytes(const ModelArch& m, const TpLocalShape& sh, bool sp, int B, bool ckpt, const DeviceModel& d) {
  const int tp = sh.tp;
  // Mirrors the networks' arenas under a TensorParallel context
  // (core/model/gpt2/gpt2.cpp, core/model/llama/llama.cpp): the same buffers
  // in the same sizes, each rounded up to 64 bytes.
  const ModelConfig& c = m.config();
  const bool llama = m.llama_shaped();
  const double es = d.act_bytes;
  const double N = double(B) * double(c.T), C = double(c.C), F = double(sh.F), HS = double(c.head_size());
  const double NR = sp ? double(ceil_div(int64_t(N), tp)) : N;  // rows of the residual stream on this rank
  const double Q = sh.NH * HS;                                  // this rank's query width
  const double QKV = llama ? Q + 2.0 * sh.NKV * HS : 3 * Q;     // its q|k|v width
  const double saved = d.attention_probs ? double(B) * sh.NH * double(c.T) * double(c.T) : double(B) * sh.NH * double(c.T);
  const double ldv = std::ceil(double(sh.V_local) / d.logits_align) * d.logits_align;
  double layer = 0;
  layer += r64(NR * C * es);                                  // ln1 (rows; gathered into the shared buffer when read)
  layer += (llama ? 1 : 2) * r64(NR * 4);                     // its statistics (rows)
  layer += r64(N * QKV * es);                                 // q|k|v (heads / tp)
  if (c.qk_norm)                                              // q|k before qk-norm, its per-head rstd
    layer += r64(N * (Q + sh.NKV * HS) * es) + r64(N * (sh.NH + sh.NKV) * 4);
  layer += r64(N * Q * es);                                   // attention output (heads / tp)
  layer += r64(saved * 4);                                    // attention's saved state (heads / tp)
  layer += r64(NR * C * es);                                  // residual after attention (rows)
  layer += r64(NR * C * es);                                  // ln2 (rows)
  layer += (llama ? 1 : 2) * r64(NR * 4);                     // its statistics (rows)
  layer += llama ? r64(N * 2 * F * es) + r64(N * F * es)      // gate|up, silu(gate)*up (ffn / tp)
                 : 2 * r64(N * F * es);                       // fc, gelu(fc) (ffn / tp)
  if (c.post_norms) layer += 2 * (r64(NR * C * es) + r64(NR * 4));  // attention / MLP outputs before their norms (rows)
  double total = 0;
  if (llama) {
    total += r64(double(c.T) * HS * 4);                       // RoPE table
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
  total += r64(N * std::max(C, Q) * es);                      // backward: dbuf_c (also d attention output)
  total += r64(N * QKV * es);                                 // backward: dqkv
  total += r64(N * F * es);                                   // backward: the MLP hidden grad
  if (c.qk_norm) total += r64(2 * HS * 4);                    // q_norm|k_norm's gradient, summed over TP
  if (c.post_norms) total += r64(NR * C * es);                // backward: the gradient through a post norm (rows)
  return total;
}

}  // namespace planner_detail

namespace {

// au: an adapter run's units over this TP rank's local layout (nullptr: a
// full fine-tune).
MemoryBreakdown tp_memory(const ModelArch& m, const TensorParallelPlan& plan, bool sp, const Sharding& s, int B,
                          bool ckpt, const DeviceModel& d, const AdapterUnits* au = nullptr) {
  std::vector<int64_t> units;
  for (const auto& u : plan.local_layout().units) units.push_back(u.numel);
  const double acts = tp_activation_bytes(m, plan.shape(), sp, B, ckpt, d);
  MemoryBreakdown r = au ? adapter_memory_of_units(*au, s, B, m.config().T, acts, d, false)
                         : memory_of_units(units, m.config().L, m.config().T, s, B, acts, d);
  // Replicated KV heads (tp > n_kv_head, Llama): fp32 scratch that sums the
  // replicas' q|k|v weight gradients (llama.cpp, outside the arena).
  const TpLocalShape& sh = plan.shape();
  if (m.llama_shaped() && sh.kv_replicas > 1) {
    const double HS = double(m.config().head_size()), C = double(m.config().C);
    const double QKV = sh.NH * HS + 2.0 * sh.NKV * HS, bias = m.config().qkv_bias ? 1 : 0;  // bias grads ride along
    r.workspace += r64(QKV * (C + bias) * 4) + r64(double(m.config().kv_heads()) * 2 * sh.NKV * HS * (C + bias) * 4);
  }
  return r;
}

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

int tp_collectives_per_micro_batch(const ModelConfig& c, bool ckpt) {
  return 4 * c.L + 2 + (ckpt ? 2 * c.L : 0);
}

namespace planner_detail {

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
    // An adapter run: the base and the adapters split like the layers they
    // wrap; what the dp collectives reduce is the adapters' local units.
    const bool adapt = req.adapter.on();
    const AdapterUnits au = adapt ? adapter_units(m, tp_plan.local_layout(), req.adapter, dev, true) : AdapterUnits{};
    if (adapt) units = au.adapter;
    const AdapterUnits* aup = adapt ? &au : nullptr;
    const int hybrid_dp =
        req.shard_group_size > 0 ? req.shard_group_size : default_hybrid_shard_group(req.gpus_per_node, tp, dp);
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
      row.sharding.offload_grad_on_device = offload_keeps_device_grad(
          parse_offload_mode(req.offload), std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * dp))));
      row.mem = tp_memory(m, tp_plan, req.sequence_parallel, row.sharding, req.micro_batch, req.checkpointing, dev, aup);
      row.fits = row.mem.total() <= plan.capacity;
      auto fits_at = [&](int b) {
        return tp_memory(m, tp_plan, req.sequence_parallel, row.sharding, b, req.checkpointing, dev, aup).total() <=
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
      if (adapt) c.overlapped += base_gather_seconds(au, row.sharding, row.accum, bw_group);
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
  const bool adapt = r.adapter.on();
  std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 11},   {"strategy", 15}, {"params", 8}, {"grads", 8},  {"optim", 8},  {"activ", 8},
      {"comm", 8},    {"total", 8},     {"fits", 5},   {"max mb", 7}, {"compute", 9}, {"tp comm", 9},
      {"dp comm", 9}, {"step", 9},      {"tok/s", 10}, {"MFU", 5},    {"tp link", 12}};
  if (adapt) cols.insert(cols.begin() + 2, {"base", 8});
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i <= 1 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.tp_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.tp_rows) {
    const bool mark = row.tp == r.job_tp && row.sharding.strategy == r.job_strategy;
    std::vector<std::string> c = {
        "tp" + std::to_string(row.tp) + " x dp" + std::to_string(row.dp), row.sharding.strategy + (mark ? " *" : ""),
        gib(row.mem.base, 2), gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.comm, 2), gib(row.mem.total(), 2), row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-", seconds(row.compute_s),
        seconds(row.tp_comm_s), seconds(row.comm_s - row.tp_comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%", row.tp_link};
    if (!adapt) c.erase(c.begin() + 2);
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i <= 1 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    if (row.host_bytes_per_node > 0) line += "  host " + gib(row.host_bytes_per_node) + " GiB/node, +" + seconds(row.offload_s);
    o << line << "\n";
  }
  for (const auto& n : p.tp_not_offered) o << "tp" << n.first << ": not offered: " << n.second << "\n";
  if (r.job_tp > 1) o << "(* the job's parallel.tensor_parallel and parallel.sharding)\n";
}

}  // namespace planner_detail

}  // namespace trainrun
