// `trainrun export`: a model (our model file or an HF directory) as a Hugging
// Face directory, streamed.
//
// Every safetensors header is known from the layout before a byte of weight
// is read (names, HF shapes, the dtype), so each output file is its header
// followed by its tensors in order, and each tensor is read from the source
// (mapped, hf_interop.h's FlatModelSource) in pieces of at most kExportPiece
// (64 MiB) of fp32, transposed (GPT-2's Conv1D) and narrowed (bf16) in a buffer
// of the piece's size, and pwritten at its offset. Peak memory is a few
// pieces (the fp32 piece, its transpose, its bf16 form), never the model:
// a 70B export holds ~200 MiB, not 280 GB.
//
// Sharding follows save_pretrained (huggingface_hub's
// split_torch_state_dict_into_shards): tensors in HF's order (hf_save_order), a new shard when
// the next tensor would take the current one past the limit, a tensor larger
// than the limit alone in its own shard; shards are
// model-0000i-of-0000N.safetensors with model.safetensors.index.json
// {"metadata": {"total_size"}, "weight_map"} (keys sorted, as
// save_pretrained's json.dumps(sort_keys=True)); one shard is
// model.safetensors and no index.
#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/checkpoint/hf_interop.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "core/io/safetensors.h"
#include "core/train/generate.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace trainrun {

const std::vector<std::string> kHfTokenizerFiles = {"tokenizer.json",   "tokenizer_config.json",
                                                    "special_tokens_map.json", "tokenizer.model",
                                                    "vocab.json",       "merges.txt",
                                                    "added_tokens.json"};

uint64_t parse_max_shard_size(const std::string& text) {
  auto bad = [&](const std::string& why) {
    TR_FAIL("--max-shard-size: '", text, "' ", why,
            "; give bytes (1000000) or a size with KB/MB/GB/TB (powers of 1000, as Hugging Face reads them: "
            "5GB = 5000000000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 5GB, 500MB, 2GiB");
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t num_begin = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == num_begin) bad("is not a size");
  const std::string num = text.substr(num_begin, i - num_begin);
  if (std::count(num.begin(), num.end(), '.') > 1) bad("is not a number");
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size() && !std::isspace(static_cast<unsigned char>(text[i])); ++i)
    unit += char(std::toupper(static_cast<unsigned char>(text[i])));
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) bad("is not a size");
  double mult = 0;
  const std::pair<const char*, double> units[] = {
      {"", 1},        {"B", 1},          {"KB", 1e3},       {"MB", 1e6},       {"GB", 1e9},
      {"TB", 1e12},   {"KIB", 1024.0},   {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  for (const auto& [u, m] : units)
    if (unit == u) mult = m;
  if (mult == 0) bad("has an unknown unit '" + unit + "'");
  const double bytes = std::stod(num) * mult;
  if (!(bytes >= 1)) bad("is not a positive size");
  if (bytes > 1.8e19) bad("is too large");
  return uint64_t(bytes);
}

namespace {

// ---- sources ---------------------------------------------------------------------------

// Our model file: the layout's tensors by name, fp32, mapped.
class ModelFileSource final : public FlatModelSource {
 public:
  explicit ModelFileSource(const std::string& path) : file_(path) {
    const ModelConfig cfg = config_from_file_metadata(file_.metadata(), path);
    try {
      arch_ = make_model_arch(cfg);
    } catch (const Error& e) {
      TR_FAIL(path, ": inconsistent model shape in __metadata__ (", e.what(), ")");
    }
    for (const auto& t : arch_->layout().tensors) {
      const MappedSafeTensors::View* v = file_.find(t.name);
      TR_CHECK(v, "export: '", path, "' has no tensor '", t.name, "' (the ", arch_->describe(),
               " of its metadata needs it); the file is damaged or not a trainrun model file");
      TR_CHECK(v->dtype == "F32", "export: '", path, "': tensor '", t.name, "' has dtype ", v->dtype,
               "; trainrun's model files hold F32");
      TR_CHECK(v->shape == t.shape, "export: '", path, "': tensor '", t.name,
               "' has the wrong shape for the model in its metadata");
      views_.push_back(v);
    }
  }
  const ModelArch& arch() const override { return *arch_; }
  void read(int64_t global, int64_t count, float* out) const override {
    const auto& tensors = arch_->layout().tensors;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const ParamTensor& t = tensors[k];
      const int64_t lo = std::max(global, t.offset), hi = std::min(global + count, t.offset + t.numel);
      if (lo >= hi) continue;
      const uint8_t* p = views_[k]->data + size_t(lo - t.offset) * 4;
      std::memcpy(out + (lo - global), p, size_t(hi - lo) * 4);
      // The pages read leave the resident set: RSS stays one piece.
      MappedSafeTensors::View piece;
      piece.data = p;
      piece.nbytes = uint64_t(hi - lo) * 4;
      file_.drop_pages(piece);
    }
  }

 private:
  MappedSafeTensors file_;
  std::unique_ptr<ModelArch> arch_;
  std::vector<const MappedSafeTensors::View*> views_;  // by layout tensor
};

class MemorySource final : public FlatModelSource {
 public:
  MemorySource(const ModelConfig& cfg, const std::vector<float>& flat) : arch_(make_model_arch(cfg)), flat_(flat) {
    TR_CHECK(int64_t(flat.size()) == arch_->layout().total, "export: ", flat.size(), " values for a model of ",
             arch_->layout().total);
  }
  const ModelArch& arch() const override { return *arch_; }
  void read(int64_t global, int64_t count, float* out) const override {
    std::memcpy(out, flat_.data() + global, size_t(count) * 4);
  }

 private:
  std::unique_ptr<ModelArch> arch_;
  const std::vector<float>& flat_;
};

// ---- the plan ----------------------------------------------------------------------------

struct OutTensor {
  const ParamTensor* t = nullptr;
  // A fused HF tensor (HfTensor::fused): our tensors that make it, in row
  // order (t is the first); empty otherwise.
  std::vector<const ParamTensor*> parts;
  HfTensor hf;
  std::vector<int64_t> shape;  // as stored (HF's)
  uint64_t nbytes = 0;
};

struct OutShard {
  std::string file;
  std::vector<size_t> tensors;  // into the OutTensor list, in file order
  uint64_t bytes = 0;
};

std::vector<OutShard> plan_shards(const std::vector<OutTensor>& ts, uint64_t max_bytes) {
  std::vector<OutShard> shards;
  OutShard cur;
  for (size_t i = 0; i < ts.size(); ++i) {
    const uint64_t n = ts[i].nbytes;
    if (n > max_bytes) {  // alone in its own shard, the current one stays open
      shards.push_back({"", {i}, n});
      continue;
    }
    if (cur.bytes + n > max_bytes && !cur.tensors.empty()) {
      shards.push_back(cur);
      cur = {};
    }
    cur.tensors.push_back(i);
    cur.bytes += n;
  }
  if (!cur.tensors.empty()) shards.push_back(cur);
  char name[64];
  for (size_t s = 0; s < shards.size(); ++s) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    shards[s].file = shards.size() == 1 ? "model.safetensors" : name;
  }
  return shards;
}

