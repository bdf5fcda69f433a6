// The pipeline runtime of one rank (executor.h).
#include "parallel/pipeline/executor.h"

#include <chrono>
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

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Posts sends in order on one thread, so the compute thread never waits
// for a peer to take a message it does not need yet.
class Sender {
 public:
  explicit Sender(Communicator* comm) : comm_(comm), th_([this] { loop(); }) {}
  ~Sender() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  std::shared_future<void> post(const void* buf, size_t bytes, int peer, uint32_t tag, std::string label) {
    auto done = std::make_shared<std::promise<void>>();
    std::shared_future<void> f = done->get_future().share();
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back({buf, bytes, peer, tag, done, std::move(label)});
    }
    cv_.notify_all();
    return f;
  }

 private:
  struct Job {
    const void* buf;
    size_t bytes;
    int peer;
    uint32_t tag;
    std::shared_ptr<std::promise<void>> done;
    std::string label;  // the trace span's name
  };
  void loop() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        j = q_.front();
        q_.pop_front();
      }
      try {
        StepTracer::Span span(tracer, j.label, "p2p", 1);
        comm_->send(j.buf, j.bytes, j.peer, j.tag);
        j.done->set_value();
      } catch (...) {
        j.done->set_exception(std::current_exception());
      }
    }
  }
 public:
  StepTracer* tracer = nullptr;  // set between steps only

 private:
  Communicator* comm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> q_;
  bool stop_ = false;
  std::thread th_;  // last: started once the rest is built
};

// One microbatch's place on a chunk: a network (its activations) and its
// tokens, and with document masking its document offsets, which stay until
// the slot's next forward, so the backward (and activation checkpointing's
// recompute, and zero_bubble's deferred weight step) sees the same documents.
struct Slot {
  std::unique_ptr<Network> net;
  DeviceBuffer in, tgt;
  DeviceBuffer doc_start, pos;  // (B,T) int32, with Options::document_mask only
  std::shared_future<void> send;  // the last send from its buffers
  std::string send_what;          // for the message if that send failed
  bool busy = false;
};

struct ChunkRun {
  const PipelineChunk* chunk = nullptr;
  PipelineStage stage;  // the chunk's, with split_backward under zero_bubble
  std::vector<Slot> slots;
  std::map<int, int> slot_of;  // microbatch -> slot
};

class NetworkView final : public Network {
 public:
  explicit NetworkView(const PipelineExecutor& e) : e_(e) {}
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
};

}  // namespace

struct PipelineExecutor::Impl {
  Backend* be;
  const PipelineStagePlan& plan;
  PipelineStageStore& store;
  Communicator* pp;
  Options opts;
  std::vector<ChunkRun> chunks;
  DeviceBuffer scratch;  // the stage networks' shared transient buffers
  std::unique_ptr<Sender> sender;
  std::unique_ptr<NetworkView> view;
  int64_t step = 0;
  double wait_s = 0;
  bool split = false;
  StepTracer* tracer = nullptr;
  // Tests: TRAINRUN_DEBUG_PIPE_KILL=<global rank>:<step>:<microbatch> kills
  // this process with SIGKILL before that microbatch's forward (mid-step).
  int kill_rank = -1, kill_mb = -1;
  int64_t kill_step = -1;
  size_t io_bytes = 0;

  Impl(Backend* b, const PipelineStagePlan& p, PipelineStageStore& s, Communicator* c, Options o)
      : be(b), plan(p), store(s), pp(c), opts(std::move(o)) {}

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

