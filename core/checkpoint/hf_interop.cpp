#include "core/checkpoint/hf_interop.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/checkpoint/checkpoint.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"
#include "core/train/generate.h"
#include "parallel/sharding/frozen_store.h"  // ReaderLoadable
#include "parallel/sharding/offload.h"  // host_memory_available

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

}  // namespace

std::string resolve_verified_model_file(const std::string& path, const char* what) {
  const std::string file = resolve_model_file(path);
  const fs::path ckdir = fs::path(file).parent_path();
  if (fs::exists(ckdir / "manifest.json")) {
    // A checkpoint carries checksums: using a damaged one would hand a
    // corrupt model to the user (or every tool downstream) without a word.
    // Only the file that is read: the optimizer state is twice its size.
    const std::string why = Checkpointer::verify(ckdir.string(), {fs::path(file).filename().string()});
    TR_CHECK(why.empty(), what, ": checkpoint '", ckdir.string(), "' is damaged: ", why, "; ", what,
             " from an earlier checkpoint (pass its checkpoints/step_... directory)");
  }
  return file;
}

namespace {

// The model files of an HF directory: model.safetensors, or the shards that
// save_pretrained lists in model.safetensors.index.json.
std::vector<std::string> hf_model_files(const std::string& dir, const std::string& what) {
  const fs::path d(dir);
  std::vector<std::string> files;
  if (fs::exists(d / "model.safetensors")) {
    files.push_back((d / "model.safetensors").string());
  } else if (fs::exists(d / "model.safetensors.index.json")) {
    const std::string ipath = (d / "model.safetensors.index.json").string();
    std::ifstream f(ipath);
    json idx;
    try {
      idx = json::parse(f);
    } catch (const std::exception& e) {
      TR_FAIL(what, ": '", ipath, "' is not valid JSON (", e.what(), ")");
    }
    TR_CHECK(idx.contains("weight_map") && idx["weight_map"].is_object(), what, ": '", ipath, "' has no weight_map");
    std::set<std::string> seen;
    for (const auto& [k, v] : idx["weight_map"].items()) {
      TR_CHECK(v.is_string(), what, ": '", ipath, "': weight_map['", k, "'] is not a file name");
      if (seen.insert(v.get<std::string>()).second) files.push_back((d / v.get<std::string>()).string());
    }
  } else {
    const bool bin = fs::exists(d / "pytorch_model.bin");
    TR_FAIL(what, ": '", dir, "' has no model.safetensors",
            bin ? " (only pytorch_model.bin, which trainrun does not read: re-save it with "
                  "save_pretrained(dir, safe_serialization=True))"
                : "; expected config.json + model.safetensors");
  }
  return files;
}

// One element of a float dtype: F32 and BF16 inline (the common cases, read
// element by element for the transposed Conv1D matrices), the rest through
// convert_to_f32.
inline float load_elem(const std::string& dtype, size_t es, const uint8_t* p) {
  float f;
  if (es == 4) {
    std::memcpy(&f, p, 4);
  } else if (dtype[0] == 'B') {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t bits = uint32_t(h) << 16;
    std::memcpy(&f, &bits, 4);
  } else {
    convert_to_f32(dtype, p, 1, &f);
  }
  return f;
}

}  // namespace

