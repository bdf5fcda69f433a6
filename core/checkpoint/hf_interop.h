// Hugging Face model directories: `trainrun export` and `model.init_from`.
//
// A directory holds config.json and model.safetensors (or
// model.safetensors.index.json + shards, as save_pretrained writes large
// models) with HF's names AND layouts. What an architecture's directory
// looks like is the architecture's (ModelArch: config.json both ways,
// hf_tensor() for each tensor's name and layout, ties such as GPT-2's
// lm_head.weight = transformer.wte.weight, the order save_pretrained writes
// tensors in); hf_interop.cpp reads and hf_export.cpp writes the files for
// any of them, both through mapped files and bounded pieces. A tied tensor is not written (save_pretrained
// omits it too: safetensors cannot hold two names for one storage); on
// import it is accepted when present only if it equals what it is tied to.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// ---- export (core/checkpoint/hf_export.cpp) ----

// `trainrun export`'s options.
constexpr uint64_t kDefaultMaxShardBytes = 5000000000ull;  // "5GB", save_pretrained's default
constexpr size_t kExportPiece = size_t(64) << 20;          // the most fp32 bytes read at once
struct HfExportOptions {
  std::string dtype = "fp32";                        // --dtype: fp32 | bf16 (round to nearest even)
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;  // --max-shard-size: above it, shards + an index
  // Bytes of fp32 per piece read from the source; tests make it tiny so
  // small models take the piecewise paths (a transposed tensor in row blocks).
  size_t piece_bytes = kExportPiece;
  // A from-scratch run's copy of its data's tokenizer.json (the one
  // prepare.json names), written with a tokenizer_config.json so that
  // AutoTokenizer loads it beside the model; empty = none. A fine-tune
  // carries its model.init_from's tokenizer files instead.
  std::string run_tokenizer;
};
// --max-shard-size as Hugging Face reads it: a number of bytes, or a number
// (decimals allowed) with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
// (powers of 1024), case-insensitive: "5GB" = 5e9. Throws an Error naming
// the flag and what is accepted.
uint64_t parse_max_shard_size(const std::string& text);

// A model in our flat layout (nn.Linear, fp32), readable by ranges, so an
// export never holds more than one piece of it: a checkpoint's or run's model
// file and an HF directory are both mapped (MappedSafeTensors), nothing read
// until asked for, pages dropped after each read.
class FlatModelSource {
 public:
  virtual ~FlatModelSource() = default;
  virtual const ModelArch& arch() const = 0;
  // Elements [global, global + count) of arch().layout() into out.
  virtual void read(int64_t global, int64_t count, float* out) const = 0;
};
// One of our model files (a checkpoint's or a run's model.safetensors): every
// layout tensor checked for name, F32 and shape, naming the file and tensor.
std::unique_ptr<FlatModelSource> open_model_file_source(const std::string& path);
// An HF directory (config.json + model.safetensors or an index + shards),
// with the checks of model.init_from (missing / mis-shaped / non-float
// tensors named with their file). `what` prefixes messages.
std::unique_ptr<FlatModelSource> open_hf_source(const std::string& dir, const std::string& what);

// Writes an HF directory atomically: into a sibling temporary directory,
// fsynced, then renamed into place. Files: config.json (hf_config_json()
// with torch_dtype, plus what hf_carry_over keeps of `origin`'s),
// generation_config.json (origin's, else one from the token ids),
// model.safetensors or model-0000i-of-0000N.safetensors +
// model.safetensors.index.json (save_pretrained's greedy split above
// max_shard_bytes), and origin's tokenizer files. Each tensor streams from
// `src` in pieces of at most opt.piece_bytes of fp32, converted/transposed
// and written at its offset (every header is known from the layout up front).
// `origin`: an HF directory the model came from ("" for none). An existing
// DIR is replaced only when it holds nothing but export files; anything else
// there is refused rather than deleted.
void export_hf(const std::string& dir, const FlatModelSource& src, const HfExportOptions& opt,
               const std::string& origin = "");
