// export --merge (adapter_merge.h).
#include "core/checkpoint/adapter_merge.h"

#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "core/model/adapter/lora.h"
#include "core/model/adapter/peft_files.h"
#include "kernels/backend_factory.h"

namespace trainrun {

namespace {
// The base's elements with s * B A added inside each adapted weight; DoRA
// (use_dora) then scales each output row o by m_o / ||W_o + s (B A)_o||, as
// peft's merge_and_unload: W' = (m / ||W + s B A||_row) (W + s B A).
class MergedSource final : public FlatModelSource {
 public:
  MergedSource(std::unique_ptr<FlatModelSource> base, const std::string& adapter_dir,
               const std::string& what = "export --merge")
      : base_(std::move(base)), be_(make_cpu_backend(1)) {
    const LoraOptions o = peft_adapter_options(adapter_dir, what);
    ad_ = std::make_unique<LoraAdapters>(base_->arch(), o, be_.get(), 1);
    flat_ = read_peft_adapter(adapter_dir, base_->arch(), *ad_, what);
    for (const LoraTarget& t : ad_->targets()) {
      const ParamTensor& w = base_->arch().layout().get(t.module + ".weight");
      TR_CHECK(w.shape.size() == 2 && w.shape[0] == t.linear.out && w.shape[1] == t.linear.in,
               "export --merge: ", w.name, " is not the (", t.linear.out, ", ", t.linear.in, ") linear the adapter wraps (a bug)");
      weights_.push_back(&w);
    }
  }
  const ModelArch& arch() const override { return base_->arch(); }
  void read(int64_t global, int64_t count, float* out) const override {
    base_->read(global, count, out);
    const int64_t r = ad_->options().rank;
    const double s = ad_->scaling();
    const ParamLayout& al = ad_->layout();
    for (size_t k = 0; k < weights_.size(); ++k) {
      const ParamTensor& w = *weights_[k];
      const int64_t lo = std::max(global, w.offset), hi = std::min(global + count, w.offset + w.numel);
      if (lo >= hi) continue;
      const LoraTarget& t = ad_->targets()[k];
      const float* A = flat_.data() + al.tensors[size_t(t.a_tensor)].offset;  // (r, in)
      const float* B = flat_.data() + al.tensors[size_t(t.b_tensor)].offset;  // (out, r)
      const int64_t in = t.linear.in;
      if (t.m_tensor >= 0) {
        merge_dora_rows(t, w, A, B, flat_.data() + al.tensors[size_t(t.m_tensor)].offset, global, count, lo, hi, out);
        continue;
      }
      for (int64_t e = lo; e < hi; ++e) {
        const int64_t o = (e - w.offset) / in, i = (e - w.offset) % in;
        double d = 0;
        for (int64_t j = 0; j < r; ++j) d += double(B[o * r + j]) * double(A[j * in + i]);
        out[e - global] += float(s * d);
      }
    }
  }

 private:
  // DoRA: elements [lo, hi) of weight w (inside out's [global, global +
  // count)). A row's scale needs the whole merged row, so a row the request
  // cuts is read whole from the base (at most two per weight and request).
  void merge_dora_rows(const LoraTarget& t, const ParamTensor& w, const float* A, const float* B, const float* m,
                       int64_t global, int64_t count, int64_t lo, int64_t hi, float* out) const {
    const int64_t r = ad_->options().rank, in = t.linear.in;
    const double s = ad_->scaling();
    std::vector<float> whole;
    std::vector<double> row(static_cast<size_t>(in));
    for (int64_t o = (lo - w.offset) / in; o <= (hi - 1 - w.offset) / in; ++o) {
      const int64_t r0 = w.offset + o * in;  // the row's first element
      const float* base_row;
      if (r0 >= global && r0 + in <= global + count) {
        base_row = out + (r0 - global);  // already read, still the base's values
      } else {
        whole.resize(size_t(in));
        base_->read(r0, in, whole.data());
        base_row = whole.data();
      }
      double sq = 0;
      for (int64_t i = 0; i < in; ++i) {
        double d = 0;
        for (int64_t j = 0; j < r; ++j) d += double(B[o * r + j]) * double(A[j * in + i]);
        row[size_t(i)] = double(base_row[i]) + s * d;
        sq += row[size_t(i)] * row[size_t(i)];
      }
      TR_CHECK(sq > 0, "export --merge: ", w.name, " row ", o, " of W + s B A is zero, so DoRA's scale m / ||.|| is "
               "undefined; the adapter or the base is broken");
      const double g = double(m[o]) / std::sqrt(sq);
      const int64_t a = std::max(lo, r0), b = std::min(hi, r0 + in);
      for (int64_t e = a; e < b; ++e) out[e - global] = float(g * row[size_t(e - r0)]);
    }
  }

  std::unique_ptr<FlatModelSource> base_;
  std::unique_ptr<Backend> be_;  // LoraAdapters' scratch (it never computes here)
  std::unique_ptr<LoraAdapters> ad_;
  std::vector<float> flat_;  // the adapter (small)
  std::vector<const ParamTensor*> weights_;  // per target, its base weight
};
}  // namespace

std::string export_merged_hf(const std::string& base, const std::string& adapter_dir, const std::string& out_dir,
                             const HfExportOptions& opt) {
  std::string origin, from;
  std::unique_ptr<FlatModelSource> src;
  if (is_hf_model_dir(base)) {
    src = open_hf_source(base, "export --merge");
    origin = from = base;
  } else {
    from = resolve_verified_model_file(base, "export --merge");
    src = open_model_file_source(from);
    origin = init_from_of_model_file(from);
    if (!origin.empty() && !is_hf_model_dir(origin)) origin.clear();
  }
  MergedSource merged(std::move(src), adapter_dir);
  export_hf(out_dir, merged, opt, origin);
  return from + " + " + adapter_dir;
}

}  // namespace trainrun
