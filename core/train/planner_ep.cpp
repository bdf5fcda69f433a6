// The planner's expert-parallel rows (`trainrun plan`, issue 28): for a
// mixture-of-experts model, expert-parallel degrees ep 1, 2, 4, 8 at tp 1
// and pp 1 (ep folds into dp: every rank is still a data-parallel rank).
//
// The model of one rank at degree ep (W GPUs, the dp strategy S), as the
// trainer stores it (core/model/moe/expert_parallel_plan.h,
// parallel/expert/ep_split_store.h):
//  - the dense part (attention, norms, the router, a shared expert,
//    embeddings, head: every tensor but the routed experts') is sharded by
//    S over all W ranks, exactly as a dense model's units are;
//  - the rank's n_experts / ep experts (every `.experts.` tensor split over
//    the ep ranks of an expert group) are sharded by S over the expert
//    data-parallel group, the W / ep ranks with the same ep index
//    (no_shard: held whole), so their fp32 master, act-dtype copy, fp32
//    gradient and AdamW moments (4 + 2 + 4 + 8 bytes per element on a GPU)
//    are 1 / W of all experts' state at any ep;
//  - each part's gradients reduce(-scatter) over its own group as S does,
//    and each part gathers its own units (full_shard): two sets of buffers
//    in flight, plus the blocks the store assembles from the two parts for
//    the network (a block's params in act dtype and its fp32 gradient, two
//    blocks of each counted);
//  - activations: the model's arena, whose MoE buffers hold N x top_k
//    routed rows; with balanced routing a rank receives as many rows as it
//    sends (ep ranks x N K / ep), so that arena stands, plus what the MoE
//    MLP places for the exchange (MoeMlp::ep_exchange_bytes, the same
//    figure the trainer allocates: the received rows kept per layer set,
//    N K C act bytes each, and two N K C scratch buffers). A router that
//    sends every token to one rank's experts grows that rank's buffers up
//    to ep times the routed rows (moe_mlp.h): the plan assumes the load
//    balancing the aux loss is for.
//  - time: the same FLOPs as ep 1 (routing moves tokens, not work), plus 2
//    all-to-alls per MoE layer in the forward (dispatch, combine) and 2 in
//    the backward (2 more when checkpointing recomputes the forward), each
//    N x top_k x C act-dtype bytes per rank of which (ep-1)/ep leave it
//    (the rows for its own experts stay), over the ep group's link (the
//    topology's for a group of ep consecutive ranks, as a TP group's; else
//    NVLink inside a node, the network across). They sit between the router
//    and the experts' GEMMs, on the critical path: counted exposed.
// ep 1 is the strategy row itself (experts sharded by S with the rest).
// The assembly's device copies (a block's parameters per acquire, its
// gradient per backward) are not in the step time: a few GB/s-seconds of
// device bandwidth against the block's GEMMs.
// The recommended degree is the fastest that fits (ties: the smaller ep,
// fewer all-to-all bytes). With offload each part's state moves to the
// host as the strategy rows' does (add_offload over both parts); with
// hybrid_shard the dense part shards inside groups of G ranks and the
// experts inside the G/ep of them with the rank's ep index, replicated
// across groups. Not offered with adapters (the trainer refuses them with
// ep), nor where ep does not divide the experts, the GPUs or hybrid's G.
#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>

#include "core/common/error.h"
#include "core/model/moe/expert_parallel_plan.h"
#include "core/model/moe/moe_mlp.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

using namespace planner_detail;

namespace planner_detail {

std::vector<int64_t> expert_unit_numels(const ModelArch& m) {
  const ParamLayout& l = m.layout();
  std::vector<int64_t> ex(l.units.size(), 0);
  for (const ParamTensor& t : l.tensors)
    // The trainer's rule for a routed expert's tensor (".experts.<e>."; a
    // shared expert is dense): what an ep rank holds a share of.
    if (expert_of_tensor(t.name) >= 0) ex[size_t(t.unit)] += t.numel;
  return ex;
}

EpUnits ep_units(const ModelArch& m, int ep) {
  EpUnits u;
  u.dense = unit_numels(m);
  const std::vector<int64_t> ex = expert_unit_numels(m);
  for (size_t i = 0; i < u.dense.size(); ++i) {
    u.dense[i] -= ex[i];
    if (ex[i] > 0) {
      u.experts.push_back(ex[i] / ep);
      u.largest_block = std::max(u.largest_block, u.dense[i] + ex[i] / ep);
    }
  }
  return u;
}

Sharding ep_local_sharding(const Sharding& s, int ep) {
  Sharding x = s;
  x.world = std::max(1, s.world / ep);
  // hybrid_shard: the rank's experts shard over the G/ep members of its
  // shard group with its ep index, replicated across the W/G groups.
  x.group = s.strategy == "no_shard" ? 1 : s.strategy == "hybrid_shard" ? std::max(1, s.group / ep) : x.world;
  return x;
}

}  // namespace planner_detail

