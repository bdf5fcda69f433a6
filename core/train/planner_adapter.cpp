// The planner's adapter part (see planner.h, "parameter-efficient
// fine-tuning"): what one rank holds in a LoRA / DoRA / QLoRA run, from
// the buffers the code allocates:
//
//   base       the frozen base (parallel/sharding/frozen_store.cpp): each
//              unit's elements in base_dtype, whole (no_shard,
//              shard_grad_op) or 1/G of it (full_shard, hybrid_shard),
//              each unit's piece padded to 16 elements; nf4 stores every
//              block linear's weight as nf4::stored_bytes (4 bits + its
//              absmax codes and double-quantization scales; a TP slice:
//              4 bits + an fp32 absmax per 64-block), the rest
//              (embeddings, norms, biases, the LM head) in bf16, a unit's
//              piece padded to 64 bytes
//   params, grads, optimizer
//              the adapters' own store: an ordinary ParamStore over their
//              layout (one unit per block: A and B of every target, DoRA's
//              magnitudes), so fp32 master (+ an act-dtype copy on a bf16
//              device), fp32 gradients, two AdamW moments, sharded as the
//              strategy says (memory_of_units)
//   comm       the base's units in flight: the embeddings, the head and one
//              block (the frozen store gathers a unit when it is acquired,
//              without prefetching the next), gathered
//              at full size under full_shard / hybrid_shard and, when the
//              base is stored in another dtype than the GEMMs read (nf4;
//              fp32 or bf16 that is not the act dtype), converted to it;
//              plus the adapter store's own buffers
//   workspace  the inputs, the library workspace and runtime reserve, and
//              what the adapters add outside the arena (core/model/adapter/
//              lora.cpp): dropout(x) (rows x widest input), x A^T and its
//              gradient (rows x r each); DoRA also xW^T and xBA^T (rows x
//              widest output each), a 256-row slab of W + sBA and the row
//              norms; and AdaptedUnitAccess's fp32 scratch, where the
//              network writes the base gradients it still computes (norms,
//              GPT-2's biases: a block or the head's norm, never the
//              embedding or lm_head.weight) and nobody reads
//
// The same function serves tp 1, a TP rank's local layout (the base and the
// adapters split like the layers they wrap: a column-parallel linear's B
// and magnitudes by output rows, a row-parallel one's A by input columns)
// and a pipeline stage's units.
#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "core/model/adapter/lora.h"
#include "core/model/adapter/nf4.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"

