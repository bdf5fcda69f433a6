// The job spec: typed sections, each field with a default and a meaning.
// Parsed from YAML (core/config/job_spec.cpp) with --set overrides; the
// field table there is the single source of truth for names, defaults,
// ranges and docs (docs/job-spec.md is checked against it by a test).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainrun {

struct ModelSpec {
  std::string preset = "none";  // a published shape (core/config/model_presets.h) filling the fields not set; none = off
  std::string arch = "auto";   // auto | gpt2 | llama; auto = model.init_from's model_type, else gpt2 (ModelConfig::from_spec)
  int n_layer = 4;             // L, transformer blocks
  int n_head = 4;              // NH, attention heads; n_embd % n_head == 0
  int n_embd = 128;            // C, residual width
  int vocab_size = 256;        // V; 256 = byte-level
  int seq_len = 128;           // T, context length (also the position table size)
  double init_std = 0.02;      // std of the normal init; residual projections get init_std/sqrt(2L)
  std::string init_from;       // Hugging Face directory to start from (its config.json gives the shape); "" = none
  // Llama's shape (GPT-2 has none of these: its kv heads = n_head, MLP = 4C, LayerNorm eps 1e-5).
  int n_kv_head = 0;           // key/value heads (GQA); 0 = n_head; must divide n_head
  int ffn_dim = 0;             // MLP width (llama: intermediate_size, required); 0 = the arch's default
  int head_dim = 0;            // attention head width (llama-shaped); 0 = n_embd / n_head
  double norm_eps = 1e-5;      // RMSNorm epsilon (llama)
  double rope_theta = 500000;  // RoPE base (llama; Llama 3 uses 500000)
  std::string tie_embeddings = "auto";  // auto | true | false; auto: gpt2 tied, llama untied (Llama 3.2 1B/3B: true)
  struct RopeScalingSpec {
    std::string type = "none";  // none | llama3 (Llama 3.1's frequency bands) | longrope (Phi-3's)
    double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
    int original_max_position_embeddings = 8192;
    // longrope: one factor per RoPE frequency (head_dim / 2 each), kept as
    // their text, "1.0,1.05,..." (a YAML list is joined); and the context
    // its attention factor counts (config.json's max_position_embeddings; 0 = seq_len).
    std::string short_factor, long_factor;
    int max_position_embeddings = 0;
  } rope_scaling;
  // Gemma 2's maths (gemma2; a preset or model.init_from's config.json fills them; 0 = off).
  double attn_softcap = 0;     // attention scores -> cap * tanh(scores / cap) (attn_logit_softcapping)
  double final_softcap = 0;    // logits -> cap * tanh(logits / cap) (final_logit_softcapping)
  double query_scale = 0;      // scores scaled by query_scale^-0.5 (query_pre_attn_scalar); 0 = head_dim's
  int sliding_window = 0;      // local attention over this many tokens (gemma2: even layers); 0 = none
  // Mixture of experts (mixtral): every block's MLP a routed set of experts (docs/models.md).
  int n_experts = 0;             // experts per block (num_local_experts); 0 = the arch's (a dense MLP)
  int n_experts_per_tok = 0;     // top-k experts each token reaches; 0 = the arch's
  int moe_ffn_dim = 0;           // each routed expert's MLP width (qwen2_moe: moe_intermediate_size); 0 = ffn_dim
  int shared_expert_ffn_dim = 0; // the shared expert's width (qwen2_moe); 0 = none
  std::string norm_topk_prob = "auto";  // auto | true | false: renormalise the chosen weights; auto = the arch's
  double router_aux_loss_coef = 0.001;  // weight of the load-balancing loss (transformers'); 0 = off
  double router_z_loss_coef = 0;        // weight of the router z-loss (ST-MoE); 0 = off
  std::string moe_balance = "aux_loss";  // aux_loss | bias: aux-loss-free balancing (DeepSeek-V3) on top
  double moe_bias_update_rate = 0.001;   // with moe_balance bias: the bias's step per optimizer step
  // Parameter-efficient fine-tuning (docs/fine-tuning.md): the base frozen, only the adapters train.
  std::string base_dtype = "auto";  // auto | fp32 | bf16 | nf4: how the frozen base is held (auto: fp32 on the CPU)
  struct AdapterSpec {
    std::string type = "none";      // none | lora | dora
    int rank = 8;                   // r, the adapters' inner dimension
    double alpha = 16;              // the update is scaled by alpha / rank (peft's lora_alpha)
    double dropout = 0;             // on the adapter's input (peft's lora_dropout), deterministic per seed
    std::string target_modules = "all-linear";  // HF module names, comma-joined ("q_proj,v_proj"), or all-linear
    std::string init_from;          // a PEFT adapter directory to start from; "" = fresh (A kaiming-uniform, B zero)
    bool on() const { return type != "none"; }
  } adapter;
};

struct SyntheticSpec {
  int vocab = 0;               // tokens in the Markov chain; 0 = model.vocab_size
  int branching = 4;           // successors per state with non-zero probability
  double concentration = 1.0;  // Dirichlet-like spread of the successor weights
  uint64_t seed = 1234;        // seed of the chain (not of training)
};