int64_t moe_expert_parameters(const ModelArch& m) {
  int64_t n = 0;
  for (int64_t e : expert_unit_numels(m)) n += e;
  return n;
}

int moe_layers(const ModelArch& m) {
  int n = 0;
  for (int64_t e : expert_unit_numels(m)) n += e > 0;
  return n;
}

double ep_all_to_all_bytes_per_micro_batch(const ModelArch& m, int ep, int micro_batch, bool checkpointing,
                                           int act_bytes) {
  const ModelConfig& c = m.config();
  if (ep <= 1 || !c.moe.on()) return 0;
  const double rows = double(micro_batch) * c.T * c.moe.top_k;
  const double leaving = rows * c.C * act_bytes * double(ep - 1) / ep;
  const int per_layer = 4 + (checkpointing ? 2 : 0);
  return double(moe_layers(m)) * per_layer * leaving;
}

MemoryBreakdown estimate_ep_memory(const ModelArch& m, int ep, const Sharding& s, int micro_batch,
                                   bool checkpointing, const DeviceModel& d) {
  const ModelConfig& c = m.config();
  TR_CHECK(ep >= 1 && (ep == 1 || (c.moe.on() && c.moe.n_experts % ep == 0)), "plan: expert-parallel degree ", ep,
           " must divide the model's ", c.moe.n_experts, " experts");
  if (ep == 1) return estimate_memory(m, s, micro_batch, checkpointing, d);
  TR_CHECK(s.strategy != "hybrid_shard" || s.group % ep == 0, "plan: expert parallelism ", ep, " with hybrid_shard "
           "groups of ", s.group, ": ep must divide the shard group (else every rank holds every expert)");
  const Sharding x = ep_local_sharding(s, ep);
  const double landing = double(MoeMlp::ep_exchange_bytes(c.moe, c.C, size_t(d.act_bytes), int64_t(micro_batch) * c.T,
                                                          checkpointing ? 1 : c.L, true, ep));
  // The dense part as a dense model's units over all W ranks (its
  // activations and workspace are the rank's), then the experts' state
  // over the expert-dp group, as memory_of_units counts an element.
  const EpUnits u = ep_units(m, ep);
  MemoryBreakdown r = memory_of_units(u.dense, c.L, c.T, s, micro_batch,
                                      estimate_activation_bytes(m, micro_batch, checkpointing, d) + landing, d);
  const std::vector<int64_t>& xu = u.experts;
  const MemoryBreakdown xs = state_of_units(xu, x, d);
  r.params += xs.params;
  r.grads += xs.grads;
  r.optimizer += xs.optimizer;
  // Sharded: a reduce-scatter landing shard, two blocks' fp32 gradient
  // buckets and (full_shard) two gathered blocks, as the dense part's.
  const double a = d.act_bytes;
  if (x.strategy != "no_shard") {
    const int64_t G = std::max(1, x.group);
    double max_shard = 0, block = 0;
    for (int64_t n : xu) {
      max_shard = std::max(max_shard, double(ceil_div(n, G)));
      block = std::max(block, double(ceil_div(n, G) * G));
    }
    r.comm += 4 * max_shard + 2 * block * (4 + (x.strategy == "shard_grad_op" ? 0 : a));
  }
  // The assembled blocks (dense part + experts, what the network reads):
  // two blocks' act-dtype parameters and fp32 gradients.
  r.comm += 2 * double(u.largest_block) * (a + 4);
  return r;
}