namespace trainrun {

using namespace planner_detail;

std::string resolve_base_dtype(const std::string& base_dtype, const DeviceModel& d) {
  TR_CHECK(base_dtype == "auto" || base_dtype == "fp32" || base_dtype == "bf16" || base_dtype == "nf4",
           "--base-dtype (model.base_dtype): '", base_dtype, "' is not one of auto, fp32, bf16, nf4");
  if (base_dtype != "auto") return base_dtype;
  return d.act_bytes == 4 ? "fp32" : "bf16";
}

void check_adapter_request(const AdapterRequest& a, const ModelArch& m) {
  TR_CHECK(a.type == "none" || a.type == "lora" || a.type == "dora", "--adapter (model.adapter.type): '", a.type,
           "' is not one of lora, dora");
  if (!a.on()) return;
  TR_CHECK(a.rank >= 1, "--rank (model.adapter.rank): ", a.rank, " must be >= 1 (the LoRA rank r)");
  resolve_base_dtype(a.base_dtype, DeviceModel::gpu());
  resolve_target_modules(m, a.target_modules);  // names the module and the model's linears
  TR_CHECK(!m.block_linears().empty(), "--adapter: the ", m.describe(), " model has no block linears to adapt");
}

namespace planner_detail {

namespace {
double pad16(int64_t n) { return double((n + 15) / 16 * 16); }
}  // namespace

AdapterUnits adapter_units(const ModelArch& m, const ParamLayout& layout, const AdapterRequest& a,
                           const DeviceModel& d, bool tp_slice) {
  AdapterUnits u;
  u.r = a.rank;
  u.dora = a.type == "dora";
  u.dtype = resolve_base_dtype(a.base_dtype, d);
  const std::vector<std::string> names = resolve_target_modules(m, a.target_modules);
  const std::vector<BlockLinear> lins = m.block_linears();
  const int L = m.config().L;
  // Which base tensors are block linears' weights (nf4 quantizes those),
  // and each target's local (out, in) in this layout.
  std::set<std::string> linear_weights;
  for (int l = 0; l < L; ++l) {
    int64_t per_block = 0;
    for (const BlockLinear& b : lins) {
      const std::string w = m.hf_block_prefix(l) + b.module + ".weight";
      linear_weights.insert(w);
      if (std::find(names.begin(), names.end(), b.short_name()) == names.end()) continue;
      const ParamTensor& t = layout.get(w);  // (out, in), local under TP
      TR_CHECK(t.shape.size() == 2, "planner: ", w, " is not a matrix (a bug)");
      const int64_t out = t.shape[0], in = t.shape[1];
      per_block += int64_t(u.r) * (in + out) + (u.dora ? out : 0);
      u.max_in = std::max(u.max_in, in);
      u.max_out = std::max(u.max_out, out);
    }
    u.adapter.push_back(per_block);
  }
  const double es = u.dtype == "fp32" ? 4 : 2;  // nf4: the rest is bf16
  u.grad_scratch = std::max<int64_t>(frozen_grad_scratch_elems(layout), 1);
  for (const ParamUnit& pu : layout.units) {
    u.base_numel.push_back(pu.numel);
    double bytes = 0;
    for (const ParamTensor& t : layout.tensors) {
      if (t.offset < pu.offset || t.offset >= pu.offset + pu.numel) continue;
      // A TP slice of an NF4 weight: its codes and an fp32 absmax per 64-block (~0.5625 bytes per element).
      const double nf4_bytes = tp_slice ? double((t.numel + 1) / 2 + 4 * ((t.numel + 63) / 64))
                                        : double(nf4::stored_bytes(t.numel));
      bytes += u.dtype == "nf4" && linear_weights.count(t.name) ? nf4_bytes : es * t.numel;
    }
    u.base_bytes.push_back(bytes);
  }
  return u;
}

MemoryBreakdown adapter_memory_of_units(const AdapterUnits& u, const Sharding& s, int B, int T, double activations,
                                        const DeviceModel& d, bool held) {
  const double a = d.act_bytes;
  const bool sharded = s.strategy == "full_shard" || s.strategy == "hybrid_shard";
  const int64_t G = sharded ? std::max(1, s.group) : 1;
  const size_t n = u.base_numel.size();
  const bool nf4 = u.dtype == "nf4";
  const double es = u.dtype == "fp32" ? 4 : 2;
  MemoryBreakdown r;
  // The frozen base: each unit's piece (padded as the store pads it).
  std::vector<double> stored(n), gathered(n);
  for (size_t i = 0; i < n; ++i) {
    if (nf4) {
      const double piece = std::ceil(u.base_bytes[i] / double(G) / 64.0) * 64.0;
      stored[i] = piece;
      gathered[i] = piece * double(G);
    } else {
      const int64_t shard = ceil_div(u.base_numel[i], G);
      stored[i] = pad16(shard) * es;
      gathered[i] = double(shard * G) * es;
    }
    r.base += stored[i];
  }
  // The units in flight: the embeddings, the head and one block (front,
  // back and the largest in between): the frozen store gathers on the
  // caller's thread when a unit is acquired, with no prefetch, so a block
  // is released before the next is gathered; its pool keeps one buffer
  // per size. A held pipeline stage: all of its units.
  std::vector<size_t> flight;
  if (held || n <= 3) {
    for (size_t i = 0; i < n; ++i) flight.push_back(i);
  } else {
    flight = {0, n - 1};
    size_t big = 1;
    for (size_t i = 2; i + 1 < n; ++i)
      if (u.base_numel[i] > u.base_numel[big]) big = i;
    flight.push_back(big);
  }
  for (size_t i : flight) {
    if (sharded && G > 1) r.comm += gathered[i];
    // Stored in another form than the GEMMs read: a converted copy per use.
    if (u.base_bytes[i] != a * double(u.base_numel[i])) r.comm += a * double(u.base_numel[i]);
  }
  // The adapters' store: an ordinary one over their units (memory_of_units
  // reads [0], [1] and back(): pad a layout of fewer than 3 blocks).
  std::vector<int64_t> ad = u.adapter;
  while (ad.size() < 3) ad.push_back(0);
  const MemoryBreakdown st = memory_of_units(ad, int(u.adapter.size()), T, s, B, 0, d);
  r.params = st.params;
  r.grads = st.grads;
  r.optimizer = st.optimizer;
  r.comm += st.comm;
  r.activations = activations;
  // Outside the arena (lora.cpp's buffers; AdaptedUnitAccess's scratch).
  const double rows = double(B) * double(T);
  // (+ 8: the trainer's loss accumulator and the adapter store's grad-norm accumulator, a float each.)
  r.workspace =
      st.workspace + rows * double(u.max_in) * a + 2 * rows * double(u.r) * a + 4.0 * double(u.grad_scratch) + 8;
  if (u.dora)
    r.workspace += 2 * rows * double(u.max_out) * a + double(std::min<int64_t>(u.max_out, 256)) * double(u.max_in) * a +
                   4.0 * double(u.max_out);
  return r;
}

// Seconds of the base's all-gathers per step (full_shard / hybrid_shard:
// every unit in forward and again in backward, each micro-batch, under
// compute as the sharded store's gathers are); no_shard / shard_grad_op
// hold it whole and move nothing.
double base_gather_seconds(const AdapterUnits& u, const Sharding& s, int accum, double bw_group) {
  if (s.strategy != "full_shard" && s.strategy != "hybrid_shard") return 0;
  const int G = std::max(1, s.group);
  if (G <= 1) return 0;
  double bytes = 0;
  for (double b : u.base_bytes) bytes += b;
  return accum * 2.0 * double(G - 1) / G * bytes / bw_group;
}

void render_adapter_line(const AdapterRequest& a, const ModelArch& m, std::ostringstream& o) {
  const AdapterUnits au = adapter_units(m, m.layout(), a, DeviceModel::gpu());
  double trainable = 0;
  for (int64_t n : au.adapter) trainable += double(n);
  o << "adapter   " << a.type << " r=" << a.rank << " on " << a.target_modules << ": " << count_str(trainable)
    << " trainable parameters (" << fixed(100 * trainable / double(m.num_parameters()), 3) << "%); frozen base in "
    << au.dtype << ": " << gib(adapter_base_bytes(m, a, DeviceModel::gpu()), 2) << " GiB"
    << (au.dtype == "nf4" ? " (block linears 4-bit + absmax codes + scales, the rest bf16)" : "") << "; "
    << si(adapter_flops_per_token(m, a), "FLOP") << " per token for MFU (4N frozen base + 6 x adapter params + 12*L*C*T)";
  if (a.type == "dora") o << ", DoRA's 3 more base-sized GEMMs per adapted linear in the time";
  o << "\n";
}

}  // namespace planner_detail

int64_t adapter_params_per_block(const ModelArch& m, const AdapterRequest& a) {
  const AdapterUnits u = adapter_units(m, m.layout(), a, DeviceModel::gpu());
  return u.adapter.empty() ? 0 : u.adapter.front();
}

double adapter_base_bytes(const ModelArch& m, const AdapterRequest& a, const DeviceModel& d) {
  const AdapterUnits u = adapter_units(m, m.layout(), a, d);
  double t = 0;
  for (double b : u.base_bytes) t += b;
  return t;
}

MemoryBreakdown estimate_adapter_memory(const ModelArch& m, const AdapterRequest& a, const Sharding& s, int B,
                                        bool ckpt, const DeviceModel& d) {
  return adapter_memory_of_units(adapter_units(m, m.layout(), a, d), s, B, m.config().T,
                                 estimate_activation_bytes(m, B, ckpt, d), d, false);
}

double adapter_flops_per_token(const ModelArch& m, const AdapterRequest& a) {
  const ModelConfig& c = m.config();
  const double adapter = double(adapter_params_per_block(m, a)) * c.L;
  return 4.0 * double(m.matmul_parameters()) + 6.0 * adapter + 12.0 * double(c.L) * double(c.C) * double(c.T);
}

double adapter_extra_flops_per_token(const ModelArch& m, const AdapterRequest& a) {
  // (The LM head's weight gradient and the embedding's backward are not
  // computed over a frozen base: Network, frozen.)
  const ModelConfig& c = m.config();
  double extra = 0;
  if (a.type == "dora") {
    const std::vector<std::string> names = resolve_target_modules(m, a.target_modules);
    double adapted = 0;  // elements of the adapted base weights, per block
    for (const BlockLinear& b : m.block_linears())
      if (std::find(names.begin(), names.end(), b.short_name()) != names.end()) adapted += double(b.in) * b.out;
    extra += 3 * 2.0 * adapted * c.L;
  }
  return extra;
}

}  // namespace trainrun
