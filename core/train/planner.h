// The performance model: the GPU table and the memory / step-time planner
// behind `trainrun plan`.
//
// Why one analytic model for both the planner and MFU: the figures a user
// plans with and the figures a run reports must come from the same formulas,
// or the two disagree for reasons nobody can see. Both take the model from
// its ModelArch (core/model/model.h: units, parameters, FLOPs per token, the
// activation arena); the rest of the memory model mirrors
// parallel/sharding_*.cpp's buffers, and tests/test_planner.cpp holds it to
// the backend's measured peak on CPU runs (within 15%) so it cannot drift.
// Model shapes as text (`--model`) are core/model/model_shape.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"

namespace trainrun {

// Published datasheet figures for the SXM parts: dense (no sparsity) tensor
// core peaks, memory as nvidia-smi reports it, NVLink bandwidth per
// direction per GPU, and the usual network per GPU in a DGX/HGX node.
struct GpuSpec {
  std::string key;       // "h100"
  std::string name;      // "H100 SXM"
  double bf16_flops;     // FLOP/s, dense
  double fp8_flops;      // FLOP/s, dense; 0 when the part has no fp8
  double memory_bytes;
  double nvlink_bytes_per_s;   // per direction
  double network_bytes_per_s;  // per GPU, between nodes
};
const std::vector<GpuSpec>& gpu_specs();
// By key ("h100") or by a device name that contains the part ("NVIDIA H100
// 80GB HBM3", "cuda:0 (NVIDIA A100-SXM4-80GB)"); nullptr when unknown.
const GpuSpec* find_gpu_spec(const std::string& name);

// "80GiB", "80GB", "141 GB", "81559MiB", "80G" (K/M/G/T alone are binary,
// like free -g); throws Error for anything else, naming `what`.
double parse_bytes(const std::string& text, const std::string& what);
std::string format_bytes(double bytes);  // "1.5 GiB"

// What the memory model assumes about the device.
struct DeviceModel {
  int act_bytes = 2;              // bytes per parameter/activation element (bf16 2, fp32 4)
  bool attention_probs = false;   // true: attention keeps (B,NH,T,T) probabilities (the CPU
                                  // backend); false: a flash kernel's (B,NH,T) log-sum-exp
  double library_workspace = 0;   // GEMM library workspace (cuBLASLt)
  double runtime_reserve = 0;     // CUDA context, NCCL buffers, allocator slack
  int logits_align = 1;           // logits rows padded to a multiple of this (Backend::logits_stride)
  static DeviceModel cpu();       // the CPU backend: fp32, probabilities, nothing reserved
  static DeviceModel gpu();       // bf16, flash attention, 32 MiB + 1 GiB reserved
  ActivationDevice activations() const { return {act_bytes, attention_probs, logits_align}; }
};

// Bytes per rank by category. The categories are the run's report's too
// (core/train/progress.h): params (fp32 master + act-dtype copies held
// between steps), grads (the reduced fp32 gradient, sharded or not),
// optimizer (AdamW moments), activations (the model's arena), comm (gathered
// parameter units, full-size gradient buckets awaiting reduce-scatter, the
// reduce-scatter landing buffer), workspace (inputs, library workspace,
// runtime reserve; in a measured run: whatever else the backend held).
//
// An adapter run (model.adapter) adds `base`: the frozen base as this rank
// stores it (in base_dtype, sharded as the strategy says); params, grads and
// optimizer are then the adapters' (the only trainable state), comm also
// holds the base's gathered (and, for nf4, dequantized) units, and
// workspace the adapters' scratch and the fp32 buffer the network writes
// the frozen base's unused norm (and bias) gradients into.
struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0, workspace = 0;
  double base = 0;
  double total() const { return base + params + grads + optimizer + activations + comm + workspace; }
};

