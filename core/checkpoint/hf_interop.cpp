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

#include "core/checkpoint/checkpoint.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"
#include "core/train/generate.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

// The four matrices HF GPT-2 stores as Conv1D (in, out), the transpose of ours.
bool is_conv1d(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    const size_t n = std::strlen(s);
    if (name.size() >= n && name.compare(name.size() - n, n, s) == 0) return true;
  }
  return false;
}

// dst (cols, rows) = src (rows, cols)^T, in tiles so that both sides stay in
// cache for the large matrices of a 1.5B model.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t B = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += B)
    for (int64_t j0 = 0; j0 < cols; j0 += B)
      for (int64_t i = i0; i < std::min(rows, i0 + B); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + B); ++j) dst[j * rows + i] = src[i * cols + j];
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Files a previous export leaves; a directory holding only these may be replaced.
bool is_export_file(const std::string& name) { return name == "config.json" || name == "model.safetensors"; }

json hf_config_json(const GPT2Config& cfg) {
  json c;
  c["architectures"] = {"GPT2LMHeadModel"};
  c["model_type"] = "gpt2";
  c["vocab_size"] = cfg.V;
  // Our position table has seq_len rows, so that is the longest context.
  c["n_positions"] = cfg.T;
  c["n_ctx"] = cfg.T;
  c["n_embd"] = cfg.C;
  c["n_layer"] = cfg.L;
  c["n_head"] = cfg.NH;
  c["n_inner"] = nullptr;                   // 4 * n_embd
  c["activation_function"] = "gelu_new";    // GELU, tanh approximation (ours)
  c["layer_norm_epsilon"] = 1e-5;
  c["initializer_range"] = cfg.init_std;
  // trainrun trains without dropout; 0 keeps a fine-tune in transformers the same regime.
  c["resid_pdrop"] = 0.0;
  c["embd_pdrop"] = 0.0;
  c["attn_pdrop"] = 0.0;
  c["scale_attn_weights"] = true;
  c["scale_attn_by_inverse_layer_idx"] = false;
  c["reorder_and_upcast_attn"] = false;
  c["tie_word_embeddings"] = true;
  c["use_cache"] = true;
  // GPT-2's BPE vocabulary (50257, or llm.c's padded 50304) has <|endoftext|>
  // at 50256; a byte-level or other vocabulary has no special tokens, and
  // GPT2Config's default 50256 would point outside it.
  if (cfg.V > 50256) {
    c["bos_token_id"] = 50256;
    c["eos_token_id"] = 50256;
  } else {
    c["bos_token_id"] = nullptr;
    c["eos_token_id"] = nullptr;
  }
  c["torch_dtype"] = "float32";
  return c;
}

}  // namespace

