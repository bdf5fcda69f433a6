#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "core/common/error.h"
#include "core/common/int_list.h"
#include "parallel/pipeline/slots.h"

namespace trainrun {

const char* pipe_op_name(PipeOp op) {
  switch (op) {
    case PipeOp::F: return "F";
    case PipeOp::B: return "B";
    case PipeOp::BI: return "BI";
    case PipeOp::BW: return "BW";
    case PipeOp::SendAct: return "send_act";
    case PipeOp::RecvAct: return "recv_act";
    case PipeOp::SendGrad: return "send_grad";
    case PipeOp::RecvGrad: return "recv_grad";
  }
  return "?";
}

const char* pipe_compute_span_name(PipeOp op) {
  switch (op) {
    case PipeOp::F: return "forward";
    case PipeOp::B: return "backward";
    case PipeOp::BI: return "backward_input";
    case PipeOp::BW: return "backward_weight";
    default: return nullptr;
  }
}

bool pipe_op_from_span_name(const std::string& name, PipeOp* op) {
  for (PipeOp o : {PipeOp::F, PipeOp::B, PipeOp::BI, PipeOp::BW})
    if (name == pipe_compute_span_name(o)) {
      *op = o;
      return true;
    }
  return false;
}

namespace {

std::string action_text(const PipeAction& a) {
  std::string s = std::string(pipe_op_name(a.op)) + " mb" + std::to_string(a.microbatch) + " stage" +
                  std::to_string(a.stage);
  if (a.peer >= 0) s += (a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad ? " to rank " : " from rank ") +
                        std::to_string(a.peer);
  return s;
}

// Appends one compute with the communication around it. Receives go just
// before the compute that needs them, sends just after the compute that
// produced them.
class Builder {
 public:
  Builder(PipelineSchedule& s, int rank) : s_(s), r_(rank), out_(s.actions[size_t(rank)]) {}

  void forward(int mb, int stage) {
    if (stage > 0) out_.push_back({PipeOp::RecvAct, mb, stage, s_.rank_of_stage(stage - 1)});
    out_.push_back({PipeOp::F, mb, stage, -1});
    if (stage < s_.stages() - 1) out_.push_back({PipeOp::SendAct, mb, stage, s_.rank_of_stage(stage + 1)});
  }
  // op: B (whole) or BI (input gradient; BW follows later).
  void backward(int mb, int stage, PipeOp op) {
    if (stage < s_.stages() - 1) out_.push_back({PipeOp::RecvGrad, mb, stage, s_.rank_of_stage(stage + 1)});
    out_.push_back({op, mb, stage, -1});
    if (stage > 0) out_.push_back({PipeOp::SendGrad, mb, stage, s_.rank_of_stage(stage - 1)});
  }
  void weight(int mb, int stage) { out_.push_back({PipeOp::BW, mb, stage, -1}); }
  int rank() const { return r_; }

