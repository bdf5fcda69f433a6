// The planner's pipeline-parallel part (see planner.h): the bubble
// formulas, each stage's memory under a schedule, the tp x pp rows of
// `trainrun plan` and their table.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <sstream>

#include "core/common/error.h"
#include "core/model/tensor_parallel.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/sharding/offload.h"
#include "parallel/pipeline/schedule.h"

namespace trainrun {

using namespace planner_detail;

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

// The transient scratch the stage networks of a rank share (the buffers
// core/model/gpt2|llama add with add_transient; the same for every stage,
// head or not): the recompute set under checkpointing (what L = 2 blocks'
// arena holds beyond the checkpointed one's: one layer's set), the
// backward scratch, the sequence-parallel collectives' buffers, and with KV heads
// replicated over TP their fp32 weight-gradient scratch (outside the arena
// of a network of its own: `outside_arena`).
// position_tables: the arena's zero position table and its gradient,
// which a stage network leaves out of the shared scratch unless it embeds
// through them (the first stage without TP); `position_tables` says their
// bytes.
double pipeline_transient_bytes(const ModelArch& m, const TpLocalShape& sh, bool sp, int B, bool ckpt,
                                const DeviceModel& d, double* outside_arena, double* position_tables) {
  const ModelConfig& mc = m.config();
  const int tp = sh.tp;
  const bool llama = m.llama_shaped(), seq = sp && tp > 1;
  const double N = double(B) * mc.T, C = double(mc.C), es = d.act_bytes;
  const double HS = double(mc.head_size()), F = double(sh.F);
  const double NR = seq ? double(ceil_div(int64_t(N), tp)) : N;
  const double QKV = llama ? sh.NH * HS + 2.0 * sh.NKV * HS : 3.0 * sh.NH * HS;
  double t = 0;
  if (ckpt) t += arena_of_layers(m, tp, sp, 2, B, false, d) - arena_of_layers(m, tp, sp, 2, B, true, d);
  // Llama's embedding reads no position table since issue 29 (encoder_forward
  // with a null wpe): nothing of the kind in the scratch for either arch.
  *position_tables = 0;
  t += *position_tables;
  if (seq) t += r64(NR * C * es) + r64(N * C * es) + r64((llama ? 1 : 2) * C * 4);  // rows, gathered, a norm's grads
  // backward: dbuf_c (also d attention output, N x Q), dqkv, the MLP hidden grad
  t += r64(N * std::max(C, sh.NH * HS) * es) + r64(N * QKV * es) + r64(N * F * es);
  if (mc.qk_norm && tp > 1) t += r64(2 * HS * 4);  // q_norm|k_norm's gradient, summed over TP
  if (mc.post_norms) t += r64(NR * C * es);        // the gradient through a post norm (rows)
  *outside_arena = 0;
  const double bias = mc.qkv_bias ? 1 : 0;  // replicated KV: the bias gradients ride after the weights'
  if (llama && sh.kv_replicas > 1)
    *outside_arena = r64(QKV * (C + bias) * 4) + r64(double(mc.kv_heads()) * 2 * sh.NKV * HS * (C + bias) * 4);
  return t + *outside_arena;
}

// The stage store's communication buffers (parallel/pipeline/stage_store.cpp
// over sharding_sharded.cpp's pool), from each chunk pass's units in the
// order its network acquires them (the stage store's begin_chunk_pass),
// padded to the shard group:
//   held (pipeline_reshard false): every unit of the stage gathered
//     (full_shard / hybrid_shard) and its full fp32 gradient, all step (the
//     reductions wait for the last microbatch); one landing shard.
//   reshard: the gathers of two consecutive units of a pass (the one
//     computing, the next one prefetched); the fp32 gradients of two
//     consecutive units of a backward (the one computing, the one being
//     reduce-scattered behind it); the tied embedding's (or its copy's)
//     gradient, open all step for the sum between the first and last
//     stage; one landing shard.
struct ChunkPasses {
  std::vector<int64_t> forward, backward;  // unit numels, acquire order
  std::vector<int64_t> grads;              // backward's gradients reduced per microbatch, in order
  int64_t tied = 0;                        // the tied unit's numel on this chunk (0: none)
};
double stage_comm_bytes(const std::vector<ChunkPasses>& chunks, const Sharding& s, double a) {
  if (s.strategy == "no_shard") return 0;  // replicated: no gathers, gradients in place
  const int64_t G = std::max(1, s.group);
  auto pad = [&](int64_t n) { return double(ceil_div(n, G) * G); };
  const bool gathers = s.strategy != "shard_grad_op";
  double max_shard = 0, held = 0, pair_params = 0, pair_grads = 0, tied = 0;
  for (const ChunkPasses& c : chunks) {
    for (int64_t n : c.forward) max_shard = std::max(max_shard, double(ceil_div(n, G))), held += pad(n);
    auto max_pair = [&](const std::vector<int64_t>& v) {
      double m = v.empty() ? 0 : pad(v.front());
      for (size_t i = 1; i < v.size(); ++i) m = std::max(m, pad(v[i - 1]) + pad(v[i]));
      return m;
    };
    pair_params = std::max({pair_params, max_pair(c.forward), max_pair(c.backward)});
    pair_grads = std::max(pair_grads, max_pair(c.grads));
    if (c.tied > 0) tied += pad(c.tied);
  }
  const double landing = 4 * max_shard;
  if (!s.pipeline_reshard) return (gathers ? a * held : 0) + 4 * held + landing;
  return (gathers ? a * pair_params : 0) + 4 * (pair_grads + tied) + landing;
}

// estimate_pipeline_memory with the TP plan built once by the caller (a
// 70B model's plan is costly to build, and the planner asks for every
// strategy of every mesh).
// au: an adapter run's units over the TP-local layout (nullptr: a full
// fine-tune); a stage then holds its base units frozen and its blocks' adapters.
std::vector<PipelineStageMemory> pipeline_memory(const ModelArch& m, const TensorParallelPlan& tpp, bool sp, int pp,
                                                 const std::string& kind, int v, int mb_count, const Sharding& s,
                                                 int B, bool ckpt, const DeviceModel& d,
                                                 const AdapterUnits* au = nullptr) {
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
  // flight: what its blocks add (per block: what one more block adds to a
  // microbatch's arena; with checkpointing only its output) plus the rest
  // (embedding output, backward scratch; the final norm and logits only on
  // the last stage), less the transient part that every network of the
  // rank shares, counted once.
  const double a1 = arena_of_layers(m, tp, sp, 1, B, ckpt, d), a2 = arena_of_layers(m, tp, sp, 2, B, ckpt, d);
  const double per_layer = a2 - a1, fixed_part = a1 - per_layer;
  double kv_scratch = 0;  // the part of the transient that no arena of its own holds
  double pos_tables = 0;  // the part only the first stage without TP needs
  const double transient = pipeline_transient_bytes(m, tpp.shape(), sp, B, ckpt, d, &kv_scratch, &pos_tables);
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
    head_part = r64(NR * mc.C * es) + (m.llama_shaped() ? 1 : 2) * r64(NR * 4) + r64(N * ldv * es) + r64(N * 4);
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
    const double HS = double(mc.head_size()), N = double(B) * mc.T, es = d.act_bytes;
    const bool llama = m.llama_shaped();
    const double QKV = llama ? sh.NH * HS + 2.0 * sh.NKV * HS : 3.0 * sh.NH * HS;
    kept_grads = r64(N * QKV * es) + 2 * r64(N * mc.C * es) + (llama ? 0 : r64(N * sh.F * es));
  }
  std::vector<PipelineStageMemory> out;
  for (int r = 0; r < pp; ++r) {
    PipelineStageMemory st;
    st.rank = r;
    std::vector<int64_t> mine;
    std::vector<size_t> mine_idx;  // the same units, as indices into `units`
    std::vector<int> my_layers;    // the blocks this rank holds
    std::vector<ChunkPasses> passes;
    int first_layer_of_rank_chunk = 0, max_chunk = 0;
    std::vector<int> starts(split.size(), 0);
    for (size_t i = 1; i < split.size(); ++i) starts[i] = starts[i - 1] + split[i - 1];
    for (int c = 0; c < v; ++c) {
      const int vs = r + c * pp;
      first_layer_of_rank_chunk = starts[size_t(vs)];
      max_chunk = std::max(max_chunk, split[size_t(vs)]);
      st.layers += split[size_t(vs)];
      ChunkPasses cp;
      std::vector<int64_t> blocks;
      for (int l = 0; l < split[size_t(vs)]; ++l) {
        blocks.push_back(units[size_t(1 + first_layer_of_rank_chunk + l)]);
        my_layers.push_back(first_layer_of_rank_chunk + l);
      }
      if (vs == 0) {
        mine_idx.push_back(0);
        mine.push_back(units.front());  // the embedding
        cp.forward.push_back(units.front());
        if (mc.tied) cp.tied = units.front();  // its gradient waits for the last stage's
      }
      mine.insert(mine.end(), blocks.begin(), blocks.end());
      for (int l = 0; l < split[size_t(vs)]; ++l) mine_idx.push_back(size_t(1 + first_layer_of_rank_chunk + l));
      cp.forward.insert(cp.forward.end(), blocks.begin(), blocks.end());
      if (vs == pp * v - 1) {
        mine.push_back(units.back());  // final norm and head
        mine_idx.push_back(units.size() - 1);
        cp.forward.push_back(units.back());
        // A tied head reads the embedding: the last stage holds a copy.
        if (mc.tied && r != 0) mine.push_back(units.front()), mine_idx.push_back(0);
        if (mc.tied) {
          cp.forward.push_back(units.front());
          cp.backward.push_back(units.front());
          if (r != 0) cp.tied = units.front();
        }
        cp.backward.push_back(units.back());
        cp.grads.push_back(units.back());
      }
      cp.backward.insert(cp.backward.end(), blocks.rbegin(), blocks.rend());
      cp.grads.insert(cp.grads.end(), blocks.rbegin(), blocks.rend());
      // The first stage's embedding gradient comes last, with no gather; tied, it waits all step (cp.tied).
      if (vs == 0 && !mc.tied) cp.grads.push_back(units.front());
      // The held store gathers the tied copy once; a rank that is first and
      // last (pp 1) reads its own embedding: counted once.
      if (vs == 0 && vs == pp * v - 1 && mc.tied) cp.forward.pop_back();
      passes.push_back(cp);
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
    st.kept_activations =
        max_chunk * (per_layer + kept_grads) + fixed_part - (transient - kv_scratch) - (has_head ? 0 : head_part);
    // The executor's scratch is its largest chunk's: with the position
    // tables only where virtual stage 0 lives (rank 0) and TP is off.
    st.transient_activations = transient - (r == 0 && tp == 1 ? 0 : pos_tables);
    const double acts = st.in_flight * st.kept_activations + st.transient_activations;
    if (au) {
      // The stage's frozen base units and its blocks' adapters.
      AdapterUnits mine_au = *au;
      mine_au.base_numel.clear(), mine_au.base_bytes.clear(), mine_au.adapter.clear();
      for (size_t i : mine_idx) mine_au.base_numel.push_back(au->base_numel[i]), mine_au.base_bytes.push_back(au->base_bytes[i]);
      for (int l : my_layers) mine_au.adapter.push_back(au->adapter[size_t(l)]);
      st.mem = adapter_memory_of_units(mine_au, s, B, mc.T, acts, d, !s.pipeline_reshard && s.strategy != "no_shard");
    } else {
      st.mem = memory_of_units(mine, st.layers, mc.T, s, B, acts, d);
      st.mem.comm = stage_comm_bytes(passes, s, d.act_bytes);
    }
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

namespace planner_detail {

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
  // An adapter run: each degree's units of the frozen base and the
  // adapters; what the dp collectives reduce is the adapters'.
  const bool adapt = req.adapter.on();
  std::map<int, AdapterUnits> tp_adapter;
  for (int tp : tps) {
    tp_plans[tp] = std::make_unique<TensorParallelPlan>(m, tp, 0);
    if (tp > 1) {
      for (const auto& u : tp_plans[tp]->local_layout().units) tp_units[tp].push_back(u.numel);
    } else {
      tp_units[tp] = unit_numels(m);
    }
    if (adapt) {
      tp_adapter[tp] =
          adapter_units(m, tp > 1 ? tp_plans[tp]->local_layout() : m.layout(), req.adapter, dev, tp > 1);
      tp_units[tp] = tp_adapter[tp].adapter;
    }
  }
  for (int pp : degrees) {
    const std::string name = "pp" + std::to_string(pp);
    auto skip = [&](const std::string& n, const std::string& why) { plan.pp_not_offered.push_back({n, why}); };
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
      // The trainer's default (parallel/mesh: the dp ranks of a node, a divisor of dp).
      const int hybrid_dp = req.shard_group_size > 0 ? req.shard_group_size
                                                     : default_hybrid_shard_group(req.gpus_per_node, tp, dp);
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
        // Offload: each stage's ranks offload their own units (below).
        row.sharding.offload = req.offload != "none";
        row.sharding.pipeline_reshard = ParallelSpec::pipeline_reshard_resolved(req.pipeline_reshard, strategy);
        row.pp_reshard = row.sharding.pipeline_reshard && strategy != "no_shard";
        row.sharding.offload_grad_on_device = offload_keeps_device_grad(parse_offload_mode(req.offload), accum);
        const auto stages = pipeline_memory(m, *tp_plans[tp], req.sequence_parallel, pp, kind, v, accum, row.sharding,
                                            req.micro_batch, req.checkpointing, dev, adapt ? &tp_adapter[tp] : nullptr);
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
        if (!row.pp_reshard && strategy != "no_shard") {
          // Held (stage_store.h): each unit gathered once per step, under the
          // first microbatch's forward (prefetched in stage order:
          // overlapped), every reduce-scatter after the last backward, where
          // nothing hides it (exposed); shard_grad_op's all-gather after the
          // optimizer and hybrid's replica all-reduce as without a pipeline.
          const int G = std::max(1, row.sharding.group);
          double Ppad = 0;
          for (int64_t n : units) Ppad += double(ceil_div(n, G) * G);
          const double ring = G > 1 ? double(G - 1) / G : 0;
          const double bw_rs = strategy == "shard_grad_op" ? bw_world : bw_group;
          const CommVolume once = comm_time(units, row.sharding, 1, dev.act_bytes, bw_world, bw_group, bw_world);
          c = CommVolume{};
          if (strategy == "shard_grad_op") {
            c.exposed = once.exposed + ring * 4 * Ppad / bw_rs;
          } else {
            c.overlapped = ring * dev.act_bytes * Ppad / bw_group;
            c.exposed = ring * 4 * Ppad / bw_rs + once.exposed;  // once.exposed: hybrid's replica all-reduce
          }
        }
        if (adapt) {
          // The stage's share of the base's gathers (held: once a step, counted as a reshard's one micro-batch).
          AdapterUnits share = tp_adapter[tp];
          for (double& b : share.base_bytes) b *= stage_share;
          c.overlapped += base_gather_seconds(share, row.sharding, row.pp_reshard ? accum : 1, bw_group);
        }
        // Host memory as if every GPU of a node held the worst stage's share
        // (an upper bound: a node's ranks hold different stages).
        if (row.sharding.offload) add_offload(row, units, req, dev.act_bytes, c);
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

// The pipeline meshes: one row per (tp, pp), its best strategy, the worst
// stage's memory, bubble and p2p.
void render_pp_table(const Plan& p, std::ostringstream& o) {
  const auto& r = p.req;
  o << "\npipeline parallel (tp x pp x dp = " << r.gpus_per_node * r.nodes << " GPUs; schedule "
    << (p.pp_rows.empty() ? r.pp_schedule : p.pp_rows.front().pp_schedule)
    << "; pp outermost, stages over " << (r.nodes > 1 ? "the network" : "NVLink")
    << "; memory of the worst stage; the best strategy per mesh; pipeline_reshard " << r.pipeline_reshard
    << (r.pipeline_reshard == "auto" ? " (true under full_shard and hybrid_shard)" : "")
    << ": comm is " << "each unit gathered per use (reshard) or the stage's units and fp32 gradients held all step)\n";
  const bool adapt = r.adapter.on();
  std::vector<std::pair<std::string, size_t>> cols = {
      {"mesh", 17}, {"strategy", 20}, {"stage", 6}, {"inflt", 6}, {"params", 8}, {"grads", 8}, {"optim", 8},
      {"activ", 8}, {"comm", 8}, {"total", 8},     {"fits", 5},  {"mb/step", 8}, {"bubble", 7}, {"compute", 9}, {"p2p", 9},
      {"tp comm", 9}, {"step", 9},    {"tok/s", 10}, {"MFU", 5}};
  if (adapt) cols.insert(cols.begin() + 4, {"base", 8});
  std::string header;
  for (size_t i = 0; i < cols.size(); ++i)
    header += i <= 1 ? pad_right(cols[i].first, cols[i].second) : pad_left(cols[i].first, cols[i].second);
  if (!p.pp_rows.empty()) o << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const auto& row : p.pp_rows) {
    const bool mark = row.pp == r.job_pp && (r.job_tp <= 1 ? row.tp == 1 : row.tp == r.job_tp);
    std::vector<std::string> c = {
        "tp" + std::to_string(row.tp) + " x pp" + std::to_string(row.pp) + " x dp" + std::to_string(row.dp),
        row.sharding.strategy + (row.pp_reshard || row.sharding.strategy == "no_shard" ? "" : " held") + (mark ? " *" : ""),
        std::to_string(row.worst_stage), std::to_string(row.worst_in_flight),
        gib(row.mem.base, 2), gib(row.mem.params, 2), gib(row.mem.grads, 2), gib(row.mem.optimizer, 2), gib(row.mem.activations, 2),
        gib(row.mem.comm, 2), gib(row.mem.total(), 2), row.fits ? "yes" : "NO", std::to_string(row.accum), fixed(row.bubble * 100, 1) + "%",
        seconds(row.compute_s), seconds(row.p2p_s), seconds(row.tp_comm_s), seconds(row.step_s),
        si(row.tokens_per_s, ""), fixed(row.mfu * 100, 0) + "%"};
    if (!adapt) c.erase(c.begin() + 4);
    std::string line;
    for (size_t i = 0; i < cols.size(); ++i) line += i <= 1 ? pad_right(c[i], cols[i].second) : pad_left(c[i], cols[i].second);
    if (row.host_bytes_per_node > 0) line += "  host " + gib(row.host_bytes_per_node) + " GiB/node, +" + seconds(row.offload_s);
    o << line << "\n";
  }
  for (const auto& n : p.pp_not_offered) o << n.first << ": not offered: " << n.second << "\n";
  if (r.job_pp > 1) o << "(* the job's parallel.pipeline_parallel)\n";
}

}  // namespace planner_detail

}  // namespace trainrun
