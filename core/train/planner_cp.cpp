// The planner's context-parallel rows (`trainrun plan`, issue 27): cp x dp
// meshes at tp 1 and pp 1, the parameters sharded over all of them
// (full_shard over dp x cp, as the trainer's stores do), each rank's
// activation arena over T / cp rows (estimate_cp_activation_bytes), and
// the ring's K/V traffic over the cp group's link. The ring sends a block
// while the current one's attention computes (double-buffered on NCCL):
// what of the transfer the step's attention does not cover is exposed.
#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>

#include "core/common/error.h"
#include "core/model/tensor_parallel.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"
#include "parallel/context/cp_attention.h"

namespace trainrun {

using namespace planner_detail;

double estimate_cp_activation_bytes(const ModelArch& m, int cp, const std::string& mode, int micro_batch,
                                    bool checkpointing, const DeviceModel& d, int tp, bool sequence_parallel) {
  if (tp <= 1) return cp_activation_bytes(m, cp, mode, micro_batch, checkpointing, d, nullptr, sequence_parallel);
  const TpLocalShape sh = TensorParallelPlan(m, tp, 0).shape();  // rank 0's sizes are every rank's
  return cp_activation_bytes(m, cp, mode, micro_batch, checkpointing, d, &sh, sequence_parallel);
}

namespace planner_detail {

// The TP rank's shape depends on the heads, widths and vocabulary, not on
// T: one TensorParallelPlan per tp serves every row and micro-batch size
// (building one splits the whole layout: seconds for a 70B model).
double cp_activation_bytes(const ModelArch& m, int cp, const std::string& mode, int micro_batch, bool checkpointing,
                           const DeviceModel& d, const TpLocalShape* tp_shape, bool sequence_parallel) {
  const ModelConfig& c = m.config();
  TR_CHECK(cp >= 1 && c.T % (2 * cp) == 0, "plan: model.seq_len ", c.T, " is not a multiple of 2 x cp (", 2 * cp,
           ")");
  auto network = [&](const ModelArch& arch, const DeviceModel& dm) {
    return tp_shape ? tp_activation_bytes(arch, *tp_shape, sequence_parallel, micro_batch, checkpointing, dm)
                    : estimate_activation_bytes(arch, micro_batch, checkpointing, dm);
  };
  if (cp == 1) return network(m, d);
  // The network's arena over T / cp rows, each layer keeping the cp
  // attention's log-sum-exp (never probabilities); RoPE's table stays global.
  ModelConfig local = c;
  local.T = c.T / cp;
  DeviceModel ld = d;
  ld.attention_probs = false;
  double bytes = network(*make_model_arch(local), ld);
  if (m.llama_shaped()) bytes += r64(double(c.T) * c.head_size() * 4) - r64(double(local.T) * c.head_size() * 4);
  // The cp attention of this TP rank's heads (rank 0's sizes are every rank's).
  const int NH = tp_shape ? tp_shape->NH : c.NH, NKV = tp_shape ? tp_shape->NKV : c.kv_heads();
  return bytes + double(CpAttention::workspace_bytes_for(mode, micro_batch, c.T, cp, NH, NKV, c.head_size(),
                                                         d.act_bytes));
}

}  // namespace planner_detail

double cp_ring_bytes_per_micro_batch(const ModelConfig& c, int cp, int micro_batch, bool checkpointing,
                                     int act_bytes, int kv_heads) {
  if (cp <= 1) return 0;
  const int nkv = kv_heads > 0 ? kv_heads : c.kv_heads();
  const double block = double(micro_batch) * (c.T / cp) * 2.0 * nkv * c.head_size();  // K|V rows
  const double forward = (cp - 1) * block * act_bytes;
  const double backward = (cp - 1) * block * act_bytes + cp * block * 4;  // K/V again, and fp32 dK|dV
  return c.L * ((checkpointing ? 2 : 1) * forward + backward);
}

namespace planner_detail {

void plan_context_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra,
                           double bw_inter, double recompute, double fpt) {
  const PlanRequest& req = plan.req;
  const ModelConfig& mc = m.config();
  const int W = req.gpus_per_node * req.nodes;
  if (req.adapter.on()) return;  // adapter runs under cp: not modelled here yet (their memory is planner_adapter's)
  for (int tp : {1, 2, 4, 8}) {
    if (tp > 1) {  // the degrees the TP rows offer (their table says why not the others)
      if (tp > req.gpus_per_node || W % tp != 0) continue;
      try {
        check_tensor_parallel(mc, tp);
      } catch (const Error&) {
        continue;
      }
    }
    std::unique_ptr<TensorParallelPlan> tp_plan;
    std::vector<int64_t> units = unit_numels(m);
    int kv_heads = mc.kv_heads();
    if (tp > 1) {
      tp_plan = std::make_unique<TensorParallelPlan>(m, tp, 0);  // every rank's sizes are rank 0's
      units.clear();
      for (const auto& u : tp_plan->local_layout().units) units.push_back(u.numel);
      kv_heads = tp_plan->shape().NKV;
    }
    for (int cp = 2; cp * tp <= W; cp *= 2) {
      if (W % (cp * tp) != 0) continue;
      if (mc.T % (2 * cp) != 0) {
        if (tp == 1)
          plan.cp_not_offered.push_back({cp, "model.seq_len " + std::to_string(mc.T) + " is not a multiple of " +
                                                 std::to_string(2 * cp)});
        continue;
      }
      PlanRow row;
      row.cp = cp;
      row.tp = tp;
      row.dp = W / (cp * tp);
      row.sharding.strategy = "full_shard";
      row.sharding.world = W / tp;
      row.sharding.group = W / tp;  // over dp x cp
      row.sharding.offload = req.offload != "none";
      auto memory_at = [&](int b) {
        return memory_of_units(units, mc.L, mc.T / cp, row.sharding, b,
                               cp_activation_bytes(m, cp, req.cp_mode, b, req.checkpointing, dev,
                                                   tp_plan ? &tp_plan->shape() : nullptr, req.sequence_parallel),
                               dev);
      };
      row.mem = memory_at(req.micro_batch);
      row.fits = row.mem.total() <= plan.capacity;
      if (memory_at(1).total() <= plan.capacity) {
        int lo = 1, hi = 2;
        while (hi <= (1 << 20) && memory_at(hi).total() <= plan.capacity) lo = hi, hi *= 2;
        while (hi - lo > 1) {
          const int mid = lo + (hi - lo) / 2;
          (memory_at(mid).total() <= plan.capacity ? lo : hi) = mid;
        }
        row.max_micro_batch = lo;
      }
      row.accum = std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * row.dp)));
      // Rows of each sequence a GPU computes per step; a TP rank does 1/tp of their FLOPs.
      const double rows_gpu = double(row.accum) * req.micro_batch * double(mc.T) / cp;
      const double peak = plan.gpu.bf16_flops * req.compute_efficiency;
      row.compute_s = rows_gpu * (fpt + recompute) / tp / peak;
      // TP's activation collectives over the rank's T / cp rows, between GEMMs (exposed), as the TP rows count them.
      if (tp > 1) {
        row.tp_link = "NVLink";
        double bw = plan.gpu.nvlink_bytes_per_s;
        for (const auto& l : req.tp_links)
          if (l.tp == tp) row.tp_link = l.kind, bw = l.bytes_per_s;
        const double act = double(req.micro_batch) * (mc.T / cp) * mc.C * dev.act_bytes;
        row.tp_comm_s = row.accum * tp_collectives_per_micro_batch(mc, req.checkpointing) * 2.0 * (tp - 1) / tp *
                        act / (bw * req.bus_efficiency);
      }
      // A cp group is cp ranks tp apart (cp sits just outside tp): inside a node when cp x tp GPUs fit one.
      // Each TP rank's ring carries its own KV heads.
      const bool intra = cp * tp <= req.gpus_per_node;
      row.cp_link = intra ? "NVLink" : "network";
      const double ring_bw = intra ? bw_intra : bw_inter;
      row.cp_ring_s = row.accum *
                      cp_ring_bytes_per_micro_batch(mc, cp, req.micro_batch, req.checkpointing, dev.act_bytes,
                                                    kv_heads) /
                      ring_bw;
      // What hides it: the attention of the same steps (12 L Q T per token,
      // counted whole as MFU does; the causal half is what runs), 1/tp of the heads.
      const double attn_s = rows_gpu * 0.5 * 12.0 * mc.L * mc.q_dim() * double(mc.T) *
                            (req.checkpointing ? 4.0 / 3.0 : 1.0) / tp / peak;
      const double ring_exposed = std::max(0.0, row.cp_ring_s - attn_s);
      const double bw_group = W <= req.gpus_per_node ? bw_intra : bw_inter;
      const CommVolume c = comm_time(units, row.sharding, row.accum, dev.act_bytes, bw_group, bw_group, bw_group);
      row.comm_s = c.overlapped + c.exposed + row.cp_ring_s + row.tp_comm_s;
      row.exposed_comm_s = c.exposed + ring_exposed + row.tp_comm_s;
      row.step_s = row.exposed_comm_s + std::max(row.compute_s, c.overlapped);
      const double tokens_step = double(row.accum) * req.micro_batch * double(mc.T) * row.dp;
      row.tokens_per_s = tokens_step / row.step_s;
      row.mfu = tokens_step / W * fpt / row.step_s / plan.gpu.bf16_flops;
      plan.cp_rows.push_back(row);
    }
  }
}

