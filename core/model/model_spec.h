// The model a job spec describes, resolved once at job load: model.preset
// and model.init_from fill in the model.* fields the spec did not set.
//
// For each shape field (ModelArch::shape_keys(), plus model.seq_len):
//   set in the file or by --set  the spec's value; a preset with another one
//                                logs "model.n_layer: 2 (preset llama3.1-8b
//                                has 32)"; model.init_from's config.json with
//                                another one is an error naming both
//   else, model.preset           the preset's value
//   else, model.init_from        config.json's; seq_len: its
//                                max_position_embeddings (gpt2: n_positions)
//                                capped at kInitFromMaxSeqLen, logged (a set
//                                seq_len must be at most the directory's)
//   else                         the default
// ("Set" to a sentinel that means "the model's own", tie_embeddings: auto,
// n_kv_head: 0, ffn_dim: 0, arch: auto, counts as not set.)
// A field a preset filled counts as set for the init_from comparison, so a
// preset and a directory that describe different models are an error
// naming both. Every filled field is recorded in JobSpec::origins, which
// makes the resolution idempotent: job.resolved.yaml (every field written)
// resolves to itself, in the workers too.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

// The longest model.seq_len that model.init_from gives a job that sets none:
// 8192, the context Llama 3.x was pre-trained at (its rope_scaling's
// original_max_position_embeddings) and the seq_len of model.preset's Llama 3
// rows and of torchtitan's Llama 3 training configs. Llama 3.1's config.json
// allows 131072 after long-context training; at that length one micro-batch's
// activations alone outgrow a GPU, so a longer context is asked for, not
// assumed. Models with fewer positions (GPT-2's 1024, Llama 2's 4096) get theirs.
constexpr int kInitFromMaxSeqLen = 8192;

// Resolves in place, then runs validate_job_spec() (the rules that read the
// shape were deferred by the parser). `log`: the explicit-over-preset lines
// (the launcher logs them; workers re-resolving job.resolved.yaml do not).
// Reads model.init_from's config.json only (never the weights). Throws
// Error naming the key, both values and where each came from.
void resolve_model_shape(JobSpec& job, bool log = true);

// load_job_spec() + resolve_model_shape(): what every command that runs or
// plans a job calls.
JobSpec load_resolved_job_spec(const std::string& path, const std::vector<std::string>& overrides = {},
                               bool log = true);

}  // namespace trainrun