struct DataSpec {
  std::string format = "llmc";       // llmc | raw_uint16 | raw_uint32 | synthetic
  std::string train;                  // path or glob of training shards (not for synthetic)
  std::string val;                    // path or glob of validation shards; empty = no eval
  SyntheticSpec synthetic;
  std::string document_mask = "false"; // false | true: block-causal attention + positions restarting per document
  int document_separator = -1;        // the token id that starts a document; -1 = prepare.json's document_start_id
  bool document_mask_on() const { return document_mask == "true"; }
};

struct TrainSpec {
  int64_t global_batch_tokens = 0;   // tokens per optimizer step; 0 = use global_batch_size
  int global_batch_size = 8;         // sequences per optimizer step (if global_batch_tokens == 0)
  int micro_batch_size = 8;          // sequences per forward/backward per rank
  int max_steps = 100;
  int exit_interval = 0;
  int max_skipped_steps = 10;         // updates skipped for a non-finite loss/grad norm before the job stops              // stop (with a checkpoint) after this many steps of this invocation; 0 = off
  double lr = 1e-3;                   // peak learning rate
  double min_lr = 1e-4;               // floor of the decay
  int warmup_steps = 10;
  std::string schedule = "cosine";    // cosine | linear | constant
  double weight_decay = 0.1;          // AdamW decoupled decay (not on biases / LayerNorm)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;             // global L2 norm clip; 0 = off
  uint64_t seed = 42;                 // init + sampling seed
  int eval_interval = 50;             // steps between evals; 0 = only at the end
  int eval_steps = 4;                 // batches per eval
  int log_interval = 10;              // steps between log lines / metrics.jsonl records
  std::string activation_checkpointing = "none";  // none | blocks
  // Preference tuning (core/train/preference.h): sft = next-token loss on
  // the data's targets; dpo | ipo | orpo on pairs from prepare --format preference.
  std::string objective = "sft";      // sft | dpo | ipo | orpo
  double dpo_beta = 0.1;              // beta of dpo / ipo, lambda of orpo (TRL's beta)
  double dpo_label_smoothing = 0;     // dpo: eps of conservative DPO, in [0, 0.5)
  std::string reference = "precompute";  // precompute | adapter_off: the reference log-probs (dpo, ipo)

  // Sequences per optimizer step. Validation resolves global_batch_tokens
  // into global_batch_size (= global_batch_tokens / model.seq_len) because
  // this section does not know seq_len, so after validation this simply
  // returns global_batch_size. Divisibility by micro_batch_size * world size
  // is checked at launch, where the world size is known.
  int derived_global_batch_size() const;
};

struct OutputSpec {
  std::string dir = "runs/default";   // run directory: metrics.jsonl, job.resolved.yaml, model.safetensors
  int sample_tokens = 200;             // tokens sampled at the end of the run (0 = none)
  std::string sample_prompt = "\n";
  std::string trace_steps;             // steps whose timeline is written to <dir>/trace.json: "2,10"; "" = none
};

struct ParallelSpec {
  int nproc_per_node = 0;              // 0 = one per usable GPU (resolve_nproc_per_node), 1 without / backend cpu
  std::string sharding = "full_shard"; // no_shard | shard_grad_op | full_shard | hybrid_shard
  int shard_group_size = 0;            // hybrid_shard group size; 0 = ranks per node
  std::string offload = "none";        // none | cpu | nvme: where master weights, moments and grad shard live
  std::string offload_dir;             // nvme: directory for the state files (required with nvme)
  double timeout_s = 300;              // every collective / rendezvous wait
  std::string topology_file;           // saved topology description (trainrun topo --save); empty = detect
  std::string cpu_affinity = "auto";   // auto | none: bind workers to cores near their GPU / spread over NUMA
  int tensor_parallel = 1;             // ranks per tensor-parallel group (tp, innermost in the mesh); 1 = off
  std::string sequence_parallel = "false";  // "true": split activations along the sequence between the TP linears
  int pipeline_parallel = 1;           // pipeline stages (pp, outermost in the mesh); 1 = off
  int context_parallel = 1;            // ranks a sequence is split over (cp, between dp_shard and tp); 1 = off
  std::string cp_mode = "ring";        // ring | all_to_all: how attention crosses the cp ranks
  int expert_parallel = 1;             // ranks a mixture of experts' experts are split over (ep, inside dp); 1 = off
  int pipeline_virtual_stages = 1;     // model chunks per pipeline rank (interleaved_1f1b); 1 otherwise
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b | interleaved_1f1b | zero_bubble (refused for now)
  std::string pipeline_layers;         // "" = even split; else layers per virtual stage, "3,1" (YAML list or text)
  std::string pipeline_reshard = "auto";  // auto | true | false: a stage re-gathers its units per microbatch
  bool sequence_parallel_on() const { return sequence_parallel == "true"; }
  bool pipeline_reshard_on() const { return pipeline_reshard_resolved(pipeline_reshard, sharding); }
  // auto: true where the strategy shards parameters (full_shard,
  // hybrid_shard): a pipeline stage then holds a unit gathered only while it
  // computes and reduce-scatters its gradient per microbatch, the memory the
  // user chose FSDP for; holding a stage's units and fp32 gradients whole for
  // the step (false) is twice a 70B tp2 x pp2 stage's state on an H200.
  // no_shard / shard_grad_op replicate parameters anyway: false.
  static bool pipeline_reshard_resolved(const std::string& setting, const std::string& strategy) {
    if (setting == "auto") return strategy == "full_shard" || strategy == "hybrid_shard";
    return setting == "true";
  }
};