// ---- writing ----------------------------------------------------------------------------

inline uint16_t bf16_round_nearest_even(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: a quiet NaN, as torch does
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

class OutFile {
 public:
  explicit OutFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TR_CHECK(fd_ >= 0, "export: cannot create '", path, "': ", std::strerror(errno));
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write_at(uint64_t off, const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, n, off_t(off));
      if (w < 0 && errno == EINTR) continue;
      TR_CHECK(w > 0, "export: cannot write '", path_, "': ", w < 0 ? std::strerror(errno) : "no progress",
               " (is the disk full?)");
      p += w, off += uint64_t(w), n -= size_t(w);
    }
  }
  void close_synced() {
    TR_CHECK(::fsync(fd_) == 0, "export: cannot fsync '", path_, "': ", std::strerror(errno));
    TR_CHECK(::close(fd_) == 0, "export: cannot close '", path_, "': ", std::strerror(errno));
    fd_ = -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// One tensor from the source into `f` at byte `at`, piece by piece.
void write_tensor(const FlatModelSource& src, const OutTensor& o, bool bf16, size_t piece_bytes, OutFile& f,
                  uint64_t at, std::vector<float>& piece, std::vector<float>& tpiece, std::vector<uint16_t>& half) {
  const ParamTensor& t = *o.t;
  const size_t es = bf16 ? 2 : 4;
  const int64_t max_elems = std::max<int64_t>(1, int64_t(piece_bytes / 4));
  // Emits n fp32 values as the output dtype at element offset e of the tensor.
  auto emit = [&](const float* v, int64_t n, int64_t e) {
    if (!bf16) return f.write_at(at + uint64_t(e) * es, v, size_t(n) * 4);
    half.resize(size_t(n));
    for (int64_t k = 0; k < n; ++k) half[size_t(k)] = bf16_round_nearest_even(v[k]);
    f.write_at(at + uint64_t(e) * es, half.data(), size_t(n) * 2);
  };
  // Ours in HF's layout, from element `base` of the file's tensor on.
  auto copy = [&](const ParamTensor& p, int64_t base) {
    for (int64_t a = 0; a < p.numel; a += max_elems) {
      const int64_t n = std::min(max_elems, p.numel - a);
      piece.resize(size_t(n));
      src.read(p.offset + a, n, piece.data());
      emit(piece.data(), n, base + a);
    }
  };
  if (!o.parts.empty()) {
    // Each part is a contiguous run of rows of the fused tensor.
    for (const ParamTensor* p : o.parts) copy(*p, src.arch().hf_tensor(*p).fused_row * (p->numel / p->shape[0]));
    return;
  }
  if (!o.hf.transposed) return copy(t, 0);
  // Ours (R, K) row-major, the file's (K, R): a piece of our rows [r0, r0+n)
  // is the file's columns [r0, r0+n), one run of n per file row (a single
  // run when the piece is the whole tensor, as for every GPT-2 up to 1.5B).
  const int64_t R = t.shape[0], K = t.shape[1];
  const int64_t rows = std::max<int64_t>(1, max_elems / std::max<int64_t>(K, 1));
  for (int64_t r0 = 0; r0 < R; r0 += rows) {
    const int64_t n = std::min(rows, R - r0);
    piece.resize(size_t(n * K));
    tpiece.resize(size_t(n * K));
    src.read(t.offset + r0 * K, n * K, piece.data());
    constexpr int64_t B = 32;  // tiles: both sides stay in cache
    for (int64_t i0 = 0; i0 < n; i0 += B)
      for (int64_t j0 = 0; j0 < K; j0 += B)
        for (int64_t i = i0; i < std::min(n, i0 + B); ++i)
          for (int64_t j = j0; j < std::min(K, j0 + B); ++j) tpiece[size_t(j * n + i)] = piece[size_t(i * K + j)];
    if (n == R) {
      emit(tpiece.data(), n * K, 0);
    } else {
      for (int64_t k = 0; k < K; ++k) emit(tpiece.data() + k * n, n, k * R + r0);
    }
  }
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

json read_json_file(const fs::path& p, const char* what) {
  std::ifstream f(p);
  TR_CHECK(f, what, ": cannot read '", p.string(), "'");
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    TR_FAIL(what, ": '", p.string(), "' is not valid JSON (", e.what(), ")");
  }
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// config.json, generation_config.json and the tokenizer files into tmp.
void write_side_files(const fs::path& tmp, const ModelArch& arch, const HfExportOptions& opt,
                      const std::string& origin) {
  json config = arch.hf_config_json();
  json origin_config;
  bool have_origin = false;
  if (!origin.empty()) {
    origin_config = read_json_file(fs::path(origin) / "config.json", "export");
    have_origin = origin_config.value("model_type", "") == arch.hf_model_type();
    if (have_origin) {
      arch.hf_carry_over(origin_config, config);
    } else {
      TR_LOG_WARN("export: '", origin, "/config.json' is not a ", arch.display_name(),
                  " (model_type ", origin_config.value("model_type", "?"), "); its token ids and tokenizer are not "
                  "carried over");
    }
  }
  config["torch_dtype"] = opt.dtype == "bf16" ? "bfloat16" : "float32";
  write_file_synced((tmp / "config.json").string(), config.dump(2) + "\n");

  const fs::path gen = fs::path(origin) / "generation_config.json";
  if (have_origin && fs::is_regular_file(gen)) {
    write_file_synced((tmp / "generation_config.json").string(), read_all(gen));
  } else {
    // What save_pretrained derives from the model config.
    json g;
    g["_from_model_config"] = true;
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (config.contains(key) && !config[key].is_null()) g[key] = config[key];
    write_file_synced((tmp / "generation_config.json").string(), g.dump(2) + "\n");
  }
  if (!have_origin) {
    if (opt.run_tokenizer.empty()) return;
    write_file_synced((tmp / "tokenizer.json").string(), read_all(opt.run_tokenizer));
    // The generic fast class: the config's model_type would pick one
    // (LlamaTokenizerFast) that adds a BOS this tokenizer may not have.
    json tc;
    tc["tokenizer_class"] = "PreTrainedTokenizerFast";
    tc["clean_up_tokenization_spaces"] = false;
    write_file_synced((tmp / "tokenizer_config.json").string(), tc.dump(2) + "\n");
    TR_LOG_INFO("export: the run's tokenizer '", opt.run_tokenizer, "' (its data's) -> tokenizer.json, tokenizer_config.json");
    return;
  }
  std::vector<std::string> copied;
  for (const auto& name : kHfTokenizerFiles) {
    const fs::path p = fs::path(origin) / name;
    if (!fs::is_regular_file(p)) continue;
    write_file_synced((tmp / name).string(), read_all(p));
    copied.push_back(name);
  }
  std::string list;
  for (const auto& c : copied) list += (list.empty() ? "" : ", ") + c;
  TR_LOG_INFO("export: from '", origin, "': token ids", fs::is_regular_file(gen) ? ", generation_config.json" : "",
              copied.empty() ? " (no tokenizer files there)" : ", " + list);
}

void write_weights(const fs::path& tmp, const FlatModelSource& src, const HfExportOptions& opt) {
  const ModelArch& arch = src.arch();
  const bool bf16 = opt.dtype == "bf16";
  const char* dtype = bf16 ? "BF16" : "F32";
  std::vector<OutTensor> ts;
  for (const ParamTensor* tp : arch.hf_save_order()) {
    const ParamTensor& t = *tp;
    const HfTensor hf = arch.hf_tensor(t);
    if (hf.fused() && !ts.empty() && !ts.back().parts.empty() && ts.back().hf.name == hf.name) {
      // The next part of the fused tensor the previous one began.
      OutTensor& o = ts.back();
      const HfTensor& prev = arch.hf_tensor(*o.parts.back());
      TR_CHECK(hf.fused_row == prev.fused_row + o.parts.back()->shape[0], "export: '", t.name, "' does not follow '",
               o.parts.back()->name, "' in '", hf.name, "' (a bug in the arch's hf_save_order)");
      o.parts.push_back(&t);
      continue;
    }
    OutTensor o;
    o.t = &t;
    o.hf = hf;
    if (hf.fused()) {
      TR_CHECK(hf.fused_row == 0, "export: '", t.name, "' is not the first part of '", hf.name,
               "' (a bug in the arch's hf_save_order)");
      o.parts.push_back(&t);
    }
    o.shape = hf.hf_shape(t.shape);
    int64_t numel = 1;
    for (int64_t d : o.shape) numel *= d;
    o.nbytes = uint64_t(numel) * (bf16 ? 2 : 4);
    ts.push_back(std::move(o));
  }
  for (const OutTensor& o : ts)
    if (!o.parts.empty()) {
      const ParamTensor& last = *o.parts.back();
      TR_CHECK(arch.hf_tensor(last).fused_row + last.shape[0] == o.hf.fused_rows, "export: the parts of '", o.hf.name,
               "' do not cover its ", o.hf.fused_rows, " rows (a bug in the arch's hf_save_order)");
    }
  const std::vector<OutShard> shards = plan_shards(ts, opt.max_shard_bytes);
  // transformers refuses a safetensors file without metadata format "pt".
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"producer", std::string("trainrun ") + TRAINRUN_VERSION}};
  std::vector<float> piece, tpiece;
  std::vector<uint16_t> half;
  nlohmann::json weight_map = nlohmann::json::object();  // sorted keys, as save_pretrained
  uint64_t total = 0;
  for (const auto& s : shards) {
    std::vector<SafeTensorEntry> entries;
    for (size_t i : s.tensors) entries.push_back({ts[i].hf.name, dtype, ts[i].shape, ts[i].nbytes});
    const std::string header = encode_safetensors_header(entries, meta);
    OutFile f((tmp / s.file).string());
    f.write_at(0, header.data(), header.size());
    uint64_t at = header.size();
    for (size_t i : s.tensors) {
      write_tensor(src, ts[i], bf16, opt.piece_bytes, f, at, piece, tpiece, half);
      at += ts[i].nbytes;
      weight_map[ts[i].hf.name] = s.file;
      total += ts[i].nbytes;
    }
    f.close_synced();
  }
  if (shards.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    write_file_synced((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  }
  TR_LOG_INFO("export: ", ts.size(), " tensors, ", total, " bytes of ", dtype, " in ", shards.size(), " file(s)");
}

fs::path normalized(const std::string& dir) {
  fs::path out = fs::absolute(fs::path(dir)).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" -> "dir"
  return out;
}

}  // namespace

bool is_hf_export_file(const std::string& name) {
  static const std::regex shard(R"(model-[0-9]{5}-of-[0-9]{5}\.safetensors)");
  if (name == "config.json" || name == "generation_config.json" || name == "model.safetensors" ||
      name == "model.safetensors.index.json" || std::regex_match(name, shard))
    return true;
  return std::find(kHfTokenizerFiles.begin(), kHfTokenizerFiles.end(), name) != kHfTokenizerFiles.end();
}

bool is_hf_model_dir(const std::string& path) {
  return fs::is_directory(path) && fs::exists(fs::path(path) / "config.json");
}

std::unique_ptr<FlatModelSource> open_model_file_source(const std::string& path) {
  return std::make_unique<ModelFileSource>(path);
}

void export_hf(const std::string& dir, const FlatModelSource& src, const HfExportOptions& opt,
               const std::string& origin) {
  TR_CHECK(!dir.empty(), "export: --out is empty; name the directory to write");
  TR_CHECK(opt.dtype == "fp32" || opt.dtype == "bf16", "--dtype: '", opt.dtype,
           "' is not an export dtype; use fp32 or bf16");
  TR_CHECK(opt.max_shard_bytes > 0, "--max-shard-size: must be positive");
  const fs::path out = normalized(dir);
  const fs::path parent = out.parent_path();
  const std::string name = out.filename().string();
  TR_CHECK(origin.empty() || normalized(origin) != out, "export: --out '", dir,
           "' is the directory exported from; choose another directory");

  // Refuse before writing anything: replacing a directory that holds other
  // files (a run directory, ".") would delete them.
  if (fs::exists(out)) {
    TR_CHECK(fs::is_directory(out), "export: --out '", dir, "' exists and is not a directory");
    for (const auto& e : fs::directory_iterator(out))
      TR_CHECK(is_hf_export_file(e.path().filename().string()), "export: --out '", dir, "' exists and holds '",
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
    write_weights(tmp, src, opt);
    write_side_files(tmp, src.arch(), opt, origin);
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

void export_hf(const std::string& dir, const ModelConfig& cfg, const std::vector<float>& flat,
               const HfExportOptions& opt) {
  MemorySource src(cfg, flat);
  export_hf(dir, src, opt, "");
}

std::string init_from_of_model_file(const std::string& model_file) {
  const fs::path d = fs::path(model_file).parent_path();
  std::string yaml;
  try {
    if (fs::exists(d / "manifest.json")) {
      const json m = read_json_file(d / "manifest.json", "export");
      if (m.contains("job_spec") && m["job_spec"].is_string()) yaml = m["job_spec"].get<std::string>();
    } else if (fs::exists(d / "job.resolved.yaml")) {
      yaml = read_all(d / "job.resolved.yaml");
    }
    if (yaml.empty()) return "";
    const YAML::Node job = YAML::Load(yaml);
    if (job["model"] && job["model"]["init_from"] && job["model"]["init_from"].IsScalar())
      return job["model"]["init_from"].as<std::string>();
  } catch (const std::exception& e) {
    // The weights are what is exported; an unreadable job spec only costs the tokenizer.
    TR_LOG_WARN("export: cannot read the job spec next to '", model_file, "' (", e.what(),
                "); no tokenizer or token ids are carried over");
  }
  return "";
}

std::string export_checkpoint_hf(const std::string& checkpoint, const std::string& out_dir,
                                 const HfExportOptions& opt) {
  if (is_hf_model_dir(checkpoint)) {
    const auto src = open_hf_source(checkpoint, "export");
    export_hf(out_dir, *src, opt, checkpoint);
    return checkpoint;
  }
  const std::string file = resolve_verified_model_file(checkpoint, "export");
  const auto src = open_model_file_source(file);
  std::string origin = init_from_of_model_file(file);
  if (!origin.empty() && !is_hf_model_dir(origin)) {
    TR_LOG_WARN("export: the job's model.init_from '", origin, "' is gone (no config.json there); writing a "
                "minimal generation_config.json and no tokenizer files");
    origin.clear();
  }
  HfExportOptions o = opt;
  if (origin.empty() && o.run_tokenizer.empty()) o.run_tokenizer = run_tokenizer_of_model_file(file);
  export_hf(out_dir, *src, o, origin);
  return file;
}

}  // namespace trainrun