  void wait_send(Slot& s) {
    if (!s.send.valid()) return;
    const auto t0 = Clock::now();
    try {
      s.send.get();
    } catch (const std::exception& e) {
      s.send = {};
      TR_FAIL(s.send_what, " failed: ", e.what());
    }
    s.send = {};
    wait_s += seconds(Clock::now() - t0);
  }
  Slot& slot(int c, int mb) {
    ChunkRun& cr = chunks[size_t(c)];
    auto it = cr.slot_of.find(mb);
    if (it != cr.slot_of.end()) return cr.slots[size_t(it->second)];
    for (size_t i = 0; i < cr.slots.size(); ++i)
      if (!cr.slots[i].busy) {
        Slot& s = cr.slots[i];
        wait_send(s);  // its buffers are about to be overwritten
        s.busy = true;
        cr.slot_of[mb] = int(i);
        return s;
      }
    TR_FAIL("pipeline: stage ", cr.chunk->virtual_stage, " holds more microbatches than its ", cr.slots.size(),
            " activation sets (a bug)");
  }
  void free_slot(int c, int mb) {
    ChunkRun& cr = chunks[size_t(c)];
    auto it = cr.slot_of.find(mb);
    if (it == cr.slot_of.end()) return;
    cr.slots[size_t(it->second)].busy = false;
    cr.slot_of.erase(it);
  }
  void recv(void* buf, int mb, int vs, int peer_vs, int dir) {
    StepTracer::Span span(tracer, detail::cat(dir == 0 ? "recv_act mb" : "recv_grad mb", mb, " stage ", vs), "p2p");
    const auto t0 = Clock::now();
    const int boundary = std::min(vs, peer_vs);
    try {
      pp->recv(buf, io_bytes, peer_vs % P(), tag(mb, boundary, dir));
    } catch (const std::exception& e) {
      TR_FAIL(where(dir == 0 ? "receiving the activation" : "receiving the gradient", mb, vs, peer_vs), " failed: ",
              e.what());
    }
    wait_s += seconds(Clock::now() - t0);
  }
  void send(Slot& s, const void* buf, int mb, int vs, int peer_vs, int dir) {
    wait_send(s);
    s.send_what = where(dir == 0 ? "sending the activation" : "sending the gradient", mb, vs, peer_vs);
    s.send = sender->post(buf, io_bytes, peer_vs % P(), tag(mb, std::min(vs, peer_vs), dir),
                          detail::cat(dir == 0 ? "send_act mb" : "send_grad mb", mb, " stage ", vs));
  }
  void wait_all_sends() {
    for (ChunkRun& cr : chunks)
      for (Slot& s : cr.slots) wait_send(s);
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
      docs = DocumentMask{to.doc_start, to.pos};
    }
    if (to.inputs || to.targets || to.doc_start) load(mb, to);
    s.net->forward(store.chunk_access(chunk_of(ch.virtual_stage)), to.inputs, to.targets, B, T, for_backward,
                   dloss_scale, docs);
    if (ch.stage.last) be->sum(loss_sum, s.net->losses(), int64_t(B) * T);
  }
};

