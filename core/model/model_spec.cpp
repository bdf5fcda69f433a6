// model.preset and model.init_from filling the shape (model_spec.h).
#include "core/model/model_spec.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/config/model_presets.h"
#include "core/model/model.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

constexpr int kFromResolution = 0;  // SpecOrigin::rank of a field filled here

std::string origin_of(const JobSpec& job, const std::string& key) {
  auto it = job.origins.find(key);
  return it == job.origins.end() ? std::string("default") : it->second.where;
}

// Set, and to a value rather than to a field's "the arch's default"
// sentinel: tie_embeddings: auto, n_kv_head, ffn_dim and head_dim: 0 written out
// mean "whatever the model has", so a preset or config.json fills them.
bool has_value(const JobSpec& job, const std::string& key) {
  if (!job.is_set(key)) return false;
  const ModelSpec& m = job.model;
  if (key == "model.tie_embeddings") return m.tie_embeddings != "auto";
  if (key == "model.n_kv_head") return m.n_kv_head != 0;
  if (key == "model.ffn_dim") return m.ffn_dim != 0;
  if (key == "model.head_dim") return m.head_dim != 0;
  if (key == "model.n_experts") return m.n_experts != 0;
  if (key == "model.n_experts_per_tok") return m.n_experts_per_tok != 0;
  if (key == "model.moe_ffn_dim") return m.moe_ffn_dim != 0;
  if (key == "model.norm_topk_prob") return m.norm_topk_prob != "auto";
  return true;
}

void fill(JobSpec& job, const JobSpec& from, const std::string& key, const std::string& where) {
  job_spec_copy_field(from, job, key);
  job.origins[key] = {where, kFromResolution};
}

void apply_preset(JobSpec& job, bool log) {
  const ModelPreset* p = find_model_preset(job.model.preset);
  // The field's enum lets only known names through; a spec built in code may not.
  TR_CHECK(p, "model.preset: unknown preset '", job.model.preset, "'");
  JobSpec preset;
  preset.model = p->spec;
  const std::string from = "model.preset " + std::string(p->name);
  // A different architecture is not a variant of the preset but another model.
  if (job.model.arch != "auto" && job.model.arch != p->spec.arch)
    TR_FAIL(origin_of(job, "model.arch"), ": model.arch: ", job.model.arch, " but model.preset ", p->name, " is a ",
            p->spec.arch, "; remove one of them");
  if (job.model.arch == "auto") fill(job, preset, "model.arch", from);

  std::vector<std::string> keys;
  for (const ShapeKey& k : make_model_arch(ModelConfig::from_spec(p->spec))->shape_keys()) keys.push_back(k.field);
  keys.push_back("model.seq_len");
  for (const std::string& key : keys) {
    if (!has_value(job, key)) {
      fill(job, preset, key, from);
      continue;
    }
    const std::string mine = job_spec_value_text(job, key), theirs = job_spec_value_text(preset, key);
    if (log && mine != theirs) TR_LOG_INFO(key, ": ", mine, " (preset ", p->name, " has ", theirs, ")");
  }
}

// The checkpoint a start of this job resumes from, if any (checkpoint.resume:
// auto = output.dir's latest; a path; never), as the Checkpointer finds it.
std::string checkpoint_to_resume(const JobSpec& job) {
  const std::string& r = job.checkpoint.resume;
  if (r == "never") return "";
  if (r != "auto") return r;
  const fs::path ck = fs::path(job.output.dir) / "checkpoints";
  std::ifstream f(ck / "latest");
  std::string name;
  if (!f || !std::getline(f, name) || name.empty()) return "";
  return (ck / name).string();
}

// model.init_from's directory is gone but the job resumes: the checkpoint
// holds the weights, and the shape the job was resolved to when it started
// (its manifest's job_spec). The directory is only needed for a fresh start.
bool apply_resumed_shape(JobSpec& job, const std::string& missing, bool log) {
  const std::string ck = checkpoint_to_resume(job);
  if (ck.empty()) return false;
  std::ifstream f(fs::path(ck) / "manifest.json");
  if (!f) return false;
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(f);
  } catch (const std::exception&) {
    return false;  // a damaged manifest: the resume reports it
  }
  if (!m.contains("job_spec") || !m["job_spec"].is_string()) return false;
  const JobSpec was = parse_job_spec(m["job_spec"].get<std::string>(), ck + "/manifest.json", {});
  const std::string from = "'" + ck + "' (the checkpoint this job resumes; " + missing + " is gone)";
  JobSpec shape;
  shape.model = was.model;
  if (job.model.arch == "auto") fill(job, shape, "model.arch", from);
  for (const ShapeKey& k : make_model_arch(ModelConfig::from_spec(was.model))->shape_keys())
    if (!has_value(job, k.field)) fill(job, shape, k.field, from);
  if (!job.is_set("model.seq_len")) fill(job, shape, "model.seq_len", from);
  if (log)
    TR_LOG_INFO("model.init_from: ", missing, " is gone; the shape comes from ", ck,
                ", which this job resumes (the weights come from it too)");
  return true;  // a disagreement with the checkpoint is the resume's error, as for any job
}