namespace planner_detail {

void plan_expert_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra, double bw_inter,
                          double recompute, double fpt) {
  const PlanRequest& req = plan.req;
  const ModelConfig& mc = m.config();
  if (!mc.moe.on()) return;
  const int W = req.gpus_per_node * req.nodes;
  auto refuse_all = [&](const std::string& why) {
    for (int ep = 2; ep <= 8; ep *= 2) plan.ep_not_offered.push_back({ep, why});
  };
  if (req.adapter.on()) return refuse_all("adapters under expert parallelism are not planned (nor trained) yet");
  const std::string strategy = req.job_strategy.empty() ? "full_shard" : req.job_strategy;
  const int hybrid_group = req.shard_group_size > 0 ? req.shard_group_size : req.gpus_per_node;
  const double peak = plan.gpu.bf16_flops * req.compute_efficiency;
  for (int ep = 1; ep <= 8; ep *= 2) {
    if (ep > 1 && mc.moe.n_experts % ep != 0) {
      plan.ep_not_offered.push_back({ep, "the model's " + std::to_string(mc.moe.n_experts) + " experts do not split over " +
                                             std::to_string(ep) + " ranks"});
      continue;
    }
    if (ep > 1 && W % ep != 0) {
      plan.ep_not_offered.push_back({ep, std::to_string(W) + " GPUs do not split into groups of " + std::to_string(ep)});
      continue;
    }
    if (ep > 1 && strategy == "hybrid_shard" && hybrid_group % ep != 0) {
      plan.ep_not_offered.push_back({ep, "hybrid_shard's shard group of " + std::to_string(hybrid_group) +
                                             " ranks does not split into ep groups of " + std::to_string(ep) +
                                             " (the trainer would hold every expert on every rank)"});
      continue;
    }
    PlanRow row;
    row.ep = ep;
    row.dp = W;
    row.sharding.strategy = strategy;
    row.sharding.world = W;
    row.sharding.group = strategy == "no_shard" ? 1 : strategy == "hybrid_shard" ? hybrid_group : W;
    row.sharding.offload = req.offload != "none";
    row.sharding.offload_grad_on_device = offload_keeps_device_grad(
        parse_offload_mode(req.offload), std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * W))));
    auto memory_at = [&](int b) { return estimate_ep_memory(m, ep, row.sharding, b, req.checkpointing, dev); };
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
    const Sharding xs = ep_local_sharding(row.sharding, ep);  // the expert-dp group's
    const EpUnits u = ep_units(m, ep);
    if (ep > 1) {  // what the device keeps of them (offload: the act-dtype copy only)
      const MemoryBreakdown st = state_of_units(u.experts, xs, dev);
      row.expert_state = st.params + st.grads + st.optimizer;
    }
    row.accum = std::max(1, int(ceil_div(req.global_batch, int64_t(req.micro_batch) * W)));
    const double tokens_gpu = double(row.accum) * req.micro_batch * double(mc.T);
    row.compute_s = tokens_gpu * (fpt + recompute) / peak;
    // The ep group is consecutive ranks, as a TP group of the same size: the
    // topology's link for that group (`plan --topology`), else NVLink inside
    // a node and the network across nodes.
    const bool intra = ep <= req.gpus_per_node;
    row.ep_link = ep == 1 ? "none" : intra ? "NVLink" : "network";
    double bw_ep = intra ? bw_intra : bw_inter;
    for (const auto& l : req.tp_links)
      if (ep > 1 && l.tp == ep) row.ep_link = l.kind, bw_ep = l.bytes_per_s * req.bus_efficiency;
    row.a2a_s = row.accum *
                ep_all_to_all_bytes_per_micro_batch(m, ep, req.micro_batch, req.checkpointing, dev.act_bytes) / bw_ep;
    // Each part's collectives as the strategy rows count them: the dense
    // units over all W ranks, the rank's experts over its expert-dp group
    // (the ranks with its ep index: strided, so across nodes when there
    // are several).
    const double bw_world = req.nodes > 1 ? bw_inter : bw_intra;
    const double bw_group = row.sharding.group <= req.gpus_per_node ? bw_intra : bw_inter;
    const std::vector<int64_t> all = unit_numels(m);
    CommVolume c = comm_time(ep > 1 ? u.dense : all, row.sharding, row.accum, dev.act_bytes, bw_world, bw_group,
                             bw_world);
    const std::vector<int64_t>& xu = u.experts;
    if (ep > 1) {
      // The expert-dp group is strided (across nodes when there are several);
      // hybrid's expert shard group lies inside the rank's shard group.
      const CommVolume cx = comm_time(xu, xs, row.accum, dev.act_bytes, bw_world,
                                      strategy == "hybrid_shard" ? bw_group : bw_world, bw_world);
      c.overlapped += cx.overlapped;
      c.exposed += cx.exposed;
    }
    // Offload: the host state of both parts (1/W of each at any ep), the
    // host AdamW over it, the uploads.
    if (row.sharding.offload)
      add_offload(row, ep > 1 ? u.dense : all, req, dev.act_bytes, c, ep > 1 ? &xu : nullptr, &xs);
    row.comm_s = c.overlapped + c.exposed + row.a2a_s;
    row.exposed_comm_s = c.exposed + row.a2a_s;
    row.step_s = row.exposed_comm_s + std::max(row.compute_s, c.overlapped);
    row.tokens_per_s = tokens_gpu * W / row.step_s;
    row.mfu = tokens_gpu * fpt / row.step_s / plan.gpu.bf16_flops;
    plan.ep_rows.push_back(row);
  }
  // The recommendation: the fastest that fits; ties to the smaller degree.
  const PlanRow* best = nullptr;
  for (const PlanRow& r : plan.ep_rows)
    if (r.fits && (!best || r.step_s < best->step_s * (1 - 1e-9))) best = &r;
  std::ostringstream o;
  if (!best) {
    const PlanRow* least = nullptr;
    for (const PlanRow& r : plan.ep_rows)
      if (!least || r.mem.total() < least->mem.total()) least = &r;
    o << "expert parallel: none of the offered degrees fits " << gib(plan.capacity) << " GiB per GPU";
    if (least)
      o << " (the least, ep" << least->ep << ", needs " << gib(least->mem.total()) << " GiB: its experts alone "
        << gib(least->expert_state) << ")";
    // More nodes add replicas of the expert groups, not ranks to split an expert over.
    o << "; a rank's n_experts/ep experts are sharded over the W/ep ranks of its expert-dp group (1/W of the "
         "experts' state at any ep), so the strategy rows, without the all-to-all buffers, are the way to fit"
      << (req.checkpointing ? "" : ", with --activation-checkpointing blocks") << ".";
  } else {
    plan.has_ep_recommendation = true;
    plan.ep_recommended = *best;
    o << "expert parallel: recommended ep" << best->ep << " (parallel.expert_parallel: " << best->ep << ", "
      << strategy << " for the rest): " << gib(best->mem.total()) << " of " << gib(plan.capacity) << " GiB, "
      << seconds(best->step_s) << " per step";
    if (best->ep > 1)
      o << ", " << mc.moe.n_experts / best->ep << " experts per rank, all-to-all " << seconds(best->a2a_s)
        << " per step over " << best->ep_link;
    o << "; the fastest that fits.";
  }
  plan.ep_recommendation = o.str();
}