// An HF directory opened for reading by ranges of our flat layout:
// config.json checked, every file mapped (MappedSafeTensors: nothing is read
// until asked for), every tensor the directory's model needs found with its
// shape and dtype checked. `target` is the model read into: the directory's
// own (null), or the job's, whose shape check_init_from() has compared with
// config.json (GPT-2: a shorter position table, the first seq_len rows of wpe).
class HfReader {
 public:
  HfReader(const std::string& dir, const std::string& what, const ModelArch* target = nullptr)
      : dir_(dir), what_(what), hf_(read_hf_model_config(dir, what, target ? target->name() : "")),
        source_(make_model_arch(hf_)), target_(target ? target : source_.get()) {
    const ModelArch& arch = *source_;
    for (const auto& path : hf_model_files(dir, what)) {
      parts_.push_back(std::make_unique<MappedSafeTensors>(path));
      for (const auto& v : parts_.back()->tensors()) {
        const std::string key = arch.hf_canonical_name(v.name);
        TR_CHECK(!by_name_.count(key), what, ": tensor '", v.name, "' appears twice (in '", by_name_[key].path,
                 "' and '", path, "')");
        by_name_[key] = {&v, path, parts_.back().get()};
      }
    }
    std::set<std::string> used;
    for (const auto& t : arch.layout().tensors) {
      const HfTensor h = arch.hf_tensor(t);
      const std::string key = arch.hf_canonical_name(h.name);
      auto it = by_name_.find(key);
      TR_CHECK(it != by_name_.end(), what, ": '", dir, "' has no tensor '", h.name, "' (needed for the ",
               arch.hf_shape_keys(), " in its config.json); the directory is incomplete or not a ",
               arch.display_name(), " model");
      const Source& src = it->second;
      TR_CHECK(!h.fused() || (!h.transposed && h.fused_row >= 0 && h.fused_row + t.shape[0] <= h.fused_rows), "hf: '",
               t.name, "' is rows [", h.fused_row, ", ", h.fused_row + t.shape[0], ") of '", h.name, "' of ",
               h.fused_rows, " rows (a bug in the arch's hf_tensor)");
      const std::vector<int64_t> want = h.hf_shape(t.shape);
      TR_CHECK(src.view->shape == want, what, ": '", src.path, "': tensor '", src.view->name, "' has shape ",
               shape_str(src.view->shape), " but config.json implies ", shape_str(want),
               h.layout_note.empty() ? "" : " (" + h.layout_note + ")");
      check_float(src);
      used.insert(key);
    }
    for (const auto& [key, src] : by_name_) {
      if (used.count(key)) continue;
      if (const ParamTie* tie = tie_named(key)) {
        // Our copy is the tensor it is tied to: a copy of that loads (read()
        // compares them), a different one would change the model.
        const ParamTensor& to = arch.layout().get(tie->tensor);
        const HfTensor h = arch.hf_tensor(to);
        TR_CHECK(!h.transposed, "hf: tied tensor '", tie->tensor, "' is stored transposed (unsupported; a bug)");
        TR_CHECK(src.view->shape == to.shape, what, ": '", src.path, "': ", src.view->name, " has shape ",
                 shape_str(src.view->shape), ", not ", h.name, "'s ", shape_str(to.shape),
                 "; trainrun's LM head is tied to the token embedding");
        check_float(src);
        tied_[tie->tensor] = {&src, h.name};
        continue;
      }
      if (arch.hf_ignored_buffer(key)) continue;
      ignored_.push_back(src.view->name);
    }
    // The target reads each of its tensors from the same-named source
    // tensor: the whole of it, or (a shorter table) its first rows.
    for (const auto& t : target_->layout().tensors) {
      const ParamTensor* s = arch.layout().find(t.name);
      TR_CHECK(s, what, ": '", dir, "' has no tensor for '", t.name, "' of the job's model");
      const bool prefix = t.shape.size() == s->shape.size() && t.shape[0] <= s->shape[0] &&
                          std::equal(t.shape.begin() + 1, t.shape.end(), s->shape.begin() + 1);
      TR_CHECK(t.shape == s->shape || (prefix && !target_->hf_tensor(t).transposed), what, ": '", dir,
               "': tensor '", t.name, "' is ", shape_str(s->shape), " there but ", shape_str(t.shape),
               " in the job's model");
    }
  }

  const ModelConfig& config() const { return source_->config(); }
  const ModelArch& source_arch() const { return *source_; }
  const ParamLayout& target() const { return target_->layout(); }

  void warn_ignored() const {
    if (ignored_.empty()) return;
    std::string list;
    for (size_t i = 0; i < ignored_.size() && i < 5; ++i) list += (i ? ", " : "") + ignored_[i];
    if (ignored_.size() > 5) list += ", ...";
    TR_LOG_WARN(what_, ": '", dir_, "': ignored ", ignored_.size(), " tensor(s) that ", source_->display_name(),
                "'s language model does not use: ", list);
  }

  // Elements [global, global + count) of the target layout into out, in
  // nn.Linear layout; the pages read leave the resident set afterwards.
  void read(int64_t global, int64_t count, float* out) const { read_runs(global, count, 0, 1, out); }

  // `reps` runs of `count` elements, `stride` apart from `global` (a TP
  // rank's slice of an inner dim: one run per row), back to back into out.
  // Each tensor the runs touched drops its pages once at the end, not once
  // per row: a 70B tp8 rank reads ~1.3M rows in a few thousand calls.
  // A single run drops each tensor as soon as it is read (a whole-model
  // read then holds one tensor's pages at a time).
  void read_runs(int64_t global, int64_t count, int64_t stride, int64_t reps, float* out) const {
    std::vector<const Source*> touched;
    for (int64_t i = 0; i < reps; ++i) read_one(global + i * stride, count, out + i * count, touched, reps == 1);
    for (const Source* src : touched) src->file->drop_pages(*src->view);
  }