// The same from whole-model weights in memory (tests, small models).
void export_hf(const std::string& dir, const ModelConfig& cfg, const std::vector<float>& flat,
               const HfExportOptions& opt = {});

// The files an export writes (and so may replace): config.json,
// generation_config.json, model.safetensors, the index and its shards, the
// tokenizer files (kHfTokenizerFiles).
bool is_hf_export_file(const std::string& name);
extern const std::vector<std::string> kHfTokenizerFiles;

// --checkpoint of export/generate: a directory holding config.json is a
// Hugging Face model directory (a run or checkpoint directory never has one).
bool is_hf_model_dir(const std::string& path);

// `trainrun export`: `checkpoint` is what `generate --checkpoint` accepts (a
// run directory -> its latest checkpoint, a checkpoint directory, or a
// .safetensors file) or an HF model directory. A checkpoint directory is
// verified (sizes, checksums) first. The origin whose tokenizer and token
// ids carry over: the HF directory itself, else the job's model.init_from
// (from the checkpoint's manifest or the run's job.resolved.yaml) when that
// directory still exists. Returns what was exported (a file or directory).
std::string export_checkpoint_hf(const std::string& checkpoint, const std::string& out_dir,
                                 const HfExportOptions& opt = {});

// The model.init_from of the job that wrote `model_file` (its checkpoint's
// manifest, or job.resolved.yaml in its directory); "" when none is known.
std::string init_from_of_model_file(const std::string& model_file);

// ---- import (core/checkpoint/hf_interop.cpp) ----

// resolve_model_file (core/train/generate.h), then, when the file is part of
// a checkpoint (a manifest.json beside it), the checkpoint's checksums: a
// damaged one is an Error naming `what` ("export", "generate") and the
// checkpoint, never a model quietly built from corrupt weights.
std::string resolve_verified_model_file(const std::string& path, const char* what);

// Reads a whole HF directory (config.json: read_hf_model_config) into our
// flat layout (nn.Linear layout); returns its config. Names may carry the
// arch's optional prefixes (GPT-2: "transformer."); F16/BF16 are widened.
// Missing or mis-shaped tensors are errors naming the tensor. First, from
// config.json alone, the parameter count x `host_bytes_per_param` (what the
// caller will hold: 4 for `flat`, more when it copies it) is checked
// against host memory (check_host_memory_for_model).
ModelConfig load_hf(const std::string& dir, std::vector<float>& flat, const std::string& what = "hf",
                    double host_bytes_per_param = 4);
// Throws Error naming `what`, the model, the GiB needed and the GiB
// available when the model of `dir`'s config.json, at `bytes_per_param`,
// exceeds `available` bytes (0: unknown, no check).
void check_host_memory_for_model(const std::string& dir, const std::string& what, double bytes_per_param,
                                 uint64_t available);

// model.init_from: the job's model (from its model.* fields: the job spec
// stays the one description of the model that is trained, resumed and
// written to job.resolved.yaml) must be the directory's; a mismatch names
// the field and both values (ModelArch::check_init_from; GPT-2 allows a
// shorter model.seq_len, keeping the first seq_len rows of the position
// table). Returns the flat parameters.
std::vector<float> load_init_from(const ModelSpec& model);

// The same checks for `arch` (the job's model), reading only the ranges this
// rank holds (ParamStore::held_ranges) from the mapped files of `dir`, in
// pieces of at most kInitFromPiece bytes, into the store's fp32 master
// weights. The caller agrees on errors across ranks and then calls
// ps.params_updated() (collective). `log`: warn about tensors the model
// does not use.
constexpr size_t kInitFromPiece = size_t(64) << 20;
void load_init_from_ranges(const ModelArch& arch, const std::string& dir, ParamStore& ps, bool log);

}  // namespace trainrun