void export_hf_gpt2(const std::string& dir, const GPT2Config& cfg, const std::vector<float>& flat) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  TR_CHECK(int64_t(flat.size()) == lay.total, "export: ", flat.size(), " values for a model of ", lay.total);
  TR_CHECK(!dir.empty(), "export: --out is empty; name the directory to write");
  fs::path out = fs::absolute(fs::path(dir)).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" -> "dir"
  const fs::path parent = out.parent_path();
  const std::string name = out.filename().string();

  // Refuse before writing anything: replacing a directory that holds other
  // files (a run directory, ".") would delete them.
  if (fs::exists(out)) {
    TR_CHECK(fs::is_directory(out), "export: --out '", dir, "' exists and is not a directory");
    for (const auto& e : fs::directory_iterator(out))
      TR_CHECK(is_export_file(e.path().filename().string()), "export: --out '", dir, "' exists and holds '",
               e.path().filename().string(),
               "', which an export did not write; choose a new or empty directory (it is replaced as a whole)");
  }
  std::error_code ec;
  fs::create_directories(parent, ec);
  TR_CHECK(!ec, "export: cannot create '", parent.string(), "': ", ec.message());
  const fs::path tmp = parent / ("." + name + ".tmp-" + std::to_string(::getpid()));
  const fs::path old = parent / ("." + name + ".old-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  TR_CHECK(!ec, "export: cannot create '", tmp.string(), "': ", ec.message());
  try {
    SafeTensorFile f;
    // transformers refuses a safetensors file without metadata format "pt".
    f.metadata["format"] = "pt";
    f.metadata["producer"] = std::string("trainrun ") + TRAINRUN_VERSION;
    std::vector<float> tbuf;
    for (const auto& t : lay.tensors) {
      const float* src = flat.data() + t.offset;
      if (is_conv1d(t.name)) {
        tbuf.resize(size_t(t.numel));
        transpose(src, t.shape[0], t.shape[1], tbuf.data());
        f.tensors.push_back(make_f32_tensor(t.name, {t.shape[1], t.shape[0]}, tbuf.data()));
      } else {
        f.tensors.push_back(make_f32_tensor(t.name, t.shape, src));
      }
    }
    write_safetensors((tmp / "model.safetensors").string(), f);
    write_file_synced((tmp / "config.json").string(), hf_config_json(cfg).dump(2) + "\n");
    fsync_dir(tmp);
    // Swap into place. A crash between the two renames leaves the previous
    // export intact under the .old- name (and the new one under .tmp-).
    if (fs::exists(out)) {
      fs::remove_all(old, ec);
      fs::rename(out, old, ec);
      TR_CHECK(!ec, "export: cannot move aside '", out.string(), "': ", ec.message());
    }
    fs::rename(tmp, out, ec);
    TR_CHECK(!ec, "export: cannot rename '", tmp.string(), "' to '", out.string(), "': ", ec.message());
    fsync_dir(parent);
    fs::remove_all(old, ec);
  } catch (...) {
    fs::remove_all(tmp, ec);  // never leave a half-written export behind
    throw;
  }
}

std::string resolve_verified_model_file(const std::string& path, const char* what) {
  const std::string file = resolve_model_file(path);
  const fs::path ckdir = fs::path(file).parent_path();
  if (fs::exists(ckdir / "manifest.json")) {
    // A checkpoint carries checksums: using a damaged one would hand a
    // corrupt model to the user (or every tool downstream) without a word.
    const std::string why = Checkpointer::verify(ckdir.string());
    TR_CHECK(why.empty(), what, ": checkpoint '", ckdir.string(), "' is damaged: ", why, "; ", what,
             " from an earlier checkpoint (pass its checkpoints/step_... directory)");
  }
  return file;
}

std::string export_checkpoint_hf(const std::string& checkpoint, const std::string& out_dir) {
  const std::string file = resolve_verified_model_file(checkpoint, "export");
  std::vector<float> flat;
  const GPT2Config cfg = load_model_safetensors(file, flat);
  export_hf_gpt2(out_dir, cfg, flat);
  return file;
}