void render_ep_table(const Plan& p, std::ostringstream& o) {
  const auto& r = p.req;
  if (p.ep_rows.empty() && p.ep_not_offered.empty()) return;
  const ModelConfig& c = r.model;
  o << "\nexpert parallel (ep ranks share the " << c.moe.n_experts << " experts, top-" << c.moe.top_k
    << "; tp 1; ep folds into dp " << r.gpus_per_node * r.nodes << "; the rest sharded "
    << (r.job_strategy.empty() ? "full_shard" : r.job_strategy)
    << "; the dense part sharded over all ranks, a rank's experts over the W/ep ranks of its expert-dp "
       "group; experts / exp state: its experts and their share of params, grads and AdamW state; a2a: 2 all-to-alls per MoE layer "
    << "forward and 2 backward of micro-batch x T x top_k x C values, (ep-1)/ep of them leaving the rank; balanced "
       "routing assumed)\n";
  std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 11},   {"experts", 8}, {"exp state", 10}, {"params", 8}, {"grads", 8},    {"optim", 8},
      {"activ", 8},   {"total", 8},   {"fits", 5},       {"max mb", 7}, {"compute", 9},  {"a2a", 9},
      {"comm t", 9},  {"step", 9},    {"tok/s", 10},     {"MFU", 5},    {"ep link", 8}};
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i == 0 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.ep_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.ep_rows) {
    const std::vector<std::string> v = {
        "ep" + std::to_string(row.ep) + " x dp" + std::to_string(row.dp),
        row.ep == 1 ? "sharded" : std::to_string(c.moe.n_experts / row.ep),
        row.ep == 1 ? "-" : gib(row.expert_state, 2), gib(row.mem.params, 2), gib(row.mem.grads, 2),
        gib(row.mem.optimizer, 2), gib(row.mem.activations, 2), gib(row.mem.total(), 2), row.fits ? "yes" : "NO",
        row.max_micro_batch > 0 ? std::to_string(row.max_micro_batch) : "-", seconds(row.compute_s),
        seconds(row.a2a_s), seconds(row.comm_s), seconds(row.step_s), si(row.tokens_per_s, ""),
        fixed(row.mfu * 100, 0) + "%", row.ep_link};
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i == 0 ? pad_right(v[i], cols[i].second) : pad_left(v[i], cols[i].second);
    o << line << "\n";
  }
  for (const auto& n : p.ep_not_offered) o << "ep" << n.first << ": not offered: " << n.second << "\n";
}

}  // namespace planner_detail
}  // namespace trainrun