// How parameters are spread: the strategy and the shard-group size G
// (no_shard 1; shard_grad_op / full_shard the world; hybrid_shard the group).
struct Sharding {
  std::string strategy = "full_shard";
  int group = 1;
  int world = 1;
  // parallel.offload cpu/nvme (parallel/sharding/offload.h): the fp32 master
  // weights, moments and gradient shard leave the device; it keeps its
  // act-dtype parameter shard (and hybrid_shard its gradient shard, which
  // it all-reduces across replicas on the device).
  bool offload = false;
  // Pipelines only: parallel.pipeline_reshard resolved for this strategy
  // (JobSpec's auto: true under full_shard / hybrid_shard). true: a stage
  // gathers a unit per use and reduce-scatters its gradient per microbatch;
  // false: it holds every unit gathered, and its full fp32 gradient, for
  // the whole step (parallel/pipeline/stage_store.h).
  bool pipeline_reshard = true;
  // nvme with gradient accumulation keeps the fp32 gradient shard on the
  // device too (offload_keeps_device_grad): summed there, landed once a step.
  bool offload_grad_on_device = false;
};
// Host bytes per rank that offload keeps (16 per element of the rank's state).
double offload_host_bytes_per_rank(const ModelArch& m, const Sharding& s);

MemoryBreakdown estimate_memory(const ModelArch& m, const Sharding& s, int micro_batch, bool checkpointing,
                                const DeviceModel& d);
// The activation arena alone (ModelArch::activation_bytes; on the CPU equal
// to the network's activation_bytes()).
double estimate_activation_bytes(const ModelArch& m, int micro_batch, bool checkpointing, const DeviceModel& d);

// ---- parameter-efficient fine-tuning (model.adapter) --------------------------------

// What the planner needs of a job's model.adapter and model.base_dtype
// (`plan --adapter lora --rank 16 --base-dtype nf4`).
struct AdapterRequest {
  std::string type = "none";                  // none | lora | dora
  int rank = 16;                              // r
  std::string target_modules = "all-linear";  // comma-joined HF short names, or all-linear
  std::string base_dtype = "auto";            // auto | fp32 | bf16 | nf4
  bool on() const { return type != "none"; }
};
// "bf16" / "fp32" / "nf4": auto is the backend's activation dtype (bf16 on
// CUDA, fp32 on the CPU), as the trainer holds the frozen base. Throws Error
// for anything but auto, fp32, bf16, nf4 (naming --base-dtype).
std::string resolve_base_dtype(const std::string& base_dtype, const DeviceModel& d);
// Throws Error naming the flag or key for a rank <= 0, an unknown type or
// base dtype, or a target module the model does not have.
void check_adapter_request(const AdapterRequest& a, const ModelArch& m);
// Trainable elements per block (A and B of every target, DoRA's magnitudes),
// and in all (L blocks): what `trainable params` counts.
int64_t adapter_params_per_block(const ModelArch& m, const AdapterRequest& a);
// The frozen base's bytes in base_dtype (nf4: nf4::stored_bytes of every
// block linear's weight, the rest bf16), the whole model, unsharded.
double adapter_base_bytes(const ModelArch& m, const AdapterRequest& a, const DeviceModel& d);
// One rank's memory in an adapter run at tp 1 (pp 1): the frozen base
// sharded as `s` says (no_shard / shard_grad_op: whole; full_shard /
// hybrid_shard: 1/G of every unit, gathered per use), the adapters' state
// sharded alike, the activation arena, and the buffers listed above.
MemoryBreakdown estimate_adapter_memory(const ModelArch& m, const AdapterRequest& a, const Sharding& s,
                                        int micro_batch, bool checkpointing, const DeviceModel& d);
// FLOPs per token as the trainer's MFU counts an adapter run: 4N for the
// frozen base (forward and input gradient, no weight gradient), 6 per
// adapter parameter, and attention's 12*L*C*T.
double adapter_flops_per_token(const ModelArch& m, const AdapterRequest& a);
// What the step computes beyond that (hardware FLOPs per token, not in MFU):
// DoRA's 3 more base-sized GEMMs per adapted linear (5 instead of LoRA's 2:
// core/model/adapter/dora.cpp).
double adapter_extra_flops_per_token(const ModelArch& m, const AdapterRequest& a);

// ---- tensor parallelism ----------------------------------------------------------

// The activation arena of one rank of a TP group of `tp` (core/model/
// gpt2|llama's networks with a TensorParallel context, buffer by buffer;
// tp 1: estimate_activation_bytes). Inside attention and the MLP (q|k|v,
// attention state, the MLP's hidden, their gradients) and the logits
// (vocab-parallel) a rank holds 1/tp; the residual stream, the norms'
// statistics and the residual gradient hold 1/tp of the rows only with
// sequence parallelism; the norms' outputs, which the column layers read
// whole, stay full size (this code base keeps them gathered rather than
// re-gathering them in backward, as Megatron does).
double estimate_tp_activation_bytes(const ModelArch& m, int tp, bool sequence_parallel, int micro_batch,
                                    bool checkpointing, const DeviceModel& d);