struct LauncherSpec {
  int max_restarts = 0;                // restart all workers this many times after a failure
  double grace_period_s = 10;          // after a signal or a failure, wait this long before SIGKILL
  int log_tail_lines = 20;             // lines of the failed rank's log in the failure report
  std::string master_addr = "127.0.0.1";  // address the node-0 store binds and workers dial
  int master_port = 0;                 // 0 = pick a free port
  int nnodes = 0;                      // nodes, one agent each; 0 = from Slurm (SLURM_NNODES), else 1
};

struct CheckpointSpec {
  int interval = 0;                    // steps between checkpoints; 0 = only the final one
  int keep_last = 3;                   // newest checkpoints kept (0 = keep all)
  int keep_every = 0;                  // also keep every step divisible by this forever; 0 = none
  std::string async = "false";         // "true": write in a background thread (the state read in pieces)
  std::string on_error = "stop";       // a failed write: stop | continue (training goes on)
  std::string resume = "auto";         // auto (latest verified in output.dir) | never | a checkpoint path
  std::string final = "true";          // write a checkpoint at the end of the run
};

// Where a field's value came from: the file ("job.yaml:3:12"), an override
// ("--set model.n_layer=2"), or the model resolution that filled it
// (resolve_model_shape: "model.preset llama3.1-8b", "'DIR/config.json'").
struct SpecOrigin {
  std::string where;
  int rank = 0;  // precedence: 0 = filled by resolution, 1 = file, 2 = --set
};

struct JobSpec {
  ModelSpec model;
  DataSpec data;
  TrainSpec train;
  OutputSpec output;
  ParallelSpec parallel;
  LauncherSpec launcher;
  CheckpointSpec checkpoint;
  std::string backend = "auto";        // auto | cpu | cuda
  std::string source = "<defaults>";   // where it came from (file path), for messages
  // Dotted keys that were set (fields, and sections that were opened),
  // with where: a key absent here has its default. The model resolution
  // (core/model/model_spec.h) reads it to tell "set" from "default", and
  // validate_job_spec() to name the place a rule is about.
  std::map<std::string, SpecOrigin> origins;
  bool is_set(const std::string& key) const { return origins.count(key) != 0; }
};

// Load a job spec from a YAML file, apply "--set a.b=value" overrides, fill
// defaults and validate every field and cross-field rule. Throws
// trainrun::Error naming the dotted key and file:line:column.
JobSpec load_job_spec(const std::string& path, const std::vector<std::string>& overrides = {});
// Same, from YAML text (for tests); `name` is used in messages instead of a path.
JobSpec parse_job_spec(const std::string& yaml_text, const std::string& name,
                       const std::vector<std::string>& overrides = {});
// The fully resolved spec as YAML (every field, defaults filled in, each
// with its doc as a trailing comment); parse_job_spec() reads it back to the
// same spec.
std::string job_spec_to_yaml(const JobSpec& spec);

// Range and cross-field checks for a spec built in code (parse_job_spec and
// load_job_spec already run them, except, while model.preset or
// model.init_from has not filled the shape in, the rules that read the
// model's shape: resolve_model_shape() runs this once it has; this judges
// the fields as they are). Resolves
// train.global_batch_size from train.global_batch_tokens. Messages name
// spec.origins' places, else spec.source.
void validate_job_spec(JobSpec& spec);

// A field's value as job_spec_to_yaml() writes it ("32", "1e-05", "llama",
// "\"dir\"" for a path), and a copy of one field between specs; both
// throw for a key that is not a field.
std::string job_spec_value_text(const JobSpec& spec, const std::string& key);
void job_spec_copy_field(const JobSpec& from, JobSpec& to, const std::string& key);

// One row of the field table, rendered as text (for docs, --help, tests).
struct JobSpecField {
  std::string key;            // dotted, e.g. "train.lr"
  std::string type;           // int | int64 | uint64 | float | string | enum
  std::string default_value;  // as it is written in YAML
  std::string allowed;        // e.g. ">= 1", "[0, 1)", "llmc | synthetic", "any"
  std::string doc;            // one line, with units
};
std::vector<JobSpecField> job_spec_fields();
// The field table as markdown (one table per section); docs/job-spec.md
// embeds it verbatim and a test keeps the two equal.
std::string job_spec_reference_markdown();

}  // namespace trainrun