 private:
  struct Source {
    const MappedSafeTensors::View* view = nullptr;
    std::string path;
    const MappedSafeTensors* file = nullptr;
  };

  // One contiguous run; drops each source's pages after it (drop_now) or
  // adds it (once) to `touched` for the caller to drop.
  void read_one(int64_t global, int64_t count, float* out, std::vector<const Source*>& touched,
                bool drop_now) const {
    auto done = [&](const Source* src) {
      if (drop_now) src->file->drop_pages(*src->view);
      else if (std::find(touched.begin(), touched.end(), src) == touched.end()) touched.push_back(src);
    };
    const int64_t end = global + count;
    const auto& ts = target().tensors;  // in flat order: the first one ending after `global`
    auto first = std::upper_bound(ts.begin(), ts.end(), global,
                                  [](int64_t g, const ParamTensor& t) { return g < t.offset + t.numel; });
    for (auto it = first; it != ts.end() && it->offset < end; ++it) {
      const ParamTensor& t = *it;
      const int64_t lo = std::max(global, t.offset), hi = std::min(end, t.offset + t.numel);
      if (lo >= hi) continue;
      const HfTensor h = target_->hf_tensor(t);
      const Source& src = by_name_.at(source_->hf_canonical_name(h.name));
      const size_t es = safetensors_dtype_size(src.view->dtype);
      float* dst = out + (lo - global);
      const int64_t a = lo - t.offset, n = hi - lo;
      if (h.transposed) {
        // Ours (out, in) element (o, i) is the file's (in, out) element (i, o).
        const int64_t in = t.shape[1], outc = t.shape[0];
        for (int64_t k = 0; k < n; ++k) {
          const int64_t o = (a + k) / in, i = (a + k) % in;
          dst[k] = load_elem(src.view->dtype, es, src.view->data + size_t(i * outc + o) * es);
        }
      } else {
        // A shorter table (GPT-2's wpe): its first rows, the same row-major
        // prefix. A part of a fused tensor: its rows, from its first one.
        const int64_t base = h.fused_row * (t.numel / t.shape[0]);
        convert_to_f32(src.view->dtype, src.view->data + size_t(base + a) * es, size_t(n), dst);
        if (auto tit = tied_.find(t.name); tit != tied_.end()) {
          check_tied(tit->second, a, n, dst);
          done(tit->second.src);
        }
      }
      done(&src);
    }
  }
  struct Tied {
    const Source* src = nullptr;  // the file's copy (lm_head.weight)
    std::string to;               // HF's name of the tensor it must equal
  };
  const ParamTie* tie_named(const std::string& key) const {
    for (const auto& tie : source_->layout().ties)
      if (source_->hf_canonical_name(tie.name) == key) return &tie;
    return nullptr;
  }
  void check_float(const Source& src) const {
    const std::string& d = src.view->dtype;
    TR_CHECK(d == "F32" || d == "BF16" || d == "F16" || d == "F64", what_, ": '", src.path, "': tensor '",
             src.view->name, "' has dtype ", d, "; only F32, BF16, F16 and F64 weights can be loaded");
  }
  // The tied copy's elements matching [a, a + n) of what it is tied to must equal them.
  void check_tied(const Tied& tied, int64_t a, int64_t n, const float* values) const {
    const Source& h = *tied.src;
    std::vector<float> copy(static_cast<size_t>(n));
    convert_to_f32(h.view->dtype, h.view->data + size_t(a) * safetensors_dtype_size(h.view->dtype), size_t(n),
                   copy.data());
    TR_CHECK(std::memcmp(copy.data(), values, size_t(n) * 4) == 0, what_, ": '", h.path, "': ", h.view->name,
             " differs from ", tied.to, "; trainrun's LM head is tied to the token embedding, so an untied head "
             "cannot be loaded");
  }

  std::string dir_, what_;
  ModelConfig hf_;
  std::unique_ptr<ModelArch> source_;
  const ModelArch* target_;
  std::vector<std::unique_ptr<MappedSafeTensors>> parts_;
  std::map<std::string, Source> by_name_;
  std::map<std::string, Tied> tied_;  // by the tensor they are tied to
  std::vector<std::string> ignored_;
};

