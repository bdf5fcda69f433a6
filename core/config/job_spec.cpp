// The job spec: one field table drives parsing, validation, YAML output and
// the markdown reference, so a field added here is parsed, checked, written
// to job.resolved.yaml and documented without touching anything else.
//
// Defaults live in the struct initialisers of job_spec.h (other code builds
// JobSpec{} directly); the table reads them from a default-constructed
// JobSpec instead of repeating them, so the two cannot disagree.
//
// Every message has the shape
//   <where>: <dotted.key>: <problem>; <what to do>
// where <where> is "file:line:col" (1-based, from the YAML node) or
// "--set key=value" for an override.
#include "core/config/job_spec.h"

#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <type_traits>
#include <variant>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/common/trace.h"
#include "core/config/model_presets.h"
#include "parallel/pipeline/schedule.h"

namespace trainrun {

int TrainSpec::derived_global_batch_size() const { return global_batch_size; }

namespace {

// ---- the field table -------------------------------------------------------

// A pointer to the field's storage; the alternative is the field's type, so
// the table cannot pair a key with a member of the wrong type.
using Ref = std::variant<int*, int64_t*, uint64_t*, double*, std::string*>;

struct Bound {
  double value;
  bool open;  // strict inequality
};

struct Rule {
  std::optional<Bound> lo, hi;
  std::vector<std::string> choices;  // non-empty = enum
  bool non_empty = false;
  // An enum value outside choices that this explains better than "unknown
  // value" (model.preset: a name more than one release fits); "" = no.
  std::string (*explain_unknown)(const std::string&) = nullptr;
};

Rule any() { return {}; }
Rule at_least(double v) { Rule r; r.lo = Bound{v, false}; return r; }
Rule above(double v) { Rule r; r.lo = Bound{v, true}; return r; }
Rule in_half_open(double lo, double hi) {  // [lo, hi)
  Rule r;
  r.lo = Bound{lo, false};
  r.hi = Bound{hi, true};
  return r;
}
Rule in_range_int(double lo, double hi) {  // [lo, hi]
  Rule r;
  r.lo = Bound{lo, false};
  r.hi = Bound{hi, false};
  return r;
}
Rule one_of(std::vector<std::string> c) { Rule r; r.choices = std::move(c); return r; }
Rule non_empty() { Rule r; r.non_empty = true; return r; }

struct Field {
  const char* key;  // dotted path, the same text as the member path
  Ref (*get)(JobSpec&);
  Rule rule;
  const char* doc;

  bool is_enum() const { return !rule.choices.empty(); }
  std::string section() const {
    std::string k = key;
    auto dot = k.rfind('.');
    return dot == std::string::npos ? "" : k.substr(0, dot);
  }
  std::string leaf() const {
    std::string k = key;
    auto dot = k.rfind('.');
    return dot == std::string::npos ? k : k.substr(dot + 1);
  }
};

// The key string is the stringised member path, so key and storage cannot drift.
#define TR_SPEC_FIELD(path, rule, doc) \
  Field { #path, [](JobSpec& s) -> Ref { return &s.path; }, rule, doc }

Rule one_of_presets() {
  Rule r = one_of({"none"});
  for (const std::string& n : model_preset_names()) r.choices.push_back(n);
  r.explain_unknown = ambiguous_preset_message;
  return r;
}

// Order here is the order of job_spec_to_yaml() and of the docs. Fields of
// one section are contiguous; a subsection follows its parent's fields.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      TR_SPEC_FIELD(backend, one_of({"auto", "cpu", "cuda"}),
                    "compute backend; auto = cuda when a GPU is visible, else cpu"),

