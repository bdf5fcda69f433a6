// Hugging Face model directories: `trainrun export` and `model.init_from`.
//
// A directory holds config.json and model.safetensors (or
// model.safetensors.index.json + shards, as save_pretrained writes large
// models) with HF's names AND layouts. What an architecture's directory
// looks like is the architecture's (ModelArch: config.json both ways,
// hf_tensor() for each tensor's name and layout, ties such as GPT-2's
// lm_head.weight = transformer.wte.weight); this file reads and writes the
// files for any of them. A tied tensor is not written (save_pretrained
// omits it too: safetensors cannot hold two names for one storage); on
// import it is accepted when present only if it equals what it is tied to.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// Writes DIR/config.json and DIR/model.safetensors (fp32) atomically: into a
// sibling temporary directory, fsynced, then renamed into place. An existing
// DIR is replaced only when it holds nothing but a previous export's files;
// anything else there is refused rather than deleted.
void export_hf(const std::string& dir, const ModelConfig& cfg, const std::vector<float>& flat);

// `trainrun export`: `checkpoint` is what `generate --checkpoint` accepts (a
// run directory -> its latest checkpoint, a checkpoint directory, or a
// .safetensors file). A checkpoint directory is verified (sizes, checksums)
// first. Returns the model file that was exported.
std::string export_checkpoint_hf(const std::string& checkpoint, const std::string& out_dir);

// resolve_model_file (core/train/generate.h), then, when the file is part of
// a checkpoint (a manifest.json beside it), the checkpoint's checksums: a
// damaged one is an Error naming `what` ("export", "generate") and the
// checkpoint, never a model quietly built from corrupt weights.
std::string resolve_verified_model_file(const std::string& path, const char* what);

// Reads a whole HF directory (config.json: read_hf_model_config) into our
// flat layout (nn.Linear layout); returns its config. Names may carry the
// arch's optional prefixes (GPT-2: "transformer."); F16/BF16 are widened.
// Missing or mis-shaped tensors are errors naming the tensor.
ModelConfig load_hf(const std::string& dir, std::vector<float>& flat, const std::string& what = "hf");

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
