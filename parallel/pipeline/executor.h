// The pipeline runtime of one rank: runs its action list (schedule.h) every
// step over its stage networks, moving activations and their gradients to
// and from the neighbouring stages over the mesh's pp group.
//
// Per chunk (a virtual stage this rank computes) the executor keeps one
// network per microbatch it may hold at once (the most the action list
// has forwarded and not yet backwarded: P - r for 1f1b's rank r, M for
// gpipe), each with its own kept activations and token buffers, and one
// transient scratch that every network of the rank shares (what a single
// forward or backward writes and reads; core/model/arena_plan.h); a
// microbatch takes a free one at its receive or forward and gives it back
// after its backward (once the gradient sent from it has left).
//
// Messages go over the pipeline's links (links.h): one 2-rank communicator
// per direction between two pp ranks, so no communicator is used from two
// threads. Two ways to send, chosen by the links:
//  - blocking sends (Gloo, or NCCL with TRAINRUN_NCCL_BLOCKING=1): posted to
//    a sender thread, in the order the list issues them, and the list goes
//    on; receives wait on the compute thread. Each message has its own tag
//    (microbatch, stage boundary, direction), so a receive can only match
//    its own send.
//  - stream-ordered links (NCCL): everything is issued from the compute
//    thread and nothing waits on the host. A send runs on its link's stream
//    after the compute that produced it (send_deferred); the compute stream
//    waits for it only before the buffer is overwritten (slot reuse) and at
//    the end of the step. A receive runs on its link's stream once the
//    compute stream is past the buffer's last use, and the compute stream
//    waits for it. NCCL has no tags: messages on a link match in issue
//    order, which check_pipeline_schedule proves is the same on both sides.
// Either way the schedule's contract holds: check_pipeline_schedule proves
// the lists cannot hang with sends that do not wait. A transfer that fails
// or times out is an Error naming this stage, the peer stage and its rank,
// the microbatch and the step (on NCCL through the link's op label, in the
// watchdog's abort message too).
//
// The loss: the last stage adds every microbatch's token losses to the
// caller's device sum (normalised by the caller's dloss_scale, the global
// target count); the trainer's all-reduce reports it on every rank.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "core/model/model.h"
#include "parallel/comm/communicator.h"
#include "parallel/pipeline/links.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_plan.h"
#include "parallel/pipeline/stage_store.h"

namespace trainrun {

struct TensorParallel;
struct ContextParallel;
struct ExpertParallel;
class StepTracer;

class PipelineExecutor {
 public:
  struct Options {
    int micro_batch = 1, seq_len = 1;
    bool activation_checkpointing = false;
    // data.document_mask: every stage (not only the first) gets each
    // microbatch's document offsets, since every stage's attention (and
    // Llama's RoPE) is block-causal over them.
    bool document_mask = false;
    const TensorParallel* tp = nullptr;
    // Context parallelism: the stage networks' cp group (null = none);
    // seq_len is then this rank's rows per sequence (T / cp).
    const ContextParallel* cp = nullptr;
    // Expert parallelism: the stage networks' ep group (null = none). One
    // network per slot, so each in-flight micro-batch keeps its own exchange plans.
    const ExpertParallel* ep = nullptr;
    // Global ranks of the pp group (index = stage rank), for messages.
    std::vector<int> stage_ranks;
  };
  // `links`: this rank's, built from the same schedule; outlives the executor.
  // `units`: the stage store (or, with adapters, the base's and theirs joined).
  PipelineExecutor(const ModelArch& arch, Backend* be, const PipelineStagePlan& plan, PipelineSchedule schedule,
                   PipelineUnits& units, PipelineLinks& links, Options opts);
  ~PipelineExecutor();

