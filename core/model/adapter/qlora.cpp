// nf4_base_tensors (qlora.h).
#include "core/model/adapter/qlora.h"

#include <algorithm>

#include "core/common/error.h"
#include "core/model/adapter/nf4.h"

namespace trainrun {

std::vector<int> nf4_base_tensors(const ModelArch& arch) {
  const ParamLayout& lay = arch.layout();
  std::vector<int> out;
  for (int l = 0; l < arch.config().L; ++l)
    for (const BlockLinear& b : arch.block_linears()) {
      const ParamTensor& w = lay.get(arch.hf_block_prefix(l) + b.module + ".weight");
      TR_CHECK(w.shape == std::vector<int64_t>({b.out, b.in}), "model.base_dtype nf4: ", w.name,
               " is not the (", b.out, ", ", b.in, ") weight of an nn.Linear (a bug)");
      out.push_back(int(&w - lay.tensors.data()));
    }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {
// The frozen store's view of nf4.h (frozen_store.h's Nf4Codec).
class Codec final : public Nf4Codec {
 public:
  float absmax_of(const float* x, int64_t n) const override { return nf4::absmax_of(x, n); }
  void quantize_absmax(const std::vector<float>& absmax, float& offset, std::vector<uint8_t>& qabsmax,
                       std::vector<float>& absmax2) const override {
    nf4::Nf4Stats s = nf4::quantize_absmax(absmax);
    offset = s.offset;
    qabsmax = std::move(s.qabsmax);
    absmax2 = std::move(s.absmax2);
  }
  void encode(const float* x, int64_t first, int64_t count, int64_t n, const float* absmax,
              uint8_t* packed) const override {
    nf4::encode(x, first, count, n, absmax, packed);
  }
  const float* dynamic_map() const override { return nf4::dynamic_map().data(); }
};
}  // namespace

std::shared_ptr<const Nf4Codec> nf4_codec() { return std::make_shared<Codec>(); }

void round_trip_base(const ModelArch& arch, std::vector<float>& flat, const std::string& base_dtype) {
  TR_CHECK(int64_t(flat.size()) == arch.layout().total, "round_trip_base: ", flat.size(), " weights for a model of ",
           arch.layout().total, " (a bug)");
  if (base_dtype == "bf16") {
    for (float& x : flat) x = bf16_value(x);
  } else if (base_dtype == "nf4") {
    // One tensor at a time: its codes and absmaxes (~0.52 bytes per element) on top of the model.
    for (int i : nf4_base_tensors(arch)) {
      const ParamTensor& t = arch.layout().tensors[size_t(i)];
      float* x = flat.data() + t.offset;
      nf4::dequantize(nf4::quantize(x, t.numel, t.name), x);
    }
  } else {
    TR_CHECK(base_dtype == "auto" || base_dtype == "fp32", "base dtype '", base_dtype,
             "' is not one of auto, fp32, bf16, nf4");
  }
}

FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype) {
  FrozenFormat f;
  f.dtype = base_dtype == "auto" ? "fp32" : base_dtype;
  if (f.dtype == "nf4") {
    f.nf4_tensors = nf4_base_tensors(arch);
    f.codec = nf4_codec();
  }
  return f;
}

FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype, const ParamLayout& layout) {
  FrozenFormat f = frozen_format(arch, base_dtype);
  if (f.dtype != "nf4") return f;
  std::vector<int> mine;
  for (int i : f.nf4_tensors) {
    const ParamTensor& whole = arch.layout().tensors[size_t(i)];
    if (const ParamTensor* t = layout.find(whole.name)) {
      TR_CHECK(t->numel == whole.numel, "model.base_dtype nf4: ", whole.name, " has ", t->numel, " of its ",
               whole.numel, " elements in this layout; NF4 quantizes whole tensors only (a bug)");
      mine.push_back(int(t - layout.tensors.data()));
    }
  }
  std::sort(mine.begin(), mine.end());
  f.nf4_tensors = std::move(mine);
  return f;
}

FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype, const TensorParallelPlan& plan,
                           Communicator* tp_comm) {
  FrozenFormat f = frozen_format(arch, base_dtype);
  if (f.dtype != "nf4" || plan.size() == 1) return f;
  TR_CHECK(tp_comm && tp_comm->world_size() == plan.size(), "model.base_dtype nf4: no TP communicator (a bug)");
  f.nf4_tp_comm = tp_comm;
  const ParamLayout& global = plan.global_layout();
  const ParamLayout& local = plan.local_layout();
  const int64_t B = nf4::kBlock;
  for (int t : f.nf4_tensors) {
    const ParamTensor& gt = global.tensors[size_t(t)];
    const ParamTensor& lt = local.tensors[size_t(t)];
    Nf4TpSlice sl;
    sl.global_numel = gt.numel;
    for (const TpRun& r : plan.runs_in(lt.offset, lt.numel)) {
      const int64_t at_local = r.local - lt.offset, at_global = r.global - gt.offset;
      if (r.global < 0 || at_local % B != 0 || at_global % B != 0 || r.count % B != 0) {
        std::string shape;
        for (int64_t d : gt.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        TR_FAIL("model.base_dtype nf4 with parallel.tensor_parallel ", plan.size(), ": tensor ", gt.name, " (",
                shape, ") is split into pieces of ", r.count, " elements (one at element ", at_global,
                " of the flattened weight), not whole 64-element blocks: bitsandbytes quantizes the whole "
                "(out, in) weight in blocks of 64 consecutive elements, so each tensor-parallel piece must be "
                "whole blocks (a column-parallel weight's rows per rank times in_features, a row-parallel "
                "weight's in_features / tensor_parallel, multiples of 64). Use a parallel.tensor_parallel that "
                "splits it so, or data parallelism with parallel.sharding: full_shard, which shards an NF4 "
                "base without this condition");
      }
      if (!sl.runs.empty()) {
        Nf4BlockRun& last = sl.runs.back();
        if (last.local + last.count == at_local / B && last.global + last.count == at_global / B) {
          last.count += r.count / B;
          continue;
        }
      }
      sl.runs.push_back({at_local / B, at_global / B, r.count / B});
    }
    f.nf4_tp.push_back(std::move(sl));
  }
  return f;
}

}  // namespace trainrun
