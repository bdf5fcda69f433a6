// The pipeline runtime of one rank (executor.h).
#include "parallel/pipeline/executor.h"

#include "parallel/context/cp_attention.h"

#include <algorithm>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "core/common/error.h"
#include "core/common/trace.h"
#include "parallel/context/cp_attention.h"
#include "parallel/pipeline/sender.h"
#include "parallel/pipeline/slots.h"

namespace trainrun {

namespace {

// One microbatch's place on a chunk: a network (its activations) and its
// tokens, and with document masking its document offsets, which stay until
// the slot's next forward, so the backward (and activation checkpointing's
// recompute, and zero_bubble's deferred weight step) sees the same documents.
struct Slot {
  std::unique_ptr<Network> net;
  DeviceBuffer in, tgt;
  DeviceBuffer doc_start, pos;  // (B,T) int32, with Options::document_mask only
  std::vector<int32_t> host_doc;  // (B, T x cp) host: with document masks under context parallelism
};

// A send that may still be reading its slot's buffers: on a sender thread
// (a future), or stream-ordered (the compute stream's wait for it, owed).
struct SendInFlight {
  std::shared_future<void> done;
  std::unique_ptr<PendingCollective> pending;
  std::string what;  // for the message if it failed
};

struct ChunkRun {
  const PipelineChunk* chunk = nullptr;
  PipelineStage stage;  // the chunk's, with split_backward under zero_bubble
  std::vector<Slot> slots;
};

class NetworkView final : public Network {
 public:
  NetworkView(const PipelineExecutor& e, const RouterReport& r) : e_(e), router_(r) {}
  RouterReport router_report() const override { return router_; }
  void forward(UnitAccess&, const int32_t*, const int32_t*, int, int, bool, float, DocumentMask) override { no(); }
  void backward(UnitAccess&) override { no(); }
  const float* losses() const override { no(); }
  const void* logits() const override { no(); }
  int logits_stride() const override { no(); }
  size_t activation_bytes() const override { return e_.activation_bytes(); }
  void free_activations() override { no(); }

 private:
  [[noreturn]] static void no() { TR_FAIL("pipeline: the stage networks compute through the executor (a bug)"); }
  const PipelineExecutor& e_;
  const RouterReport& router_;  // the executor's, set by the trainer (set_router_report)
};

}  // namespace

struct PipelineExecutor::Impl {
  Backend* be;
  const PipelineStagePlan& plan;
  PipelineUnits& store;
  PipelineLinks& links;
  MicrobatchHook hook;  // null: none
  LastStageHook last_hook;  // null: none
  Options opts;
  std::vector<ChunkRun> chunks;
  DeviceBuffer scratch;  // the stage networks' shared transient buffers
  // One per outgoing link, by the peer's pp rank; none when the links are
  // stream-ordered (NCCL): sends are then issued from the compute thread,
  // since enqueueing one never waits on the peer.
  std::map<int, std::unique_ptr<PipelineSender>> senders;
  std::unique_ptr<NetworkView> view;
  Network::RouterReport shown;             // what view reports (set_router_report)
  std::map<int, const Network*> latest;   // by virtual stage: the network of its latest forward
  int64_t step = 0;
  bool split = false;
  // The measured bubble: marks on the compute stream (Backend::time_mark)
  // around every compute action of the last train_step, and at its start
  // and end; read (which may wait for the GPU) only when asked for.
  std::shared_ptr<void> step_begin, step_end;
  std::vector<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>> compute_marks;
  double bubble = -1;  // from those marks, once computed
  StepTimes times;
  StepTracer* tracer = nullptr;
  // Tests: TRAINRUN_DEBUG_PIPE_KILL=<global rank>:<step>:<microbatch> kills
  // this process with SIGKILL before that microbatch's forward (mid-step).
  int kill_rank = -1, kill_mb = -1;
  int64_t kill_step = -1;
  size_t io_bytes = 0;

  Impl(Backend* b, const PipelineStagePlan& p, PipelineUnits& s, PipelineLinks& l, Options o)
      : be(b), plan(p), store(s), links(l), opts(std::move(o)) {}