void apply_init_from(JobSpec& job, bool log) {
  const std::string dir = job.model.init_from;
  const std::string path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(path) && apply_resumed_shape(job, path, log)) return;
  const ModelConfig hf_cfg =
      read_hf_model_config(dir, "model.init_from", job.model.arch == "auto" ? "" : job.model.arch);
  JobSpec hf;
  hf.model = hf_cfg.to_spec();
  const std::string from = "'" + path + "'";
  if (job.model.arch == "auto") fill(job, hf, "model.arch", from);

  const std::unique_ptr<ModelArch> arch = make_model_arch(hf_cfg);
  for (const ShapeKey& k : arch->shape_keys()) {
    if (!has_value(job, k.field)) {
      fill(job, hf, k.field, from);
      continue;
    }
    const std::string mine = job_spec_value_text(job, k.field), theirs = job_spec_value_text(hf, k.field);
    if (mine != theirs)
      TR_FAIL("model.init_from: '", path, "' has ", k.hf_key, " = ", theirs, " but ", k.field, " is ", mine, " (",
              origin_of(job, k.field), "); remove ", k.field, " to take the directory's value, or set it to ", theirs,
              " (the job's model.* must describe the weights it starts from)");
  }
  // seq_len is the training context: the spec's when it sets one, never
  // longer than the positions the model has (GPT-2's table has no more
  // rows; Llama's RoPE was not trained past them).
  const int max_t = hf_cfg.T;
  if (job.is_set("model.seq_len")) {
    TR_CHECK(job.model.seq_len <= max_t, "model.init_from: '", path, "' has ", arch->hf_context_key(), " = ", max_t,
             " but model.seq_len is ", job.model.seq_len, " (", origin_of(job, "model.seq_len"),
             "); set model.seq_len to at most ", max_t, " (the model has no positions beyond that)");
    return;
  }
  // Not set: the model's context, as model.preset gives it, not the field's
  // default of 128 (a fine-tune of a Llama at 128 tokens trains silently at
  // 1/64 of the context it was made for). Capped at kInitFromMaxSeqLen,
  // with a line saying so.
  const int t = std::min(max_t, kInitFromMaxSeqLen);
  if (log)
    TR_LOG_INFO("model.seq_len: ", t, " (not set: ", path, "'s ", arch->hf_context_key(), " is ", max_t,
                max_t > kInitFromMaxSeqLen
                    ? ", capped at " + std::to_string(kInitFromMaxSeqLen) +
                          ", the context Llama 3 was pre-trained at and model.preset's; set model.seq_len for "
                          "longer, up to " + std::to_string(max_t)
                    : std::string(""),
                ")");
  job.model.seq_len = t;
  job.origins["model.seq_len"] = {from, kFromResolution};
}

}  // namespace

void resolve_model_shape(JobSpec& job, bool log) {
  if (job.model.preset == "none" && job.model.init_from.empty()) return;  // the spec is the shape, as it always was
  if (job.model.preset != "none") apply_preset(job, log);
  if (!job.model.init_from.empty()) {
    // Absolute from here on: job.resolved.yaml and the checkpoints' job
    // spec carry it, and `export`/`generate` read it later from wherever
    // they are run (a relative path would resolve against their cwd).
    job.model.init_from = fs::absolute(job.model.init_from).lexically_normal().string();
    apply_init_from(job, log);
  }
  validate_job_spec(job);
  // The whole model's rules (the arch's own too), here at job load rather
  // than in every worker. A layout only: no weights are allocated.
  ModelConfig::from_spec(job.model).validate();
}

JobSpec load_resolved_job_spec(const std::string& path, const std::vector<std::string>& overrides, bool log) {
  JobSpec job = load_job_spec(path, overrides);
  resolve_model_shape(job, log);
  return job;
}

}  // namespace trainrun