// Per-GPU memory of one rank of a tp x dp mesh: the TP-local layout
// (core/model/tensor_parallel.h: split weights, replicated norms, the vocab
// padded to a multiple of tp) sharded over the dp group as `s` says (s.group
// and s.world count dp ranks), and the TP activation arena. tp 1 is
// estimate_memory.
MemoryBreakdown estimate_tp_memory(const ModelArch& m, int tp, bool sequence_parallel, const Sharding& s,
                                   int micro_batch, bool checkpointing, const DeviceModel& d);
// Activation collectives of one micro-batch under TP (each an all-reduce of
// micro_batch x seq_len x n_embd act-dtype values, or with sequence
// parallelism an all-gather plus a reduce-scatter of the same bus volume):
// 2 forward + 2 backward per block, the vocab-parallel embedding's forward
// and the LM head's input gradient, and 2 more per block when checkpointing
// recomputes the forward.
int tp_collectives_per_micro_batch(const ModelConfig& c, bool checkpointing);

// ---- context parallelism (planner_cp.cpp) -------------------------------------------

// One rank's activation arena at parallel.context_parallel cp (pp 1):
// the network over T / cp rows of each sequence with the cp attention's
// log-sum-exp per layer (never probabilities), RoPE's global table, and
// the cp attention's workspace (CpAttention::workspace_bytes_for). With
// tp > 1 the network is the TP rank's (estimate_tp_activation_bytes over
// T / cp rows; sequence_parallel as there) and the cp attention runs on its
// heads. On the CPU equal to the cp network's activation_bytes() (tested at
// tp 1 and 2). cp 1: estimate_tp_activation_bytes.
double estimate_cp_activation_bytes(const ModelArch& m, int cp, const std::string& mode, int micro_batch,
                                    bool checkpointing, const DeviceModel& d, int tp = 1,
                                    bool sequence_parallel = false);
// Bytes each rank of a ring sends for one micro-batch: per layer, cp-1 K/V
// blocks (micro_batch x T/cp rows of 2 x kv_heads x head_dim) in forward,
// again in the recompute with checkpointing, cp-1 in backward, and cp fp32
// dK|dV accumulators. kv_heads: the rank's (a TP rank's share); 0 = n_kv_head.
double cp_ring_bytes_per_micro_batch(const ModelConfig& c, int cp, int micro_batch, bool checkpointing,
                                     int act_bytes, int kv_heads = 0);

// ---- expert parallelism (planner_ep.cpp) ----------------------------------------------

// The routed experts' elements (every `.experts.` tensor, all layers), and
// the number of blocks that have them.
int64_t moe_expert_parameters(const ModelArch& m);
int moe_layers(const ModelArch& m);
// Bytes each rank sends over links for one micro-batch at expert-parallel
// degree ep: per MoE layer 2 all-to-alls forward (dispatch, combine), 2
// backward, 2 more with checkpointing, each micro_batch x T x top_k x C
// act-dtype values of which (ep-1)/ep leave the rank. 0 for ep 1.
double ep_all_to_all_bytes_per_micro_batch(const ModelArch& m, int ep, int micro_batch, bool checkpointing,
                                           int act_bytes);
// One rank's memory at degree ep (tp 1, pp 1): n_experts/ep experts whole
// (fp32 master + act copy, fp32 gradient, AdamW moments), the rest sharded
// as `s` says, the arena plus two all-to-all landing buffers. ep 1: estimate_memory.
MemoryBreakdown estimate_ep_memory(const ModelArch& m, int ep, const Sharding& s, int micro_batch,
                                   bool checkpointing, const DeviceModel& d);

// ---- the plan ----------------------------------------------------------------------