void render_cp_table(const Plan& p, std::ostringstream& o) {
  const auto& r = p.req;
  if (p.cp_rows.empty() && p.cp_not_offered.empty()) return;
  o << "\ncontext parallel (cp x tp x dp = " << r.gpus_per_node * r.nodes << " GPUs; cp_mode " << r.cp_mode
    << "; full_shard over dp x cp; each rank computes T/cp rows of every sequence; the ring passes every layer's "
    << "K/V cp-1 times forward (again in the recompute) and backward, and fp32 dK/dV cp times; with tp, each TP "
    << "rank's ring carries its own KV heads and the TP collectives of its rows add to the step)\n";
  std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 17},  {"T/rank", 8}, {"params", 8},  {"activ", 8},   {"total", 8}, {"fits", 5},
      {"max mb", 7}, {"compute", 9}, {"K/V ring", 9}, {"exposed", 9}, {"step", 9},  {"tok/s", 10},
      {"MFU", 5},    {"cp link", 8}};
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i == 0 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.cp_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.cp_rows) {
    const bool mark = row.cp == r.job_cp;
    const std::vector<std::string> c = {
        "cp" + std::to_string(row.cp) + (row.tp > 1 ? " x tp" + std::to_string(row.tp) : "") + " x dp" +
            std::to_string(row.dp) + (mark && row.tp == std::max(1, r.job_tp) ? " *" : ""),
        std::to_string(r.model.T / row.cp), gib(row.mem.params, 2), gib(row.mem.activations, 2),
        gib(row.mem.total(), 2), row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-", seconds(row.compute_s),
        seconds(row.cp_ring_s), seconds(row.exposed_comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%", row.cp_link};
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i == 0 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    o << line << "\n";
  }
  for (const auto& n : p.cp_not_offered) o << "cp" << n.first << ": not offered: " << n.second << "\n";
  if (r.job_cp > 1) o << "(* the job's parallel.context_parallel)\n";
}

}  // namespace planner_detail
}  // namespace trainrun
