// Pipeline schedules as per-rank action lists, and the stage split.
//
// A pipeline of P ranks runs M microbatches (the step's accumulation count)
// through P * v virtual stages: rank r holds the model chunks of virtual
// stages r, r + P, ..., r + (v - 1) P (v = parallel.pipeline_virtual_stages;
// 1 except for interleaved_1f1b), as Megatron-LM interleaves them. Each
// rank's schedule is a list of actions, executed in order:
//   compute: F (forward), B (the whole backward), BI (backward, input
//            gradient only: what the previous stage waits for) and BW (the
//            weight gradient BI left, zero_bubble only);
//   comm:    SendAct/RecvAct (an activation to / from the next stage),
//            SendGrad/RecvGrad (its gradient back).
// Sends are posted without waiting (the runtime waits for them before their
// buffer is reused and at the end of the step), receives wait; messages
// between two ranks in one direction match in the order they are issued.
// check_schedule() runs every rank's list against those rules before the
// first step, so a schedule that would hang (or compute on data it has not
// received) is an error naming the ranks and their blocked actions, never a
// hang at step 1 of a 1,000-step job.
//
// The schedules (parallel.pipeline_schedule):
//   gpipe             every forward, then every backward; M activations in flight
//   1f1b              P - r - 1 warm-up forwards, then one forward one backward,
//                     then the remaining backwards; at most P - r in flight
//   interleaved_1f1b  1f1b over v chunks per rank (Megatron's order: P
//                     microbatches per chunk in turn); bubble / v; M % P == 0
//   zero_bubble       ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1f1b with the
//                     backward split into BI and BW; rank r defers r weight
//                     passes to the end, where its 1f1b bubble was, keeping
//                     1f1b's activation memory
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace trainrun {

enum class PipeOp { F, B, BI, BW, SendAct, RecvAct, SendGrad, RecvGrad };
const char* pipe_op_name(PipeOp op);  // "F", "B", "BI", "BW", "send_act", ...
// A compute op's name in trace spans ("forward", "backward",
// "backward_input", "backward_weight"; the executor writes "<name> mb<m>
// stage <s>", `bench pipeline` reads it back); null for a comm op.
const char* pipe_compute_span_name(PipeOp op);
// Its inverse: false for a name that is no compute op's.
bool pipe_op_from_span_name(const std::string& name, PipeOp* op);

struct PipeAction {
  PipeOp op;
  int microbatch = 0;
  int stage = 0;  // the virtual stage computed (compute) or sending/receiving (comm)
  int peer = -1;  // comm: the other rank
};

struct PipelineSchedule {
  std::string kind;  // gpipe | 1f1b | interleaved_1f1b | zero_bubble
  int ranks = 1, virtual_stages = 1, microbatches = 1;
  std::vector<std::vector<PipeAction>> actions;  // per rank
  int stages() const { return ranks * virtual_stages; }
  int rank_of_stage(int s) const { return s % ranks; }
};

// Builds the schedule. Errors name the numbers and the keys: fewer
// microbatches than stages (than P * v for interleaved, which also needs
// M % P == 0), an unknown kind, v != 1 for a schedule without chunks.
PipelineSchedule make_pipeline_schedule(const std::string& kind, int ranks, int virtual_stages, int microbatches);

// Every microbatch is forwarded and backwarded exactly once on every
// virtual stage, on the rank that holds it, after the data it needs
// arrived, and the lists run to the end with sends posted and receives
// waiting: throws Error naming what is wrong (for a hang: every rank's next
// action). First, the link order check: on every link (an ordered pair of
// ranks, links.h) the sender's send order is the receiver's receive order,
// else an Error naming the link, its ranks and the two microbatches.
//
// Then the lists again with the executor's buffer reuse (slots.h): an
// action that takes over a slot, or sends from it again, runs only once
// the slot's last send has been received.
//
// What that proves about the runtimes. The model: each rank runs its list
// in order; a receive waits for its message; a send is posted and the list
// goes on; the slot waits wait for "received"; on every link messages pair
// up in order (the link order check). The Gloo runtime is that model: its
// compute thread runs the list, blocks in receives and in the slot waits,
// and hands each send to its link's own sender thread (one per link, so a
// send that waits for one peer never holds up another link; one thread for
// all links hung pp4 interleaved_1f1b). A send there meets its receive
// (rendezvous) instead of being buffered, which adds only "the k-th
// transfer on a link after the (k-1)-th": already implied, since the
// receiver's k-th receive comes after its (k-1)-th in its list.
// The NCCL runtime (a stream per link, every op issued in list order from
// the compute thread, nothing waiting on the host) has the same waits, as
// GPU edges: a transfer starts after the previous op on its link's stream
// and after the compute stream's point at its issue (the data produced, or
// the buffer free); a compute action waits for the previous compute, for
// the receives it needs and for the slot plan's sends. That is a subset of
// Gloo's edges (there, a receive blocks every later action, needed or not),
// so a cycle among NCCL's waits would be one among Gloo's: what this check
// proves for Gloo holds for NCCL. (The executor's only other waits are at
// the end of the step, for every send, which the check's "every message
// received" covers.)
void check_pipeline_schedule(const PipelineSchedule& s);

// A simulated run with unit costs (F = 1, BI = 1, BW = 1, B = 2 for a
// rank's whole share of the layers, 1/v of that per interleaved chunk;
// comm 0): the step's length, the bubble (idle share of ranks x length)
// and each rank's peak of activations held (a microbatch's chunk that is
// forwarded and whose weight gradient is not done yet).
struct PipelineStats {
  double length = 0;
  double bubble = 0;
  std::vector<int> peak_in_flight;
};
PipelineStats simulate_pipeline_schedule(const PipelineSchedule& s);
// The same run with given costs: cost(virtual stage, op) for each compute
// op (F, B, BI, BW) and `p2p` for every message's transfer (arrival = the
// send's time + p2p). `trainrun bench pipeline` feeds it a real run's
// measured times, which tells a schedule's bubble with those stage costs
// (uneven stages, BW cheaper than F) from what the ops' time noise and the
// runtime add (replay_pipeline_schedule below).
PipelineStats simulate_pipeline_schedule(const PipelineSchedule& s, const std::function<double(int, PipeOp)>& cost,
                                         double p2p);
// The same run with a cost for each compute action itself (its stage, op
// and microbatch): `trainrun bench pipeline` replays a traced step with
// every action's own measured time, so the bubble it gives is what a
// runtime with no overhead and free transfers would have measured over the
// very same op times, noise included; the measured bubble minus that is
// the runtime's own share.
PipelineStats replay_pipeline_schedule(const PipelineSchedule& s, const std::function<double(const PipeAction&)>& cost,
                                       double p2p);

// `--explain`: one line per rank (its actions in order, e.g. "F0.1 send_act
// ..."), then the simulated length, bubble and activation peaks.
std::string explain_pipeline_schedule(const PipelineSchedule& s);

// The layers of each of P * v virtual stages: an even split (the first
// L % stages stages one layer more) or parallel.pipeline_layers. An explicit
// split that drops or duplicates a layer (its sum is not L), has the wrong
// number of entries, or gives a stage no layers is an error naming it.
std::vector<int> split_pipeline_layers(int layers, int stages, const std::vector<int>& explicit_split);

// parallel.pipeline_layers' text ("3,1", "[3, 1]", "" = none) as numbers;
// anything else is an Error naming the key and the text.
std::vector<int> parse_pipeline_layers(const std::string& text);

}  // namespace trainrun