GPT2Config read_hf_gpt2_config(const std::string& dir, const std::string& what) {
  const std::string hint =
      "; expected a Hugging Face GPT-2 directory (config.json + model.safetensors), as written by `trainrun "
      "export` or save_pretrained(dir, safe_serialization=True)";
  TR_CHECK(fs::exists(dir), what, ": '", dir, "' does not exist", hint);
  TR_CHECK(fs::is_directory(dir), what, ": '", dir, "' is not a directory", hint);
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream f(path);
  TR_CHECK(f, what, ": '", dir, "' has no config.json", hint);
  json c;
  try {
    c = json::parse(f);
  } catch (const std::exception& e) {
    TR_FAIL(what, ": '", path, "' is not valid JSON (", e.what(), ")");
  }
  TR_CHECK(c.is_object(), what, ": '", path, "' is not a JSON object");
  TR_CHECK(c.contains("model_type") && c["model_type"].is_string(), what, ": '", path,
           "' has no model_type; only Hugging Face GPT-2 (model_type \"gpt2\") can be loaded");
  const std::string mt = c["model_type"].get<std::string>();
  TR_CHECK(mt == "gpt2", what, ": '", path, "' has model_type \"", mt,
           "\"; only \"gpt2\" can be loaded (trainrun implements GPT-2)");

  // Keys left out take transformers' GPT2Config defaults, as from_pretrained does.
  auto get_int = [&](const char* key, int dflt) {
    if (!c.contains(key) || c[key].is_null()) return dflt;
    TR_CHECK(c[key].is_number_integer(), what, ": '", path, "': ", key, " is not an integer: ", c[key].dump());
    return c[key].get<int>();
  };
  auto get_bool = [&](const char* key, bool dflt) {
    if (!c.contains(key) || c[key].is_null()) return dflt;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto unsupported = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's GPT-2 needs ", need,
            ", so these weights would compute a different function");
  };
  GPT2Config cfg;
  cfg.V = get_int("vocab_size", 50257);
  cfg.T = get_int("n_positions", 1024);
  cfg.C = get_int("n_embd", 768);
  cfg.L = get_int("n_layer", 12);
  cfg.NH = get_int("n_head", 12);
  if (c.contains("initializer_range") && c["initializer_range"].is_number())
    cfg.init_std = c["initializer_range"].get<double>();
  TR_CHECK(cfg.V > 0 && cfg.T > 0 && cfg.C > 0 && cfg.L > 0 && cfg.NH > 0, what, ": '", path,
           "': vocab_size, n_positions, n_embd, n_layer and n_head must be positive");
  TR_CHECK(cfg.C % cfg.NH == 0, what, ": '", path, "': n_embd (", cfg.C, ") is not divisible by n_head (", cfg.NH,
           ")");
  const std::string act = c.contains("activation_function") && c["activation_function"].is_string()
                              ? c["activation_function"].get<std::string>()
                              : "gelu_new";
  // All three are GELU's tanh approximation (gelu_fast rounds sqrt(2/pi) to
  // 10 digits, far below fp32 resolution); "gelu" is the exact erf form.
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast")
    unsupported("activation_function", "\"" + act + "\"", "\"gelu_new\" (GELU, tanh approximation)");
  if (c.contains("layer_norm_epsilon") && !c["layer_norm_epsilon"].is_null()) {
    TR_CHECK(c["layer_norm_epsilon"].is_number(), what, ": '", path, "': layer_norm_epsilon is not a number: ",
             c["layer_norm_epsilon"].dump());
    const double eps = c["layer_norm_epsilon"].get<double>();
    if (std::fabs(eps - 1e-5) > 1e-11) unsupported("layer_norm_epsilon", c["layer_norm_epsilon"].dump(), "1e-05");
  }
  const int inner = get_int("n_inner", 4 * cfg.C);
  if (inner != 4 * cfg.C) unsupported("n_inner", std::to_string(inner), "null or 4 * n_embd = " + std::to_string(4 * cfg.C));
  if (!get_bool("scale_attn_weights", true)) unsupported("scale_attn_weights", "false", "true");
  if (get_bool("scale_attn_by_inverse_layer_idx", false)) unsupported("scale_attn_by_inverse_layer_idx", "true", "false");
  if (get_bool("add_cross_attention", false)) unsupported("add_cross_attention", "true", "false");
  if (!get_bool("tie_word_embeddings", true))
    unsupported("tie_word_embeddings", "false", "true (the LM head is transformer.wte)");
  return cfg;
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

