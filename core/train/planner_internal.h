// Shared by the planner's three files (planner.cpp: hardware, the tp1
// memory model, offload, the plan and its verdict; planner_tp.cpp: tensor
// parallelism; planner_pp.cpp: pipeline parallelism): the memory and
// collective models every mesh is built from, and the table formatting.
// Internal to core/train; the API is planner.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "core/train/planner.h"

namespace trainrun {
struct TpLocalShape;
namespace planner_detail {

// One TP rank's activation arena for the rank's local shape (planner_tp.cpp):
// estimate_tp_activation_bytes without building the TensorParallelPlan, for
// callers that evaluate many micro-batch sizes or sequence lengths at one tp.
double tp_activation_bytes(const ModelArch& m, const TpLocalShape& sh, bool sp, int B, bool ckpt, const DeviceModel& d);
// estimate_cp_activation_bytes with the TP rank's shape given (nullptr at tp 1).
double cp_activation_bytes(const ModelArch& m, int cp, const std::string& mode, int micro_batch, bool checkpointing,
                           const DeviceModel& d, const TpLocalShape* tp_shape, bool sequence_parallel);

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string fixed(double v, int prec);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of one buffer: the arenas start every buffer on 64 bytes.
inline double r64(double bytes) { return std::ceil(bytes / 64.0) * 64.0; }

// Elements of each sharding unit, in the order parallel/ moves them.
std::vector<int64_t> unit_numels(const ModelArch& m);

// The memory model over a layout's units (the whole model's, or one TP
// rank's local layout, or one pipeline stage's) with a given activation arena.
MemoryBreakdown memory_of_units(const std::vector<int64_t>& units, int L, int T, const Sharding& s, int B,
                                double activations, const DeviceModel& d);
// Its parameters, gradients and optimizer state alone (what the strategy
// and offload keep per element), for a part of a rank's layout.
MemoryBreakdown state_of_units(const std::vector<int64_t>& units, const Sharding& s, const DeviceModel& d);

struct CommVolume {
  double overlapped = 0, exposed = 0;  // seconds
};

// Seconds of one strategy's dp collectives per step (planner.cpp says when
// each is issued and whether it hides under compute).
CommVolume comm_time(const std::vector<int64_t>& units, const Sharding& s, int accum, double a, double bw_world,
                     double bw_group, double bw_replica);

// Offload's host memory and added step time for one row whose rank holds
// `units` (sharded as row.sharding), and `more_units` sharded as
// `more_sharding` (expert parallelism's experts over the expert-dp group).
void add_offload(PlanRow& row, const std::vector<int64_t>& units, const PlanRequest& req, double act_bytes,
                 CommVolume& c, const std::vector<int64_t>* more_units = nullptr,
                 const Sharding* more_sharding = nullptr);

// Formatting for the tables: GiB, "12 ms" / "1.25 s", "3.21 k", padded cells.
std::string gib(double b, int prec = 1);
std::string seconds(double s);
std::string si(double v, const char* unit);
std::string count_str(double n);  // 70553706496 -> "70.554B", 124439808 -> "124.4M", 27008 -> "27.0k"
inline std::string pad_right(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }
inline std::string pad_left(const std::string& s, size_t w) { return s.size() >= w ? s : std::string(w - s.size(), ' ') + s; }

// ---- adapter runs (planner_adapter.cpp) ----
// One rank's layout in an adapter run: the base's units (elements, and
// bytes as stored in base_dtype, whole), one adapter unit per block
// (trainable elements), and the widest target input / output (the
// adapters' scratch rows).
struct AdapterUnits {
  std::vector<int64_t> base_numel;
  std::vector<double> base_bytes;
  std::vector<int64_t> adapter;
  int64_t max_in = 0, max_out = 0;
  int64_t grad_scratch = 0;  // AdaptedUnitAccess's fp32 scratch (frozen_grad_scratch_elems)
  int r = 0;
  bool dora = false;
  std::string dtype;  // the resolved base dtype: fp32, bf16, nf4
};
// Over `layout` (the model's, or a TP rank's local one: the same tensor names, local shapes).
// tp_slice: `layout` is a TP rank's (nf4 then holds an fp32 absmax per
// block instead of the double quantization: nf4_frozen_store.cpp).
AdapterUnits adapter_units(const ModelArch& m, const ParamLayout& layout, const AdapterRequest& a, const DeviceModel& d,
                           bool tp_slice = false);
// The memory of one rank holding `u` (planner_adapter.cpp's header says
// what each category holds). held: a pipeline stage that keeps all of its
// base units gathered all step (pipeline_reshard false).
MemoryBreakdown adapter_memory_of_units(const AdapterUnits& u, const Sharding& s, int B, int T, double activations,
                                        const DeviceModel& d, bool held);
double base_gather_seconds(const AdapterUnits& u, const Sharding& s, int accum, double bw_group);
// The plan's "adapter" line: trainable parameters, the base's dtype and bytes, FLOPs per token.
void render_adapter_line(const AdapterRequest& a, const ModelArch& m, std::ostringstream& o);

// planner_tp.cpp: the tp 2/4/8 rows and their table.
void plan_tensor_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra, double bw_inter,
                          double recompute, double fpt);
void render_tp_table(const Plan& p, std::ostringstream& o);

// planner_pp.cpp: the tp x pp rows and their table.
void plan_pipeline_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra,
                            double bw_inter, double recompute, double fpt);
void render_pp_table(const Plan& p, std::ostringstream& o);

// planner_cp.cpp: the cp x dp rows and their table.
void plan_context_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra,
                           double bw_inter, double recompute, double fpt);
void render_cp_table(const Plan& p, std::ostringstream& o);

// planner_ep.cpp: the expert-parallel rows, their recommendation and table.
std::vector<int64_t> expert_unit_numels(const ModelArch& m);  // per unit: its routed experts' elements
// Expert parallelism's per-rank storage (planner_ep.cpp): every unit's
// dense elements (sharded over all W ranks), the MoE units' n_experts/ep
// experts (one entry per MoE layer) and their sharding over the rank's
// expert-dp group (W/ep ranks).
struct EpUnits {
  std::vector<int64_t> dense;    // every unit's dense elements
  std::vector<int64_t> experts;  // each MoE unit's n_experts/ep experts
  int64_t largest_block = 0;     // the largest MoE unit a rank assembles (dense + its experts)
};
EpUnits ep_units(const ModelArch& m, int ep);
Sharding ep_local_sharding(const Sharding& s, int ep);
void plan_expert_parallel(Plan& plan, const ModelArch& m, const DeviceModel& dev, double bw_intra, double bw_inter,
                          double recompute, double fpt);
void render_ep_table(const Plan& p, std::ostringstream& o);

}  // namespace planner_detail
}  // namespace trainrun