struct PlanRequest {
  ModelConfig model;              // from the job spec or parse_model_shape()
  std::string gpu = "h100";       // a gpu_specs() key
  double gpu_memory = 0;          // bytes per GPU; 0 = the GPU's
  int gpus_per_node = 8;
  int nodes = 1;
  int micro_batch = 1;
  int global_batch = 8;           // sequences per optimizer step
  bool checkpointing = false;
  std::string job_strategy;       // marked in the table; "" = none
  int shard_group_size = 0;       // hybrid_shard group; 0 = GPUs per node
  double compute_efficiency = 0.45;  // share of peak the GEMMs reach (the design's MFU target)
  double bus_efficiency = 0.80;      // share of nominal link bandwidth a ring collective reaches
  // Offload (--offload): where the optimizer state lives, and the host side's speeds.
  std::string offload = "none";          // none | cpu | nvme
  double host_adamw_params_per_s = 4e9;  // host AdamW per node (all its ranks): `trainrun bench optimizer`
  double pcie_bytes_per_s = 25e9;        // per GPU, each direction (PCIe Gen4 x16 in practice; Gen5 ~50e9)
  double host_memory = 0;                // bytes per node available to offload; 0 = not checked
  double nvme_bytes_per_s = 12e9;        // per node, read and write (nvme)
  // Tensor parallelism: degrees 1, 2, 4, 8 are planned (those that the model
  // and the GPU count allow), over the links below.
  bool sequence_parallel = false;  // the job's parallel.sequence_parallel
  int job_tp = 0;                  // the job's parallel.tensor_parallel, marked in the table; 0 = none
  // The link a TP group of each degree gets, from the node's topology
  // (`plan --topology` / `--nvidia-smi-topo`; parallel/topology's TP groups).
  // A degree not listed: within a node, the GPU's NVLink (SXM parts sit on
  // NVSwitch); past a node, the network.
  struct TpLink {
    int tp = 2;
    std::string kind;          // "NVLink", "PCIe", "cross-node"
    double bytes_per_s = 0;    // nominal, per direction per GPU
    std::string detail;        // "ranks 0-1 (GPUs 0,1): NVLink (NV4)"
  };
  std::vector<TpLink> tp_links;
  std::string topology_source;  // where tp_links came from ("" = the GPU table)
  bool topology_has_nvlink = true;  // the node has NVLink at all (never recommend TP over PCIe then)
  // Pipeline parallelism: degrees 2, 4, 8 and the node count, x the TP
  // degrees, under one schedule (`--pp-schedule`, default the job's
  // parallel.pipeline_schedule) with v chunks per rank for interleaved_1f1b.
  std::string pp_schedule = "1f1b";
  int pp_virtual_stages = 1;       // 0 = 2 for interleaved_1f1b, else 1
  int job_pp = 0;                  // the job's parallel.pipeline_parallel, marked; 0 = none
  std::string pipeline_reshard = "auto";  // the job's parallel.pipeline_reshard (--pp-reshard): auto | true | false
  // Context parallelism: cp 2, 4, 8, ... x tp 1, 2, 4, 8 up to the GPUs, in this mode.
  int job_cp = 0;                  // the job's parallel.context_parallel, marked; 0 = none
  std::string cp_mode = "ring";    // the job's parallel.cp_mode
  // Parameter-efficient fine-tuning (--adapter or the job's model.adapter):
  // every row is then an adapter run (frozen base + adapters).
  AdapterRequest adapter;
};

// The schedule's bubble as a share of the step's compute: (p-1)/m for gpipe
// and 1f1b, (p-1)/(v m) for interleaved_1f1b, (p-1)/(3m) for zero_bubble
// (ZB-H1). Throws Error for an unknown schedule.
double pipeline_bubble_formula(const std::string& schedule, int pp, int virtual_stages, int microbatches);

// One pipeline rank's memory: its stage's units (blocks; the first stage
// the embedding, the last the final norm and head and, when tied and
// pp > 1, its copy of the embedding) over the TP-local layout, sharded over
// dp as `s` says (comm: the stage store's gathered units and full-size
// gradients, held all step or per use as s.pipeline_reshard says); activations: `in_flight` stage networks (the executor
// holds one per microbatch in flight, each with its own arena: its chunk's
// blocks, the rest of an arena, the head's buffers on the last stage only,
// and zero_bubble's kept output gradients); in_flight is the schedule
// simulator's peak, deferred the most input-gradient steps awaiting their
// weight step at once (zero_bubble; reported, already inside in_flight).
struct PipelineStageMemory {
  int rank = 0, layers = 0, in_flight = 0, deferred = 0;
  MemoryBreakdown mem;  // activations: in_flight x kept_activations + transient_activations
  // One stage network's kept buffers (what outlives a compute call), and
  // the transient scratch every stage network of the rank shares, counted
  // once (core/model/arena_plan.h).
  double kept_activations = 0, transient_activations = 0;
};
// Every rank's, for a tp x pp x dp mesh (split: split_pipeline_layers).
std::vector<PipelineStageMemory> estimate_pipeline_memory(const ModelArch& m, int tp, bool sequence_parallel,
                                                          int pp, const std::string& schedule, int virtual_stages,
                                                          int microbatches, const Sharding& s, int micro_batch,
                                                          bool checkpointing, const DeviceModel& d);