// An HF GPT-2 directory opened for reading by ranges of our flat layout:
// config.json checked, every file mapped (MappedSafeTensors: nothing is read
// until asked for), every tensor the layout needs found with its shape and
// dtype checked. `target` is the layout read into: the directory's own, or
// the job's with a shorter position table (the first seq_len rows of wpe).
class HfGpt2Reader {
 public:
  HfGpt2Reader(const std::string& dir, const std::string& what, int target_T = 0)
      : dir_(dir), what_(what), hf_(read_hf_gpt2_config(dir, what)) {
    GPT2Config tc = hf_;
    if (target_T > 0) tc.T = target_T;
    target_ = make_gpt2_layout(tc);
    const ParamLayout source = make_gpt2_layout(hf_);
    // Names without the "transformer." prefix: GPT2LMHeadModel writes it,
    // GPT2Model (and the original OpenAI-converted files) do not, and
    // from_pretrained accepts both.
    for (const auto& path : hf_model_files(dir, what)) {
      parts_.push_back(std::make_unique<MappedSafeTensors>(path));
      for (const auto& v : parts_.back()->tensors()) {
        const std::string key = v.name.rfind("transformer.", 0) == 0 ? v.name.substr(12) : v.name;
        TR_CHECK(!by_name_.count(key), what, ": tensor '", v.name, "' appears twice (in '", by_name_[key].path,
                 "' and '", path, "')");
        by_name_[key] = {&v, path, parts_.back().get()};
      }
    }
    std::set<std::string> used;
    for (const auto& t : source.tensors) {
      const std::string key = t.name.substr(12);  // every layout name starts with "transformer."
      auto it = by_name_.find(key);
      TR_CHECK(it != by_name_.end(), what, ": '", dir, "' has no tensor '", t.name,
               "' (needed for the n_layer/n_embd/vocab_size in its config.json); the directory is incomplete or not "
               "a GPT-2 model");
      const Source& src = it->second;
      const bool conv = is_conv1d(t.name);
      const std::vector<int64_t> want = conv ? std::vector<int64_t>{t.shape[1], t.shape[0]} : t.shape;
      TR_CHECK(src.view->shape == want, what, ": '", src.path, "': tensor '", src.view->name, "' has shape ",
               shape_str(src.view->shape), " but config.json implies ", shape_str(want),
               conv ? " (Hugging Face Conv1D layout: in, out)" : "");
      check_float(src);
      used.insert(key);
    }
    for (const auto& [key, src] : by_name_) {
      if (used.count(key)) continue;
      if (key == "lm_head.weight") {
        // Our head is tied to wte: an lm_head that is a copy of it loads
        // (read() compares them), a different one would change the model.
        const ParamTensor& wte = source.get("transformer.wte.weight");
        TR_CHECK(src.view->shape == wte.shape, what, ": '", src.path, "': lm_head.weight has shape ",
                 shape_str(src.view->shape), ", not transformer.wte.weight's ", shape_str(wte.shape),
                 "; trainrun's LM head is tied to the token embedding");
        check_float(src);
        lm_head_ = &src;
        continue;
      }
      // The causal-mask buffers older transformers versions saved with the weights.
      auto ends = [&](const char* s) {
        const size_t n = std::strlen(s);
        return key.size() >= n && key.compare(key.size() - n, n, s) == 0;
      };
      if (ends(".attn.bias") || ends(".attn.masked_bias")) continue;
      ignored_.push_back(src.view->name);
    }
  }

  const GPT2Config& config() const { return hf_; }
  const ParamLayout& target() const { return target_; }

  void warn_ignored() const {
    if (ignored_.empty()) return;
    std::string list;
    for (size_t i = 0; i < ignored_.size() && i < 5; ++i) list += (i ? ", " : "") + ignored_[i];
    if (ignored_.size() > 5) list += ", ...";
    TR_LOG_WARN(what_, ": '", dir_, "': ignored ", ignored_.size(),
                " tensor(s) that GPT-2's language model does not use: ", list);
  }

  // Elements [global, global + count) of the target layout into out, in
  // nn.Linear layout; the pages read leave the resident set afterwards.
  void read(int64_t global, int64_t count, float* out) const {
    const int64_t end = global + count;
    for (const auto& t : target_.tensors) {
      const int64_t lo = std::max(global, t.offset), hi = std::min(end, t.offset + t.numel);
      if (lo >= hi) continue;
      const Source& src = by_name_.at(t.name.substr(12));
      const size_t es = safetensors_dtype_size(src.view->dtype);
      float* dst = out + (lo - global);
      const int64_t a = lo - t.offset, n = hi - lo;
      if (is_conv1d(t.name)) {
        // Ours (out, in) element (o, i) is the file's (in, out) element (i, o).
        const int64_t in = t.shape[1], outc = t.shape[0];
        for (int64_t k = 0; k < n; ++k) {
          const int64_t o = (a + k) / in, i = (a + k) % in;
          dst[k] = load_elem(src.view->dtype, es, src.view->data + size_t(i * outc + o) * es);
        }
      } else {
        // wpe with a shorter table: its first rows, the same row-major prefix.
        convert_to_f32(src.view->dtype, src.view->data + size_t(a) * es, size_t(n), dst);
        if (lm_head_ && t.name == "transformer.wte.weight") check_tied(a, n, dst);
      }
      src.file->drop_pages(*src.view);
    }
  }