      TR_SPEC_FIELD(model.preset, one_of_presets(),
                    "a published model's shape (the table in docs/job-spec.md): fills model.arch and every shape "
                    "field this spec does not set (an explicit one wins, with a log line), seq_len with the "
                    "model's original context (Llama 3.x 8192, Llama 2 4096, GPT-2 1024); with model.init_from "
                    "both must describe the same model; none = off"),
      TR_SPEC_FIELD(model.arch, one_of({"auto", "gpt2", "llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "mixtral",
                                        "qwen2_moe", "qwen3_moe"}),
                    "model family; auto = the model_type of model.init_from's config.json, else gpt2; "
                    "llama = Llama 3 (RMSNorm, RoPE, SwiGLU, grouped-query attention; its shape in the fields below); "
                    "qwen2 = Qwen2/Qwen2.5 (Llama's shape with q/k/v biases); "
                    "qwen3 = Qwen3 (Llama's fields, heads model.head_dim wide, per-head RMSNorm on q and k); "
                    "phi3 = Phi-3 (Llama's maths; fused qkv_proj and gate_up_proj in its Hugging Face files); "
                    "mistral = Mistral (Llama's shape with a sliding window, model.sliding_window); "
                    "gemma2 = Gemma 2 (Llama's fields, RMSNorm x*(1+w), norms after attention and MLP too, GeGLU, "
                    "embeddings x sqrt(n_embd), soft-capped scores and logits, local attention on even layers, tied); "
                    "mixtral = Mixtral (Llama's attention, every MLP model.n_experts experts of model.ffn_dim, "
                    "model.n_experts_per_tok per token); qwen2_moe = Qwen1.5-MoE / Qwen2-MoE (Qwen2's attention, "
                    "experts of model.moe_ffn_dim without renormalisation, a shared expert of "
                    "model.shared_expert_ffn_dim behind a sigmoid gate); qwen3_moe = Qwen3-MoE (Qwen3's attention, experts of "
                    "model.moe_ffn_dim, no shared expert)"),
      TR_SPEC_FIELD(model.n_layer, at_least(1), "transformer blocks (L)"),
      TR_SPEC_FIELD(model.n_head, at_least(1), "attention heads (NH); must divide n_embd"),
      TR_SPEC_FIELD(model.n_embd, at_least(1), "residual stream width in channels (C)"),
      TR_SPEC_FIELD(model.vocab_size, at_least(1), "vocabulary size in tokens (V); 256 = byte-level"),
      TR_SPEC_FIELD(model.seq_len, at_least(1),
                    "context length in tokens (T) of training; also the size of the position table; with "
                    "model.init_from at most its max_position_embeddings (gpt2: n_positions), and when not set "
                    "that, capped at 8192 (logged)"),
      TR_SPEC_FIELD(model.init_std, above(0),
                    "std of the normal weight init; residual projections get init_std/sqrt(2*n_layer)"),
      TR_SPEC_FIELD(model.init_from, any(),
                    "Hugging Face directory (config.json + model.safetensors or sharded safetensors, e.g. from "
                    "save_pretrained or trainrun export) whose weights replace the random init, to fine-tune; its "
                    "config.json gives model.arch (auto) and every shape field this spec does not set, and one "
                    "set to another value is an error naming both (seq_len, when not set: its max_position_embeddings, "
                    "capped at 8192); a resumed checkpoint takes precedence; empty = none"),
      TR_SPEC_FIELD(model.n_kv_head, at_least(0),
                    "key/value heads for grouped-query attention (llama); 0 = n_head; must divide n_head"),
      TR_SPEC_FIELD(model.ffn_dim, at_least(0),
                    "MLP width (llama: config.json's intermediate_size, required); 0 = the architecture's default "
                    "(gpt2: 4 * n_embd)"),
      TR_SPEC_FIELD(model.head_dim, at_least(0),
                    "width of each attention head (llama-shaped archs; config.json's head_dim): q_proj is "
                    "(n_head * head_dim, n_embd), k/v_proj (n_kv_head * head_dim, n_embd), o_proj (n_embd, "
                    "n_head * head_dim); 0 = n_embd / n_head"),
      TR_SPEC_FIELD(model.norm_eps, above(0), "RMSNorm epsilon (llama; gpt2's LayerNorm uses 1e-5)"),
      TR_SPEC_FIELD(model.rope_theta, above(0), "RoPE base frequency (llama; Llama 3: 500000)"),
      TR_SPEC_FIELD(model.sliding_window, at_least(0),
                    "sliding-window attention (mistral and phi3: every layer; gemma2: the even ones; config.json's "
                    "sliding_window): query t sees the keys t - sliding_window < j <= t, and generate's KV cache "
                    "holds sliding_window positions; 0 = none (full causal attention)"),
      TR_SPEC_FIELD(model.tie_embeddings, one_of({"auto", "false", "true"}),
                    "the LM head is the token embedding; auto = the architecture's way (gpt2: always tied; "
                    "llama: untied, but Llama 3.2 1B/3B are tied)"),
      TR_SPEC_FIELD(model.attn_softcap, at_least(0),
                    "gemma2: attention scores -> cap * tanh(scores / cap) (config.json's attn_logit_softcapping; "
                    "Gemma 2: 50); 0 = off; other archs: 0"),
      TR_SPEC_FIELD(model.final_softcap, at_least(0),
                    "gemma2: logits -> cap * tanh(logits / cap), the loss's gradient through it (config.json's "
                    "final_logit_softcapping; Gemma 2: 30); 0 = off; other archs: 0"),
      TR_SPEC_FIELD(model.query_scale, at_least(0),
                    "gemma2: attention scores are scaled by query_scale^-0.5 (config.json's query_pre_attn_scalar; "
                    "Gemma 2 2B/9B: 256 = head_dim, 27B: 144); 0 = head_dim's; other archs: 0"),
      TR_SPEC_FIELD(model.base_dtype, one_of({"auto", "fp32", "bf16", "nf4"}),
                    "with model.adapter: how the frozen base weights are held (docs/fine-tuning.md, \"NF4 storage\"); "
                    "auto = the backend's activation dtype (fp32 on the CPU, bf16 on CUDA); fp32 needs the CPU "
                    "backend; bf16 = every base weight rounded to bf16 (round to nearest even; the CPU computes with "
                    "those values in fp32); nf4 = QLoRA: every block linear's weight quantized as bitsandbytes' "
                    "quantize_4bit(blocksize=64, compress_statistics=True, nf4) does on the whole (out, in) tensor "
                    "(~0.52 bytes per weight, sharded like any frozen parameter and dequantized per unit before its "
                    "GEMMs), embeddings, norms, biases and the LM head in fp32; bf16 and nf4 need model.adapter; nf4 with "
                    "parallel.tensor_parallel > 1 needs each rank's slice of every block linear weight to be whole "
                    "64-element blocks of it (true of real models; setup names the tensor otherwise)"),
      TR_SPEC_FIELD(model.rope_scaling.type, one_of({"none", "llama3", "longrope"}),
                    "RoPE frequency scaling (llama-shaped): none, llama3 (Llama 3.1's bands), or longrope (phi3: "
                    "Phi-3's per-frequency short/long factors; config.json's rope_scaling type longrope or su)"),
      TR_SPEC_FIELD(model.rope_scaling.factor, above(0), "llama3 scaling: factor"),
      TR_SPEC_FIELD(model.rope_scaling.low_freq_factor, above(0), "llama3 scaling: low_freq_factor"),
      TR_SPEC_FIELD(model.rope_scaling.high_freq_factor, above(0), "llama3 scaling: high_freq_factor"),
      TR_SPEC_FIELD(model.rope_scaling.original_max_position_embeddings, at_least(1),
                    "llama3 and longrope scaling: the context the model was trained at before scaling (longrope: "
                    "config.json's top-level original_max_position_embeddings; a seq_len past it takes the long "
                    "factors)"),
      TR_SPEC_FIELD(model.rope_scaling.short_factor, any(),
                    "longrope scaling: the factors dividing each RoPE frequency up to "
                    "original_max_position_embeddings, head_dim / 2 positive numbers (a YAML list or \"1,1.5,...\"); "
                    "model.init_from fills it from config.json"),
      TR_SPEC_FIELD(model.rope_scaling.long_factor, any(),
                    "longrope scaling: the factors used when seq_len passes original_max_position_embeddings, "
                    "head_dim / 2 positive numbers (as short_factor)"),
      TR_SPEC_FIELD(model.rope_scaling.max_position_embeddings, at_least(0),
                    "longrope scaling: the context the attention factor sqrt(1 + ln(s) / ln(original)) counts, s = "
                    "this / original_max_position_embeddings (config.json's max_position_embeddings); 0 = seq_len"),
      TR_SPEC_FIELD(model.n_experts, at_least(0),
                    "mixture of experts (mixtral): experts per block (config.json's num_local_experts); 0 = none "
                    "(the dense MLP of the other families)"),
      TR_SPEC_FIELD(model.n_experts_per_tok, at_least(0),
                    "mixture of experts: the experts each token is routed to (top-k, num_experts_per_tok); dropless: "
                    "every token reaches them, whatever the load"),
      TR_SPEC_FIELD(model.moe_ffn_dim, at_least(0),
                    "mixture of experts: each routed expert's MLP width (qwen2_moe: moe_intermediate_size); 0 = "
                    "model.ffn_dim (mixtral's experts are intermediate_size wide)"),
      TR_SPEC_FIELD(model.shared_expert_ffn_dim, at_least(0),
                    "mixture of experts: the width of the shared expert every token also passes through, scaled "
                    "by sigmoid(shared_expert_gate) (qwen2_moe: shared_expert_intermediate_size); 0 = none"),
      TR_SPEC_FIELD(model.norm_topk_prob, one_of({"auto", "true", "false"}),
                    "mixture of experts: the chosen experts' softmax weights renormalised to sum 1; auto = the "
                    "arch's (mixtral true, qwen2_moe / qwen3_moe config.json's norm_topk_prob, false by default)"),
      TR_SPEC_FIELD(model.router_aux_loss_coef, at_least(0),
                    "mixture of experts: weight of the load-balancing loss added to each micro-batch's loss, as "
                    "transformers' load_balancing_loss_func with output_router_logits (E * sum_e f_e P_e over every "
                    "layer's router); 0 = off"),
      TR_SPEC_FIELD(model.router_z_loss_coef, at_least(0),
                    "mixture of experts: weight of the router z-loss (mean over layers and tokens of "
                    "logsumexp(router logits)^2, ST-MoE); 0 = off"),
      TR_SPEC_FIELD(model.moe_balance, one_of({"aux_loss", "bias"}),
                    "mixture of experts: how the load is balanced; aux_loss = only by the losses above; bias = "
                    "also aux-loss-free balancing (DeepSeek-V3): a per-layer, per-expert bias added to the router "
                    "probabilities for the top-k choice only (the gate weights stay the probabilities), after "
                    "every optimizer step b_e += model.moe_bias_update_rate * sign(mean load - load_e) from the "
                    "step's load over all micro-batches and data-parallel ranks; the bias is in the checkpoint "
                    "(training state, not a weight: export and generate route without it); CPU backend (with "
                    "pipeline parallelism each stage counts its layers' load); set model.router_aux_loss_coef: 0 "
                    "for DeepSeek-V3's recipe"),
      TR_SPEC_FIELD(model.moe_bias_update_rate, above(0),
                    "mixture of experts with model.moe_balance: bias: the bias's step per optimizer step "
                    "(DeepSeek-V3: 0.001)"),

      TR_SPEC_FIELD(model.adapter.type, one_of({"none", "lora", "dora"}),
                    "parameter-efficient fine-tuning (docs/fine-tuning.md): lora = frozen base + trainable "
                    "low-rank A (rank x in) and B (out x rank) on each target linear, y = W x + (alpha/rank) B A "
                    "dropout(x); only A and B get gradients and optimizer state, and the run writes them to "
                    "output.dir/adapter in peft's format (checkpoints hold the adapters + their AdamW state and a PEFT "
                    "copy, and resume on model.init_from); every sharding strategy, tensor or pipeline parallelism (not "
                    "both yet) and offload (docs/fine-tuning.md); dora = lora plus a trainable magnitude per output row (peft's use_dora: "
                    "W' = m (W + (alpha/rank) B A) / ||W + (alpha/rank) B A||_row, the norm held constant); "
                    "none = train every weight"),
      TR_SPEC_FIELD(model.adapter.rank, at_least(1), "LoRA rank r (peft's r)"),
      TR_SPEC_FIELD(model.adapter.alpha, above(0), "LoRA alpha: the update is scaled by alpha / rank (peft's lora_alpha)"),
      TR_SPEC_FIELD(model.adapter.dropout, in_half_open(0, 1),
                    "dropout on each adapter's input (peft's lora_dropout); the mask is a function of train.seed, "
                    "the step and the global token position, so any rank layout draws the same one"),
      TR_SPEC_FIELD(model.adapter.target_modules, non_empty(),
                    "the linears to adapt, by their Hugging Face module names (a YAML list, or 'q_proj,v_proj'); "
                    "llama: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; gpt2: c_attn c_proj c_fc; "
                    "all-linear = every linear of the blocks (not the LM head, as peft)"),
      TR_SPEC_FIELD(model.adapter.init_from, any(),
                    "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, from peft's "
                    "save_pretrained or a trainrun run's adapter/) to continue from; its r, lora_alpha and "
                    "target_modules must equal model.adapter's; empty = a fresh adapter (A kaiming-uniform as "
                    "peft, B zero)"),

