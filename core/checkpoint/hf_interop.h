// Hugging Face GPT-2 directories: `trainrun export` and `model.init_from`.
//
// A directory holds config.json (GPT2Config: model_type "gpt2", n_layer,
// n_head, n_embd, vocab_size, n_positions, ...) and model.safetensors (or
// model.safetensors.index.json + shards, as save_pretrained writes large
// models) with HF's names AND layouts. The one difference from our own files
// is the layout of the four projection matrices: HF GPT-2 uses Conv1D, whose
// weight is (in, out), the transpose of our nn.Linear (out, in):
//   attn.c_attn.weight (C, 3C)   attn.c_proj.weight (C, C)
//   mlp.c_fc.weight    (C, 4C)   mlp.c_proj.weight  (4C, C)
// lm_head.weight is not written: GPT2LMHeadModel ties it to transformer.wte
// (tie_word_embeddings, the default), and save_pretrained omits it too
// (safetensors cannot hold two names for one storage). On import it is
// accepted when present only if it equals wte, since our head is always tied.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/gpt2.h"
#include "parallel/sharding.h"

namespace trainrun {

// Writes DIR/config.json and DIR/model.safetensors (fp32) atomically: into a
// sibling temporary directory, fsynced, then renamed into place. An existing
// DIR is replaced only when it holds nothing but a previous export's files;
// anything else there is refused rather than deleted.
void export_hf_gpt2(const std::string& dir, const GPT2Config& cfg, const std::vector<float>& flat);

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

// Reads and checks DIR/config.json: model_type gpt2 and only the features
// our GPT-2 implements (tanh GELU, LayerNorm eps 1e-5, MLP width 4C, tied
// head, scaled attention). Keys config.json leaves out take transformers'
// GPT2Config defaults, as from_pretrained would. `what` prefixes messages.
GPT2Config read_hf_gpt2_config(const std::string& dir, const std::string& what = "hf");

// Reads a whole HF GPT-2 directory into our flat layout (make_gpt2_layout
// order, nn.Linear layout); returns its config. Names may carry the
// "transformer." prefix (GPT2LMHeadModel) or not (GPT2Model); F16/BF16 are
// widened. Missing or mis-shaped tensors are errors naming the tensor.
GPT2Config load_hf_gpt2(const std::string& dir, std::vector<float>& flat, const std::string& what = "hf");

// model.init_from: the job's model.* fields must describe the directory's
// model (the job spec stays the one description of the model that is
// trained, resumed and written to job.resolved.yaml); a mismatch names the
// field and both values. One exception: model.seq_len may be smaller than
// n_positions (fine-tuning GPT-2 at a shorter context), which keeps the
// first seq_len rows of the position table. Returns the flat parameters.
std::vector<float> load_init_from(const ModelSpec& model);

// The same checks, reading only the ranges this rank holds
// (ParamStore::held_ranges) from the mapped files, in pieces of at most
// kInitFromPiece bytes, into the store's fp32 master weights. The caller
// agrees on errors across ranks and then calls ps.params_updated()
// (collective). `log`: warn about tensors the model does not use.
constexpr size_t kInitFromPiece = size_t(64) << 20;
void load_init_from_ranges(const ModelSpec& model, ParamStore& ps, bool log);

}  // namespace trainrun