 private:
  struct Source {
    const MappedSafeTensors::View* view = nullptr;
    std::string path;
    const MappedSafeTensors* file = nullptr;
  };
  void check_float(const Source& src) const {
    const std::string& d = src.view->dtype;
    TR_CHECK(d == "F32" || d == "BF16" || d == "F16" || d == "F64", what_, ": '", src.path, "': tensor '",
             src.view->name, "' has dtype ", d, "; only F32, BF16, F16 and F64 weights can be loaded");
  }
  // The lm_head elements matching wte's [a, a + n) must equal them.
  void check_tied(int64_t a, int64_t n, const float* wte) const {
    std::vector<float> head(static_cast<size_t>(n));
    convert_to_f32(lm_head_->view->dtype, lm_head_->view->data + size_t(a) * safetensors_dtype_size(lm_head_->view->dtype),
                   size_t(n), head.data());
    TR_CHECK(std::memcmp(head.data(), wte, size_t(n) * 4) == 0, what_, ": '", lm_head_->path,
             "': lm_head.weight differs from transformer.wte.weight; trainrun's LM head is tied to the token "
             "embedding, so an untied head cannot be loaded");
    lm_head_->file->drop_pages(*lm_head_->view);
  }

  std::string dir_, what_;
  GPT2Config hf_;
  ParamLayout target_;
  std::vector<std::unique_ptr<MappedSafeTensors>> parts_;
  std::map<std::string, Source> by_name_;
  const Source* lm_head_ = nullptr;
  std::vector<std::string> ignored_;
};

GPT2Config load_hf_gpt2(const std::string& dir, std::vector<float>& flat, const std::string& what) {
  HfGpt2Reader r(dir, what);
  flat.assign(size_t(r.target().total), 0.0f);
  r.read(0, r.target().total, flat.data());
  r.warn_ignored();
  return r.config();
}

namespace {
// model.init_from: the job's model.* must describe the directory's model.
void check_init_from_shape(const ModelSpec& m, const GPT2Config& hf) {
  const std::string what = "model.init_from";
  const std::string& dir = m.init_from;
  auto same = [&](const char* field, int job, const char* key, int have) {
    TR_CHECK(job == have, what, ": '", dir, "' holds a GPT-2 with ", key, " = ", have, " (config.json) but model.",
             field, " is ", job, "; set model.", field, ": ", have,
             " (the job's model.* must describe the weights it starts from)");
  };
  same("n_layer", m.n_layer, "n_layer", hf.L);
  same("n_head", m.n_head, "n_head", hf.NH);
  same("n_embd", m.n_embd, "n_embd", hf.C);
  same("vocab_size", m.vocab_size, "vocab_size", hf.V);
  TR_CHECK(m.seq_len <= hf.T, what, ": '", dir, "' holds a GPT-2 with n_positions = ", hf.T,
           " (config.json) but model.seq_len is ", m.seq_len, "; set model.seq_len to at most ", hf.T,
           " (its position table has no rows beyond that)");
}
}  // namespace

std::vector<float> load_init_from(const ModelSpec& m) {
  // The shape first, from config.json alone, before mapping any weights.
  check_init_from_shape(m, read_hf_gpt2_config(m.init_from, "model.init_from"));
  HfGpt2Reader r(m.init_from, "model.init_from", m.seq_len);
  std::vector<float> flat(size_t(r.target().total));
  r.read(0, r.target().total, flat.data());
  r.warn_ignored();
  return flat;
}

void load_init_from_ranges(const ModelSpec& m, ParamStore& ps, bool log) {
  check_init_from_shape(m, read_hf_gpt2_config(m.init_from, "model.init_from"));
  HfGpt2Reader r(m.init_from, "model.init_from", m.seq_len);
  if (log) r.warn_ignored();
  const int64_t piece = int64_t(kInitFromPiece / 4);
  std::vector<float> buf;
  for (const auto& h : ps.held_ranges()) {
    for (int64_t at = 0; at < h.count; at += piece) {
      const int64_t n = std::min(piece, h.count - at);
      buf.resize(size_t(n));
      r.read(h.global + at, n, buf.data());
      ps.write_state_range(0, {h.global + at, n}, buf.data());
    }
  }
}

}  // namespace trainrun