PipelineExecutor::PipelineExecutor(const ModelArch& arch, Backend* be, const PipelineStagePlan& plan,
                                   PipelineSchedule schedule, PipelineStageStore& store, Communicator* pp,
                                   Options opts)
    : impl_(std::make_unique<Impl>(be, plan, store, pp, std::move(opts))), schedule_(std::move(schedule)) {
  Impl& im = *impl_;
  // zero_bubble: BI then, later, BW; a microbatch's activations stay until its BW.
  im.split = schedule_.kind == "zero_bubble";
  TR_CHECK(pp && schedule_.ranks == plan.ranks() && schedule_.virtual_stages == int(plan.chunks().size()),
           "pipeline: schedule, plan and pp group disagree (a bug)");
  const int r = plan.rank();
  // Activation sets per chunk: the most microbatches this rank's list has
  // received or forwarded and not yet backwarded on it, at any point.
  std::vector<int> live(plan.chunks().size(), 0), most(plan.chunks().size(), 1);
  std::vector<std::map<int, bool>> open(plan.chunks().size());
  for (const PipeAction& a : schedule_.actions[size_t(r)]) {
    const size_t c = size_t(im.chunk_of(a.stage));
    if (a.op == PipeOp::RecvAct || a.op == PipeOp::F) {
      if (!open[c][a.microbatch]) {
        open[c][a.microbatch] = true;
        most[c] = std::max(most[c], ++live[c]);
      }
    } else if (a.op == PipeOp::B || a.op == PipeOp::BW) {
      if (open[c].erase(a.microbatch)) --live[c];
    }
  }
  const int B = im.opts.micro_batch, T = im.opts.seq_len;
  for (size_t c = 0; c < plan.chunks().size(); ++c) {
    ChunkRun cr;
    cr.chunk = &plan.chunks()[c];
    cr.stage = cr.chunk->stage;
    cr.stage.split_backward = im.split;
    cr.stage.shared_scratch = true;
    for (int i = 0; i < most[c]; ++i) {
      Slot s;
      s.net = arch.make_network(be, B, im.opts.activation_checkpointing, im.opts.tp, &cr.stage);
      s.in = DeviceBuffer(be, size_t(B) * T * 4);
      s.tgt = DeviceBuffer(be, size_t(B) * T * 4);
      if (im.opts.document_mask) {
        s.doc_start = DeviceBuffer(be, size_t(B) * T * 4);
        s.pos = DeviceBuffer(be, size_t(B) * T * 4);
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
  im.sender = std::make_unique<Sender>(pp);
  im.view = std::make_unique<NetworkView>(*this);
}

PipelineExecutor::~PipelineExecutor() = default;

size_t PipelineExecutor::activation_bytes() const {
  size_t n = 0;
  for (const ChunkRun& cr : impl_->chunks)
    for (const Slot& s : cr.slots) n += s.net->activation_bytes();
  return n + impl_->scratch.bytes();
}

const Network& PipelineExecutor::network_view() const { return *impl_->view; }

void PipelineExecutor::set_tracer(StepTracer* t) {
  impl_->tracer = t;
  impl_->sender->tracer = t;
}

void PipelineExecutor::train_step(int64_t step, const Loader& load, float dloss_scale, float* loss_sum) {
  Impl& im = *impl_;
  im.step = step;
  im.wait_s = 0;
  const auto t0 = Clock::now();
  im.store.begin_step();
  for (const PipeAction& a : schedule_.actions[size_t(im.plan.rank())]) {
    const int c = im.chunk_of(a.stage);
    const PipelineChunk& ch = *im.chunks[size_t(c)].chunk;
    const bool compute = a.op == PipeOp::F || a.op == PipeOp::B || a.op == PipeOp::BI || a.op == PipeOp::BW;
    StepTracer::Span span(compute ? im.tracer : nullptr,
                          detail::cat(a.op == PipeOp::F ? "forward" : a.op == PipeOp::B ? "backward"
                                      : a.op == PipeOp::BI ? "backward_input" : "backward_weight",
                                      " mb", a.microbatch, " stage ", a.stage),
                          "compute");
    switch (a.op) {
      case PipeOp::RecvAct: {
        Slot& s = im.slot(c, a.microbatch);
        im.recv(s.net->stage_input(), a.microbatch, a.stage, a.stage - 1, 0);
        break;
      }
      case PipeOp::F:
        im.forward(im.slot(c, a.microbatch), ch, a.microbatch, load, true, dloss_scale, loss_sum);
        break;
      case PipeOp::SendAct: {
        Slot& s = im.slot(c, a.microbatch);
        im.send(s, s.net->stage_output(), a.microbatch, a.stage, a.stage + 1, 0);
        break;
      }
      case PipeOp::RecvGrad:
        im.recv(im.slot(c, a.microbatch).net->stage_output_grad(), a.microbatch, a.stage, a.stage + 1, 1);
        break;
      case PipeOp::B:
        im.slot(c, a.microbatch).net->backward(im.store.chunk_access(c));
        if (ch.stage.first) im.free_slot(c, a.microbatch);
        break;
      case PipeOp::SendGrad: {
        Slot& s = im.slot(c, a.microbatch);
        im.send(s, s.net->stage_input_grad(), a.microbatch, a.stage, a.stage - 1, 1);
        // Reused only after that send has left (Impl::slot); under
        // zero_bubble only after its weight step too.
        if (!im.split) im.free_slot(c, a.microbatch);
        break;
      }
      case PipeOp::BI:
        im.slot(c, a.microbatch).net->backward_input(im.store.chunk_access(c));
        break;
      case PipeOp::BW:
        im.slot(c, a.microbatch).net->backward_weight(im.store.chunk_access(c));
        im.free_slot(c, a.microbatch);
        break;
    }
  }
  {
    StepTracer::Span span(im.tracer, "wait for sends", "p2p");
    im.wait_all_sends();
  }
  {
    StepTracer::Span span(im.tracer, "tied sum + reductions queued", "collective");
    im.store.end_backward();
  }
  const double total = seconds(Clock::now() - t0);
  last_wait_fraction_ = total > 0 ? im.wait_s / total : 0;
}

void PipelineExecutor::forward_only(int64_t step, int microbatches, const Loader& load, float* loss_sum) {
  Impl& im = *impl_;
  im.step = step;
  // Microbatch by microbatch, chunk by chunk: every rank takes (m, chunk)
  // in the same order and each only waits on earlier ones, with sends that
  // do not wait, so this cannot hang.
  for (int m = 0; m < microbatches; ++m)
    for (size_t c = 0; c < im.chunks.size(); ++c) {
      const PipelineChunk& ch = *im.chunks[c].chunk;
      Slot& s = im.chunks[c].slots[0];
      im.wait_send(s);
      if (!ch.stage.first) im.recv(s.net->stage_input(), m, ch.virtual_stage, ch.virtual_stage - 1, 0);
      im.forward(s, ch, m, load, false, 0.0f, loss_sum);
      if (!ch.stage.last) im.send(s, s.net->stage_output(), m, ch.virtual_stage, ch.virtual_stage + 1, 0);
    }
  im.wait_all_sends();
  im.store.end_forward_only();
}

}  // namespace trainrun
