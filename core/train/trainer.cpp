#include "core/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <thread>

#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/final_weights.h"
#include "core/checkpoint/hf_interop.h"
#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/log.h"
#include "core/common/trace.h"
#include "core/data/dataset.h"
#include "core/data/document_mask.h"
#include "core/model/model.h"
#include "core/model/model_spec.h"
#include "core/model/moe/expert_parallel_plan.h"
#include "core/model/tensor_parallel.h"
#include "core/model/model_io.h"
#include "core/train/adapter_training.h"
#include "core/train/data_text.h"
#include "core/model/adapter/qlora.h"
#include "core/train/generate.h"
#include "core/train/metrics.h"
#include "core/train/preemption.h"
#include "core/train/preference.h"
#include "core/train/progress.h"
#include "core/train/schedule.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/comm_record.h"
#include "parallel/comm/communicator.h"
#include "parallel/expert/ep_split_store.h"
#include "parallel/comm/enqueue_order.h"
#include "parallel/comm/fault_injection.h"
#include "parallel/context/cp_attention.h"
#include "parallel/context/sequence_split.h"
#include "parallel/expert/expert_dispatch.h"
#include "parallel/rendezvous/net_address.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/pipeline/executor.h"
#include "parallel/pipeline/stage_plan.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/sharding/frozen_store.h"
#include "parallel/sharding/sharding.h"
#include "parallel/rendezvous/store.h"
#include "parallel/tensor/tp_param_store.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace trainrun {

namespace {
int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  TR_CHECK(end && *end == 0, "environment variable ", name, "='", v, "' is not an integer");
  return int(x);
}
std::string env_str(const char* name, const std::string& dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}
// On resume: keep the records up to the resumed step, drop the ones a
// crashed or stopped attempt wrote after it (they will be written again).
void truncate_metrics(const std::string& path, int64_t max_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    auto p = line.find("\"step\":");
    if (p == std::string::npos) continue;
    if (std::atoll(line.c_str() + p + 7) <= max_step) kept += line + "\n";
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  out << kept;
}
// Tests: TRAINRUN_DEBUG_NAN_STEP=k (or "all") poisons rank
// TRAINRUN_DEBUG_NAN_RANK's (default 0) gradients at step k.
bool debug_nan_step_for(int rank, int step) {
  const char* s = std::getenv("TRAINRUN_DEBUG_NAN_STEP");
  if (!s || !*s) return false;
  const char* r = std::getenv("TRAINRUN_DEBUG_NAN_RANK");
  if ((r && *r ? std::atoi(r) : 0) != rank) return false;
  return std::string(s) == "all" || std::atoi(s) == step;
}
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
std::string fmt(double v, int prec) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(prec) << v;
  return os.str();
}
std::string human_bytes(double b) {
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (b >= 1024 && i < 4) b /= 1024, ++i;
  return fmt(b, i ? 1 : 0) + " " + u[i];
}
}  // namespace

WorkerInfo WorkerInfo::from_env() {
  WorkerInfo w;
  w.rank = env_int("RANK", 0);
  w.world = env_int("WORLD_SIZE", 1);
  w.local_rank = env_int("LOCAL_RANK", w.rank);
  w.local_world = env_int("LOCAL_WORLD_SIZE", w.world);
  w.group_rank = env_int("GROUP_RANK", 0);
  w.master_addr = env_str("MASTER_ADDR", "127.0.0.1");
  w.master_port = env_int("MASTER_PORT", 0);
  w.secret = env_str("TRAINRUN_STORE_SECRET", "");
  // The local address peers dial for this rank's Gloo pairs: the agent's
  // choice, else the interface that reaches MASTER_ADDR (MASTER_ADDR itself
  // only exists on node 0).
  w.bind_addr = env_str("TRAINRUN_GLOO_HOST", "");
  if (w.bind_addr.empty() && w.world > 1) {
    try {
      w.bind_addr = local_address_toward(w.master_addr);
    } catch (const Error&) {
      // Unresolvable or unroutable: the store connection reports it, with the address.
    }
  }
  if (w.bind_addr.empty()) w.bind_addr = w.master_addr;
  TR_CHECK(w.world >= 1 && w.rank >= 0 && w.rank < w.world, "RANK=", w.rank, " / WORLD_SIZE=", w.world,
           " is not a valid rank; check the launcher environment");
  return w;
}

// The ranks' stop signals, agreed in one all-reduce that also sums the
// caller's own values `v`: every rank sees the same counts of ranks that got
// SIGINT and that got SIGTERM/SIGUSR1, and so takes the same decision (an
// interrupt wins over a preemption). Returns the signal to stop for, or 0.
static int agree_on_stop(Communicator& comm, std::vector<float>& v) {
  const int sig = stop_signal_received();
  v.push_back(sig == SIGINT ? 1.0f : 0.0f);
  v.push_back(sig != 0 && sig != SIGINT ? 1.0f : 0.0f);
  comm.all_reduce(v.data(), int64_t(v.size()), ReduceOp::Sum);
  const float interrupts = v[v.size() - 2], preemptions = v.back();
  v.resize(v.size() - 2);
  if (interrupts > 0) return SIGINT;
  if (preemptions > 0) return sig != 0 ? sig : SIGTERM;
  return 0;
}

// Reads this rank's part of one global batch and runs forward+backward on it.
class Trainer {
 public:
  Trainer(const JobSpec& job, const WorkerInfo& w) : job_(job), w_(w) {}
  TrainSummary run();

 private:
  // Every rank's error text (or "") after work whose time grows with the
  // disk, agreed through the store with the disk timeout: "" when every rank
  // passed "", else the lowest rank's text naming it. `what` keys it ("init_from/").
  std::string agree_after_disk_work(const std::string& what, const std::string& mine);
  void setup();
  struct StepResult {
    double loss = 0;     // the global mean loss
    double bubble = -1;  // pipeline: the ranks' mean share of the step spent waiting on peers
    int stop_signal = 0; // a preemption signal some rank received, else 0
    std::vector<float> expert_load;  // model.moe_balance: bias: the step's (layers, E) load, summed over the ranks
  };
  // Aux-loss-free balancing (moe_config.h): the bias every rank holds (the
  // same everywhere), moved by the step's load after the optimizer step.
  std::vector<float> moe_bias_;
  void update_expert_bias(const std::vector<float>& load);
  void set_expert_bias_everywhere();  // the network's, or every stage network's rows
  StepResult train_step(int step);
  double evaluate();
  void sample_at_end();
  bool sample_prompt_ids(std::vector<int32_t>& out) const;
  std::string sample_text(const std::vector<int32_t>& ids) const {
    return data_text_.tokenizer ? decode_text(*data_text_.tokenizer, ids) : decode_tokens(ids, arch_->config().V);
  }
  void sample_from_model_file(const std::string& final_weights);
  // run() after setup, with the checkpointer it aborts on a failure.
  TrainSummary run_with(Checkpointer& ckpt, Clock::time_point t_start);
  void log_memory_at_end();
  void write_resolved_spec_with_mesh(const MeshDims& dims) const;
  void read_batch(const TokenSource& src, int64_t first, int B);
  // Microbatch m of the batch at `cursor` into one pipeline stage's device
  // buffers: those of `to` that are not null.
  void read_microbatch(const TokenSource& src, int64_t cursor, int m, const PipelineExecutor::MicrobatchBuffers& to);
  // The trained store over `layout` (the model's, this rank's TP slice or
  // its pipeline stage), sharded by parallel.sharding over `dp`; with the
  // experts' storage split on and experts in the layout, the two-part
  // store of parallel/expert/ep_split_store.h over an ExpertParallelPlan
  // of it (ep_plan_).
  std::unique_ptr<ParamStore> make_model_store(const ParamLayout& layout, Communicator* dp, int group,
                                               const CommFactory& factory, const HybridComms* hybrid,
                                               const OffloadOptions& offload);
  // The compute's activations for the reports: the network, or the pipeline's stage networks.
  const Network& network() const { return pipe_ ? pipe_->network_view() : *model_; }
  bool debug_nan_step(int step) const { return debug_nan_step_for(w_.rank, step); }

  const JobSpec& job_;
  WorkerInfo w_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<Store> store_;
  // This rank's order of calls across all its communicators (world, the
  // mesh groups, the store's own groups, NCCL pipeline links): every rank
  // enqueues them in its compute thread's program order
  // (parallel/comm/enqueue_order.h). Before them: outlives every user.
  EnqueueOrder enqueue_order_;
  std::unique_ptr<Communicator> comm_;
  // The device mesh (parallel/mesh): with tensor_parallel > 1 its groups'
  // communicators, this rank's TP plan and the network's TP context. A tp1
  // run keeps the world communicator and the store's own groups, as before.
  // Before the network and the stores, which use them until they are gone.
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<MeshComms> mesh_comms_;
  std::unique_ptr<Communicator> dp_single_;  // the dp group when it is one rank
  std::unique_ptr<Communicator> ckpt_tp_comm_;  // tp > 1: the checkpoint's TP exchange (row_exchange.h)
  std::unique_ptr<TensorParallelPlan> tp_plan_;
  TensorParallel tp_ctx_;
  // Pipeline parallelism (parallel.pipeline_parallel > 1): this rank's
  // stage layout, its store (inside the TP store when both are on) and the
  // executor that runs the schedule over the stage networks; model_ is null.
  std::unique_ptr<PipelineStagePlan> pp_plan_;
  PipelineStageStore* pp_store_ = nullptr;
  // Expert parallelism: the ep group (null at 1) and what the network gets.
  // Before the network and the store, which use them until they are gone.
  std::unique_ptr<Communicator> ep_comm_;
  ExpertParallel ep_ctx_;
  // The experts' storage split (issue 28): this rank's layout and the
  // expert data-parallel group (the dp ranks with its ep index).
  std::unique_ptr<ExpertParallelPlan> ep_plan_;
  std::unique_ptr<Communicator> xdp_comm_;
  bool ep_split_ = false;  // the experts' storage is split (make_model_store)
  // hybrid_shard: the experts' shard and replica groups inside the expert-dp group.
  std::unique_ptr<Communicator> xdp_shard_, xdp_replica_;
  std::unique_ptr<HybridComms> xdp_hybrid_;
  int xdp_group_ = 0;
  std::unique_ptr<ModelArch> arch_;  // the model's description (layout, init, files, FLOPs)
  std::unique_ptr<Network> model_;   // its forward/backward and activations
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<TokenSource> train_src_, val_src_;
  DataText data_text_;  // the data's tokenizer (the sample's text) and val tokens per byte
  std::unique_ptr<PipelineLinks> pp_links_;  // before pipe_: the executor sends on them until it is gone
  // Every collective and pipeline link that may have failed after its call
  // returned (NCCL): before anything acts on their results.
  void check_comms() {
    params_->check_comms();
    if (adapt_) adapt_->store().check_comms();
    if (pp_links_) pp_links_->check_health();
  }
  std::unique_ptr<PipelineExecutor> pipe_;
  // model.adapter: the adapters and their store (the only state the
  // optimizer trains); params_ then holds the frozen base. Under a
  // pipeline their store has communicators of its own (before adapt_).
  std::unique_ptr<MeshComms> adapter_comms_;
  std::unique_ptr<Communicator> adapter_dp_single_;
  std::unique_ptr<AdapterTraining> adapt_;
  UnitAccess& units() { return adapt_ ? adapt_->units() : static_cast<UnitAccess&>(*params_); }
  ParamStore& trained() { return adapt_ ? adapt_->store() : *params_; }
  int64_t step_ = 0;  // the step in progress, for the pipeline's messages
  bool pp_logged_ = false;
  std::unique_ptr<StepTracer> tracer_;  // output.trace_steps; null = none
  void write_trace();
  int dp_rank_ = 0, dp_size_ = 1;  // data shards: the TP ranks of one dp index read the same samples
  bool counts_loss_ = true;        // TP rank 0 adds this dp index's loss to the world's sum
  int T_ = 0, mb_ = 0, global_B_ = 0, accum_ = 0;
  int64_t cursor_ = 0;  // global sample index of the next training batch
  std::vector<int32_t> host_in_, host_tgt_;  // (mb, T): whole sequences
  DeviceBuffer dev_in_, dev_tgt_;            // (mb, rows_): the rows this rank computes
  // Context parallelism: the cp group, what the network gets, this rank's
  // rows of a sequence (rows_ = T / cp; T without cp) and its host copies.
  std::unique_ptr<Communicator> cp_comm_;
  ContextParallel cp_ctx_;
  std::unique_ptr<SequenceSplit> cp_split_;
  int rows_ = 0;
  std::vector<int32_t> host_rows_;
  // data.document_mask: the separator (-1 = off) and each batch's document
  // offsets (host, then device), made from the inputs in read_batch.
  int doc_separator_ = -1;
  std::vector<int32_t> host_doc_start_, host_pos_;
  DeviceBuffer dev_doc_start_, dev_pos_;
  DocumentMask docs() const {
    return doc_separator_ < 0 ? DocumentMask{}
                              : DocumentMask{dev_doc_start_.as<int32_t>(), dev_pos_.as<int32_t>(),
                                             cp_split_ ? host_doc_start_.data() : nullptr};
  }
  // B sequences' (B, T) host rows -> this rank's (B, rows_) on the device.
  void upload_rows(void* dev, const int32_t* host, int B);
  DeviceBuffer dev_loss_sum_;  // one fp32: the sum of this rank's token losses so far
  std::unique_ptr<PreferenceTraining> pref_;  // train.objective dpo | ipo | orpo (core/train/preference.h)
  int64_t pref_ref_base_ = 0;  // pipeline: the first row of the reference pass's chunk in flight
  bool rank0_ = true;
  std::string prefix_;
};