struct PlanRow {
  int tp = 1, dp = 1;             // the mesh: tp x pp x dp = the GPUs
  int pp = 1;                     // pipeline stages (1: none)
  // Pipeline rows only: schedule, chunks per rank, microbatches per step
  // (= accum), the bubble formula's share, the p2p seconds per step, the
  // stage link, and the worst stage (the rank whose memory is mem).
  std::string pp_schedule;
  int pp_v = 1, worst_stage = 0, worst_in_flight = 0;
  double bubble = 0, p2p_s = 0;
  std::string pp_link;
  bool pp_reshard = false;        // pipeline rows: the stage store re-gathers per microbatch (sharding.pipeline_reshard)
  int cp = 1;                     // context-parallel rows: the cp degree (tp x pp x cp x dp = the GPUs)
  double cp_ring_s = 0;           // cp rows: the ring's K/V transfers per step (in comm_s; exposed: what attention does not hide)
  std::string cp_link;            // cp rows: NVLink (the group inside a node) or network
  int ep = 1;                     // expert-parallel rows: the ep degree (folds into dp)
  double a2a_s = 0;               // ep rows: the token all-to-alls per step (exposed)
  double expert_state = 0;        // ep rows (ep > 1): bytes of this rank's experts' params, grads and optimizer state
  std::string ep_link;            // ep rows: none (ep 1), NVLink or network
  std::string tp_link = "none";   // the TP group's link: none (tp 1), NVLink, PCIe, cross-node
  double tp_comm_s = 0;           // TP activation collectives per step (exposed: between GEMMs)
  Sharding sharding;              // over the dp ranks
  MemoryBreakdown mem;
  bool fits = false;
  int max_micro_batch = 0;        // 0: not even 1 fits
  int accum = 1;                  // micro-batches per rank per step
  double compute_s = 0, comm_s = 0, exposed_comm_s = 0, step_s = 0;
  double tokens_per_s = 0, mfu = 0;
  // Offload only: host memory per node (cpu: the state; nvme: its buffers),
  // NVMe traffic per step per node, and the step time it adds: host AdamW
  // plus the host->device parameter copy (exposed, between steps), the
  // device->host gradient copies (overlapped with backward; in comm_s).
  double host_bytes_per_node = 0, nvme_bytes_per_step = 0, offload_s = 0;
};

struct Plan {
  PlanRequest req;
  GpuSpec gpu;
  double capacity = 0;
  std::vector<PlanRow> rows;      // tp 1: no_shard, shard_grad_op, full_shard, hybrid_shard
  std::string verdict;            // one paragraph answering "does it train?" (tp 1)
  std::vector<PlanRow> tp_rows;   // tp 2, 4, 8 x the strategies, where offered
  std::vector<std::pair<int, std::string>> tp_not_offered;  // degree, why
  // tp x pp meshes: for each (tp, pp) the best strategy (the fastest that
  // fits, else the one that needs the least memory).
  std::vector<PlanRow> pp_rows;
  std::vector<std::pair<std::string, std::string>> pp_not_offered;  // "tp2 x pp8" or "pp8", why
  std::vector<PlanRow> cp_rows;   // cp x tp x dp, full_shard over dp x cp (tp 1 rows first)
  std::vector<std::pair<int, std::string>> cp_not_offered;  // degree, why
  // Mixture-of-experts models: ep 1/2/4/8 (planner_ep.cpp), the recommended degree and why.
  std::vector<PlanRow> ep_rows;
  std::vector<std::pair<int, std::string>> ep_not_offered;  // degree, why
  bool has_ep_recommendation = false;
  PlanRow ep_recommended;
  std::string ep_recommendation;
  // The recommended mesh (the fastest that fits, TP never across PCIe when
  // the node has NVLink, nor across nodes) and why, in one or two lines.
  bool has_recommendation = false;
  PlanRow recommended;
  std::string recommendation;
};

// Throws Error for impossible requests (no GPUs, an unknown GPU, ...).
Plan make_plan(const PlanRequest& req);
std::string render_plan(const Plan& plan);

}  // namespace trainrun