namespace {
class HfSource final : public FlatModelSource {
 public:
  HfSource(const std::string& dir, const std::string& what) : r_(dir, what) { r_.warn_ignored(); }
  const ModelArch& arch() const override { return r_.source_arch(); }
  void read(int64_t global, int64_t count, float* out) const override { r_.read(global, count, out); }

 private:
  HfReader r_;
};
}  // namespace

std::unique_ptr<FlatModelSource> open_hf_source(const std::string& dir, const std::string& what) {
  return std::make_unique<HfSource>(dir, what);
}

void check_host_memory_for_model(const std::string& dir, const std::string& what, double bytes_per_param,
                                 uint64_t available) {
  const std::unique_ptr<ModelArch> arch = make_model_arch(read_hf_model_config(dir, what, ""));
  const double params = double(arch->layout().total), needed = params * bytes_per_param;
  if (available == 0 || needed <= double(available)) return;
  const double gib = double(uint64_t(1) << 30);
  std::ostringstream o;
  o.precision(1);
  o << std::fixed << what << ": '" << dir << "' is a " << arch->describe() << " of " << params / 1e9
    << "B parameters; " << what << " holds it whole in host memory, " << bytes_per_param
    << " bytes per parameter: " << needed / gib << " GiB are needed and " << double(available) / gib
    << " GiB are available (MemAvailable, or the cgroup's memory.max). Use a machine with more memory or a "
       "smaller model";
  TR_FAIL(o.str());
}

ModelConfig load_hf(const std::string& dir, std::vector<float>& flat, const std::string& what,
                    double host_bytes_per_param) {
  // From config.json alone, before a file is mapped or a byte allocated.
  check_host_memory_for_model(dir, what, host_bytes_per_param, host_memory_available());
  HfReader r(dir, what);
  flat.assign(size_t(r.target().total), 0.0f);
  r.read(0, r.target().total, flat.data());
  r.warn_ignored();
  return r.config();
}

namespace {
// model.init_from: the shape first, from config.json alone, before mapping any weights.
void check_init_from_shape(const ModelArch& arch, const std::string& dir) {
  arch.check_init_from(read_hf_model_config(dir, "model.init_from", arch.name()), dir);
}
}  // namespace

std::vector<float> load_init_from(const ModelSpec& m) {
  const std::unique_ptr<ModelArch> arch = make_model_arch(ModelConfig::from_spec(m));
  check_init_from_shape(*arch, m.init_from);
  HfReader r(m.init_from, "model.init_from", arch.get());
  std::vector<float> flat(size_t(r.target().total));
  r.read(0, r.target().total, flat.data());
  r.warn_ignored();
  return flat;
}

void load_init_from_ranges(const ModelArch& arch, const std::string& dir, ParamStore& ps, bool log) {
  check_init_from_shape(arch, dir);
  HfReader r(dir, "model.init_from", &arch);
  if (log) r.warn_ignored();
  // A quantizing store (model.base_dtype nf4), or a pipeline stage's or a
  // tensor-parallel store over one, reads what it needs itself, tensor by
  // tensor, collectively (frozen_store.h).
  if (auto* loading = dynamic_cast<ReaderLoadable*>(&ps);
      loading && loading->load_if_quantizing([&r](int64_t global, int64_t count, int64_t stride, int64_t reps,
                                                  float* out) { r.read_runs(global, count, stride, reps, out); }))
    return;
  const int64_t piece = int64_t(kInitFromPiece / 4);
  std::vector<float> buf;
  for (const auto& h : ps.held_ranges()) {
    if (h.reps > 1) {  // strided (a TP slice): groups of whole runs
      const int64_t per = std::max<int64_t>(1, piece / h.count);
      for (int64_t first = 0; first < h.reps; first += per) {
        const ParamStore::Range part = h.rows(first, std::min(per, h.reps - first));
        buf.resize(size_t(part.numel()));
        r.read_runs(part.global, h.count, h.stride, part.reps, buf.data());
        ps.write_state_range(0, part, buf.data());
      }
      continue;
    }
    for (int64_t at = 0; at < h.count; at += piece) {
      const int64_t n = std::min(piece, h.count - at);
      buf.resize(size_t(n));
      r.read(h.global + at, n, buf.data());
      ps.write_state_range(0, {h.global + at, n}, buf.data());
    }
  }
}

}  // namespace trainrun