void Trainer::setup() {
  rank0_ = w_.rank == 0;
  // data.document_mask's separator first: a job that cannot know it fails
  // in milliseconds, before a large model is built and initialised.
  doc_separator_ = resolve_document_separator(job_);
  PreferenceTraining::check_job(job_);
  if (rank0_) {
    std::error_code ec;
    fs::create_directories(job_.output.dir, ec);
    TR_CHECK(!ec, "output.dir: cannot create '", job_.output.dir, "': ", ec.message());
  }
  // 1. device: auto = CUDA when a GPU is usable (else the CPU, with the
  // reason logged); cuda on a machine without one is an Error.
  be_ = make_backend(job_.backend, w_.local_rank, nullptr);
  // CUDA ranks talk NCCL over device memory; CPU ranks talk Gloo.
  const bool nccl = is_cuda_backend(be_.get());
  // 2. distributed
  const auto timeout = std::chrono::milliseconds(int64_t(job_.parallel.timeout_s * 1000));
  if (w_.world > 1) {
    store_ = connect_tcp_store(w_.master_addr, w_.master_port, w_.secret, timeout);
    // Store keys are per attempt: a restarted job must not meet the keys a
    // crashed attempt left behind.
    prefix_ = "attempt" + env_str("TRAINRUN_RESTART_COUNT", "0") + "/";
    comm_ = nccl ? make_nccl_communicator(be_.get(), store_.get(), prefix_ + "world/", w_.rank, w_.world, timeout)
                 : make_gloo_communicator(*store_, prefix_ + "world/", w_.rank, w_.world, w_.bind_addr, timeout);
  } else {
    // One CUDA rank still needs a communicator that copies device memory.
    comm_ = nccl ? make_nccl_communicator(be_.get(), nullptr, "world/", 0, 1, timeout) : make_single_communicator();
  }
  comm_->set_group("world");
  comm_ = maybe_inject_faults(std::move(comm_), w_.rank);  // tests: TRAINRUN_DEBUG_COMM_FAULT
  comm_ = make_ordered_communicator(maybe_record_comm(std::move(comm_), w_.rank), &enqueue_order_);
  // 3. model
  if (job_.model.adapter.on()) {
    // On CUDA the frozen base is held in bf16, the act dtype (model.base_dtype
    // auto); the adapters' ops are kernels/cuda/adapter_gemm, dropout,
    // row_norms and dora (not yet run on a GPU).
    TR_CHECK(!(is_cuda_backend(be_.get()) && job_.model.base_dtype == "fp32"), "model.base_dtype: fp32 with backend ",
             be_->name(), ": the CUDA backend holds the frozen base in its activation dtype, bf16; set "
             "model.base_dtype: auto (bf16 on CUDA), or backend: cpu for an fp32 base");
  }
  arch_ = make_model_arch(ModelConfig::from_spec(job_.model));
  const ModelConfig& cfg = arch_->config();
  T_ = cfg.T;
  mb_ = job_.train.micro_batch_size;
  data_text_ = open_data_text(job_, job_.output.sample_tokens > 0, rank0_ ? job_.output.dir : "");
  if (job_.output.sample_tokens > 0) {
    std::vector<int32_t> ids;
    (void)sample_prompt_ids(ids);  // a prompt the end-of-run sample cannot use: said now, not after training
  }
  global_B_ = job_.train.derived_global_batch_size();
  // 3b. the mesh: pp x dp_replicate x dp_shard x tp, tp innermost.
  // hybrid_shard group: the spec's, else the dp ranks inside the agent's
  // topology decision (the NVLink island, TRAINRUN_SHARD_GROUP_SIZE) or
  // this node: island / tp of them, at most the dp group (world / (tp x pp))
  // and a divisor of it, as `trainrun plan` counts it.
  // Context parallelism (parallel/context/): each sequence is split over
  // the cp ranks of a dp index; they read the same samples and keep their
  // chunks (read_batch), the network computes T / cp rows per sequence
  // with attention through the cp group, and the stores reduce and shard
  // over dp x cp (fold_context_parallel). What it does not compose with yet
  // is refused by name.
  const int cp = job_.parallel.context_parallel;
  // Adapters (LoRA, DoRA, QLoRA) are row-local and their stores reduce over
  // dp x cp as the base's do; only their dropout is not: its mask is keyed
  // by a contiguous global row index (set_dropout_rows), and a cp rank's
  // rows are two chunks of each sequence.
  TR_CHECK(cp == 1 || !job_.model.adapter.on() || job_.model.adapter.dropout == 0, "parallel.context_parallel ", cp,
           " with model.adapter.dropout ", job_.model.adapter.dropout, ": adapter dropout under context parallelism "
           "is not implemented yet (its mask is keyed by whole sequences' rows); use model.adapter.dropout: 0 or "
           "parallel.context_parallel: 1");
  TR_CHECK(cp == 1 || !cfg.moe.on(), "parallel.context_parallel ", cp, " with a mixture of experts (model.arch ",
           cfg.arch, "): the router's load-balancing statistics would cover one cp chunk, not the sequence; use "
           "parallel.context_parallel: 1");
  // The bias steers routing in every forward of a step; under a pipeline
  // each stage counts its layers' load and the step's all-reduce (over every
  // rank, so over the stages too) gives each rank every layer's
  // (PipelineExecutor::take_expert_load). The CUDA backend has no biased top-k op yet.
  TR_CHECK(cfg.moe.bias_rate == 0 || !is_cuda_backend(be_.get()), "model.moe_balance: bias on backend ", be_->name(),
           ": the CUDA backend has no biased top-k choice yet (not implemented); use the CPU backend or "
           "model.moe_balance: aux_loss");
  const int tp = job_.parallel.tensor_parallel;
  const int topo_group = env_int("TRAINRUN_SHARD_GROUP_SIZE", 0);
  const int dp_ranks = std::max(1, w_.world / std::max(1, tp * job_.parallel.pipeline_parallel * cp));
  int group = job_.parallel.shard_group_size > 0
                  ? job_.parallel.shard_group_size
                  : default_hybrid_shard_group(topo_group > 0 ? topo_group : w_.local_world, tp, dp_ranks);
  // mesh_dims: the job's mesh (the logs, job.resolved.yaml, the data);
  // dims: the stores' (cp folded into dp; the same as mesh_dims at cp 1).
  const MeshDims mesh_dims = plan_mesh(w_.world, tp, job_.parallel.pipeline_parallel, job_.parallel.sharding,
                                       job_.parallel.sharding == "hybrid_shard" ? group : 1, cp);
  const MeshDims dims = fold_context_parallel(mesh_dims);
  if (job_.parallel.sharding == "hybrid_shard") group *= cp;  // a shard group spans its dp ranks' cp ranks
  mesh_ = std::make_unique<DeviceMesh>(dims, w_.rank);
  dp_size_ = mesh_dims.dp();
  dp_rank_ = mesh_->dp_coord() / cp;
  rows_ = T_ / cp;
  // The loss is the last pipeline stage's; TP rank 0 of it counts it once.
  counts_loss_ = mesh_->coord(MeshDim::tp) == 0 && mesh_->coord(MeshDim::pp) == dims.pp - 1;
  TR_CHECK(global_B_ % (mb_ * dp_size_) == 0, "train.global_batch_size (", global_B_,
           " sequences) must be a multiple of train.micro_batch_size (", mb_, ") x data-parallel size (", dp_size_,
           " = world size ", w_.world, " / parallel.tensor_parallel ", tp,
           "); change one of them so every rank gets whole micro-batches");
  accum_ = global_B_ / (mb_ * dp_size_);
  // 4. sharded state
  // Each group is named for its errors ("dp_shard0", "dp_replicate1": the prefix).
  CommFactory factory = [this, timeout, nccl](const std::string& prefix, int rank, int world) {
    std::unique_ptr<Communicator> c =
        nccl ? make_nccl_communicator(be_.get(), store_.get(), prefix_ + prefix, rank, world, timeout)
             : make_gloo_communicator(*store_, prefix_ + prefix, rank, world, w_.bind_addr, timeout);
    c->set_group(prefix.substr(0, prefix.find('/')));
    c = maybe_record_comm(maybe_inject_faults(std::move(c), w_.rank), w_.rank);  // tests: TRAINRUN_DEBUG_COMM_*
    return make_ordered_communicator(std::move(c), &enqueue_order_);
  };
  // The cp group's communicator, first of the groups on every rank.
  if (cp > 1) {
    const DeviceMesh job_mesh(mesh_dims, w_.rank);
    cp_comm_ = factory(job_mesh.group_name(MeshDim::cp) + "/", job_mesh.coord(MeshDim::cp), cp);
    cp_ctx_.comm = cp_comm_.get();
    cp_ctx_.mode = job_.parallel.cp_mode;
    cp_split_ = std::make_unique<SequenceSplit>(T_, cp, job_mesh.coord(MeshDim::cp));
  }
  const ContextParallel* cpc = cp > 1 ? &cp_ctx_ : nullptr;
  // Expert parallelism (parallel/expert/): groups of E consecutive dp ranks
  // (dp index / E), so with tp 1 a group is E consecutive ranks of a node
  // and its all-to-all stays on NVLink; with tp each TP rank's dp group has
  // its own ep groups (the TP ranks of a dp index route the same rows and
  // exchange them alike). The job spec refuses what it does not compose
  // with yet (cp, sequence parallelism, adapters).
  const int ep = job_.parallel.expert_parallel;
  if (ep > 1) {
    TR_CHECK(cfg.moe.on(), "parallel.expert_parallel ", ep, ": model.arch ", cfg.arch,
             " has a dense MLP (model.n_experts 0); set expert_parallel to 1");
    TR_CHECK(dp_size_ % ep == 0, "parallel.expert_parallel ", ep, " does not divide the data-parallel size ", dp_size_,
             " (world size ", w_.world, "); each ep group is expert_parallel consecutive dp ranks: use a divisor of ",
             dp_size_);
    const int dpi = mesh_->dp_coord();
    // Named by the dp group (one per TP rank): "dp0_ep1" is dp ranks E..2E-1 of TP rank 0's dp group.
    ep_comm_ = factory(mesh_->dp_group_name() + "_ep" + std::to_string(dpi / ep) + "/", dpi % ep, ep);
    ep_ctx_.comm = ep_comm_.get();
    // Split storage: each rank holds its experts only (ExpertParallelPlan),
    // sharded over the expert-dp group (the dp ranks of its dp group with
    // its ep index), and the dense rest over the whole dp group
    // (parallel/expert/ep_split_store.h; make_model_store). hybrid_shard:
    // the dense part shards inside each shard group of G dp ranks as it
    // would without experts, the experts inside the G/E ranks of that group
    // with the rank's ep index (its expert-dp shard group), replicated
    // across the groups; it needs E to divide G (else every rank holds
    // every expert). Not with adapters (the job spec refuses them with ep).
    const bool hybrid = job_.parallel.sharding == "hybrid_shard";
    const int G = hybrid ? dims.dp_shard : 0;
    if (!job_.model.adapter.on() && (!hybrid || G % ep == 0)) {
      const std::string xdp = mesh_->dp_group_name() + "_xdp" + std::to_string(dpi % ep);
      xdp_comm_ = factory(xdp + "/", dpi / ep, dp_size_ / ep);
      if (hybrid) {
        // Expert-dp rank j = dpi / ep: shard groups of Gx consecutive j (the
        // rank's hybrid shard group's members with its ep index), replica
        // groups of the same j % Gx; a group of one has no communicator.
        const int j = dpi / ep, Gx = G / ep, R = dp_size_ / G;
        if (Gx > 1) xdp_shard_ = factory(xdp + "_shard" + std::to_string(j / Gx) + "/", j % Gx, Gx);
        if (R > 1) xdp_replica_ = factory(xdp + "_replica" + std::to_string(j % Gx) + "/", j / Gx, R);
        xdp_hybrid_ = std::make_unique<HybridComms>(HybridComms{xdp_shard_.get(), xdp_replica_.get()});
        xdp_group_ = Gx;
      }
      ep_split_ = true;
      ep_ctx_.split_storage = true;
    }
    if (w_.rank == 0)
      TR_LOG_INFO("expert parallelism: ep", ep, " inside dp", dp_size_, ": groups of ", ep,
                  " consecutive dp ranks of each dp group (", mesh_->dp_group_name(), "_ep0 = dp ranks 0..", ep - 1, "); ep rank i runs experts [i*",
                  cfg.moe.n_experts / ep, ", (i+1)*", cfg.moe.n_experts / ep, ") of every layer for its group's "
                  "tokens", ep_split_ ? " and holds only those (their parameters, gradients and optimizer state, sharded over "
                                       "the dp ranks with its ep index; the dense rest sharded over the whole dp group)"
                                     : "; expert weights are held by every rank here (hybrid_shard with a shard group "
                                       "that expert_parallel does not divide)");
  }
  const ExpertParallel* epc = ep > 1 ? &ep_ctx_ : nullptr;
  // Offload: the whole node's host memory is checked before any rank
  // allocates (each rank's shard is about total/world; 16 bytes each).
  OffloadOptions offload;
  offload.mode = parse_offload_mode(job_.parallel.offload);
  offload.dir = job_.parallel.offload_dir;
  offload.accum = accum_;
  if (offload.mode == OffloadMode::Nvme) check_offload_dir(offload.dir);
  // `local_total`: the elements of this rank's model slice (all of it at
  // tp1, its TP slice otherwise), sharded over the data-parallel ranks.
  auto check_host_memory = [&](int64_t local_total) {
    if (offload.mode != OffloadMode::Cpu) return;
    const int64_t per_rank =
        job_.parallel.sharding == "no_shard" ? local_total : (local_total + dims.dp() - 1) / dims.dp();
    check_offload_host_memory(offload_host_bytes(per_rank) * size_t(w_.local_world), host_memory_available(),
                              w_.local_world);
  };
  const int pp = dims.pp;
  const bool adapter = job_.model.adapter.on();
  // With adapters the optimizer state (what offload moves) is theirs alone:
  // the host check counts their elements (AdapterTraining calls it).
  AdapterTraining::Parallel adapter_par;
  adapter_par.offload = offload;
  adapter_par.check_host_memory = check_host_memory;
  if (tp == 1 && pp == 1) {
    if (!adapter) check_host_memory(arch_->layout().total);
    model_ = arch_->make_network(be_.get(), mb_, job_.train.activation_checkpointing == "blocks", nullptr, nullptr,
                                 cpc, epc);
    // With adapters the base is frozen: its store has parameters only (no
    // gradients, master weights or moments), sharded alike.
    if (ep_split_) {  // this rank's experts only, in global coordinates outside (checkpoints, init_from, files)
      params_ = make_model_store(arch_->layout(), comm_.get(), group, factory, nullptr, offload);
    } else {
      params_ = adapter
                    ? make_frozen_param_store(job_.parallel.sharding, arch_->layout(), be_.get(), comm_.get(), group,
                                              factory, frozen_format(*arch_, job_.model.base_dtype))
                    : make_param_store(job_.parallel.sharding, arch_->layout(), be_.get(), comm_.get(), group,
                                       factory, nullptr, offload);
    }
    if (adapter) {
      // The adapters' store talks over its own communicator (its own thread).
      // CUDA: NCCL over device memory (even for one rank: the single
      // communicator copies with memmove), in the rank's enqueue order as
      // every NCCL group is (factory).
      std::unique_ptr<Communicator> own =
          nccl ? factory("adapter_world/", w_.rank, w_.world)
          : w_.world > 1 ? make_gloo_communicator(*store_, prefix_ + "adapter_world/", w_.rank, w_.world,
                                                  w_.bind_addr, timeout)
                         : make_single_communicator();
      own->set_group("adapter_world");
      adapt_ = std::make_unique<AdapterTraining>(job_, *arch_, be_.get(), *params_, *comm_, std::move(own), group,
                                                 factory, mb_ * T_, adapter_par);
    }
  } else {
    // Every group's communicator, built once in the same order on every
    // rank; the store shards this rank's TP slice over the dp group.
    mesh_comms_ = std::make_unique<MeshComms>(*mesh_, factory);
    if (tp > 1) {
      // The backend's logits row alignment also pads the vocabulary (CUDA: to lcm(tp, 64)).
      tp_plan_ = std::make_unique<TensorParallelPlan>(*arch_, tp, mesh_->coord(MeshDim::tp), be_->logits_stride(1));
      if (w_.rank == 0 && tp_plan_->shape().V_pad != cfg.V)
        TR_LOG_INFO("tensor parallelism: the vocabulary of ", cfg.V, " is padded to ", tp_plan_->shape().V_pad,
                    " rows (a multiple of lcm(tp ", tp, ", backend row alignment ", be_->logits_stride(1),
                    ")); the padding rows are never in the loss, the grad norm or a file");
      tp_ctx_.plan = tp_plan_.get();
      tp_ctx_.comm = mesh_comms_->comm(MeshDim::tp);
      tp_ctx_.sequence_parallel = job_.parallel.sequence_parallel_on();
      // The checkpoint's own host communicator of the TP group (Gloo on every
      // backend: it trades host pieces), so a save, also one in a background
      // thread, never shares the training's communicators.
      ckpt_tp_comm_ = make_gloo_communicator(*store_, prefix_ + "ckpt_" + mesh_->group_name(MeshDim::tp) + "/",
                                             mesh_->coord(MeshDim::tp), tp, w_.bind_addr, timeout);
      ckpt_tp_comm_->set_group("ckpt_" + mesh_->group_name(MeshDim::tp));
    }
    const TensorParallel* tpc = tp > 1 ? &tp_ctx_ : nullptr;
    // The layout this rank's stores see: the TP slice (or the whole model),
    // then, with a pipeline, this stage's units of it.
    const ParamLayout& outer = tp > 1 ? tp_plan_->local_layout() : arch_->layout();
    if (pp == 1 && !adapter) check_host_memory(outer.total);  // a pipeline checks its stage's units below
    Communicator* dp = mesh_comms_->dp();
    if (!dp) {
      dp_single_ = make_single_communicator();
      dp = dp_single_.get();
    }
    HybridComms hybrid{mesh_comms_->comm(MeshDim::dp_shard), mesh_comms_->comm(MeshDim::dp_replicate)};
    // With adapters, the frozen base's and the adapters' groups are named by
    // this rank's dp group: the TP ranks' (or the stages') dp groups differ,
    // so their hybrid_shard groups never meet in the store.
    const std::string dp_name = mesh_->dp_group_name();
    CommFactory dp_factory = [factory, dp_name](const std::string& prefix, int rank, int world) {
      return factory(dp_name + "_" + prefix, rank, world);
    };
    std::unique_ptr<ParamStore> store;
    if (pp == 1) {
      model_ = arch_->make_network(be_.get(), mb_, job_.train.activation_checkpointing == "blocks", tpc, nullptr, cpc, epc);
      // Offload works on the inner (local) store: the TP store's norm skip
      // reaches its host grad norm too (HostOptimizerState::grad_sum_squares).
      // With adapters the base's TP slice is frozen (parameters only),
      // sharded over the dp group alike (groups from dp_factory).
      store = adapter ? make_frozen_param_store(job_.parallel.sharding, outer, be_.get(), dp, dims.dp_shard, dp_factory,
                                                frozen_format(*arch_, job_.model.base_dtype, *tp_plan_, tp_ctx_.comm))
                      : make_model_store(outer, dp, dims.dp_shard, factory, &hybrid, offload);
      if (adapter) {
        // The adapters' dp store on its own communicator (its own thread);
        // their slice follows the base's (lora.h, "Tensor parallelism").
        // CUDA: NCCL over device memory, as at tp1 (its group "<dp>_adapter").
        std::unique_ptr<Communicator> own =
            nccl            ? dp_factory("adapter/", mesh_->dp_coord(), dims.dp())
            : dims.dp() > 1 ? make_gloo_communicator(*store_, prefix_ + "adapter_" + dp_name + "/", mesh_->dp_coord(),
                                                     dims.dp(), w_.bind_addr, timeout)
                            : make_single_communicator();
        if (!nccl) own->set_group("adapter_" + dp_name);
        store = make_tensor_parallel_store(std::move(store), *tp_plan_, tp_ctx_.comm);
        adapter_par.tp = &tp_ctx_;
        adapt_ = std::make_unique<AdapterTraining>(job_, *arch_, be_.get(), *store, *comm_, std::move(own),
                                                   dims.dp_shard, dp_factory, mb_ * T_, adapter_par);
      }
    } else {
      const ParallelSpec& ps = job_.parallel;
      const int v = ps.pipeline_virtual_stages;
      const std::vector<int> split = split_pipeline_layers(cfg.L, pp * v, parse_pipeline_layers(ps.pipeline_layers));
      // Checked before the first step (the launcher checked it too): a
      // schedule that would hang is an error naming the blocked ranks.
      PipelineSchedule sched = make_pipeline_schedule(ps.pipeline_schedule, pp, v, accum_);
      check_pipeline_schedule(sched);
      pp_plan_ = std::make_unique<PipelineStagePlan>(outer, pp, v, mesh_->coord(MeshDim::pp), split);
      // Offload works on the inner store too: each stage offloads its own units.
      check_host_memory(pp_plan_->stage_layout().total);
      // With adapters the stage's base is frozen (parameters only), sharded
      // alike over the stage's dp group (groups from dp_factory).
      // bf16 / nf4: each tensor lies whole in one stage, so the stage's
      // store rounds and quantizes it as the whole model's does.
      auto inner = adapter ? make_frozen_param_store(ps.sharding, pp_plan_->stage_layout(), be_.get(), dp,
                                                      dims.dp_shard, dp_factory,
                                                      frozen_format(*arch_, job_.model.base_dtype,
                                                                    pp_plan_->stage_layout()))
                            : make_model_store(pp_plan_->stage_layout(), dp, dims.dp_shard, factory, &hybrid, offload);
      Communicator* ppc = mesh_comms_->comm(MeshDim::pp);
      // The p2p links (parallel/pipeline/links.h), after every mesh group
      // and in the same order on every rank; on NCCL each on its own
      // stream, on the CPU shared memory where both ranks share a host
      // (else Gloo; TRAINRUN_PIPELINE_SHM=0 forces Gloo).
      GroupCommFactory link_factory = [this, timeout, nccl](const std::string& prefix, int rank, int world) {
        TR_CHECK(world == 2, "pipeline: a link has 2 ranks, not ", world, " (a bug)");
        std::unique_ptr<Communicator> c =
            nccl ? make_nccl_communicator(be_.get(), store_.get(), prefix_ + prefix, rank, world, timeout, true)
                 : make_p2p_link_communicator(*store_, prefix_ + prefix, rank, w_.bind_addr, timeout);
        c->set_group(prefix.substr(0, prefix.find('/')));
        c = maybe_record_comm(maybe_inject_faults(std::move(c), w_.rank), w_.rank);
        // NCCL links are issued from the compute thread and take turns like
        // every other group; Gloo/shm links send on sender threads that
        // block for the peer by design and stay outside the order
        // (enqueue_order.h, "Scope").
        return nccl ? make_ordered_communicator(std::move(c), &enqueue_order_) : std::move(c);
      };
      pp_links_ = std::make_unique<PipelineLinks>(sched, mesh_->coord(MeshDim::pp), mesh_->group_name(MeshDim::pp),
                                                  link_factory);
      auto stage_store =
          make_pipeline_stage_store(std::move(inner), *pp_plan_, ppc, be_.get(), ps.pipeline_reshard_on(), adapter);
      pp_store_ = stage_store.get();
      PipelineUnits* stage_units = stage_store.get();
      if (adapter) {
        // The adapters of this stage's blocks, in a store of their own
        // (core/train/adapter_pipeline.h): the job's strategy over the
        // stage's dp group, on communicators of their own (that store's
        // collectives run on its own thread), and the pp group's for the
        // grad norm.
        adapter_comms_ = std::make_unique<MeshComms>(
            *mesh_, [factory](const std::string& prefix, int rank, int world) {
              return factory("adapter_" + prefix, rank, world);
            });
        auto make_inner = [&](const ParamLayout& stage_layout) {
          Communicator* adp = adapter_comms_->dp();
          if (!adp) {
            adapter_dp_single_ = make_single_communicator();
            adp = adapter_dp_single_.get();
          }
          HybridComms ah{adapter_comms_->comm(MeshDim::dp_shard), adapter_comms_->comm(MeshDim::dp_replicate)};
          CommFactory af = [dp_factory](const std::string& prefix, int rank, int world) {
            return dp_factory("adapter_" + prefix, rank, world);
          };
          return make_param_store(ps.sharding, stage_layout, be_.get(), adp, dims.dp_shard, af, &ah);
        };
        adapt_ = std::make_unique<AdapterTraining>(job_, *arch_, be_.get(), *stage_store, *pp_plan_, split, *comm_,
                                                   adapter_comms_->comm(MeshDim::pp), make_inner, mb_ * T_);
        stage_units = &adapt_->pipeline_units();
      }
      PipelineExecutor::Options po;
      po.micro_batch = mb_;
      po.seq_len = rows_;
      po.cp = cpc;
      po.ep = epc;
      po.activation_checkpointing = job_.train.activation_checkpointing == "blocks";
      po.document_mask = doc_separator_ >= 0;  // resolved first thing in setup()
      po.tp = tpc;
      po.stage_ranks = mesh_->group_ranks(MeshDim::pp);
      pipe_ = std::make_unique<PipelineExecutor>(*arch_, be_.get(), *pp_plan_, std::move(sched), *stage_units,
                                                 *pp_links_, po);
      if (adapter) {
        // Each microbatch's dropout rows, before its forward and again
        // before its backward (which recomputes the masks): the same global
        // sample index as the loader's, so a row's mask is the one 1 rank draws.
        pipe_->set_microbatch_hook([this](int m, bool training) {
          adapt_->set_microbatch(training, int(step_), cursor_ + (int64_t(m) * dp_size_ + dp_rank_) * mb_, T_);
        });
      }
      store = std::move(stage_store);
    }
    const bool wrapped = adapt_ != nullptr;  // the adapters' base is already the TP store
    params_ = tp > 1 && !wrapped ? make_tensor_parallel_store(std::move(store), *tp_plan_, tp_ctx_.comm)
                                 : std::move(store);
  }
  params_->init_params(*arch_, job_.train.seed);
  // output.trace_steps: this rank's timeline of those steps.
  if (const auto steps = parse_trace_steps(job_.output.trace_steps); !steps.empty()) {
    tracer_ = std::make_unique<StepTracer>(steps, w_.rank);
    if (pipe_) pipe_->set_tracer(tracer_.get());
  }
  // 5. data
  train_src_ = open_train_source(job_);
  val_src_ = open_val_source(job_);
  TR_CHECK(train_src_->vocab_bound() <= cfg.V, "data: tokens go up to ", train_src_->vocab_bound() - 1,
           " but model.vocab_size is ", cfg.V, "; raise model.vocab_size");
  host_in_.resize(size_t(mb_) * T_);
  host_tgt_.resize(size_t(mb_) * T_);
  if (cp_split_) host_rows_.resize(size_t(mb_) * rows_);
  dev_in_ = DeviceBuffer(be_.get(), size_t(mb_) * rows_ * 4);
  dev_tgt_ = DeviceBuffer(be_.get(), size_t(mb_) * rows_ * 4);
  if (doc_separator_ >= 0) {
    host_doc_start_.resize(host_in_.size());
    host_pos_.resize(host_in_.size());
    dev_doc_start_ = DeviceBuffer(be_.get(), size_t(mb_) * rows_ * 4);
    dev_pos_ = DeviceBuffer(be_.get(), size_t(mb_) * rows_ * 4);
  }
  dev_loss_sum_ = DeviceBuffer(be_.get(), 4);
  if (job_.train.objective != "sft") {
    PreferenceTraining::Setup ps;
    ps.job = &job_;
    ps.be = be_.get();
    ps.net = model_.get();
    ps.src = dynamic_cast<const PreferenceSource*>(train_src_.get());
    ps.world = comm_.get();
    ps.rank = w_.rank;
    ps.mb = mb_;
    ps.T = T_;
    ps.dp_rank = dp_rank_;
    ps.dp_size = dp_size_;
    ps.counts = counts_loss_;
    pref_ = std::make_unique<PreferenceTraining>(ps);
    if (pipe_) {
      // The last stage weights each microbatch's loss gradient right after
      // its forward (training), or records the reference pass's log-probs.
      pipe_->set_last_stage_hook([this](int m, bool training, Network& net) {
        const int64_t rows = (int64_t(m) * dp_size_ + dp_rank_) * mb_;
        if (training) pref_->policy_done(cursor_ + rows, mb_, net);
        else pref_->record_reference(pref_ref_base_ + rows, mb_, net);
      });
    }
  }

  if (rank0_) {
    TR_LOG_INFO("model: ", arch_->describe(), " (", arch_->num_parameters(), " parameters)");
    if (adapt_)
      TR_LOG_INFO("adapter: ", job_.model.adapter.type, " r=", job_.model.adapter.rank, " alpha=", job_.model.adapter.alpha, " on ",
                  adapt_->adapters().targets().size(), " linears (", job_.model.adapter.target_modules,
                  "), base frozen; ", adapt_->trainable_line());
    TR_LOG_INFO("data: train ", train_src_->describe(), val_src_ ? "; val " + val_src_->describe() : "; no val");
    if (doc_separator_ >= 0)
      TR_LOG_INFO("data: document mask on: a document starts at each token ", doc_separator_,
                  job_.data.document_separator < 0 ? " (prepare.json's document_start_id)" : "",
                  " and at each sequence start; attention stays inside a document and positions restart at 0");
    if (train_src_->entropy_floor() >= 0)
      TR_LOG_INFO("data: entropy floor (the lowest reachable loss) H = ", fmt(train_src_->entropy_floor(), 4),
                  " nats/token");
    TR_LOG_INFO("batch: ", global_B_, " sequences x ", T_, " tokens per step = ", mb_, " micro-batch x ", accum_,
                " accumulation x ", dp_size_, " data-parallel ranks; backend ", be_->name());
    // The resolved mesh, once: degrees, every rank's coordinates (compact
    // past 16 ranks) and the groups; job.resolved.yaml gets the same.
    TR_LOG_INFO("mesh: ", mesh_dims.describe(), " (", w_.world, " ranks; tp innermost: a TP group is consecutive ranks",
                tp > 1 && job_.parallel.sequence_parallel_on() ? "; sequence parallel" : "", ")");
    TR_LOG_INFO("mesh: rank -> (pp, dp_replicate, dp_shard, ", cp > 1 ? "cp, " : "", "tp): ",
                describe_rank_coords(mesh_dims));
    TR_LOG_INFO("mesh: groups: ", describe_mesh_groups(mesh_dims));
    if (cp > 1)
      TR_LOG_INFO("context parallel: each sequence of ", T_, " tokens split over ", cp, " ranks (", rows_,
                  " rows each: chunks i and ", 2 * cp, "-1-i of ", T_ / (2 * cp), "), attention by ",
                  job_.parallel.cp_mode, "; parameters sharded and gradients reduced over dp x cp (",
                  dims.dp(), " ranks)");
    if (tp > 1 && (tp > w_.local_world || w_.local_world % tp != 0))
      TR_LOG_WARN("mesh: parallel.tensor_parallel (", tp, ") does not divide the ", w_.local_world,
                  " ranks per node, so a TP group spans nodes. TP does 4 activation collectives per layer per "
                  "micro-batch (2 forward, 2 backward) between GEMMs, where nothing hides them; over the network "
                  "they run at a fraction of NVLink's bandwidth. Put TP inside an NVLink island (a degree that "
                  "divides the GPUs per node) or lower parallel.tensor_parallel");
    write_resolved_spec_with_mesh(mesh_dims);
    if (pp_plan_) {
      std::string split;
      for (int r = 0; r < dims.pp; ++r) {
        const PipelineStagePlan pl(arch_->layout(), dims.pp, job_.parallel.pipeline_virtual_stages, r,
                                   split_pipeline_layers(cfg.L, dims.pp * job_.parallel.pipeline_virtual_stages,
                                                         parse_pipeline_layers(job_.parallel.pipeline_layers)));
        for (const PipelineChunk& c : pl.chunks())
          split += std::string(split.empty() ? "" : ", ") + "stage " + std::to_string(c.virtual_stage) + " (pp rank " +
                   std::to_string(r) + "): layers " + std::to_string(c.stage.first_layer) + ".." +
                   std::to_string(c.stage.first_layer + c.stage.layers - 1) + (c.stage.first ? " + embedding" : "") +
                   (c.stage.last ? " + head" : "");
      }
      TR_LOG_INFO("pipeline: ", pipe_->schedule().kind, ", ", accum_, " microbatches over ", dims.pp, " ranks x ",
                  job_.parallel.pipeline_virtual_stages, " chunks; ", split);
    }
  }
  if (adapt_) {
    const ShardMemory am = adapt_->store().memory();
    TR_LOG_INFO("memory (rank ", w_.rank, ", adapters, ", adapt_->store().strategy(), "): params ",
                human_bytes(am.params), ", grads ", human_bytes(am.grads), ", optimizer ", human_bytes(am.optimizer),
                am.host ? ", host (parallel.offload: " + job_.parallel.offload + ") " + human_bytes(am.host)
                        : std::string(),
                am.disk ? ", on disk under " + job_.parallel.offload_dir + " " + human_bytes(am.disk) : std::string());
  }
  ShardMemory m = params_->memory();
  TR_LOG_INFO("memory (rank ", w_.rank, ", ", params_->strategy(), "): params ", human_bytes(m.params), ", grads ",
              human_bytes(m.grads), ", optimizer ", human_bytes(m.optimizer), ", activations ",
              human_bytes(network().activation_bytes()),
              m.host ? ", host (parallel.offload: " + job_.parallel.offload + ") " + human_bytes(m.host) : std::string(),
              m.disk ? ", on disk under " + job_.parallel.offload_dir + " " + human_bytes(m.disk) : std::string());
}

