// The performance model: model shapes, FLOPs per token, the GPU table, and
// the memory / step-time planner behind `trainrun plan`.
//
// Why one analytic model for both the planner and MFU: the figures a user
// plans with and the figures a run reports must come from the same formulas,
// or the two disagree for reasons nobody can see. The memory model mirrors
// what the code allocates (core/model/gpt2.cpp's activation arena,
// parallel/sharding_*.cpp's buffers), and tests/test_planner.cpp holds it to
// the backend's measured peak on CPU runs (within 15%) so it cannot drift.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

// A transformer described by its shape, so a model can be planned before its
// architecture is implemented (Llama). Text form, for `trainrun plan --model`:
//   gpt2:L=12,C=768,heads=12,V=50304,T=1024
//   llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096
//   llama3-70b            (a preset; presets take overrides: llama3-70b:T=4096)
// Keys: L (layers), C (width), heads, kv_heads (llama; default heads), ffn
// (MLP width; gpt2 4C, llama required), V (vocab), T (context), tied (0/1:
// LM head shares the token embedding; gpt2 1, llama 0).
struct ModelShape {
  std::string arch = "gpt2";  // gpt2 | llama
  int64_t L = 0, C = 0, heads = 0, kv_heads = 0, ffn = 0, V = 0, T = 0;
  bool tied = true;

  static ModelShape from_spec(const ModelSpec& m);
  // Throws Error naming the offending key/value and what is accepted.
  static ModelShape parse(const std::string& text);
  // Elements of each sharding unit, in the order parallel/ moves them:
  // embeddings, block 0..L-1, head (for gpt2 equal to make_gpt2_layout's units).
  std::vector<int64_t> unit_numels() const;
  int64_t num_parameters() const;
  // N of the MFU formula: the weights that multiply activations, i.e. every
  // matrix including the LM head, but not lookup tables (position
  // embeddings; the input embedding when it is not tied to the head).
  int64_t matmul_parameters() const;
  // Training FLOPs per token, forward + backward: 6N + 12*L*C*T. 6N is two
  // FLOPs per multiply-add, times three for forward + the two backward
  // GEMMs; 12*L*C*T is attention's QK^T and AV (2*2*T*C per layer forward,
  // x3). Like PaLM and nanoGPT it counts the full T x T attention, not the
  // causal half, and not the recompute of activation checkpointing (that is
  // hardware FLOPs, not model FLOPs), so MFU is comparable with theirs.
  double flops_per_token() const;
  std::string describe() const;  // "llama L=80 C=8192 heads=64 kv_heads=8 ffn=28672 V=128256 T=4096"
};

// Help text for --model (keys, presets).
std::string model_shape_help();

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
};

// Bytes per rank by category. The categories are the run's report's too
// (core/train/progress.h): params (fp32 master + act-dtype copies held
// between steps), grads (the reduced fp32 gradient, sharded or not),
// optimizer (AdamW moments), activations (the model's arena), comm (gathered
// parameter units, full-size gradient buckets awaiting reduce-scatter, the
// reduce-scatter landing buffer), workspace (inputs, library workspace,
// runtime reserve; in a measured run: whatever else the backend held).
struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0, workspace = 0;
  double total() const { return params + grads + optimizer + activations + comm + workspace; }
};

// How parameters are spread: the strategy and the shard-group size G
// (no_shard 1; shard_grad_op / full_shard the world; hybrid_shard the group).
struct Sharding {
  std::string strategy = "full_shard";
  int group = 1;
  int world = 1;
};

MemoryBreakdown estimate_memory(const ModelShape& m, const Sharding& s, int micro_batch, bool checkpointing,
                                const DeviceModel& d);
// The activation arena alone (for gpt2 equal to GPT2::activation_bytes()).
double estimate_activation_bytes(const ModelShape& m, int micro_batch, bool checkpointing, const DeviceModel& d);

// ---- the plan ----------------------------------------------------------------------

struct PlanRequest {
  ModelShape model;
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
};

struct PlanRow {
  Sharding sharding;
  MemoryBreakdown mem;
  bool fits = false;
  int max_micro_batch = 0;        // 0: not even 1 fits
  int accum = 1;                  // micro-batches per rank per step
  double compute_s = 0, comm_s = 0, exposed_comm_s = 0, step_s = 0;
  double tokens_per_s = 0, mfu = 0;
};

struct Plan {
  PlanRequest req;
  GpuSpec gpu;
  double capacity = 0;
  std::vector<PlanRow> rows;      // no_shard, shard_grad_op, full_shard, hybrid_shard (when > 1 node)
  std::string verdict;            // one paragraph answering "does it train?"
};

// Throws Error for impossible requests (no GPUs, an unknown GPU, ...).
Plan make_plan(const PlanRequest& req);
std::string render_plan(const Plan& plan);

}  // namespace trainrun