  // Where the loader puts microbatch m's data for one stage: B*T int32 each,
  // device memory; null = this stage does not need it. The first stage gets
  // the input tokens, the last the targets and, with Options::document_mask,
  // every stage the document offsets (DocumentMask, made from the inputs),
  // so a middle stage is handed no tokens, only the two offset arrays.
  struct MicrobatchBuffers {
    int32_t* inputs = nullptr;
    int32_t* targets = nullptr;
    int32_t* doc_start = nullptr;
    int32_t* pos = nullptr;
    // Context parallelism with document masks: the whole sequences' (B,
    // T x cp) document starts on the host, which the cp attention plans its
    // ring by (the device arrays above hold this rank's rows).
    int32_t* host_doc_start = nullptr;
  };
  // Called before each forward of a stage that needs any of them.
  using Loader = std::function<void(int m, const MicrobatchBuffers& to)>;
  // Called right before every compute action of microbatch m (a forward,
  // backward, backward_input or backward_weight; training: a train_step's,
  // not forward_only's), on the compute thread: model.adapter sets the
  // microbatch's dropout rows there, which its backward recomputes.
  using MicrobatchHook = std::function<void(int m, bool training)>;
  void set_microbatch_hook(MicrobatchHook h);
  // Called right after the last stage's forward of microbatch m (training
  // and forward_only), with its network: losses() holds the microbatch's
  // per-token losses and, training, the hook may weight the loss gradient
  // (Network::scale_loss_grad) before the backward reads it. The
  // preference objectives (core/train/preference.h).
  using LastStageHook = std::function<void(int m, bool training, Network& net)>;
  void set_last_stage_hook(LastStageHook h);
  // One training step's forwards and backwards (the store's end_backward
  // included); the last stage adds its token losses to loss_sum (device).
  void train_step(int64_t step, const Loader& load, float dloss_scale, float* loss_sum);
  // Forwards only, microbatch by microbatch (evaluation).
  void forward_only(int64_t step, int microbatches, const Loader& load, float* loss_sum);

  const PipelineSchedule& schedule() const { return schedule_; }
  // Every stage network's kept activations plus the shared scratch once.
  size_t activation_bytes() const;
  // The measured bubble of the last train_step: 1 - the time of its compute
  // actions / its span, both on the compute stream (Backend::time_mark:
  // host clock on the CPU, CUDA events on the GPU), so the idle share is
  // the time the stage spent waiting on its peers. On CUDA it waits for the
  // step's marks: call it after the step's host sync (the loss).
  double last_wait_fraction() const;
  // The last train_step's compute time (its compute actions) and span, in
  // ms, from the same marks. The trainer's bubble compares every rank's
  // compute with the slowest rank's span: a stage that finishes its list
  // early idles until the step's collectives all the same, and the
  // schedules' formulas count that idle time too.
  struct StepTimes {
    double compute_ms = 0, span_ms = 0;
  };
  StepTimes last_step_times() const;
  // Aux-loss-free balancing (model.moe_balance: bias) over the stages: the
  // bias of every layer of the model (L x per_layer values, layer-major)
  // goes to each stage network of this rank, its chunks' rows only; the
  // load its networks counted since the last take (every in-flight
  // microbatch's network), summed, at its chunks' rows of an (L x
  // per_layer) vector, zeros elsewhere: an all-reduce over the pp group
  // (with the dp ranks') gives every layer's load on every rank.
  void set_expert_bias(const std::vector<float>& all_layers, int L);
  // Mixture of experts: the router figures of this rank's latest forwards
  // (the last stage's losses, each chunk's layers' loads at their model
  // layer index, zeros elsewhere), for the trainer to sum over the stages;
  // and the figures network_view() reports (the sum: metrics.jsonl).
  Network::RouterReport router_report_local(int L) const;
  void set_router_report(const Network::RouterReport& r);
  std::vector<float> take_expert_load(int L, int per_layer);
  // A Network standing for this rank's stage networks where the trainer's
  // reporting wants one (activation_bytes); computing through it is an error.
  const Network& network_view() const;
  // output.trace_steps: spans of every action (compute thread) and send
  // (sender thread) while a traced step runs; null = none.
  void set_tracer(StepTracer* t);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  PipelineSchedule schedule_;
};

}  // namespace trainrun