// <output.dir>/job.resolved.yaml: the resolved spec (as the launcher wrote
// it) plus the resolved_mesh section. Written to a temporary file and
// renamed over the old one, because workers on other nodes may be reading
// it (restarts re-read it); either version loads as the same job.
std::unique_ptr<ParamStore> Trainer::make_model_store(const ParamLayout& layout, Communicator* dp, int group,
                                                      const CommFactory& factory, const HybridComms* hybrid,
                                                      const OffloadOptions& offload) {
  const std::string& s = job_.parallel.sharding;
  bool experts = false;
  for (const ParamTensor& t : layout.tensors)
    if (ep_split_ && expert_of_tensor(t.name) >= 0) {
      experts = true;  // (a pipeline stage of Qwen2-MoE's dense blocks may have none)
      break;
    }
  if (!experts) return make_param_store(s, layout, be_.get(), dp, group, factory, hybrid, offload);
  TR_CHECK(!ep_plan_, "expert parallelism: a second split store on one rank (a bug: its plan would replace the "
           "first store's layouts)");
  ep_plan_ = std::make_unique<ExpertParallelPlan>(layout, arch_->config().moe.n_experts, ep_comm_->world_size(),
                                                  ep_comm_->rank());
  const ExpertParallelPlan& p = *ep_plan_;
  // The dense store first, then the experts': the same order on every rank
  // (each may build communicators).
  auto dense = make_param_store(s, p.dense_layout(), be_.get(), dp, group, factory, hybrid, offload);
  auto expert_store =
      make_param_store(s, p.expert_layout(), be_.get(), xdp_comm_.get(), xdp_group_, factory, xdp_hybrid_.get(), offload);
  return make_expert_split_store(p.local_layout(), std::move(dense), p.dense_plan(), std::move(expert_store),
                                 p.expert_plan(), ep_comm_.get(), be_.get());
}