      TR_SPEC_FIELD(data.format, one_of({"llmc", "raw_uint16", "raw_uint32", "synthetic"}),
                    "layout of the token files; synthetic = a generated Markov chain, no files"),
      TR_SPEC_FIELD(data.train, any(), "training shards, a path or glob; required unless format is synthetic"),
      TR_SPEC_FIELD(data.val, any(), "validation shards, a path or glob; empty = no evaluation"),
      TR_SPEC_FIELD(data.document_mask, one_of({"false", "true"}),
                    "pack documents without letting them see each other: true = block-causal attention (a token "
                    "attends only to earlier tokens of its own document) and positions (gpt2's wpe, llama's RoPE) "
                    "restarting at 0 at each document; a document starts at each data.document_separator token "
                    "(which belongs to the document it starts) and at each sequence start (docs/data-format.md)"),
      TR_SPEC_FIELD(data.document_separator, at_least(-1),
                    "with data.document_mask: the token id that starts each document (prepare writes the "
                    "tokenizer's BOS, e.g. Llama 3's 128000, or GPT-2's <|endoftext|> 50256, before every "
                    "document); -1 = the document_start_id of the prepare.json beside data.train (an error when "
                    "there is none, e.g. synthetic or raw data); must be below model.vocab_size"),
      TR_SPEC_FIELD(data.synthetic.vocab, at_least(0), "tokens in the Markov chain; 0 = model.vocab_size"),
      TR_SPEC_FIELD(data.synthetic.branching, at_least(1), "successors per state with non-zero probability"),
      TR_SPEC_FIELD(data.synthetic.concentration, above(0),
                    "spread of the successor weights (Dirichlet-like); smaller = peakier, lower entropy"),
      TR_SPEC_FIELD(data.synthetic.seed, any(), "seed of the chain (not of training)"),

      TR_SPEC_FIELD(train.global_batch_tokens, at_least(0),
                    "tokens per optimizer step over all ranks; 0 = use global_batch_size; a multiple of model.seq_len"),
      TR_SPEC_FIELD(train.global_batch_size, at_least(1),
                    "sequences per optimizer step over all ranks; derived when global_batch_tokens > 0"),
      TR_SPEC_FIELD(train.micro_batch_size, at_least(1),
                    "sequences per forward/backward on one rank; accumulation makes up the rest"),
      TR_SPEC_FIELD(train.max_steps, at_least(1), "optimizer steps in the run"),
      TR_SPEC_FIELD(train.exit_interval, at_least(0),
                    "stop after this many steps of this invocation, with a checkpoint (the schedule still "
                    "follows max_steps; resume continues); 0 = run to max_steps"),
      TR_SPEC_FIELD(train.max_skipped_steps, at_least(0),
                    "steps whose update is skipped for a non-finite loss or gradient norm before the job stops"),
      TR_SPEC_FIELD(train.lr, above(0), "peak learning rate, reached at the end of warmup"),
      TR_SPEC_FIELD(train.min_lr, at_least(0), "learning-rate floor at the end of the decay (unused by constant)"),
      TR_SPEC_FIELD(train.warmup_steps, at_least(0),
                    "steps of linear warmup from 0 to lr; more than max_steps warms up over all max_steps (a warning)"),
      TR_SPEC_FIELD(train.schedule, one_of({"cosine", "linear", "constant"}),
                    "learning-rate decay after warmup, from lr to min_lr at max_steps"),
      TR_SPEC_FIELD(train.weight_decay, at_least(0), "AdamW decoupled weight decay (not on biases or LayerNorm)"),
      TR_SPEC_FIELD(train.beta1, in_half_open(0, 1), "AdamW first-moment decay"),
      TR_SPEC_FIELD(train.beta2, in_half_open(0, 1), "AdamW second-moment decay"),
      TR_SPEC_FIELD(train.eps, above(0), "AdamW denominator epsilon"),
      TR_SPEC_FIELD(train.grad_clip, at_least(0), "clip the global L2 gradient norm to this; 0 = off"),
      TR_SPEC_FIELD(train.seed, any(), "seed of weight init and sampling"),
      TR_SPEC_FIELD(train.eval_interval, at_least(0), "steps between evaluations; 0 = only at the end"),
      TR_SPEC_FIELD(train.eval_steps, at_least(1), "validation batches per evaluation"),
      TR_SPEC_FIELD(train.log_interval, at_least(1), "steps between log lines and metrics.jsonl records"),
      TR_SPEC_FIELD(train.activation_checkpointing, one_of({"none", "blocks"}),
                    "recompute activations in backward: none, or per transformer block"),
      TR_SPEC_FIELD(train.objective, one_of({"sft", "dpo", "ipo", "orpo"}),
                    "what the loss is: sft = next-token cross-entropy on the data's targets; dpo / ipo / orpo = "
                    "preference tuning on chosen/rejected pairs from `trainrun prepare --format preference` "
                    "(docs/fine-tuning.md#preference-tuning-dpo-ipo-orpo)"),
      TR_SPEC_FIELD(train.dpo_beta, above(0),
                    "dpo / ipo: beta, the strength of the tie to the reference (TRL's beta); orpo: lambda, the "
                    "weight of the odds-ratio term"),
      TR_SPEC_FIELD(train.dpo_label_smoothing, in_half_open(0, 0.5),
                    "dpo: the share eps of labels assumed flipped (conservative DPO, TRL's label_smoothing); 0 = "
                    "plain DPO"),
      TR_SPEC_FIELD(train.reference, one_of({"precompute", "adapter_off"}),
                    "dpo / ipo: where the reference log-probs come from: precompute = one forward pass over the "
                    "pairs with the starting weights before step 1, kept in a sidecar beside the data; adapter_off "
                    "= with model.adapter, the same network with its adapters switched off, each micro-batch (no "
                    "second copy of the weights); orpo uses none"),

      TR_SPEC_FIELD(output.dir, non_empty(),
                    "run directory: metrics.jsonl, job.resolved.yaml, checkpoints, model.safetensors"),
      TR_SPEC_FIELD(output.sample_tokens, at_least(0), "tokens sampled at the end of the run; 0 = none"),
      TR_SPEC_FIELD(output.sample_prompt, any(), "text the end-of-run sample starts from: through the tokenizer the prepare.json beside data.train names (the sample is printed as text), else as bytes for vocab 256, else whitespace-separated token ids"),
      TR_SPEC_FIELD(output.trace_steps, any(),
                    "steps whose timeline (forward, backward, send, recv, optimizer and collective spans of every "
                    "rank) is written to <output.dir>/trace.json in the Chrome trace-event format (Perfetto, "
                    "chrome://tracing), e.g. [2, 10]; empty = none"),