  int P() const { return plan.ranks(); }
  int stages() const { return plan.ranks() * int(plan.chunks().size()); }
  int chunk_of(int vs) const { return (vs - plan.rank()) / P(); }
  int global_rank(int stage_rank) const {
    return stage_rank < int(opts.stage_ranks.size()) ? opts.stage_ranks[size_t(stage_rank)] : stage_rank;
  }
  // The boundary between virtual stages b and b + 1, one tag per direction.
  uint32_t tag(int mb, int boundary, int dir) const {
    return uint32_t((int64_t(mb) * stages() + boundary) * 2 + dir);
  }
  std::string where(const char* what, int mb, int vs, int peer_vs) const {
    return detail::cat("pipeline (step ", step, "): ", what, " of microbatch ", mb, " between stage ", vs, " (rank ",
                       global_rank(plan.rank()), ") and stage ", peer_vs, " (rank ", global_rank(peer_vs % P()), ")");
  }

  // The sends still out, by id (the action's index in the list;
  // forward_only numbers its own). The slot plan says which to wait for
  // before which action: before a slot's buffers are overwritten, and
  // before a second send from one slot; the end of the step waits for all.
  std::map<int, SendInFlight> inflight;
  PipelineSlotPlan slots;  // this rank's (slots.h)
  // Early receives (stream-ordered links only; slots.h plan_receive_posts):
  // posts_after[k + 1] lists the receive actions issued right after action
  // k (index 0: at the step's start); `early` holds each posted receive
  // until its own action makes the compute stream wait for it.
  std::vector<std::vector<int>> posts_after;
  std::map<int, std::unique_ptr<PendingCollective>> early;
  // The buffer receive action `i` writes.
  void* recv_buffer(const PipeAction& a, int i) {
    Slot& s = chunks[size_t(chunk_of(a.stage))].slots[size_t(slots.slot[size_t(i)])];
    return a.op == PipeOp::RecvAct ? s.net->stage_input() : s.net->stage_output_grad();
  }
  // Posts receive action `i` now: the link's stream waits for the compute
  // stream's current point (the slot's last reader is enqueued by now).
  void post_recv(const PipeAction& a, int i) {
    const int dir = a.op == PipeOp::RecvAct ? 0 : 1;
    const int peer_vs = dir == 0 ? a.stage - 1 : a.stage + 1, peer = peer_vs % P();
    StepTracer::Span span(tracer, detail::cat(dir == 0 ? "post recv_act mb" : "post recv_grad mb", a.microbatch,
                                              " stage ", a.stage), "p2p");
    const std::string what = where(dir == 0 ? "receiving the activation" : "receiving the gradient", a.microbatch,
                                   a.stage, peer_vs);
    Communicator* link = links.from(peer);
    TR_CHECK(link, what, ": no link from pp rank ", peer, " to pp rank ", plan.rank(), " (a bug)");
    try {
      link->set_op_label(what);
      record_pipeline_link_use(global_rank(plan.rank()), peer, plan.rank(), false);
      early[i] = link->recv_deferred(recv_buffer(a, i), io_bytes, 0, tag(a.microbatch, std::min(a.stage, peer_vs), dir),
                                     link->compute_point());
    } catch (const std::exception& e) {
      TR_FAIL(what, " failed: ", e.what());
    }
  }
  // At receive action `i`: true when it was posted early (the compute
  // stream now waits for it); false: receive it here.
  bool finish_early_recv(int i) {
    auto it = early.find(i);
    if (it == early.end()) return false;
    std::unique_ptr<PendingCollective> p = std::move(it->second);
    early.erase(it);
    if (p) p->order_compute_after();
    return true;
  }
  void wait_send(int id) {
    auto it = inflight.find(id);
    if (it == inflight.end()) return;
    SendInFlight f = std::move(it->second);
    inflight.erase(it);
    if (f.pending) f.pending->order_compute_after();  // on the GPU: the host does not wait
    if (!f.done.valid()) return;
    try {
      f.done.get();
    } catch (const std::exception& e) {
      TR_FAIL(f.what, " failed: ", e.what());
    }
  }
  // On the compute thread, over the link from the peer's rank (its rank 0).
  // Stream-ordered (NCCL): the link's stream waits for the compute stream's
  // current point (the buffer is free: its last send was waited for by
  // wait_send), and the compute stream waits for the receive.
  void recv(void* buf, int mb, int vs, int peer_vs, int dir) {
    StepTracer::Span span(tracer, detail::cat(dir == 0 ? "recv_act mb" : "recv_grad mb", mb, " stage ", vs), "p2p");
    const int boundary = std::min(vs, peer_vs), peer = peer_vs % P();
    const std::string what = where(dir == 0 ? "receiving the activation" : "receiving the gradient", mb, vs, peer_vs);
    Communicator* link = links.from(peer);
    TR_CHECK(link, what, ": no link from pp rank ", peer, " to pp rank ", plan.rank(), " (a bug)");
    try {
      link->set_op_label(what);
      record_pipeline_link_use(global_rank(plan.rank()), peer, plan.rank(), false);
      link->recv(buf, io_bytes, 0, tag(mb, boundary, dir));
    } catch (const std::exception& e) {
      TR_FAIL(what, " failed: ", e.what());
    }
  }
  // `id`: the send's number for wait_send.
  void send(int id, const void* buf, int mb, int vs, int peer_vs, int dir) {
    const int peer = peer_vs % P();
    SendInFlight& s = inflight[id];
    s.what = where(dir == 0 ? "sending the activation" : "sending the gradient", mb, vs, peer_vs);
    Communicator* link = links.to(peer);
    TR_CHECK(link, s.what, ": no link from pp rank ", plan.rank(), " to pp rank ", peer, " (a bug)");
    const uint32_t t = tag(mb, std::min(vs, peer_vs), dir);
    std::string label = detail::cat(dir == 0 ? "send_act mb" : "send_grad mb", mb, " stage ", vs);
    if (senders.empty()) {
      // Stream-ordered: enqueued after the compute that produced `buf`;
      // the compute stream waits for it only in wait_send.
      StepTracer::Span span(tracer, label, "p2p");
      try {
        link->set_op_label(s.what);
        record_pipeline_link_use(global_rank(plan.rank()), plan.rank(), peer, true);
        s.pending = link->send_deferred(buf, io_bytes, 1, t);
      } catch (const std::exception& e) {
        TR_FAIL(s.what, " failed: ", e.what());
      }
      return;
    }
    auto it = senders.find(peer);
    TR_CHECK(it != senders.end(), s.what, ": no sender thread for pp rank ", peer, " (a bug)");
    s.done = it->second->post(link, plan.rank(), peer, buf, io_bytes, t, std::move(label));
  }
  void wait_all_sends() {
    while (!inflight.empty()) wait_send(inflight.begin()->first);
  }
  void forward(Slot& s, const PipelineChunk& ch, int mb, const Loader& load, bool for_backward, float dloss_scale,
               float* loss_sum) {
    const int B = opts.micro_batch, T = opts.seq_len;
    if (kill_rank == global_rank(plan.rank()) && kill_step == step && kill_mb == mb) std::raise(SIGKILL);
    MicrobatchBuffers to;
    if (ch.stage.first) to.inputs = s.in.as<int32_t>();
    if (ch.stage.last) to.targets = s.tgt.as<int32_t>();
    DocumentMask docs;
    if (opts.document_mask) {
      to.doc_start = s.doc_start.as<int32_t>();
      to.pos = s.pos.as<int32_t>();
      to.host_doc_start = s.host_doc.empty() ? nullptr : s.host_doc.data();
      docs = DocumentMask{to.doc_start, to.pos, to.host_doc_start};
    }
    if (to.inputs || to.targets || to.doc_start) load(mb, to);
    if (hook) hook(mb, for_backward);
    s.net->forward(store.chunk_access(chunk_of(ch.virtual_stage)), to.inputs, to.targets, B, T, for_backward,
                   dloss_scale, docs);
    latest[ch.virtual_stage] = s.net.get();
    if (ch.stage.last && last_hook) last_hook(mb, for_backward, *s.net);
    if (ch.stage.last) be->sum(loss_sum, s.net->losses(), int64_t(B) * T);
  }
};

PipelineExecutor::PipelineExecutor(const ModelArch& arch, Backend* be, const PipelineStagePlan& plan,
                                   PipelineSchedule schedule, PipelineUnits& store, PipelineLinks& links,
                                   Options opts)
    : impl_(std::make_unique<Impl>(be, plan, store, links, std::move(opts))), schedule_(std::move(schedule)) {
  Impl& im = *impl_;
  // zero_bubble: BI then, later, BW; a microbatch's activations stay until its BW.
  im.split = schedule_.kind == "zero_bubble";
  TR_CHECK(schedule_.ranks == plan.ranks() && schedule_.virtual_stages == int(plan.chunks().size()),
           "pipeline: schedule and plan disagree (a bug)");
  const int r = plan.rank();
  // Activation sets per chunk, each action's set and the sends it waits
  // for: the slot plan (slots.h), which check_pipeline_schedule proved
  // cannot hang.
  im.slots = plan_pipeline_slots(schedule_, r);
  const std::vector<int>& most = im.slots.slots_per_chunk;
  const int B = im.opts.micro_batch, T = im.opts.seq_len;
  for (size_t c = 0; c < plan.chunks().size(); ++c) {
    ChunkRun cr;
    cr.chunk = &plan.chunks()[c];
    cr.stage = cr.chunk->stage;
    cr.stage.split_backward = im.split;
    cr.stage.shared_scratch = true;
    for (int i = 0; i < most[c]; ++i) {
      Slot s;
      s.net = arch.make_network(be, B, im.opts.activation_checkpointing, im.opts.tp, &cr.stage, im.opts.cp, im.opts.ep);
      s.in = DeviceBuffer(be, size_t(B) * T * 4);
      s.tgt = DeviceBuffer(be, size_t(B) * T * 4);
      if (im.opts.document_mask) {
        s.doc_start = DeviceBuffer(be, size_t(B) * T * 4);
        s.pos = DeviceBuffer(be, size_t(B) * T * 4);
        if (im.opts.cp) s.host_doc.resize(size_t(B) * T * im.opts.cp->size());
      }
      cr.slots.push_back(std::move(s));
    }
    im.chunks.push_back(std::move(cr));
  }
  // One transient scratch for every stage network of the rank (arena_plan.h):
  // one compute call runs at a time, and none leaves anything in it.
  size_t transient = 0;
  for (const ChunkRun& cr : im.chunks)
    for (const Slot& s : cr.slots) transient = std::max(transient, s.net->transient_bytes());
  im.scratch = DeviceBuffer(be, transient);
  if (transient > 0)
    for (ChunkRun& cr : im.chunks)
      for (Slot& s : cr.slots) s.net->bind_transient(im.scratch.get());
  im.io_bytes = size_t(im.chunks[0].slots[0].net->stage_io_elems(B, T)) * dtype_size(be->act_dtype());
  if (const char* k = std::getenv("TRAINRUN_DEBUG_PIPE_KILL"); k && *k) {
    long long kr = -1, ks = -1, km = -1;
    if (std::sscanf(k, "%lld:%lld:%lld", &kr, &ks, &km) == 3) {
      im.kill_rank = int(kr);
      im.kill_step = ks;
      im.kill_mb = int(km);
    }
  }
  if (links.stream_ordered()) {
    // Early receives: a receive that takes its slot over may be posted
    // while the slot's previous microbatch's sends are still out only if no
    // send reads the activation buffer it writes (true of GPT-2's and
    // Llama's stage networks; checked, not assumed).
    bool takeover_early = true;
    for (const ChunkRun& cr : im.chunks)
      for (const Slot& s : cr.slots) {
        if (cr.stage.first) continue;  // receives no activation
        void* in = s.net->stage_input();
        if (in && (in == s.net->stage_output() || in == s.net->stage_input_grad())) takeover_early = false;
      }
    const std::vector<int> post = plan_receive_posts(schedule_, r, im.slots, takeover_early);
    const auto& list = schedule_.actions[size_t(r)];
    im.posts_after.assign(list.size() + 1, {});
    for (size_t i = 0; i < list.size(); ++i)
      if ((list[i].op == PipeOp::RecvAct || list[i].op == PipeOp::RecvGrad) && post[i] < int(i))
        im.posts_after[size_t(post[i] + 1)].push_back(int(i));
  }
  if (!links.stream_ordered()) {
    // Trace rows 1, 2, ...: one per link, in the order of the peers.
    for (const PipeAction& a : schedule_.actions[size_t(r)])
      if ((a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad) && !im.senders.count(a.peer))
        im.senders[a.peer] = nullptr;
    int tid = 1;
    for (auto& [peer, snd] : im.senders) snd = std::make_unique<PipelineSender>(im.global_rank(r), tid++);
  }
  im.view = std::make_unique<NetworkView>(*this, im.shown);
}

PipelineExecutor::~PipelineExecutor() = default;

size_t PipelineExecutor::activation_bytes() const {
  size_t n = 0;
  for (const ChunkRun& cr : impl_->chunks)
    for (const Slot& s : cr.slots) n += s.net->activation_bytes();
  return n + impl_->scratch.bytes();
}

const Network& PipelineExecutor::network_view() const { return *impl_->view; }

Network::RouterReport PipelineExecutor::router_report_local(int L) const {
  Network::RouterReport r;
  r.max_tokens.assign(size_t(L), 0.0);
  r.mean_tokens.assign(size_t(L), 0.0);
  for (const ChunkRun& c : impl_->chunks) {
    const auto it = impl_->latest.find(c.chunk->virtual_stage);
    if (it == impl_->latest.end()) continue;
    const Network::RouterReport mine = it->second->router_report();
    if (c.stage.last) r.aux_loss = mine.aux_loss, r.z_loss = mine.z_loss;
    for (size_t l = 0; l < mine.max_tokens.size() && c.stage.first_layer + int(l) < L; ++l) {
      r.max_tokens[size_t(c.stage.first_layer) + l] = mine.max_tokens[l];
      r.mean_tokens[size_t(c.stage.first_layer) + l] = mine.mean_tokens[l];
    }
  }
  return r;
}

void PipelineExecutor::set_router_report(const Network::RouterReport& r) { impl_->shown = r; }

void PipelineExecutor::set_expert_bias(const std::vector<float>& all, int L) {
  TR_CHECK(L > 0 && all.size() % size_t(L) == 0, "pipeline: an expert bias of ", all.size(), " values for ", L,
           " layers (a bug)");
  const size_t row = all.size() / size_t(L);
  for (ChunkRun& c : impl_->chunks) {
    const PipelineStage& st = c.stage;
    TR_CHECK(st.first_layer + st.layers <= L, "pipeline: stage layers ", st.first_layer, "+", st.layers,
             " past the model's ", L, " (a bug)");
    const std::vector<float> mine(all.begin() + int64_t(st.first_layer) * int64_t(row),
                                  all.begin() + int64_t(st.first_layer + st.layers) * int64_t(row));
    for (Slot& s : c.slots) s.net->set_expert_bias(mine);
  }
}

// Every network of a chunk (one per microbatch in flight) counted the
// microbatches it ran: their sum is the stage's load for its layers.
std::vector<float> PipelineExecutor::take_expert_load(int L, int per_layer) {
  std::vector<float> all(size_t(L) * size_t(per_layer), 0.f);
  for (ChunkRun& c : impl_->chunks)
    for (Slot& s : c.slots) {
      const std::vector<float> l = s.net->take_expert_load();
      if (l.empty()) continue;
      TR_CHECK(l.size() == size_t(c.stage.layers) * size_t(per_layer), "pipeline: a stage's expert load of ",
               l.size(), " values for ", c.stage.layers, " layers x ", per_layer, " (a bug)");
      float* at = all.data() + int64_t(c.stage.first_layer) * per_layer;
      for (size_t i = 0; i < l.size(); ++i) at[i] += l[i];
    }
  return all;
}

void PipelineExecutor::set_tracer(StepTracer* t) {
  impl_->tracer = t;
  int tid = 1;
  for (auto& [peer, snd] : impl_->senders) {
    snd->tracer = t;
    if (t) t->name_thread(tid++, detail::cat("pipeline sends to pp rank ", peer));
  }
}

void PipelineExecutor::set_microbatch_hook(MicrobatchHook h) { impl_->hook = std::move(h); }
void PipelineExecutor::set_last_stage_hook(LastStageHook h) { impl_->last_hook = std::move(h); }

void PipelineExecutor::train_step(int64_t step, const Loader& load, float dloss_scale, float* loss_sum) {
  Impl& im = *impl_;
  im.step = step;
  im.links.set_step(step);
  im.compute_marks.clear();
  im.bubble = -1;
  im.store.begin_step();
  im.step_begin = im.be->time_mark();
  const std::vector<PipeAction>& list = schedule_.actions[size_t(im.plan.rank())];
  im.early.clear();  // a failed step's leftovers
  auto post_after = [&](int k) {
    if (im.posts_after.empty()) return;
    for (int j : im.posts_after[size_t(k + 1)]) im.post_recv(list[size_t(j)], j);
  };
  post_after(-1);
  for (size_t i = 0; i < list.size(); ++i) {
    const PipeAction& a = list[i];
    const int c = im.chunk_of(a.stage);
    const PipelineChunk& ch = *im.chunks[size_t(c)].chunk;
    // The sends whose buffers this action takes over or sends from again
    // (slots.h): waited for first, so their time counts as idle.
    for (int w : im.slots.waits[i]) im.wait_send(w);
    Slot& s = im.chunks[size_t(c)].slots[size_t(im.slots.slot[i])];
    const bool compute = a.op == PipeOp::F || a.op == PipeOp::B || a.op == PipeOp::BI || a.op == PipeOp::BW;
    // The span's name is built only while a step is traced (a hot loop).
    StepTracer* const tr = compute && im.tracer && im.tracer->active() ? im.tracer : nullptr;
    StepTracer::Span span(tr, tr ? detail::cat(pipe_compute_span_name(a.op), " mb", a.microbatch, " stage ", a.stage)
                                 : std::string(),
                          "compute");
    if (compute) im.compute_marks.emplace_back(im.be->time_mark(), nullptr);
    const int id = int(i);
    switch (a.op) {
      case PipeOp::RecvAct:
        if (!im.finish_early_recv(id)) im.recv(s.net->stage_input(), a.microbatch, a.stage, a.stage - 1, 0);
        break;
      case PipeOp::F:
        im.forward(s, ch, a.microbatch, load, true, dloss_scale, loss_sum);
        break;
      case PipeOp::SendAct:
        im.send(id, s.net->stage_output(), a.microbatch, a.stage, a.stage + 1, 0);
        break;
      case PipeOp::RecvGrad:
        if (!im.finish_early_recv(id)) im.recv(s.net->stage_output_grad(), a.microbatch, a.stage, a.stage + 1, 1);
        break;
      case PipeOp::B:
        if (im.hook) im.hook(a.microbatch, true);
        s.net->backward(im.store.chunk_access(c));
        break;
      case PipeOp::SendGrad:
        im.send(id, s.net->stage_input_grad(), a.microbatch, a.stage, a.stage - 1, 1);
        break;
      case PipeOp::BI:
        if (im.hook) im.hook(a.microbatch, true);
        s.net->backward_input(im.store.chunk_access(c));
        break;
      case PipeOp::BW:
        if (im.hook) im.hook(a.microbatch, true);
        s.net->backward_weight(im.store.chunk_access(c));
        break;
    }
    if (compute) im.compute_marks.back().second = im.be->time_mark();
    post_after(id);
  }
  {
    StepTracer::Span span(im.tracer, "wait for sends", "p2p");
    im.wait_all_sends();
  }
  im.step_end = im.be->time_mark();
  {
    StepTracer::Span span(im.tracer, "tied sum + reductions queued", "collective");
    im.store.end_backward();
  }
}

// bubble = 1 - (the compute actions' time) / (the step's span), both as
// the compute stream saw them. On the CPU the marks are host clock reads
// around synchronous ops, so the idle share is the time spent waiting on
// peers (receives, unfinished sends) plus the executor's own bookkeeping;
// on CUDA, where the host only enqueues and never waits, the events show
// when the stream itself stood waiting for a receive or a send.
PipelineExecutor::StepTimes PipelineExecutor::last_step_times() const {
  Impl& im = *impl_;
  if (im.bubble < 0 && im.step_begin && im.step_end) {
    im.times.span_ms = im.be->ms_between(im.step_begin, im.step_end);
    im.times.compute_ms = 0;
    for (const auto& [a, b] : im.compute_marks) im.times.compute_ms += im.be->ms_between(a, b);
    const double span = im.times.span_ms;
    im.bubble = span > 0 ? std::clamp(1.0 - im.times.compute_ms / span, 0.0, 1.0) : 0.0;
  }
  return im.times;
}

double PipelineExecutor::last_wait_fraction() const {
  last_step_times();
  return std::max(0.0, impl_->bubble);
}

void PipelineExecutor::forward_only(int64_t step, int microbatches, const Loader& load, float* loss_sum) {
  Impl& im = *impl_;
  im.step = step;
  im.links.set_step(step);
  // Microbatch by microbatch, chunk by chunk: every rank takes (m, chunk)
  // in the same order and each only waits on earlier ones, with sends that
  // do not wait, so this cannot hang.
  // Each chunk's slot 0 carries every microbatch: its last send (id c) is
  // waited for before the slot is overwritten by the next.
  for (int m = 0; m < microbatches; ++m)
    for (size_t c = 0; c < im.chunks.size(); ++c) {
      const PipelineChunk& ch = *im.chunks[c].chunk;
      Slot& s = im.chunks[c].slots[0];
      im.wait_send(int(c));
      if (!ch.stage.first) im.recv(s.net->stage_input(), m, ch.virtual_stage, ch.virtual_stage - 1, 0);
      im.forward(s, ch, m, load, false, 0.0f, loss_sum);
      if (!ch.stage.last) im.send(int(c), s.net->stage_output(), m, ch.virtual_stage, ch.virtual_stage + 1, 0);
    }
  im.wait_all_sends();
  im.store.end_forward_only();
}

}  // namespace trainrun