void Trainer::write_resolved_spec_with_mesh(const MeshDims& dims) const {
  const fs::path path = fs::path(job_.output.dir) / "job.resolved.yaml";
  const fs::path tmp = fs::path(job_.output.dir) / ".job.resolved.yaml.tmp";
  {
    std::ofstream f(tmp);
    TR_CHECK(f, "cannot write '", tmp.string(), "'; check that output.dir is writable");
    f << job_spec_to_yaml(job_) << resolved_mesh_yaml(dims, job_.parallel.sequence_parallel_on());
    TR_CHECK(f.good(), "cannot write '", tmp.string(), "' (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TR_CHECK(!ec, "cannot replace '", path.string(), "': ", ec.message());
}

void Trainer::read_microbatch(const TokenSource& src, int64_t cursor, int m,
                              const PipelineExecutor::MicrobatchBuffers& to) {
  // Every pp rank reads the same samples (the cursor is global, the dp rank
  // picks the share): a middle stage reads them only to find the document
  // offsets, a host pass over B*T tokens, and copies just those to the device.
  src.read_samples(cursor + (int64_t(m) * dp_size_ + dp_rank_) * mb_, mb_, T_, host_in_.data(), host_tgt_.data());
  const size_t bytes = size_t(mb_) * T_ * 4;
  if (to.inputs) upload_rows(to.inputs, host_in_.data(), mb_);  // this rank's rows under cp (read_batch)
  if (to.targets) upload_rows(to.targets, host_tgt_.data(), mb_);
  if (to.doc_start) {
    TR_CHECK(doc_separator_ >= 0 && to.pos, "pipeline: document offsets asked for without data.document_mask (a bug)");
    document_offsets(host_in_.data(), mb_, T_, doc_separator_, host_doc_start_.data(), host_pos_.data());
    if (cp_split_) {
      TR_CHECK(to.host_doc_start, "pipeline: no host document starts for context parallelism (a bug)");
      const LocalDocumentMask local = split_document_mask(host_doc_start_.data(), mb_, *cp_split_);
      be_->copy_to_device(to.doc_start, local.doc_start.data(), size_t(mb_) * rows_ * 4);
      be_->copy_to_device(to.pos, local.pos.data(), size_t(mb_) * rows_ * 4);
      std::copy(host_doc_start_.begin(), host_doc_start_.end(), to.host_doc_start);
      return;
    }
    be_->copy_to_device(to.doc_start, host_doc_start_.data(), bytes);
    be_->copy_to_device(to.pos, host_pos_.data(), bytes);
  }
}

void Trainer::upload_rows(void* dev, const int32_t* host, int B) {
  if (!cp_split_) {
    be_->copy_to_device(dev, host, size_t(B) * T_ * 4);
    return;
  }
  split_rows(host, host_rows_.data(), B, 4, *cp_split_);
  be_->copy_to_device(dev, host_rows_.data(), size_t(B) * rows_ * 4);
}

// Context parallelism: every cp rank of a dp index reads the same whole
// sequences (the targets too) and keeps its chunks; the document offsets
// are made from the whole sequences, so a document that began in another
// rank's chunk keeps its start, and its positions count on from there.
void Trainer::read_batch(const TokenSource& src, int64_t first, int B) {
  src.read_samples(first, B, T_, host_in_.data(), host_tgt_.data());
  upload_rows(dev_in_.get(), host_in_.data(), B);
  upload_rows(dev_tgt_.get(), host_tgt_.data(), B);
  if (doc_separator_ >= 0) {
    document_offsets(host_in_.data(), B, T_, doc_separator_, host_doc_start_.data(), host_pos_.data());
    if (cp_split_) {  // global starts, positions inside the document (sequence_split.h)
      const LocalDocumentMask local = split_document_mask(host_doc_start_.data(), B, *cp_split_);
      be_->copy_to_device(dev_doc_start_.get(), local.doc_start.data(), size_t(B) * rows_ * 4);
      be_->copy_to_device(dev_pos_.get(), local.pos.data(), size_t(B) * rows_ * 4);
      return;
    }
    be_->copy_to_device(dev_doc_start_.get(), host_doc_start_.data(), size_t(B) * T_ * 4);
    be_->copy_to_device(dev_pos_.get(), host_pos_.data(), size_t(B) * T_ * 4);
  }
}

// The per-token losses are summed on the device, so on a GPU no micro-batch
// waits for a host copy; the step's one host read is the total, which then
// rides one all-reduce together with the preemption vote.
// DeepSeek-V3's update, per layer: b_e += rate * sign(mean load - load_e)
// (an expert at the mean keeps its bias). Every rank has the same load (all-
// reduced) and the same bias, so the biases stay equal without a collective.
void Trainer::update_expert_bias(const std::vector<float>& load) {
  const MoeConfig& m = arch_->config().moe;
  const int E = m.n_experts;
  TR_CHECK(load.size() == moe_bias_.size(), "model.moe_balance: bias: a load of ", load.size(), " values for ",
           moe_bias_.size(), " biases (a bug)");
  for (size_t l = 0; l * E < load.size(); ++l) {
    const float* ld = load.data() + l * E;
    double mean = 0;
    for (int e = 0; e < E; ++e) mean += ld[e];
    mean /= E;
    for (int e = 0; e < E; ++e) {
      const double d = mean - ld[e];
      moe_bias_[l * E + size_t(e)] += float(m.bias_rate * double((d > 0) - (d < 0)));
    }
  }
  set_expert_bias_everywhere();
}

void Trainer::set_expert_bias_everywhere() {
  if (pipe_)
    pipe_->set_expert_bias(moe_bias_, arch_->config().L);
  else
    model_->set_expert_bias(moe_bias_);
}

Trainer::StepResult Trainer::train_step(int step) {
  trained().zero_grads();
  // The mean over the targets in the loss of the whole global batch (all
  // micro-batches and ranks), as PyTorch's ignore_index mean over that
  // batch: every rank counts the same global window from the (mmapped)
  // masks, so no collective is needed. Without masks this is B*T, as before.
  // A preference objective's loss is already a mean over the global batch's pairs.
  const int64_t ntgt = pref_ ? 1 : train_src_->count_targets(cursor_, global_B_, T_);
  if (pref_) pref_->begin_step(cursor_, global_B_);
  float dloss_scale = ntgt > 0 ? 1.0f / float(ntgt) : 0.0f;  // an all-masked batch trains nothing
  if (debug_nan_step(step + 1)) dloss_scale = NAN;  // tests: TRAINRUN_DEBUG_NAN_STEP
  be_->zero(dev_loss_sum_.get(), 4);
  if (pipe_) {
    // The schedule's forwards and backwards; the last stage sums the losses.
    pipe_->train_step(
        step + 1,
        [&](int m, const PipelineExecutor::MicrobatchBuffers& to) { read_microbatch(*train_src_, cursor_, m, to); },
        pref_ && !std::isnan(dloss_scale) ? 1.0f : dloss_scale, dev_loss_sum_.as<float>());
    if (!pp_logged_) {
      // How often FSDP under a pipeline gathered and reduced the stage's
      // units (once per step held, per microbatch with pipeline_reshard):
      // said once per rank.
      pp_logged_ = true;
      TR_LOG_INFO("pipeline (rank ", w_.rank, ", pp rank ", mesh_->coord(MeshDim::pp), "): step ", step + 1, ": ",
                  pp_store_->acquires_last_step(), " unit acquires and ", pp_store_->reductions_last_step(),
                  " gradient reductions for ", pp_plan_->stage_layout().units.size(), " units and ", accum_,
                  " microbatches; idle (waiting on peers) ", fmt(100 * pipe_->last_wait_fraction(), 1),
                  "% of the pipeline's span");
    }
  }
  for (int m = 0; m < accum_ && !pipe_; ++m) {
    int64_t first = cursor_ + (int64_t(m) * dp_size_ + dp_rank_) * mb_;
    read_batch(*train_src_, first, mb_);
    if (adapt_) adapt_->set_microbatch(true, step + 1, first, T_);
    {
      StepTracer::Span span(tracer_.get(), "forward mb" + std::to_string(m), "compute");
      if (pref_) {
        // adapter_off: the frozen base store itself, so the adapters' store
        // sees no pass it would prefetch for.
        AdaptersOff base(*params_);
        pref_->micro_batch(
            first, mb_,
            [&] { model_->forward(base, dev_in_.as<int32_t>(), dev_tgt_.as<int32_t>(), mb_, T_, false, 0.0f, docs()); },
            [&] {
              // Scale 1: the pair weights come after (NaN stays NaN: TRAINRUN_DEBUG_NAN_STEP).
              model_->forward(units(), dev_in_.as<int32_t>(), dev_tgt_.as<int32_t>(), mb_, T_, true,
                              std::isnan(dloss_scale) ? dloss_scale : 1.0f, docs());
            });
      } else {
        model_->forward(units(), dev_in_.as<int32_t>(), dev_tgt_.as<int32_t>(), mb_, rows_, true, dloss_scale,
                        docs());
        be_->sum(dev_loss_sum_.as<float>(), model_->losses(), int64_t(mb_) * rows_);
      }
    }
    StepTracer::Span span(tracer_.get(), "backward mb" + std::to_string(m), "compute");
    model_->backward(units());
  }
  cursor_ += global_B_;
  {
    StepTracer::Span span(tracer_.get(), "finish_grads (gradient reductions)", "collective");
    trained().finish_grads();
  }
  std::vector<float> v(1, 0.0f);
  be_->copy_to_host(v.data(), dev_loss_sum_.get(), 4);
  // The loss sync has drained the pipeline links: a link op the watchdog
  // aborted fails here, naming its peer and microbatch, before the world
  // all-reduce and long before the optimizer could use its buffer.
  if (pp_links_) pp_links_->check_health();
  if (!counts_loss_) v[0] = 0.0f;  // the TP ranks of a dp index computed the same loss: count it once
  PipelineExecutor::StepTimes pt;
  if (pipe_) {
    pt = pipe_->last_step_times();
    v.push_back(float(pt.compute_ms));  // summed over the ranks below
  }
  // v[0] = the preference loss, then its metrics' sums at the end (zeros
  // where !counts_loss_), taken off again after the all-reduce.
  if (pref_) pref_->push_sums(v);
  StepResult r;
  StepTracer::Span vote_span(tracer_.get(), "loss all_reduce + stop vote", "collective");
  // Aux-loss-free balancing: the step's expert load rides the same
  // all-reduce, summed over every rank (the TP ranks of a dp index count the
  // same rows: a common factor, which the update's sign ignores).
  std::vector<float> load = moe_bias_.empty() ? std::vector<float>{}
                           : pipe_ ? pipe_->take_expert_load(arch_->config().L, arch_->config().moe.n_experts)
                                   : model_->take_expert_load();
  v.insert(v.end(), load.begin(), load.end());
  // Pipeline + mixture of experts: the router figures rank 0 reports
  // (metrics.jsonl) are on every stage (each its layers' loads, the last
  // its losses): the ranks of dp index 0 and TP rank 0 add theirs to the
  // same all-reduce (the others zeros), so the sum is the model's.
  std::vector<float> router;
  if (pipe_ && arch_->config().moe.on()) {
    const int L = arch_->config().L;
    router.assign(size_t(2 + 2 * L), 0.f);
    if (mesh_->dp_coord() == 0 && mesh_->coord(MeshDim::tp) == 0) {
      const Network::RouterReport rr = pipe_->router_report_local(L);
      router[0] = float(rr.aux_loss), router[1] = float(rr.z_loss);
      for (int l = 0; l < L; ++l)
        router[size_t(2 + l)] = float(rr.max_tokens[size_t(l)]), router[size_t(2 + L + l)] = float(rr.mean_tokens[size_t(l)]);
    }
    v.insert(v.end(), router.begin(), router.end());
  }
  r.stop_signal = agree_on_stop(*comm_, v);  // the vote rides the loss all-reduce
  if (!router.empty()) {
    const int L = arch_->config().L;
    std::copy(v.end() - int64_t(router.size()), v.end(), router.begin());
    v.resize(v.size() - router.size());
    Network::RouterReport rr;
    rr.aux_loss = router[0], rr.z_loss = router[1];
    // No figures before a forward with statistics (as one rank's network): every layer's mean is 0 then.
    if (router[size_t(2 + L)] > 0)
      for (int l = 0; l < L; ++l)
        rr.max_tokens.push_back(router[size_t(2 + l)]), rr.mean_tokens.push_back(router[size_t(2 + L + l)]);
    pipe_->set_router_report(rr);
  }
  if (!load.empty()) {
    std::copy(v.end() - int64_t(load.size()), v.end(), load.begin());
    v.resize(v.size() - load.size());
    r.expert_load = std::move(load);
  }
  if (pref_) v[0] = float(pref_->pop_sums(v));
  if (pipe_) {
    // The bubble: 1 - the ranks' mean compute / the slowest rank's span
    // (the pipeline's length), so a stage that ends its list early counts
    // its wait for the step's end, as the schedules' formulas do.
    float span = float(pt.span_ms);
    comm_->all_reduce(&span, 1, ReduceOp::Max);
    r.bubble = span > 0 ? std::clamp(1.0 - double(v[1]) / w_.world / double(span), 0.0, 1.0) : 0.0;
  }
  r.loss = ntgt > 0 ? double(v[0]) / double(ntgt) : 0.0;
  return r;
}

// Validation loss over a fixed set: eval_steps global batches from the start
// of the val stream, split over ranks like training batches, so the figure
// does not depend on the world size or micro-batch size.
double Trainer::evaluate() {
  if (!val_src_ || job_.train.eval_steps <= 0) return -1;
  be_->zero(dev_loss_sum_.get(), 4);
  int64_t ntgt = 0;
  for (int e = 0; e < job_.train.eval_steps; ++e) {
    ntgt += val_src_->count_targets(int64_t(e) * global_B_, global_B_, T_);
    if (pipe_)
      pipe_->forward_only(
          step_, accum_,
          [&](int m, const PipelineExecutor::MicrobatchBuffers& to) {
            read_microbatch(*val_src_, int64_t(e) * global_B_, m, to);
          },
          dev_loss_sum_.as<float>());
    for (int m = 0; m < accum_ && !pipe_; ++m) {
      read_batch(*val_src_, int64_t(e) * global_B_ + (int64_t(m) * dp_size_ + dp_rank_) * mb_, mb_);
      if (adapt_) adapt_->set_microbatch(false, 0, 0, T_);  // no dropout
      model_->forward(units(), dev_in_.as<int32_t>(), dev_tgt_.as<int32_t>(), mb_, rows_, false, 0.0f, docs());
      be_->sum(dev_loss_sum_.as<float>(), model_->losses(), int64_t(mb_) * rows_);
    }
  }
  params_->take_comm_wait_seconds();  // eval's gathers are not training-step communication
  float total = 0;
  be_->copy_to_host(&total, dev_loss_sum_.get(), 4);
  if (pp_links_) pp_links_->check_health();  // as after a training step
  if (!counts_loss_) total = 0.0f;
  comm_->all_reduce(&total, 1, ReduceOp::Sum);
  return ntgt > 0 ? double(total) / double(ntgt) : 0.0;
}

std::string Trainer::agree_after_disk_work(const std::string& what, const std::string& mine) {
  if (w_.world == 1) return mine;
  // The rendezvous store, not a collective: the ranks finish reading a
  // shared filesystem minutes apart at 70B, far past parallel.timeout_s
  // (meant for compute skew), so the wait has the disk timeout. Rank 0
  // collects one key per rank and publishes the verdict: O(world) keys.
  const Millis timeout(disk_wait_timeout_ms(job_));
  const std::string key = prefix_ + what;
  store_->set(key + std::to_string(w_.rank), store_bytes("." + mine));  // "." + "": passed
  if (w_.rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < w_.world; ++r) keys.push_back(key + std::to_string(r));
    std::string verdict = ".";
    try {
      store_->wait(keys, timeout);
      for (int r = 0; r < w_.world; ++r) {
        const std::string text = store_text(store_->get(keys[size_t(r)], timeout)).substr(1);
        store_->remove(keys[size_t(r)]);
        if (!text.empty() && verdict == ".") verdict += text + " (rank " + std::to_string(r) + ")";
      }
    } catch (const std::exception& e) {
      verdict = std::string(".") + e.what();  // still published, so no rank waits on
    }
    store_->set(key + "verdict", store_bytes(verdict));
    return verdict.substr(1);
  }
  return store_text(store_->get(key + "verdict", timeout)).substr(1);
}

TrainSummary Trainer::run() {
  auto t_start = Clock::now();
  setup();
  // Resume before anything is written, so a refused checkpoint loses nothing.
  // An adapter run checkpoints the adapters and their AdamW state only;
  // the frozen base is re-read from model.init_from on resume.
  Checkpointer ckpt(job_, adapt_ ? adapt_->checkpoint_subject() : CheckpointSubject::of_model(*arch_), w_.rank,
                    w_.world, store_.get(), comm_.get(), prefix_);
  ckpt.clean_stale();
  // A failure from here on first abandons any checkpoint in flight (its
  // reason reaches every rank's save), then propagates.
  try {
    return run_with(ckpt, t_start);
  } catch (const std::exception& e) {
    ckpt.abort(e.what());
    throw;
  }
}

TrainSummary Trainer::run_with(Checkpointer& ckpt, Clock::time_point t_start) {
  const auto& tr = job_.train;
  const fs::path out(job_.output.dir);
  TrainState resumed;
  // The store the checkpoints hold: the model's, or with adapters theirs.
  ParamStore& ckpt_store = adapt_ ? adapt_->store() : *params_;
  const bool is_resume = ckpt.load(ckpt_store, resumed);
  if (!adapt_) ckpt.set_tp_exchange(ckpt_tp_comm_.get());
  ckpt.prepare(ckpt_store);
  // model.init_from replaces the random init, but only for a fresh start: a
  // checkpoint already holds the fine-tuned weights (and the moments) that
  // grew from it. Decided after load() so a resume never needs the directory.
  // An adapter run's checkpoint holds only the adapters: its frozen base is
  // always model.init_from (the manifest's fingerprint was checked in load).
  if (!job_.model.init_from.empty()) {
    if (is_resume && !adapt_) {
      if (rank0_) TR_LOG_INFO("model.init_from: not used; the resumed checkpoint takes precedence");
    } else {
      // Every rank maps the files and reads only the ranges it holds; the
      // ranks agree on any rank's error before the weights go live.
      std::string why;
      try {
        if (const int64_t ms = debug_init_from_delay_ms(w_.rank)) std::this_thread::sleep_for(Millis(ms));
        load_init_from_ranges(*arch_, job_.model.init_from, *params_, rank0_);
      } catch (const std::exception& e) {
        why = e.what();
      }
      why = agree_after_disk_work("init_from/", why);
      if (!why.empty()) TR_FAIL(why);
      params_->params_updated();
      if (rank0_) TR_LOG_INFO("model.init_from: initial weights from ", job_.model.init_from);
    }
  }
  if (adapt_ && is_resume) {
    if (rank0_ && !job_.model.adapter.init_from.empty())
      TR_LOG_INFO("model.adapter.init_from: not used; the resumed checkpoint's adapters take precedence");
  } else if (adapt_) {
    adapt_->init_params();
    if (rank0_ && !job_.model.adapter.init_from.empty())
      TR_LOG_INFO("model.adapter.init_from: initial adapters from ", job_.model.adapter.init_from);
  }
  if (pref_ && pref_->precompute()) {
    // The reference is the starting weights: computed before step 1 (or read back).
    // Chunks of rows as training splits a batch over the dp ranks (and, in
    // a pipeline, its microbatches).
    const int64_t chunk = int64_t(mb_) * dp_size_ * (pipe_ ? accum_ : 1);
    pref_->prepare_reference(
        [&](int64_t base) {
          if (pipe_) {
            pref_ref_base_ = base;  // the last stage's hook records each microbatch
            pipe_->forward_only(
                0, accum_,
                [&](int m, const PipelineExecutor::MicrobatchBuffers& to) { read_microbatch(*train_src_, base, m, to); },
                dev_loss_sum_.as<float>());
            return;
          }
          const int64_t first = base + int64_t(dp_rank_) * mb_;
          read_batch(*train_src_, first, mb_);
          if (adapt_) adapt_->set_microbatch(false, 0, 0, T_);  // no dropout
          model_->forward(units(), dev_in_.as<int32_t>(), dev_tgt_.as<int32_t>(), mb_, T_, false, 0.0f, docs());
          pref_->record_reference(first, mb_, *model_);
        },
        chunk, is_resume);
  }
  cursor_ = resumed.cursor;
  if (arch_->config().moe.bias_rate > 0) {
    // Aux-loss-free balancing: the bias from the checkpoint, or none yet.
    const ModelConfig& mc = arch_->config();
    const size_t n = size_t(mc.L) * size_t(mc.moe.n_experts);
    TR_CHECK(resumed.moe_expert_bias.empty() || resumed.moe_expert_bias.size() == n, "resume: the checkpoint's "
             "moe_expert_bias has ", resumed.moe_expert_bias.size(), " values, this model's ", mc.L, " layers x ",
             mc.moe.n_experts, " experts need ", n, "; resume with the model it was saved with");
    if (is_resume && resumed.moe_expert_bias.empty() && rank0_)
      TR_LOG_WARN("resume: the checkpoint has no expert bias (saved without model.moe_balance: bias); it starts at 0");
    moe_bias_ = resumed.moe_expert_bias.empty() ? std::vector<float>(n, 0.f) : resumed.moe_expert_bias;
    set_expert_bias_everywhere();
  }
  const int first_step = int(resumed.step);
  std::unique_ptr<MetricsWriter> metrics;
  if (rank0_) {
    if (is_resume) {
      truncate_metrics((out / "metrics.jsonl").string(), first_step);
    } else {
      std::error_code ec;
      fs::remove(out / "metrics.jsonl", ec);  // a fresh run starts a fresh record
    }
    metrics = std::make_unique<MetricsWriter>((out / "metrics.jsonl").string());
  }
  TrainSummary sum;
  sum.tokens = resumed.tokens;
  double ckpt_blocked = 0;
  int last_saved = -1;
  auto save_checkpoint = [&](int done_steps) {
    check_comms();  // never commit state that a failed collective produced
    TrainState st;
    st.step = done_steps;
    st.cursor = cursor_;
    st.tokens = sum.tokens;
    st.moe_expert_bias = moe_bias_;
    const uint64_t writes0 = Checkpointer::write_calls();
    const double blocked =
        adapt_ ? ckpt.save(ckpt_store, st, adapt_->checkpoint_files()) : ckpt.save(*params_, st);
    ckpt_blocked += blocked;
    last_saved = done_steps;
    if (rank0_) {
      // The pwrites of this process (one rank in a real job; `bench
      // checkpoint` reads them from here).
      const std::string writes =
          job_.checkpoint.async == "true" ? ""
                                          : ", " + std::to_string(Checkpointer::write_calls() - writes0) + " pwrites";
      TR_LOG_INFO("checkpoint: step ", done_steps,
                  (job_.checkpoint.async == "true" ? " writing in the background (the next optimizer step waits for "
                                                     "it to have read the state)"
                                                   : " written"),
                  "; training blocked ", fmt(blocked, 3), " s", writes);
    }
  };
  sum.entropy_floor = train_src_->entropy_floor();
  AdamWParams ap;
  ap.beta1 = float(tr.beta1);
  ap.beta2 = float(tr.beta2);
  ap.eps = float(tr.eps);
  ap.weight_decay = float(tr.weight_decay);
  const int64_t tokens_per_step = int64_t(global_B_) * T_;
  double train_time = 0;
  // Status line / log lines, metrics.jsonl records, TensorBoard, MFU,
  // memory by category, the end-of-run summary and plot (core/train/progress.h).
  RunReporter::Context rc;
  rc.job = &job_;
  rc.arch = arch_.get();
  rc.backend = be_.get();
  rc.params = params_.get();
  rc.network = &network();
  rc.rank = w_.rank;
  rc.world = w_.world;
  rc.tokens_per_step = tokens_per_step;
  rc.entropy_floor = sum.entropy_floor;
  rc.val_tokens_per_byte = data_text_.val_tokens_per_byte;
  rc.metrics = metrics.get();
  rc.start = t_start;
  if (adapt_) {
    // The frozen base computes its forward and input gradient (4N) but no
    // weight gradient; the adapters all three (6 per parameter).
    const ModelConfig& c = arch_->config();
    rc.flops_per_token = 4.0 * double(arch_->matmul_parameters()) + 6.0 * double(adapt_->adapters().layout().total) +
                         12.0 * double(c.L) * double(c.C) * double(c.T);
    rc.flops_formula = "4N frozen base + 6 x adapter params + 12*L*C*T";
  }
  RunReporter reporter(rc);
  if (is_resume && first_step >= tr.max_steps && rank0_)
    TR_LOG_INFO("resume: the checkpoint is at step ", first_step, " >= train.max_steps (", tr.max_steps,
                "); nothing to train");
  // train.exit_interval: stop early (time-sliced jobs, tests of resume); the
  // LR schedule is still laid out over max_steps so a resumed run continues it.
  const int end_step = tr.exit_interval > 0 ? std::min(tr.max_steps, first_step + tr.exit_interval) : tr.max_steps;
  // A stop signal that reached a worker while it was still setting up
  // (workers with peers cannot act on it alone): agree now, before any step,
  // and stop with nothing to checkpoint rather than train one more step.
  if (first_step < end_step) {
    std::vector<float> none;
    sum.stop_signal = agree_on_stop(*comm_, none);
    if (sum.stop_signal != 0 && rank0_)
      TR_LOG_WARN(stopped_before_training(sum.stop_signal, " while the workers were setting up"));
  }
  for (int step = first_step; step < end_step && sum.stop_signal == 0; ++step) {
    params_->set_step(step + 1);  // the world's communicator and the store's own groups
    if (adapt_) adapt_->store().set_step(step + 1);
    if (cp_comm_) cp_comm_->set_step(step + 1);  // the ring's errors name the step
    if (ep_comm_) ep_comm_->set_step(step + 1);  // the all-to-alls' errors name the step
    if (mesh_comms_) {
      comm_->set_step(step + 1);
      for (MeshDim d : {MeshDim::tp, MeshDim::dp_shard, MeshDim::dp_replicate, MeshDim::pp})
        if (Communicator* c = mesh_comms_->comm(d)) c->set_step(step + 1);
      if (Communicator* c = mesh_comms_->dp()) c->set_step(step + 1);
    }
    step_ = step + 1;
    debug_fail_hook(w_.rank, step + 1);  // launcher tests: TRAINRUN_DEBUG_FAIL_RANK/_STEP
    auto t0 = Clock::now();
    if (tp_plan_) tp_ctx_.take_comm_seconds();  // only this step's collectives
    const double lr = lr_at(step, tr.max_steps, tr.warmup_steps, tr.lr, tr.min_lr, tr.schedule);
    if (tracer_) tracer_->begin_step(step + 1);
    std::optional<StepTracer::Span> step_span;
    step_span.emplace(tracer_.get(), "step " + std::to_string(step + 1), "step");
    const StepResult sr = train_step(step);
    const double loss = sr.loss;
    double gnorm = 0;
    {
      StepTracer::Span span(tracer_.get(), "grad norm (all_reduce)", "collective");
      gnorm = std::sqrt(trained().grad_norm_squared());
    }
    // Clip by the global norm: every rank computed the same norm, so every
    // shard scales by the same factor.
    float grad_scale = 1.0f;
    if (tr.grad_clip > 0 && gnorm > tr.grad_clip) grad_scale = float(tr.grad_clip / (gnorm + 1e-6));
    ap.lr = float(lr);
    // The loss is all-reduced and the norm is global, so every rank sees the
    // same values and takes the same decision: no rank updates alone.
    const bool finite = std::isfinite(loss) && std::isfinite(gnorm);
    // A collective that failed after its call returned (NCCL) must stop the
    // step here: an update from a half-reduced gradient, and a checkpoint
    // of it, would be silently wrong.
    check_comms();
    if (finite) {
      // AdamW's bias correction uses the global step (not the count of
      // applied updates), so a resumed run recomputes it exactly.
      // An async checkpoint in flight reads the state the update changes.
      ckpt_blocked += ckpt.before_state_change();
      StepTracer::Span span(tracer_.get(), "optimizer (AdamW + gathers)", "optimizer");
      trained().optimizer_step(ap, step + 1, grad_scale);
      if (!sr.expert_load.empty()) update_expert_bias(sr.expert_load);
    } else {
      ++sum.skipped_steps;
      if (rank0_)
        TR_LOG_WARN("step ", step + 1, ": non-finite ", std::isfinite(loss) ? "gradient norm" : "loss", " (loss ", loss,
                    ", grad_norm ", gnorm, "); skipped the update on every rank (", sum.skipped_steps, " of at most ",
                    tr.max_skipped_steps, ")");
      TR_CHECK(sum.skipped_steps <= tr.max_skipped_steps, "training stopped at step ", step + 1, ": ",
               sum.skipped_steps, " updates were skipped for a non-finite loss or gradient norm (train.max_skipped_steps: ",
               tr.max_skipped_steps, "); lower train.lr, raise train.warmup_steps or check the data; the last "
               "checkpoint holds the state before the divergence");
    }
    be_->synchronize();
    step_span.reset();  // ends here: eval, reporting and checkpoints are not the step
    if (tracer_) tracer_->end_step();
    const double dt = seconds_since(t0);
    const double comm_wait = trained().take_comm_wait_seconds();
    const double tp_comm = tp_plan_ ? tp_ctx_.take_comm_seconds() : -1;  // before eval: the step's only
    train_time += dt;
    sum.steps = step + 1;
    sum.final_loss = loss;
    sum.losses.push_back(loss);
    sum.tokens += tokens_per_step;

    const bool last = step + 1 == end_step;
    const bool do_eval = val_src_ && (last || (tr.eval_interval > 0 && (step + 1) % tr.eval_interval == 0));
    double val_loss = do_eval ? evaluate() : -1;
    if (val_loss >= 0 && (sum.best_val_loss < 0 || val_loss < sum.best_val_loss)) sum.best_val_loss = val_loss;
    StepReport report;
    report.step = step + 1;
    report.last = last;
    report.loss = loss;
    report.lr = lr;
    report.grad_norm = gnorm;
    report.step_seconds = dt;
    report.comm_wait_seconds = comm_wait;
    report.tp_comm_seconds = tp_comm;
    report.val_loss = val_loss;
    report.bubble = sr.bubble;
    if (pref_) report.extra = pref_->metrics();
    reporter.on_step(report);
    if (job_.checkpoint.interval > 0 && (step + 1) % job_.checkpoint.interval == 0) save_checkpoint(step + 1);
    // Preemption: the ranks agreed in train_step; save and stop at this
    // step boundary.
    if (sr.stop_signal != 0 && step + 1 < end_step) {
      sum.stop_signal = sr.stop_signal;
      if (rank0_)
        TR_LOG_INFO("stop requested (signal ", sr.stop_signal, "): saving a checkpoint at step ", step + 1, " and exiting");
      if (last_saved != step + 1) save_checkpoint(step + 1);
      break;
    }
  }
  const bool stopped_early = end_step < tr.max_steps;
  if (sum.stop_signal == 0 && (job_.checkpoint.final == "true" || stopped_early) &&
      last_saved != std::max(first_step, end_step) && !(is_resume && first_step >= tr.max_steps))
    save_checkpoint(std::max(first_step, end_step));
  ckpt.wait();
  write_trace();
  if (pp_store_ && pp_plan_->tied()) {
    // The tied embedding and its copy on the last stage must still be the
    // same weights (the gradient sum keeps them so): checked, not assumed.
    uint64_t h = 0;
    const bool same = pp_store_->tied_copies_identical(&h);
    TR_CHECK(same, "pipeline: the tied embedding on the first and last stage differ after step ", sum.steps,
             " (rank ", w_.rank, "); this is a bug: the head's gradient was not summed between the stages");
    if (pp_plan_->embedding_unit() >= 0 || pp_plan_->tied_copy_unit() >= 0)
      TR_LOG_INFO("pipeline (rank ", w_.rank, "): the tied embedding is identical on the first and last stage after "
                  "step ", sum.steps, " (fp32 master weights, hash ", std::hex, h, std::dec, ")");
  }
  sum.checkpoint_blocked_seconds = ckpt_blocked;
  sum.checkpoint_host_bytes = ckpt.host_buffer_bytes();
  sum.tokens_per_sec = train_time > 0 ? sum.tokens / train_time : 0;
  const ShardMemory mem = params_->memory();
  sum.params_bytes = mem.params;
  sum.grads_bytes = mem.grads;
  sum.optimizer_bytes = mem.optimizer;
  sum.host_bytes = mem.host;
  sum.comm_bytes = mem.comm_buffers;
  if (adapt_) {
    // The frozen base has parameters only; gradients and AdamW state are the adapters'.
    const ShardMemory am = adapt_->store().memory();
    sum.params_bytes += am.params;
    sum.grads_bytes = am.grads;
    sum.optimizer_bytes = am.optimizer;
    sum.host_bytes += am.host;
  }
  sum.activation_bytes = network().activation_bytes();

  if (sum.stop_signal != 0) {
    // Preempted: the checkpoint is what matters; skip the final export and
    // the sample so the job exits well inside the agent's grace period.
    log_memory_at_end();
    comm_->barrier();
    return sum;
  }
  if (adapt_) {
    // The run's result is the adapter, in peft's format; the base is
    // model.init_from, unchanged.
    adapt_->write_peft((out / "adapter").string());
    sum.wall_seconds = seconds_since(t_start);
    if (rank0_) {
      TR_LOG_INFO("adapter: written to ", (out / "adapter").string(),
                  " (peft.PeftModel.from_pretrained(base, dir) loads it)");
      if (job_.output.sample_tokens > 0 && (tp_plan_ || pipe_ || ep_split_))
        TR_LOG_INFO("sample: skipped at tp/pp > 1 with adapters (the sampler has no TP/PP split); run `trainrun "
                    "generate --checkpoint ", job_.model.init_from, " --adapter ", (out / "adapter").string(), "`");
    }
    // The sample at tp1/pp1: the base through the frozen store (gathered per
    // unit, as in training) with the adapters applied unmerged, dropout off.
    if (job_.output.sample_tokens > 0 && !tp_plan_ && !pipe_ && !ep_split_) {
      adapt_->set_microbatch(false, int(step_), 0, T_);
      sample_at_end();
    }
    log_memory_at_end();
    comm_->barrier();
    return sum;
  }
  // Final weights: each rank writes its own ranges, as for a checkpoint;
  // no rank ever holds the whole model.
  const std::string path = (out / "model.safetensors").string();
  save_final_weights(path, *arch_, *params_, w_.rank, w_.world, store_.get(), prefix_,
                     std::chrono::milliseconds(disk_wait_timeout_ms(job_)));
  sum.wall_seconds = seconds_since(t_start);
  if (job_.output.sample_tokens > 0 && !tp_plan_ && !pipe_ && !ep_split_) sample_at_end();
  log_memory_at_end();
  // Every rank is done with collectives; rank 0 then draws the summary and
  // plot without anyone waiting on it.
  comm_->barrier();
  // At tp > 1 rank 0 samples alone and without collectives: after the
  // barrier, so no peer waits for it inside a collective's timeout.
  if (job_.output.sample_tokens > 0 && (tp_plan_ || pipe_ || ep_split_)) sample_from_model_file(path);
  if (rank0_) reporter.finish(path);  // the one-screen summary (last on screen) and plot.svg
  return sum;
}

// output.trace_steps: every rank writes its events next to the others'
// then rank 0 merges them into <output.dir>/trace.json (ranks as processes)
// and removes the pieces.
void Trainer::write_trace() {
  if (!tracer_) return;
  const fs::path dir = fs::path(job_.output.dir) / "trace.parts";
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path mine = dir / ("rank" + std::to_string(w_.rank) + ".json");
  {
    std::ofstream f(mine);
    f << tracer_->events_json();
    TR_CHECK(f.good(), "output.trace_steps: cannot write ", mine.string());
  }
  comm_->barrier();
  if (!rank0_) return;
  std::vector<std::string> parts;
  for (int r = 0; r < w_.world; ++r) {
    std::ifstream f(dir / ("rank" + std::to_string(r) + ".json"));
    TR_CHECK(f.good(), "output.trace_steps: rank ", r, "'s timeline is missing from ", dir.string());
    parts.emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  const fs::path out = fs::path(job_.output.dir) / "trace.json";
  {
    std::ofstream f(out);
    f << merge_trace_json(parts);
    TR_CHECK(f.good(), "output.trace_steps: cannot write ", out.string());
  }
  fs::remove_all(dir, ec);
  TR_LOG_INFO("trace: steps ", job_.output.trace_steps, " of ", w_.world, " ranks in ", out.string(),
              " (open in https://ui.perfetto.dev or chrome://tracing)");
}

// Every rank's memory, for whoever sizes the next run (and the tests that
// bound a rank's host memory by its device share): the backend's peak and
// the process's peak resident set (VmHWM, host memory of every kind).
void Trainer::log_memory_at_end() {
  int64_t hwm_kib = -1;
  std::ifstream st("/proc/self/status");
  for (std::string line; std::getline(st, line);)
    if (line.rfind("VmHWM:", 0) == 0) hwm_kib = std::atoll(line.c_str() + 6);
  TR_LOG_INFO("memory at the end (rank ", w_.rank, "): backend peak ", be_->peak_bytes(), " bytes (",
              human_bytes(double(be_->peak_bytes())), "), process peak RSS ",
              hwm_kib < 0 ? std::string("unknown") : std::to_string(hwm_kib * 1024) + " bytes (" +
                                                          human_bytes(double(hwm_kib) * 1024) + ")");
}

// output.sample_prompt as the model's token ids: through the data's
// tokenizer when prepare.json names one (as `trainrun generate` encodes),
// else its bytes for a byte-level model, else whitespace-separated ids. Text for a model of another vocabulary cannot be encoded
// here; the sample is then skipped with a line saying so (every rank
// decides alike), never the job failed after its training: until 2026-12 a
// BPE-data run trained to the end and exited 1 at its sample.
bool Trainer::sample_prompt_ids(std::vector<int32_t>& out) const {
  if (data_text_.tokenizer) {
    out = encode_text_prompt(*data_text_.tokenizer, job_.output.sample_prompt);
    if (out.empty()) out.push_back(0);
    return true;
  }
  try {
    out = encode_prompt(job_.output.sample_prompt, arch_->config().V);
  } catch (const Error& e) {
    if (rank0_)
      TR_LOG_WARN("sample: skipped: output.sample_prompt '", job_.output.sample_prompt, "' is text, but the model's "
                  "vocab is ", arch_->config().V, " (not bytes) and the run samples without a tokenizer; give token "
                  "ids (output.sample_prompt: '1 2 3'), set output.sample_tokens: 0, or sample afterwards with "
                  "`trainrun generate --tokenizer tokenizer.json`");
    return false;
  }
  if (out.empty()) out.push_back(0);
  return true;
}

// The end-of-run sample, on the run's own backend with a KV cache, by every
// rank together: parameters come through the store (a sharded run gathers
// one unit at a time, as in training), rank 0 picks each token and
// broadcasts it, so no rank sits in a collective for longer than one
// token's forward. The training activations are freed first; if the
// decoder would need more memory than they took, it is skipped with a line
// saying so (every rank decides alike: the sizes are the same everywhere).
void Trainer::sample_at_end() {
  if (!arch_->has_decoder()) {
    if (rank0_)
      TR_LOG_INFO("sample: skipped: ", arch_->name(), " has no KV-cached decoder yet (output.sample_tokens: ",
                  job_.output.sample_tokens, "); set output.sample_tokens: 0 to silence this");
    return;
  }
  SampleOptions so;
  so.max_tokens = job_.output.sample_tokens;
  so.temperature = 0.8;
  so.top_k = 40;
  so.seed = job_.train.seed;
  if (data_text_.tokenizer) so.vocab_limit = int(data_text_.tokenizer->vocab_size());  // as `trainrun generate`
  const ModelConfig& cfg = arch_->config();
  std::vector<int32_t> prompt;
  if (!sample_prompt_ids(prompt)) return;
  const size_t training_acts = model_->activation_bytes();
  const size_t need = arch_->decoder_bytes_needed(*be_, sample_cache_positions(cfg, prompt.size(), so));
  if (need > std::max<size_t>(training_acts, size_t(256) << 20)) {
    if (rank0_)
      TR_LOG_INFO("sample: skipped: its KV cache and buffers would take ", human_bytes(double(need)),
                  ", more than the ", human_bytes(double(training_acts)),
                  " the training activations used; lower output.sample_tokens or use `trainrun generate`");
    return;
  }
  model_->free_activations();
  auto toks = sample_tokens(be_.get(), units(), *arch_, prompt, so, comm_.get());
  if (rank0_) TR_LOG_INFO("sample:\n", sample_text(toks));
}

// The sample at tp > 1 or pp > 1. The KV-cached decoders have no tensor-
// or pipeline-parallel split yet (that would be the training forward's column/row collectives
// once per token), so the sample runs on the logical model file just
// written (model.safetensors, global coordinates): rank 0 alone, with the
// single-process decoder of `trainrun generate` (CPU, fp32), the same
// seed, temperature and top-k as the tp1 sample. That needs the whole fp32
// model in rank 0's host memory, so it runs only when that is no more
// than the training state this rank held (its params, grads and optimizer
// share) or 256 MiB: a small model samples as at tp1, and a large one (a
// 70B model at tp8 holds ~2 bytes per parameter per rank, the file is 4)
// is never gathered on one rank; it is skipped with a line saying so.
// Called after the end-of-run barrier: the other ranks are done.
void Trainer::sample_from_model_file(const std::string& final_weights) {
  if (!rank0_) return;
  if (!arch_->has_decoder()) {
    TR_LOG_INFO("sample: skipped: ", arch_->name(), " has no KV-cached decoder yet (output.sample_tokens: ",
                job_.output.sample_tokens, "); set output.sample_tokens: 0 to silence this");
    return;
  }
  const ShardMemory mem = params_->memory();
  const double whole = double(arch_->layout().total) * 4;
  const double allowed = std::max(double(mem.params + mem.grads + mem.optimizer), double(256 << 20));
  if (whole > allowed) {
    TR_LOG_INFO("sample: skipped: at parallel.tensor_parallel ", job_.parallel.tensor_parallel,
                ", pipeline_parallel ", job_.parallel.pipeline_parallel, " the sample decodes the whole model on one rank, and its ", human_bytes(whole),
                " of fp32 weights are more than the ", human_bytes(allowed),
                " this rank held for training; sample from ", final_weights,
                " with `trainrun generate` on a machine with the memory, or set output.sample_tokens: 0");
    return;
  }
  SampleOptions so;
  so.max_tokens = job_.output.sample_tokens;
  so.temperature = 0.8;
  so.top_k = 40;
  so.seed = job_.train.seed;
  if (data_text_.tokenizer) so.vocab_limit = int(data_text_.tokenizer->vocab_size());  // as `trainrun generate`
  std::vector<int32_t> prompt;
  if (!sample_prompt_ids(prompt)) return;
  std::vector<float> flat;
  (void)load_model_safetensors(final_weights, flat);
  TR_CHECK(int64_t(flat.size()) == arch_->layout().total, "sample: ", final_weights, " holds ", flat.size(),
           " parameters, not this model's ", arch_->layout().total, " (a bug)");
  const auto toks = sample_tokens(*arch_, flat, prompt, so);
  TR_LOG_INFO("sample (tensor_parallel ", job_.parallel.tensor_parallel, ", pipeline_parallel ",
              job_.parallel.pipeline_parallel, ": rank 0 decodes ", final_weights, "):\n", sample_text(toks));
}

TrainSummary run_training(const JobSpec& job_in, const WorkerInfo& worker) {
  install_stop_handlers();
  // The launcher resolved model.preset / model.init_from already; a job
  // built in code (tests, embedders) gets the same shape here. Idempotent.
  JobSpec job = job_in;
  resolve_model_shape(job, /*log=*/false);
  Trainer t(job, worker);
  return t.run();
}

int exit_code_for(const TrainSummary& s) {
  if (s.stop_signal == 0) return 0;
  return s.stop_signal == SIGINT ? 128 + SIGINT : kExitRequeue;
}

}  // namespace trainrun