      TR_SPEC_FIELD(parallel.nproc_per_node, at_least(0),
                    "worker processes per node; 0 = one per GPU this process may use (the topology's GPUs narrowed by "
                    "CUDA_VISIBLE_DEVICES), or 1 without GPUs or with backend cpu"),
      TR_SPEC_FIELD(parallel.sharding, one_of({"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}),
                    "how parameters, gradients and optimizer state are split: DDP, ZeRO-2, FSDP, HSDP"),
      TR_SPEC_FIELD(parallel.shard_group_size, at_least(0),
                    "ranks per shard group for hybrid_shard; 0 = ranks per node"),
      TR_SPEC_FIELD(parallel.offload, one_of({"none", "cpu", "nvme"}),
                    "where each rank's fp32 master weights, AdamW moments and fp32 gradient shard live (16 bytes "
                    "per parameter of its shard): none = on the device; cpu = host memory (pinned on GPUs), the "
                    "update on host threads (vectorised host AdamW, bit-identical to the device's on the CPU "
                    "backend); nvme = all four in one file per rank under offload_dir (streamed through a fixed 40 MiB of "
                    "host buffers per rank, O_DIRECT where possible, io_uring when built in; unlinked once open). "
                    "Works with every strategy and with parallel.tensor_parallel"),
      TR_SPEC_FIELD(parallel.offload_dir, any(),
                    "directory for parallel.offload: nvme's state files (required with nvme; must be writable)"),
      TR_SPEC_FIELD(parallel.timeout_s, above(0),
                    "seconds a collective or rendezvous wait may take before the job stops"),
      TR_SPEC_FIELD(parallel.topology_file, any(),
                    "node topology to use instead of detecting it (a file from `trainrun topo --save`); empty = detect"),
      TR_SPEC_FIELD(parallel.cpu_affinity, one_of({"auto", "none"}),
                    "auto: bind each worker to cores of its GPU's NUMA node (CPU backend: spread over NUMA nodes); none: leave it to the OS"),

      TR_SPEC_FIELD(parallel.tensor_parallel, at_least(1),
                    "ranks per tensor-parallel group (Megatron-style column/row-parallel linears, vocab-parallel "
                    "embedding and cross-entropy), consecutive ranks of one node; must divide the world size "
                    "together with pipeline_parallel; data parallelism (parallel.sharding) runs over the rest; 1 = off"),
      TR_SPEC_FIELD(parallel.sequence_parallel, one_of({"false", "true"}),
                    "true: split activations along the sequence between the tensor-parallel linears (needs "
                    "tensor_parallel > 1; with 1 it is ignored, with a warning)"),
      TR_SPEC_FIELD(parallel.context_parallel, at_least(1),
                    "ranks one sequence is split over (cp, a mesh dimension between dp_shard and tp): rank i "
                    "of N holds chunks i and 2N-1-i of the 2N equal chunks of model.seq_len (so causal work is "
                    "even), which must be a multiple of 2N; the world size must be a multiple of "
                    "tensor_parallel x pipeline_parallel x context_parallel; 1 = off. Every op but attention "
                    "runs on the rank's rows; parameters are sharded and gradients reduced over dp x cp (adapters' "
                    "too); sliding windows, soft-caps and query scales apply; not with model.adapter.dropout > 0, "
                    "a mixture of experts or a preference objective (refused)"),
      TR_SPEC_FIELD(parallel.cp_mode, one_of({"ring", "all_to_all"}),
                    "how attention crosses the context-parallel ranks: ring = each rank keeps its queries and "
                    "K/V blocks travel around the ring (online-softmax partials merged in a fixed order); "
                    "all_to_all = Ulysses, heads exchanged for sequence (needs model.n_head divisible by "
                    "context_parallel x tensor_parallel; key/value heads are replicated when fewer)"),
      TR_SPEC_FIELD(parallel.expert_parallel, at_least(1),
                    "ranks a mixture of experts' expert compute is split over (ep, inside the data-parallel "
                    "group: consecutive dp ranks, so the token all-to-all stays inside a node): rank i of E runs "
                    "experts [i*n/E, (i+1)*n/E) of every layer for the tokens of all E ranks (all_to_all_v "
                    "dispatch and combine) and holds only those experts' weights, gradients and optimizer state, "
                    "sharded over the dp ranks with its ep index, the dense rest sharded over the whole dp group "
                    "(hybrid_shard: inside each shard group, which ep must divide, else every rank holds every "
                    "expert); must divide model.n_experts and the "
                    "data-parallel size; needs a mixture of experts; composes with tensor_parallel and "
                    "pipeline_parallel (each TP rank's and stage's dp group has its own ep groups); not yet with "
                    "context or sequence parallelism or adapters (refused); 1 = off"),
      TR_SPEC_FIELD(parallel.pipeline_parallel, at_least(1),
                    "pipeline stages (pp, the outermost mesh dimension): the layers split over this many ranks, the "
                    "embedding on the first and the final norm and LM head on the last; microbatches are the "
                    "step's gradient-accumulation count (global_batch_size / (micro_batch_size x data-parallel "
                    "size)) and must be >= the stages; 1 = off"),
      TR_SPEC_FIELD(parallel.pipeline_virtual_stages, at_least(1),
                    "model chunks per pipeline rank (v): interleaved_1f1b only (needs microbatches >= "
                    "pipeline_parallel x v and a multiple of pipeline_parallel); 1 for every other schedule"),
      TR_SPEC_FIELD(parallel.pipeline_schedule, one_of({"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}),
                    "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward one "
                    "backward; bubble (p-1)/m), interleaved_1f1b (v chunks per rank; bubble (p-1)/(v m)), "
                    "zero_bubble (ZB-H1: the backward split into an input-gradient step and a weight-gradient step that "
                    "rank r defers r times; bubble (p-1)/(3m); keeps each block's output gradients until the weight "
                    "step; not with activation checkpointing)"),
      TR_SPEC_FIELD(parallel.pipeline_layers, any(),
                    "layers per virtual stage, e.g. [3, 1] (a YAML list, or '3,1'): they must sum to model.n_layer "
                    "and give every stage at least one; empty = an even split (the first stages one more)"),
      TR_SPEC_FIELD(parallel.pipeline_reshard, one_of({"auto", "false", "true"}),
                    "true: a stage gathers each unit for every microbatch and frees it after use, and "
                    "reduce-scatters its gradient per microbatch (FSDP's memory; more all-gathers, overlapped "
                    "by prefetch); false: each unit is gathered once per step and held, with its full fp32 "
                    "gradient, for all microbatches, reduce-scattered after the last (fewer collectives, the "
                    "stage's parameters and gradients unsharded all step); auto = true under full_shard and "
                    "hybrid_shard, false under no_shard and shard_grad_op; trainrun plan --pp-reshard counts either"),

      TR_SPEC_FIELD(checkpoint.interval, at_least(0), "steps between checkpoints; 0 = only the final one"),
      TR_SPEC_FIELD(checkpoint.keep_last, at_least(0), "newest checkpoints kept; older ones are deleted (0 = keep all)"),
      TR_SPEC_FIELD(checkpoint.keep_every, at_least(0),
                    "also keep checkpoints whose step is a multiple of this, forever; 0 = none"),
      TR_SPEC_FIELD(checkpoint.async, one_of({"false", "true"}),
                    "true: write in a background thread, reading the state in 64 MiB pieces while forward and backward run; "
                    "the next optimizer step waits until it has read the state"),
      TR_SPEC_FIELD(checkpoint.on_error, one_of({"stop", "continue"}),
                    "when a checkpoint cannot be written (disk full...): stop the job, or warn and continue"),
      TR_SPEC_FIELD(checkpoint.resume, non_empty(),
                    "auto = the latest verified checkpoint in output.dir (if any); never; or a checkpoint directory"),
      TR_SPEC_FIELD(checkpoint.final, one_of({"true", "false"}), "write a checkpoint at the end of the run"),

      TR_SPEC_FIELD(launcher.max_restarts, at_least(0),
                    "times the agent restarts all workers after a failure (they resume from the latest checkpoint)"),
      TR_SPEC_FIELD(launcher.grace_period_s, at_least(0),
                    "seconds workers get to exit after a forwarded signal or a failure before SIGKILL"),
      TR_SPEC_FIELD(launcher.log_tail_lines, at_least(0), "lines of the failed rank's log shown in the failure report"),
      TR_SPEC_FIELD(launcher.master_addr, non_empty(),
                    "address of the node-0 rendezvous store that workers dial (MASTER_ADDR); with several nodes "
                    "under Slurm the default 127.0.0.1 means the first host of SLURM_JOB_NODELIST; --master-addr "
                    "sets it"),
      TR_SPEC_FIELD(launcher.master_port, in_range_int(0, 65535),
                    "store port (MASTER_PORT); 0 = pick a free one on one node; with several nodes 0 = 20000 + "
                    "SLURM_JOB_ID % 10000 under Slurm, else 29500; --master-port sets it"),
      TR_SPEC_FIELD(launcher.nnodes, at_least(0),
                    "nodes in the job, one agent each; 0 = SLURM_NNODES under `srun --ntasks-per-node=1`, else "
                    "1; --nnodes sets it"),
  };
  return table;
}
#undef TR_SPEC_FIELD

// Names people bring from nanoGPT, Hugging Face and torchtitan configs. They
// are never accepted, only suggested, so there is one spelling per field.
const std::vector<std::pair<const char*, const char*>>& aliases() {
  static const std::vector<std::pair<const char*, const char*>> a = {
      {"learning_rate", "train.lr"},         {"max_iters", "train.max_steps"},
      {"warmup_iters", "train.warmup_steps"}, {"batch_size", "train.micro_batch_size"},
      {"max_norm", "train.grad_clip"},       {"clip_grad", "train.grad_clip"},
      {"block_size", "model.seq_len"},       {"context_length", "model.seq_len"},
      {"n_positions", "model.seq_len"},      {"n_ctx", "model.seq_len"},
      {"d_model", "model.n_embd"},           {"hidden_size", "model.n_embd"},
      {"num_layers", "model.n_layer"},       {"num_heads", "model.n_head"},
      {"out_dir", "output.dir"},             {"dtype", "backend"},
  };
  return a;
}

const Field* find_field(const std::string& key) {
  for (const Field& f : fields())
    if (key == f.key) return &f;
  return nullptr;
}

// Sections are every proper prefix of a field key ("data", "data.synthetic").
const std::vector<std::string>& sections() {
  static const std::vector<std::string> s = [] {
    std::vector<std::string> out;
    for (const Field& f : fields()) {
      std::string k = f.key;
      for (auto dot = k.find('.'); dot != std::string::npos; dot = k.find('.', dot + 1)) {
        std::string p = k.substr(0, dot);
        if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
      }
    }
    return out;
  }();
  return s;
}

bool is_section(const std::string& key) {
  const auto& s = sections();
  return std::find(s.begin(), s.end(), key) != s.end();
}

std::string parent_of(const std::string& key) {
  auto dot = key.rfind('.');
  return dot == std::string::npos ? "" : key.substr(0, dot);
}
std::string leaf_of(const std::string& key) {
  auto dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

// Direct children (fields and subsections) of a section, "" = top level,
// in table order.
std::vector<std::string> children_of(const std::string& section) {
  std::vector<std::string> out;
  for (const Field& f : fields()) {
    std::string k = f.key;
    while (!k.empty() && parent_of(k) != section) k = parent_of(k);
    if (!k.empty() && k != section && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

// ---- text helpers ------------------------------------------------------------

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Optimal string alignment distance: Levenshtein plus adjacent transpositions,
// so "esp" is one edit from "eps".
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// Typos get longer with the word; a fixed cut-off would either miss
// "lerning_rate" or suggest "lr" for "n".
size_t max_typo(const std::string& word) { return std::max<size_t>(1, (word.size() + 2) / 4); }

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// The closest known key for an unknown dotted key: a typo in the key itself,
// the right name in the wrong section, or an alias from another framework.
std::optional<std::string> suggest_key(const std::string& unknown) {
  const std::string parent = parent_of(unknown), leaf = lower(leaf_of(unknown));
  struct Cand {
    std::string target, full, leaf;
  };
  std::vector<Cand> cands;
  for (const std::string& s : sections()) cands.push_back({s, s, leaf_of(s)});
  for (const Field& f : fields()) cands.push_back({f.key, f.key, f.leaf()});
  for (const auto& [alias, target] : aliases()) cands.push_back({target, "", alias});

  std::optional<std::string> best;
  size_t best_d = SIZE_MAX;
  bool best_same = false;
  for (const Cand& c : cands) {
    size_t d = edit_distance(leaf, lower(c.leaf));
    if (!c.full.empty()) d = std::min(d, edit_distance(lower(unknown), lower(c.full)));
    if (d > max_typo(leaf)) continue;
    const bool same = parent_of(c.target) == parent;
    if (d < best_d || (d == best_d && same && !best_same)) {
      best = c.target;
      best_d = d;
      best_same = same;
    }
  }
  return best;
}

std::optional<std::string> suggest_choice(const std::string& value, const std::vector<std::string>& choices) {
  std::optional<std::string> best;
  size_t best_d = SIZE_MAX;
  for (const std::string& c : choices) {
    size_t d = edit_distance(lower(value), c);
    if (d <= max_typo(value) && d < best_d) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

// Shortest text that reads back as the same double, so resolved YAML is
// both exact and readable (0.001, not 0.0010000000000000000208).
std::string format_double(double v) {
  char buf[64];
  // %g would write 300 as "3e+02".
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// Double-quoted YAML scalar: the one style that can carry any text
// (newlines, leading spaces, '#', ': ') unchanged.
std::string yaml_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string value_text(const Field& f, const JobSpec& spec) {
  // get() needs a mutable spec to hand out a writable pointer; reading only.
  Ref r = f.get(const_cast<JobSpec&>(spec));
  if (auto p = std::get_if<int*>(&r)) return std::to_string(**p);
  if (auto p = std::get_if<int64_t*>(&r)) return std::to_string(**p);
  if (auto p = std::get_if<uint64_t*>(&r)) return std::to_string(**p);
  if (auto p = std::get_if<double*>(&r)) return format_double(**p);
  const std::string& s = *std::get<std::string*>(r);
  return f.is_enum() ? s : yaml_quote(s);
}

std::string default_text(const Field& f) {
  static const JobSpec defaults;
  return value_text(f, defaults);
}

// The variant index of a field's storage (0 int .. 4 string).
size_t kind(const Field& f) {
  static JobSpec scratch;  // only the pointer's type is used, never the value
  return f.get(scratch).index();
}

std::string type_name(const Field& f) {
  if (f.is_enum()) return "enum";
  switch (kind(f)) {
    case 0: return "int";
    case 1: return "int64";
    case 2: return "uint64";
    case 3: return "float";
    default: return "string";
  }
}

std::string allowed_text(const Rule& r) {
  if (!r.choices.empty()) return join(r.choices, " | ");
  if (r.non_empty) return "non-empty";
  if (r.lo && r.hi)
    return (r.lo->open ? "(" : "[") + format_double(r.lo->value) + ", " + format_double(r.hi->value) +
           (r.hi->open ? ")" : "]");
  if (r.lo) return (r.lo->open ? "> " : ">= ") + format_double(r.lo->value);
  if (r.hi) return (r.hi->open ? "< " : "<= ") + format_double(r.hi->value);
  return "any";
}

// What a value of this field looks like, for "expected ..." messages.
std::string expected_text(const Field& f) {
  if (f.is_enum()) return "one of " + join(f.rule.choices, ", ");
  switch (kind(f)) {
    case 0:
    case 1: return "an integer";
    case 2: return "a non-negative integer";
    case 3: return "a number";
    default: return "a string";
  }
}

// ---- where things came from ----------------------------------------------------

[[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& problem) {
  if (key.empty()) TR_FAIL(where, ": ", problem);
  TR_FAIL(where, ": ", key, ": ", problem);
}

// Who set a key (or opened a section), for messages and for precedence:
// a --set beats the file (SpecOrigin::rank). Kept in JobSpec::origins.
using Origins = std::map<std::string, SpecOrigin>;
constexpr int kFromFile = 1, kFromSet = 2;

// The place to blame for a rule about `keys`: the first one that was written
// somewhere, else the nearest enclosing section that was, else the fallback
// (the file's start), since defaults themselves are never wrong.
std::string where_of(const Origins& o, const std::vector<std::string>& keys, const std::string& fallback) {
  for (const std::string& k : keys) {
    auto it = o.find(k);
    if (it != o.end()) return it->second.where;
  }
  for (const std::string& k : keys)
    for (std::string p = parent_of(k); !p.empty(); p = parent_of(p)) {
      auto it = o.find(p);
      if (it != o.end()) return it->second.where;
    }
  return fallback;
}

std::string where_mark(const std::string& name, const YAML::Mark& m) {
  return name + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
}

// ---- scalars -------------------------------------------------------------------

enum class Parsed { Ok, NotInteger, TooBig };

std::string strip_plus(const std::string& t) { return !t.empty() && t[0] == '+' ? t.substr(1) : t; }

bool parse_double(const std::string& text, double& out) {
  const std::string t = strip_plus(text);
  if (t.empty()) return false;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  return ec == std::errc() && end == t.data() + t.size();
}

// Integers also accept an integral float ("1e6", "2.0"): token and step
// counts are often written that way, and the value is exact.
Parsed parse_int64(const std::string& text, int64_t& out) {
  const std::string t = strip_plus(text);
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  if (!t.empty() && end == t.data() + t.size()) {
    if (ec == std::errc()) return Parsed::Ok;
    if (ec == std::errc::result_out_of_range) return Parsed::TooBig;
  }
  double d;
  if (!parse_double(text, d) || !std::isfinite(d) || d != std::floor(d)) return Parsed::NotInteger;
  if (d < -9.2e18 || d > 9.2e18) return Parsed::TooBig;
  out = static_cast<int64_t>(d);
  return Parsed::Ok;
}

Parsed parse_uint64(const std::string& text, uint64_t& out) {
  const std::string t = strip_plus(text);
  if (!t.empty() && t[0] == '-') return Parsed::NotInteger;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  if (!t.empty() && end == t.data() + t.size()) {
    if (ec == std::errc()) return Parsed::Ok;
    if (ec == std::errc::result_out_of_range) return Parsed::TooBig;
  }
  double d;
  if (!parse_double(text, d) || !std::isfinite(d) || d != std::floor(d) || d < 0) return Parsed::NotInteger;
  if (d >= 18446744073709551615.0) return Parsed::TooBig;
  out = static_cast<uint64_t>(d);
  return Parsed::Ok;
}

// Store one YAML value into a field, checking only its type; ranges and
// cross-field rules run afterwards in check_fields / check_rules so specs
// built in code get the same checks.
std::string kind_of(const YAML::Node& n);

void assign(const Field& f, JobSpec& spec, const YAML::Node& v, const std::string& where) {
  const std::string key = f.key;
  if (v.IsSequence() &&
      (key == "parallel.pipeline_layers" || key == "output.trace_steps" || key == "model.adapter.target_modules" ||
       key == "model.rope_scaling.short_factor" || key == "model.rope_scaling.long_factor")) {
    // The list-valued keys: kept as their text, "3,1" (parse_pipeline_layers,
    // parse_trace_steps, the adapter's target list).
    std::string joined;
    for (const YAML::Node& e : v) {
      if (!e.IsScalar()) fail(where, key, "expected a list of plain values, got a nested " + kind_of(e));
      joined += (joined.empty() ? "" : ",") + e.Scalar();
    }
    *std::get<std::string*>(f.get(spec)) = joined;
    return;
  }
  if (v.IsSequence()) fail(where, key, "expected " + expected_text(f) + ", got a list");
  if (v.IsMap()) fail(where, key, "expected " + expected_text(f) + ", got a map");
  Ref r = f.get(spec);
  if (!v.IsDefined() || v.IsNull()) {
    // An empty value is the natural way to write an empty path or prompt.
    if (auto p = std::get_if<std::string*>(&r); p && !f.is_enum()) {
      (*p)->clear();
      return;
    }
    fail(where, key,
         "has no value; write " + expected_text(f) + ", or remove the key to keep the default (" +
             default_text(f) + ")");
  }
  const std::string& t = v.Scalar();
  const std::string got = ", got '" + t + "'";
  if (auto p = std::get_if<int*>(&r)) {
    int64_t x = 0;
    Parsed st = parse_int64(t, x);
    if (st == Parsed::NotInteger) fail(where, key, "expected an integer" + got);
    if (st == Parsed::TooBig || x < INT_MIN || x > INT_MAX)
      fail(where, key, "'" + t + "' does not fit in a 32-bit integer; use a value up to " + std::to_string(INT_MAX));
    **p = static_cast<int>(x);
  } else if (auto p = std::get_if<int64_t*>(&r)) {
    int64_t x = 0;
    Parsed st = parse_int64(t, x);
    if (st == Parsed::NotInteger) fail(where, key, "expected an integer" + got);
    if (st == Parsed::TooBig)
      fail(where, key, "'" + t + "' does not fit in a 64-bit integer; use a value up to " + std::to_string(INT64_MAX));
    **p = x;
  } else if (auto p = std::get_if<uint64_t*>(&r)) {
    uint64_t x = 0;
    Parsed st = parse_uint64(t, x);
    if (st == Parsed::NotInteger) fail(where, key, "expected a non-negative integer" + got);
    if (st == Parsed::TooBig)
      fail(where, key, "'" + t + "' does not fit in 64 bits; use a value up to " + std::to_string(UINT64_MAX));
    **p = x;
  } else if (auto p = std::get_if<double*>(&r)) {
    double x = 0;
    if (!parse_double(t, x)) fail(where, key, "expected a number" + got);
    if (!std::isfinite(x)) fail(where, key, "expected a finite number" + got);
    **p = x;
  } else {
    *std::get<std::string*>(r) = t;
  }
}

// ---- validation ------------------------------------------------------------------

bool in_bounds(double v, const Rule& r) {
  if (r.lo && (r.lo->open ? !(v > r.lo->value) : !(v >= r.lo->value))) return false;
  if (r.hi && (r.hi->open ? !(v < r.hi->value) : !(v <= r.hi->value))) return false;
  return true;
}

void check_fields(JobSpec& spec, const Origins& o, const std::string& fallback) {
  for (const Field& f : fields()) {
    const std::string where = where_of(o, {f.key}, fallback);
    Ref r = f.get(spec);
    if (auto p = std::get_if<std::string*>(&r)) {
      const std::string& s = **p;
      if (f.is_enum() && std::find(f.rule.choices.begin(), f.rule.choices.end(), s) == f.rule.choices.end()) {
        const std::string all = join(f.rule.choices, ", ");
        if (f.rule.explain_unknown)
          if (const std::string why = f.rule.explain_unknown(s); !why.empty()) fail(where, f.key, why);
        if (auto near = suggest_choice(s, f.rule.choices))
          fail(where, f.key, "unknown value '" + s + "'; did you mean '" + *near + "'? (one of: " + all + ")");
        fail(where, f.key, "unknown value '" + s + "'; use one of: " + all);
      }
      if (f.rule.non_empty && s.empty())
        fail(where, f.key, "must not be empty; give a value (default " + default_text(f) + ")");
      continue;
    }
    double v = 0;
    if (auto p = std::get_if<int*>(&r)) v = **p;
    else if (auto p = std::get_if<int64_t*>(&r)) v = static_cast<double>(**p);
    else if (auto p = std::get_if<uint64_t*>(&r)) v = static_cast<double>(**p);
    else v = *std::get<double*>(r);
    if (!in_bounds(v, f.rule))
      fail(where, f.key,
           value_text(f, spec) + " is out of range; must be " + (f.rule.lo && f.rule.hi ? "in " : "") +
               allowed_text(f.rule));
  }
}

// Whether model.* holds the model's final shape. A preset or an init_from
// directory fills it in later (resolve_model_shape, core/model/model_spec.h),
// so until then the rules that read it would judge the defaults.
bool shape_is_final(const JobSpec& s) { return s.model.preset == "none" && s.model.init_from.empty(); }

// Rules between fields, in one place so they are easy to audit. `shape`:
// model.* is the final shape, so the rules that read it run.
void check_rules(JobSpec& s, const Origins& o, const std::string& fallback, bool shape = true) {
  auto at = [&](std::vector<std::string> keys) { return where_of(o, keys, fallback); };
  auto str = [](auto v) { return std::to_string(v); };

  const ModelSpec& m = s.model;
  if (shape && m.n_embd % m.n_head != 0) {
    // Name the key the user actually wrote ("--set model.n_head=5").
    // (A value model.preset / init_from filled, rank 0, is not one the user wrote.)
    auto written = [&](const char* k) { auto it = o.find(k); return it != o.end() && it->second.rank > 0; };
    if (!written("model.n_embd") && written("model.n_head"))
      fail(at({"model.n_head"}), "model.n_head",
           str(m.n_head) + " does not divide model.n_embd (" + str(m.n_embd) + "); choose a divisor of n_embd");
    fail(at({"model.n_embd", "model.n_head"}), "model.n_embd",
         str(m.n_embd) + " is not divisible by model.n_head (" + str(m.n_head) +
             "); make n_embd a multiple of n_head");
  }

  const DataSpec& d = s.data;
  if (d.format != "synthetic" && d.train.empty())
    fail(at({"data.train", "data.format"}), "data.train",
         "required when data.format is '" + d.format +
             "'; set it to the training shards (a path or glob), or use data.format: synthetic");
  if (shape && d.format == "synthetic") {
    if (d.synthetic.vocab > m.vocab_size)
      fail(at({"data.synthetic.vocab", "model.vocab_size"}), "data.synthetic.vocab",
           str(d.synthetic.vocab) + " is larger than model.vocab_size (" + str(m.vocab_size) +
               "); lower it or raise model.vocab_size");
    const int chain_vocab = d.synthetic.vocab > 0 ? d.synthetic.vocab : m.vocab_size;
    if (d.synthetic.branching > chain_vocab)
      fail(at({"data.synthetic.branching", "data.synthetic.vocab", "model.vocab_size"}), "data.synthetic.branching",
           str(d.synthetic.branching) + " is larger than the chain's vocabulary (" + str(chain_vocab) +
               "); use at most " + str(chain_vocab));
  }
  // data.document_mask's separator: what the spec alone can tell (prepare.json
  // is looked up when the data is opened, core/data/document_mask.h).
  if (d.document_mask_on() && d.format == "synthetic" && d.document_separator < 0)
    fail(at({"data.document_mask", "data.document_separator", "data.format"}), "data.document_mask",
         "true needs data.document_separator with data.format synthetic (a generated chain has no documents); set "
         "data.document_separator to a token id that starts a document, or turn data.document_mask off");
  if (shape && d.document_separator >= m.vocab_size)
    fail(at({"data.document_separator", "model.vocab_size"}), "data.document_separator",
         str(d.document_separator) + " is not a token id of the model (model.vocab_size = " + str(m.vocab_size) +
             "); use the id of the token that starts each document");

  TrainSpec& t = s.train;
  if (shape && t.global_batch_tokens > 0) {
    const std::string where = at({"train.global_batch_tokens"});
    if (t.global_batch_tokens % m.seq_len != 0) {
      int64_t up = (t.global_batch_tokens / m.seq_len + 1) * m.seq_len;
      fail(where, "train.global_batch_tokens",
           str(t.global_batch_tokens) + " is not a multiple of model.seq_len (" + str(m.seq_len) +
               "); use a multiple such as " + str(up));
    }
    const int64_t seqs = t.global_batch_tokens / m.seq_len;
    if (seqs > INT_MAX)
      fail(where, "train.global_batch_tokens",
           str(t.global_batch_tokens) + " is " + str(seqs) + " sequences, more than fit in a 32-bit count; lower it");
    // Both written and different: the later layer (--set over file) wins,
    // so "--set train.global_batch_size=64" works on a resolved spec that
    // carries both; within one layer it is a contradiction.
    auto tok = o.find("train.global_batch_tokens"), gbs = o.find("train.global_batch_size");
    if (gbs != o.end() && t.global_batch_size != seqs) {
      const int tok_rank = tok == o.end() ? 0 : tok->second.rank;
      if (gbs->second.rank == tok_rank)
        fail(gbs->second.where, "train.global_batch_size",
             str(t.global_batch_size) + " contradicts train.global_batch_tokens (" + str(t.global_batch_tokens) +
                 " = " + str(seqs) + " sequences of model.seq_len " + str(m.seq_len) +
                 "); set only one of them (global_batch_tokens: 0 means use global_batch_size)");
      if (gbs->second.rank > tok_rank) t.global_batch_tokens = 0;
    }
    if (t.global_batch_tokens > 0) {
      t.global_batch_size = static_cast<int>(seqs);
      if (t.global_batch_size % t.micro_batch_size != 0)
        fail(where, "train.global_batch_tokens",
             str(t.global_batch_tokens) + " is " + str(seqs) + " sequences of model.seq_len " + str(m.seq_len) +
                 ", not divisible by train.micro_batch_size (" + str(t.micro_batch_size) +
                 "); use a multiple of micro_batch_size * seq_len (" +
                 str(int64_t(t.micro_batch_size) * m.seq_len) + ")");
    }
  }
  if (t.global_batch_size % t.micro_batch_size != 0)
    fail(at({"train.global_batch_size", "train.micro_batch_size"}), "train.global_batch_size",
         str(t.global_batch_size) + " is not divisible by train.micro_batch_size (" + str(t.micro_batch_size) +
             "); make it a multiple of micro_batch_size");
  if (t.schedule != "constant" && t.min_lr > t.lr)
    fail(at({"train.min_lr", "train.lr"}), "train.min_lr",
         format_double(t.min_lr) + " is above train.lr (" + format_double(t.lr) +
             "); the schedule decays from lr down to min_lr, so set min_lr <= lr");
  if (t.warmup_steps > t.max_steps) {
    // A short run of a long job (`--set train.max_steps=3`, a smoke test of
    // a shipped config) is a run worth having: it warms up over all of its
    // steps, ending at train.lr, rather than refusing to start. The resolved
    // spec records the warmup that ran.
    TR_LOG_WARN(at({"train.warmup_steps", "train.max_steps"}), ": train.warmup_steps (", t.warmup_steps,
                ") > train.max_steps (", t.max_steps, "): warming up over all ", t.max_steps, " steps");
    t.warmup_steps = t.max_steps;
  }

  try {
    (void)parse_trace_steps(s.output.trace_steps);
  } catch (const Error& e) {
    fail(at({"output.trace_steps"}), "output.trace_steps", e.what());
  }
  const ParallelSpec& p = s.parallel;
  if (p.shard_group_size > 0 && p.sharding != "hybrid_shard")
    fail(at({"parallel.shard_group_size", "parallel.sharding"}), "parallel.shard_group_size",
         str(p.shard_group_size) + " only applies to parallel.sharding: hybrid_shard (it is '" + p.sharding +
             "'); use hybrid_shard or set shard_group_size to 0");
  if (p.offload == "nvme" && p.offload_dir.empty())
    fail(at({"parallel.offload_dir", "parallel.offload"}), "parallel.offload_dir",
         "is required with parallel.offload: nvme; name a directory on a local NVMe disk");
  if (p.pipeline_parallel > 1 && p.pipeline_schedule == "zero_bubble" && t.activation_checkpointing == "blocks")
    fail(at({"parallel.pipeline_schedule", "train.activation_checkpointing"}), "parallel.pipeline_schedule",
         "zero_bubble with train.activation_checkpointing: blocks is not supported (its deferred weight step needs "
         "every block's inputs, which checkpointing does not keep); use 1f1b, or turn checkpointing off");
  if (p.pipeline_virtual_stages > 1 && p.pipeline_schedule != "interleaved_1f1b")
    fail(at({"parallel.pipeline_virtual_stages", "parallel.pipeline_schedule"}), "parallel.pipeline_virtual_stages",
         str(p.pipeline_virtual_stages) + " needs parallel.pipeline_schedule: interleaved_1f1b (it is '" +
             p.pipeline_schedule + "'); set pipeline_virtual_stages to 1 or use interleaved_1f1b");
  if ((p.pipeline_parallel > 1 || !p.pipeline_layers.empty()) && shape) {
    // The split: every layer once, every virtual stage at least one (the
    // microbatch count needs the world size: checked by the launcher;
    // with a preset or init_from this runs again once they set n_layer).
    try {
      split_pipeline_layers(s.model.n_layer, p.pipeline_parallel * p.pipeline_virtual_stages,
                            parse_pipeline_layers(p.pipeline_layers));
    } catch (const Error& e) {
      fail(at({"parallel.pipeline_layers", "parallel.pipeline_parallel", "model.n_layer"}), "parallel.pipeline_layers",
           e.what());
    }
  }
  // Expert parallelism: every ep rank runs whole experts (an equal share).
  // The data-parallel size needs the world size: the trainer checks it.
  if (p.expert_parallel > 1 && shape && m.n_experts == 0)
    fail(at({"parallel.expert_parallel", "model.n_experts"}), "parallel.expert_parallel",
         str(p.expert_parallel) + " needs a mixture of experts, but model.n_experts is 0 (a dense MLP, model.arch '" +
             m.arch + "'); set expert_parallel to 1 or use a MoE model (mixtral, qwen2_moe, qwen3_moe)");
  if (p.expert_parallel > 1 && shape && m.n_experts > 0 && m.n_experts % p.expert_parallel != 0)
    fail(at({"parallel.expert_parallel", "model.n_experts"}), "parallel.expert_parallel",
         str(p.expert_parallel) + " does not divide model.n_experts (" + str(m.n_experts) +
             "): each ep rank runs an equal number of whole experts; use a divisor of " + str(m.n_experts));
  if (p.expert_parallel > 1) {
    auto refuse = [&](bool bad, const char* key, const std::string& value) {
      if (bad)
        fail(at({"parallel.expert_parallel", key}), "parallel.expert_parallel",
             str(p.expert_parallel) + " with " + key + " " + value + " is not implemented yet; set " + key +
                 " back to its default or parallel.expert_parallel: 1");
    };
    refuse(p.context_parallel > 1, "parallel.context_parallel", str(p.context_parallel));
    refuse(p.sequence_parallel_on(), "parallel.sequence_parallel", "true");
    refuse(s.model.adapter.on(), "model.adapter.type", s.model.adapter.type);
  }
  // Context parallelism: the sequence's 2 x cp chunks must be whole (the
  // load-balanced split, parallel/context/sequence_split.h); we refuse
  // rather than pad, so every rank's rows are real tokens.
  if (p.context_parallel > 1 && shape && m.seq_len % (2 * p.context_parallel) != 0)
    fail(at({"model.seq_len", "parallel.context_parallel"}), "model.seq_len",
         str(m.seq_len) + " is not a multiple of 2 x parallel.context_parallel (" + str(2 * p.context_parallel) +
             "): context parallelism splits each sequence into 2 x context_parallel equal chunks and does not "
             "pad; use a seq_len that is a multiple of " + str(2 * p.context_parallel) +
             " or another context_parallel");
  if (p.context_parallel > 1 && p.cp_mode == "all_to_all" && shape &&
      m.n_head % (p.context_parallel * p.tensor_parallel) != 0)
    fail(at({"model.n_head", "parallel.context_parallel", "parallel.tensor_parallel", "parallel.cp_mode"}),
         "model.n_head",
         str(m.n_head) + " is not divisible by parallel.context_parallel (" + str(p.context_parallel) +
             ") x parallel.tensor_parallel (" + str(p.tensor_parallel) + ") = " +
             str(p.context_parallel * p.tensor_parallel) +
             ": cp_mode all_to_all gives each rank whole attention heads; use cp_mode: ring or degrees whose "
             "product divides n_head");
  // model.adapter / model.base_dtype: what is implemented so far (docs/fine-tuning.md).
  const ModelSpec::AdapterSpec& ad = m.adapter;
  if ((m.base_dtype == "bf16" || m.base_dtype == "nf4") && !ad.on())
    fail(at({"model.base_dtype", "model.adapter.type"}), "model.base_dtype",
         m.base_dtype + " holds a frozen base, which needs model.adapter.type: lora or dora (it is none); set "
                        "model.adapter or model.base_dtype: auto");
  if (ad.on() && p.tensor_parallel > 1 && p.pipeline_parallel > 1)
    fail(at({"parallel.tensor_parallel", "parallel.pipeline_parallel", "model.adapter.type"}),
         "parallel.tensor_parallel",
         std::to_string(p.tensor_parallel) + " with parallel.pipeline_parallel: " + std::to_string(p.pipeline_parallel) +
             " is not implemented with model.adapter yet (each runs adapters alone); use one of them, with data "
             "parallelism for the other ranks");
  if (!ad.on() && !ad.init_from.empty())
    fail(at({"model.adapter.init_from", "model.adapter.type"}), "model.adapter.init_from",
         "needs model.adapter.type: lora or dora (it is none); set the type or remove init_from");
  if (p.sequence_parallel_on() && p.tensor_parallel == 1)
    TR_LOG_WARN(at({"parallel.sequence_parallel", "parallel.tensor_parallel"}),
                ": parallel.sequence_parallel: true has no effect with parallel.tensor_parallel: 1 (sequence "
                "parallelism splits the activations of a tensor-parallel group); ignored");
}

// ---- YAML walking ----------------------------------------------------------------

[[noreturn]] void fail_unknown(const std::string& where, const std::string& key) {
  const std::string parent = parent_of(key);
  if (auto near = suggest_key(key)) {
    fail(where, key, std::string(parent.empty() ? "unknown section" : "unknown key") + "; did you mean '" + *near + "'?");
  }
  if (parent.empty())
    fail(where, key, "unknown section; the top level holds " + join(children_of(""), ", "));
  if (!is_section(parent))
    fail(where, key, "unknown key; '" + parent + "' is not a section");
  std::vector<std::string> names;
  for (const std::string& c : children_of(parent)) names.push_back(leaf_of(c));
  fail(where, key, "unknown key; the keys of '" + parent + "' are " + join(names, ", "));
}

std::string kind_of(const YAML::Node& n) {
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a map";
  return "'" + n.Scalar() + "'";
}

void walk(const YAML::Node& map, const std::string& prefix, const std::string& name, JobSpec& spec, Origins& o) {
  std::map<std::string, int> seen;  // key -> 1-based line
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node k = it->first;  // copies: the iterator hands out temporaries
    const YAML::Node v = it->second;
    const std::string kwhere = where_mark(name, k.Mark());
    if (!k.IsScalar())
      fail(kwhere, prefix.empty() ? "(top level)" : prefix,
           "a key must be a plain name, got " + kind_of(k) + "; write 'name: value'");
    const std::string key = prefix.empty() ? k.Scalar() : prefix + "." + k.Scalar();
    if (auto dup = seen.find(key); dup != seen.end())
      fail(kwhere, key, "duplicate key (first set on line " + std::to_string(dup->second) + "); keep only one");
    seen[key] = k.Mark().line + 1;

    if (key == "resolved_mesh") {
      // What a run resolved (parallel/mesh/device_mesh.h resolved_mesh_yaml),
      // written into job.resolved.yaml for people and tools: informational,
      // so loading the file back (workers, restarts, a copied spec) ignores it.
      if (!v.IsMap() && !v.IsNull())
        fail(where_mark(name, v.Mark()), key,
             "is the informational mesh trainrun writes into job.resolved.yaml and must be a map (got " + kind_of(v) +
                 "); remove it, it is not a setting (the mesh comes from parallel.*)");
      continue;
    }
    if (const Field* f = find_field(key)) {
      // A null value's mark points past the key (often to the next line).
      const std::string vwhere = v.IsNull() ? kwhere : where_mark(name, v.Mark());
      assign(*f, spec, v, vwhere);
      o[key] = {vwhere, kFromFile};
    } else if (is_section(key)) {
      o[key] = {kwhere, kFromFile};
      if (v.IsNull()) continue;  // "model:" with nothing under it = all defaults
      if (!v.IsMap())
        fail(where_mark(name, v.Mark()), key,
             "expected a section (a map of keys), got " + kind_of(v) + "; write its keys as indented 'key: value' lines under '" +
                 leaf_of(key) + ":'");
      walk(v, key, name, spec, o);
    } else {
      fail_unknown(kwhere, key);
    }
  }
}

void apply_override(const std::string& ov, JobSpec& spec, Origins& o) {
  const std::string where = "--set " + ov;
  const auto eq = ov.find('=');
  if (eq == std::string::npos)
    TR_FAIL(where, ": missing '='; write --set key.path=value, e.g. --set train.lr=3e-4");
  const std::string key = ov.substr(0, eq), text = ov.substr(eq + 1);
  if (key.empty()) TR_FAIL(where, ": missing the key before '='; write --set key.path=value, e.g. --set train.lr=3e-4");
  const Field* f = find_field(key);
  if (!f) {
    if (is_section(key)) {
      std::string example = children_of(key).front();
      fail(where, key, "a section, not a field; set one of its keys, e.g. --set " + example + "=...");
    }
    fail_unknown(where, key);
  }
  YAML::Node v;
  try {
    v = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    fail(where, key, "the value is not a YAML scalar (" + e.msg + "); quote it, e.g. --set " + key + "='" + text + "'");
  }
  assign(*f, spec, v, where);
  o[key] = {where, kFromSet};
}

std::string read_whole_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) TR_FAIL("cannot read job spec '", path, "': ", std::strerror(errno));
  std::string text;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      TR_FAIL("cannot read job spec '", path, "': ", std::strerror(err));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

}  // namespace

// ---- public API --------------------------------------------------------------------

JobSpec parse_job_spec(const std::string& yaml_text, const std::string& name,
                       const std::vector<std::string>& overrides) {
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(yaml_text);
  } catch (const YAML::ParserException& e) {
    TR_FAIL(where_mark(name, e.mark), ": invalid YAML: ", e.msg, "; fix the syntax at this position");
  }
  if (docs.size() > 1)
    TR_FAIL(where_mark(name, docs[1].Mark()),
            ": a second YAML document ('---') is not allowed; put the whole job in one document");

  JobSpec spec;
  Origins origins;
  // An empty file (or one with only comments) means "all defaults"; the
  // default data.format still needs data.train, which check_rules reports.
  if (!docs.empty() && !docs[0].IsNull()) {
    const YAML::Node& top = docs[0];
    if (!top.IsMap())
      TR_FAIL(where_mark(name, top.Mark()), ": the top level must be a map of sections (",
              join(children_of(""), ", "), "), got ", kind_of(top), "; write e.g. 'train:' then indented keys");
    walk(top, "", name, spec, origins);
  }
  for (const std::string& ov : overrides) apply_override(ov, spec, origins);

  const std::string fallback = name + ":1:1";
  check_fields(spec, origins, fallback);
  check_rules(spec, origins, fallback, shape_is_final(spec));
  spec.source = name;
  spec.origins = std::move(origins);
  return spec;
}

JobSpec load_job_spec(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_job_spec(read_whole_file(path), path, overrides);
}

void validate_job_spec(JobSpec& spec) {
  const Origins o = spec.origins;  // check_rules may rewrite spec's fields, not where they came from
  check_fields(spec, o, spec.source);
  check_rules(spec, o, spec.source);
}

std::string job_spec_value_text(const JobSpec& spec, const std::string& key) {
  const Field* f = find_field(key);
  TR_CHECK(f, "job spec: no field '", key, "' (a bug)");
  return value_text(*f, spec);
}

void job_spec_copy_field(const JobSpec& from, JobSpec& to, const std::string& key) {
  const Field* f = find_field(key);
  TR_CHECK(f, "job spec: no field '", key, "' (a bug)");
  Ref src = f->get(const_cast<JobSpec&>(from)), dst = f->get(to);
  std::visit([&](auto* d) { *d = *std::get<std::remove_pointer_t<decltype(d)>*>(src); }, dst);
}

std::string job_spec_to_yaml(const JobSpec& spec) {
  struct Line {
    std::string text, comment;
  };
  std::vector<Line> lines;
  std::string open;  // the section whose header was written last
  for (const Field& f : fields()) {
    const std::string sec = f.section();
    if (sec != open) {
      // Open every section level below the common prefix with the last one.
      std::vector<std::string> path;
      for (std::string p = sec; !p.empty(); p = parent_of(p)) path.insert(path.begin(), p);
      for (size_t i = 0; i < path.size(); ++i) {
        const std::string& p = path[i];
        if (open == p || open.rfind(p + ".", 0) == 0) continue;
        if (i == 0) lines.push_back({"", ""});
        lines.push_back({std::string(2 * i, ' ') + leaf_of(p) + ":", ""});
      }
      open = sec;
    }
    const size_t depth = sec.empty() ? 0 : std::count(sec.begin(), sec.end(), '.') + 1;
    const std::string allowed = allowed_text(f.rule);
    lines.push_back({std::string(2 * depth, ' ') + f.leaf() + ": " + value_text(f, spec),
                     std::string(f.doc) + (allowed == "any" ? "" : "; " + allowed)});
  }
  size_t col = 0;
  for (const Line& l : lines) col = std::max(col, l.text.size());
  col = std::min<size_t>(col, 40) + 2;

  std::string out = "# trainrun job spec, fully resolved: every field, defaults filled in.\n"
                    "# Reference: docs/job-spec.md\n";
  for (const Line& l : lines) {
    std::string s = l.text;
    if (!l.comment.empty()) s += std::string(s.size() < col ? col - s.size() : 2, ' ') + "# " + l.comment;
    out += s + "\n";
  }
  return out;
}

std::vector<JobSpecField> job_spec_fields() {
  std::vector<JobSpecField> out;
  for (const Field& f : fields())
    out.push_back({f.key, type_name(f), default_text(f), allowed_text(f.rule), f.doc});
  return out;
}

std::string job_spec_reference_markdown() {
  auto cell = [](const std::string& s) {
    std::string out;
    for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
  };
  std::string out;
  std::string sec = "\x01";
  for (const JobSpecField& f : job_spec_fields()) {
    const std::string s = parent_of(f.key);
    if (s != sec) {
      if (sec != "\x01") out += "\n";
      out += "### " + (s.empty() ? std::string("top level") : "`" + s + "`") + "\n\n";
      out += "| key | type | default | allowed | meaning |\n";
      out += "|---|---|---|---|---|\n";
      sec = s;
    }
    out += "| `" + f.key + "` | " + f.type + " | `" + cell(f.default_value) + "` | " + cell(f.allowed) + " | " +
           cell(f.doc) + " |\n";
  }
  return out;
}

}  // namespace trainrun