 private:
  PipelineSchedule& s_;
  int r_;
  std::vector<PipeAction>& out_;
};

void build_gpipe(PipelineSchedule& s) {
  for (int r = 0; r < s.ranks; ++r) {
    Builder b(s, r);
    for (int m = 0; m < s.microbatches; ++m) b.forward(m, r);
    for (int m = 0; m < s.microbatches; ++m) b.backward(m, r, PipeOp::B);
  }
}

void build_1f1b(PipelineSchedule& s) {
  const int P = s.ranks, M = s.microbatches;
  for (int r = 0; r < P; ++r) {
    Builder b(s, r);
    const int warmup = std::min(P - r - 1, M);
    int f = 0, bw = 0;
    for (; f < warmup; ++f) b.forward(f, r);
    for (; f < M; ++f, ++bw) {
      b.forward(f, r);
      b.backward(bw, r, PipeOp::B);
    }
    for (; bw < M; ++bw) b.backward(bw, r, PipeOp::B);
  }
}

// ZB-H1: rank r runs P - r - 1 warm-up forwards; then r rounds of F + BI
// whose weight passes it defers; then F + BI + BW (the oldest deferred
// one); then the remaining BI + BW; then the r deferred weight passes,
// which fill the end of the step where 1f1b leaves rank r idle (the last
// ranks finish their backwards first).
void build_zero_bubble(PipelineSchedule& s) {
  const int P = s.ranks, M = s.microbatches;
  for (int r = 0; r < P; ++r) {
    Builder b(s, r);
    int f = 0, bi = 0, w = 0;
    const int warmup = std::min(P - r - 1, M);
    for (; f < warmup; ++f) b.forward(f, r);
    for (int i = 0; i < r && f < M; ++i, ++f, ++bi) {
      b.forward(f, r);
      b.backward(bi, r, PipeOp::BI);
    }
    for (; f < M; ++f, ++bi, ++w) {
      b.forward(f, r);
      b.backward(bi, r, PipeOp::BI);
      b.weight(w, r);
    }
    for (; bi < M; ++bi, ++w) {
      b.backward(bi, r, PipeOp::BI);
      b.weight(w, r);
    }
    for (; w < M; ++w) b.weight(w, r);
  }
}

// Megatron-LM's interleaved order: the k-th forward of a rank is chunk
// (k / P) % v of microbatch (k / (P v)) P + k % P; backwards walk the
// chunks in reverse. Warm-up: 2 (P - r - 1) + (v - 1) P forwards.
void build_interleaved(PipelineSchedule& s) {
  const int P = s.ranks, v = s.virtual_stages, M = s.microbatches;
  const int total = M * v;
  auto mb_of = [&](int k) { return (k / (P * v)) * P + k % P; };
  auto fchunk = [&](int k) { return (k / P) % v; };
  auto bchunk = [&](int k) { return v - 1 - (k / P) % v; };
  for (int r = 0; r < P; ++r) {
    Builder b(s, r);
    const int warmup = std::min(total, 2 * (P - r - 1) + (v - 1) * P);
    int f = 0, bk = 0;
    for (; f < warmup; ++f) b.forward(mb_of(f), fchunk(f) * P + r);
    for (; f < total; ++f, ++bk) {
      b.forward(mb_of(f), fchunk(f) * P + r);
      b.backward(mb_of(bk), bchunk(bk) * P + r, PipeOp::B);
    }
    for (; bk < total; ++bk) b.backward(mb_of(bk), bchunk(bk) * P + r, PipeOp::B);
  }
}

// One message on a link, as its sender or its receiver sees it.
struct LinkMessage {
  int microbatch, from_stage, to_stage;
  bool act;
  bool operator==(const LinkMessage& o) const {
    return microbatch == o.microbatch && from_stage == o.from_stage && to_stage == o.to_stage && act == o.act;
  }
};

std::string message_text(const LinkMessage& m) {
  return std::string(m.act ? "the activation" : "the gradient") + " of microbatch " + std::to_string(m.microbatch) +
         " (stage " + std::to_string(m.from_stage) + " -> " + std::to_string(m.to_stage) + ")";
}

// The link order check: on every link (from -> to) the sender's sends, in
// its list order, are the receiver's receives in its list order. NCCL has
// no tags, so this is what makes the k-th receive get the k-th send; on
// Gloo the tags would match them anyway, but one rule serves both. Actions
// whose stages or peers are wrong are left to the simulation below, which
// names them.
void check_link_order(const PipelineSchedule& s) {
  const int S = s.stages();
  std::map<std::pair<int, int>, std::vector<LinkMessage>> sent, received;
  for (int r = 0; r < s.ranks; ++r)
    for (const PipeAction& a : s.actions[size_t(r)]) {
      const bool send = a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad;
      const bool recv = a.op == PipeOp::RecvAct || a.op == PipeOp::RecvGrad;
      if (!send && !recv) continue;
      const bool act = a.op == PipeOp::SendAct || a.op == PipeOp::RecvAct;
      // The other end's stage: an activation goes up a stage, a gradient down.
      const int other = send ? (act ? a.stage + 1 : a.stage - 1) : (act ? a.stage - 1 : a.stage + 1);
      if (a.stage < 0 || a.stage >= S || other < 0 || other >= S || a.peer != s.rank_of_stage(other)) continue;
      if (send) sent[{r, a.peer}].push_back({a.microbatch, a.stage, other, act});
      else received[{a.peer, r}].push_back({a.microbatch, other, a.stage, act});
    }
  std::set<std::pair<int, int>> links;
  for (const auto& [k, v] : sent) links.insert(k);
  for (const auto& [k, v] : received) links.insert(k);
  for (const auto& link : links) {
    const auto& out = sent[link];
    const auto& in = received[link];
    const std::string name = s.kind + " schedule: the link from rank " + std::to_string(link.first) + " to rank " +
                             std::to_string(link.second);
    for (size_t i = 0; i < std::min(out.size(), in.size()); ++i)
      TR_CHECK(out[i] == in[i], name, ": its message ", i + 1, " is ", message_text(out[i]), " as rank ", link.first,
               " sends, but rank ", link.second, " receives ", message_text(in[i]),
               " there (messages on a link match in order: NCCL has no tags); rank ", link.second,
               " must receive in rank ", link.first, "'s send order");
    TR_CHECK(out.size() == in.size(), name, ": rank ", link.first, " sends ", out.size(), " message(s) on it and rank ",
             link.second, " receives ", in.size());
  }
}

}  // namespace

PipelineSchedule make_pipeline_schedule(const std::string& kind, int ranks, int virtual_stages, int microbatches) {
  TR_CHECK(ranks >= 1, "parallel.pipeline_parallel: ", ranks, " (must be at least 1)");
  TR_CHECK(virtual_stages >= 1, "parallel.pipeline_virtual_stages: ", virtual_stages, " (must be at least 1)");
  TR_CHECK(microbatches >= 1, "pipeline: ", microbatches, " microbatches (must be at least 1)");
  PipelineSchedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.microbatches = microbatches;
  s.actions.resize(size_t(ranks));
  const bool interleaved = kind == "interleaved_1f1b";
  if (!interleaved)
    TR_CHECK(virtual_stages == 1, "parallel.pipeline_virtual_stages: ", virtual_stages, " needs parallel.pipeline_schedule: "
             "interleaved_1f1b (", kind, " runs one chunk per rank); set it to 1 or change the schedule");
  if (interleaved) {
    TR_CHECK(microbatches >= ranks * virtual_stages && microbatches % ranks == 0, "parallel.pipeline_schedule: "
             "interleaved_1f1b needs a multiple of parallel.pipeline_parallel (", ranks, ") microbatches, at least ",
             ranks * virtual_stages, " (", ranks, " stages x ", virtual_stages,
             " virtual stages); the step has ", microbatches,
             " (the accumulation count: train.global_batch_size / (micro_batch_size x data-parallel ranks))");
  } else {
    TR_CHECK(microbatches >= ranks, "parallel.pipeline_schedule: ", kind, " needs at least as many microbatches as ",
             "pipeline stages (", ranks, "); the step has ", microbatches,
             " (the accumulation count: train.global_batch_size / (micro_batch_size x data-parallel ranks)); "
             "raise train.global_batch_size or lower train.micro_batch_size");
  }
  if (kind == "gpipe") build_gpipe(s);
  else if (kind == "1f1b") build_1f1b(s);
  else if (kind == "zero_bubble") build_zero_bubble(s);
  else if (interleaved) build_interleaved(s);
  else
    TR_FAIL("parallel.pipeline_schedule: unknown schedule '", kind,
            "'; use gpipe, 1f1b, interleaved_1f1b or zero_bubble");
  return s;
}

namespace {

// The run of every rank's list with sends that do not wait and receives
// that do; with `slots`, also the executor's own waits (slots.h): an action
// runs only once the earlier sends it waits for have been received.
void simulate_lists(const PipelineSchedule& s, const std::vector<PipelineSlotPlan>* slots) {
  const int P = s.ranks, S = s.stages(), M = s.microbatches;
  // What each rank has done, per (microbatch, stage).
  std::set<std::tuple<int, int>> fwd, bwd_in, bwd_w, act_in, grad_in;
  // Messages in flight per (from, to), in order: (microbatch, stage of the
  // sender). One queue for activations and gradients together: NCCL has no
  // tags, so a pair's messages must match in issue order whatever they carry.
  // Each entry also carries the send's index in the sender's list.
  std::map<std::tuple<int, int, int>, std::deque<std::tuple<int, int, size_t>>> wires;
  std::set<std::pair<int, size_t>> received;  // (sender rank, send action index)
  std::vector<size_t> pc(size_t(P), 0);
  std::vector<int> waiting_for(size_t(P), -1);  // the send a blocked rank waits for (slots), else -1
  auto where = [&](int r, const PipeAction& a) {
    return s.kind + " schedule, rank " + std::to_string(r) + ", action " + std::to_string(pc[size_t(r)]) + " (" +
           action_text(a) + ")";
  };
  for (;;) {
    bool progress = false, done = true;
    for (int r = 0; r < P; ++r) {
      auto& list = s.actions[size_t(r)];
      while (pc[size_t(r)] < list.size()) {
        const PipeAction& a = list[size_t(pc[size_t(r)])];
        TR_CHECK(a.stage >= 0 && a.stage < S && a.microbatch >= 0 && a.microbatch < M, where(r, a),
                 ": no such stage or microbatch");
        const auto key = std::make_tuple(a.microbatch, a.stage);
        const bool compute = a.op == PipeOp::F || a.op == PipeOp::B || a.op == PipeOp::BI || a.op == PipeOp::BW;
        if (compute)
          TR_CHECK(s.rank_of_stage(a.stage) == r, where(r, a), ": stage ", a.stage, " belongs to rank ",
                   s.rank_of_stage(a.stage));
        bool blocked = false;
        waiting_for[size_t(r)] = -1;
        if (slots)
          for (int w : (*slots)[size_t(r)].waits[pc[size_t(r)]])
            if (!received.count({r, size_t(w)})) {
              waiting_for[size_t(r)] = w;
              blocked = true;
            }
        if (blocked) break;
        switch (a.op) {
          case PipeOp::F:
            TR_CHECK(a.stage == 0 || act_in.count(key), where(r, a), ": its input activation was not received");
            TR_CHECK(fwd.insert(key).second, where(r, a), ": forwarded twice");
            break;
          case PipeOp::B:
          case PipeOp::BI:
            TR_CHECK(fwd.count(key), where(r, a), ": backward before its forward");
            TR_CHECK(a.stage == S - 1 || grad_in.count(key), where(r, a), ": its output gradient was not received");
            TR_CHECK(bwd_in.insert(key).second, where(r, a), ": backward twice");
            if (a.op == PipeOp::B) bwd_w.insert(key);
            break;
          case PipeOp::BW:
            TR_CHECK(bwd_in.count(key), where(r, a), ": weight gradient before the input gradient (BI)");
            TR_CHECK(bwd_w.insert(key).second, where(r, a), ": weight gradient twice");
            break;
          case PipeOp::SendAct:
          case PipeOp::SendGrad: {
            const bool act = a.op == PipeOp::SendAct;
            TR_CHECK(act ? fwd.count(key) : bwd_in.count(key), where(r, a), ": sends what it has not computed");
            const int to_stage = act ? a.stage + 1 : a.stage - 1;
            TR_CHECK(to_stage >= 0 && to_stage < S && a.peer == s.rank_of_stage(to_stage), where(r, a),
                     ": stage ", to_stage, " is not on rank ", a.peer);
            wires[std::make_tuple(r, a.peer, 0)].push_back({a.microbatch, a.stage, pc[size_t(r)]});
            break;
          }
          case PipeOp::RecvAct:
          case PipeOp::RecvGrad: {
            const bool act = a.op == PipeOp::RecvAct;
            const int from_stage = act ? a.stage - 1 : a.stage + 1;
            TR_CHECK(from_stage >= 0 && from_stage < S && a.peer == s.rank_of_stage(from_stage), where(r, a),
                     ": stage ", from_stage, " is not on rank ", a.peer);
            auto& q = wires[std::make_tuple(a.peer, r, 0)];
            if (q.empty()) {
              blocked = true;
              break;
            }
            TR_CHECK(std::get<0>(q.front()) == a.microbatch && std::get<1>(q.front()) == from_stage, where(r, a),
                     ": the next message from rank ", a.peer, " is microbatch ", std::get<0>(q.front()), " of stage ",
                     std::get<1>(q.front()), " (messages between two ranks match in order)");
            received.insert({a.peer, std::get<2>(q.front())});
            q.pop_front();
            (act ? act_in : grad_in).insert(key);
            break;
          }
        }
        if (blocked) break;
        ++pc[size_t(r)];
        progress = true;
      }
      if (pc[size_t(r)] < list.size()) done = false;
    }
    if (done) break;
    if (!progress) {
      std::string msg = s.kind + " schedule (" + std::to_string(P) + " ranks, " + std::to_string(M) +
                        " microbatches) would hang: every rank waits for a message that is never sent:";
      for (int r = 0; r < P; ++r)
        if (pc[size_t(r)] < s.actions[size_t(r)].size()) {
          msg += " rank " + std::to_string(r) + " at " + action_text(s.actions[size_t(r)][pc[size_t(r)]]);
          if (waiting_for[size_t(r)] >= 0)
            msg += " (first waiting for its " + action_text(s.actions[size_t(r)][size_t(waiting_for[size_t(r)])]) +
                   " to be received: the executor reuses that send's buffers)";
          msg += ";";
        }
      TR_FAIL(msg);
    }
  }
  for (auto& [k, q] : wires)
    TR_CHECK(q.empty(), s.kind, " schedule: rank ", std::get<0>(k), " sends ", q.size(),
             " message(s) to rank ", std::get<1>(k), " that are never received");
  const size_t want = size_t(S) * size_t(M);
  TR_CHECK(fwd.size() == want && bwd_in.size() == want && bwd_w.size() == want, s.kind, " schedule: ", fwd.size(),
           " forwards, ", bwd_in.size(), " backwards and ", bwd_w.size(), " weight gradients of the ", want,
           " (stages x microbatches) it must run");
}

}  // namespace

void check_pipeline_schedule(const PipelineSchedule& s) {
  check_link_order(s);
  // First the lists alone, whose errors name what is wrong with them; then
  // with the executor's buffer reuse (slots.h), which only a sound list has.
  simulate_lists(s, nullptr);
  std::vector<PipelineSlotPlan> slots;
  for (int r = 0; r < s.ranks; ++r) slots.push_back(plan_pipeline_slots(s, r));
  simulate_lists(s, &slots);
}

PipelineStats simulate_pipeline_schedule(const PipelineSchedule& s) {
  // A chunk of an interleaved schedule holds 1/v of the rank's layers.
  const double scale = 1.0 / s.virtual_stages;
  return simulate_pipeline_schedule(s, [&](int, PipeOp op) { return scale * (op == PipeOp::B ? 2 : 1); }, 0.0);
}

PipelineStats simulate_pipeline_schedule(const PipelineSchedule& s, const std::function<double(int, PipeOp)>& op_cost,
                                         double p2p) {
  return replay_pipeline_schedule(s, [&](const PipeAction& a) { return op_cost(a.stage, a.op); }, p2p);
}

PipelineStats replay_pipeline_schedule(const PipelineSchedule& s, const std::function<double(const PipeAction&)>& op_cost,
                                       double p2p) {
  check_pipeline_schedule(s);
  const int P = s.ranks;
  // Each message's arrival time, per (from, to, kind) in order.
  std::map<std::tuple<int, int, int>, std::deque<double>> arrivals;
  std::vector<size_t> pc(size_t(P), 0);
  std::vector<double> clock(size_t(P), 0), busy(size_t(P), 0);
  std::vector<int> held(size_t(P), 0);
  PipelineStats st;
  st.peak_in_flight.assign(size_t(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      auto& list = s.actions[size_t(r)];
      while (pc[size_t(r)] < list.size()) {
        const PipeAction& a = list[pc[size_t(r)]];
        if (a.op == PipeOp::RecvAct || a.op == PipeOp::RecvGrad) {
          auto& q = arrivals[std::make_tuple(a.peer, r, a.op == PipeOp::RecvAct ? 0 : 1)];
          if (q.empty()) break;
          clock[size_t(r)] = std::max(clock[size_t(r)], q.front());
          q.pop_front();
        } else if (a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad) {
          arrivals[std::make_tuple(r, a.peer, a.op == PipeOp::SendAct ? 0 : 1)].push_back(clock[size_t(r)] + p2p);
        } else {
          const double c = op_cost(a);
          clock[size_t(r)] += c;
          busy[size_t(r)] += c;
          if (a.op == PipeOp::F) held[size_t(r)]++;
          if (a.op == PipeOp::B || a.op == PipeOp::BW) held[size_t(r)]--;
          st.peak_in_flight[size_t(r)] = std::max(st.peak_in_flight[size_t(r)], held[size_t(r)]);
        }
        ++pc[size_t(r)];
        progress = true;
      }
    }
  }
  st.length = *std::max_element(clock.begin(), clock.end());
  double idle = 0;
  for (int r = 0; r < P; ++r) idle += st.length - busy[size_t(r)];
  st.bubble = st.length > 0 ? idle / (double(P) * st.length) : 0;
  return st;
}

std::string explain_pipeline_schedule(const PipelineSchedule& s) {
  std::ostringstream o;
  o << "pipeline schedule " << s.kind << ": " << s.ranks << " ranks x " << s.virtual_stages << " virtual stages, "
    << s.microbatches << " microbatches\n";
  for (int r = 0; r < s.ranks; ++r) {
    o << "  rank " << r << ":";
    for (const PipeAction& a : s.actions[size_t(r)]) {
      o << ' ' << pipe_op_name(a.op) << a.microbatch;
      if (s.virtual_stages > 1) o << '.' << a.stage;
    }
    o << '\n';
  }
  const PipelineStats st = simulate_pipeline_schedule(s);
  o << "  simulated (F = BI = BW = 1, B = 2): " << st.length << " units, bubble "
    << int(st.bubble * 1000 + 0.5) / 10.0 << "%, microbatches held per rank:";
  for (int p : st.peak_in_flight) o << ' ' << p;
  o << '\n';
  return o.str();
}

std::vector<int> split_pipeline_layers(int layers, int stages, const std::vector<int>& explicit_split) {
  TR_CHECK(stages >= 1, "pipeline: ", stages, " stages (must be at least 1)");
  std::vector<int> out;
  if (explicit_split.empty()) {
    TR_CHECK(layers >= stages, "parallel.pipeline_parallel: ", stages, " stages for ", layers,
             " layers (model.n_layer); every stage needs at least one layer");
    for (int s = 0; s < stages; ++s) out.push_back(layers / stages + (s < layers % stages ? 1 : 0));
    return out;
  }
  auto text = [&] {
    std::string t = "[";
    for (size_t i = 0; i < explicit_split.size(); ++i) t += (i ? ", " : "") + std::to_string(explicit_split[i]);
    return t + "]";
  };
  TR_CHECK(int(explicit_split.size()) == stages, "parallel.pipeline_layers: ", text(), " has ",
           explicit_split.size(), " entries for ", stages, " stages (pipeline_parallel x pipeline_virtual_stages)");
  int sum = 0;
  for (size_t i = 0; i < explicit_split.size(); ++i) {
    TR_CHECK(explicit_split[i] >= 1, "parallel.pipeline_layers: ", text(), " gives stage ", i, " ",
             explicit_split[i], " layers; every stage needs at least one");
    sum += explicit_split[i];
  }
  TR_CHECK(sum == layers, "parallel.pipeline_layers: ", text(), " covers ", sum, " layers but the model has ", layers,
           " (model.n_layer): ", sum < layers ? "layers would be dropped" : "layers would be duplicated");
  return explicit_split;
}

std::vector<int> parse_pipeline_layers(const std::string& text) {
  return parse_int_list(text, {"parallel.pipeline_layers", "layer count",
                               "write one layer count per virtual stage, e.g. [3, 1] (or '3,1')", 6});
}

}  // namespace trainrun
