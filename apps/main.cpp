// trainrun: the command line. Thin by design: parse, dispatch, turn errors
// into one paragraph and an exit code. CLI11 lives in this file only.
//
// Exit codes: 0 ok, 1 error (message on stderr), 2 usage error.
#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/checkpoint/bench_checkpoint.h"
#include "core/checkpoint/adapter_merge.h"
#include "core/model/adapter/qlora.h"
#include "core/checkpoint/hf_interop.h"
#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/log.h"
#include "core/config/job_spec.h"
#include "core/data/chat_template.h"
#include "core/data/dataset.h"
#include "core/data/tokenizer/tokenizer.h"
#include "apps/tokenizer_cmd.h"
#include "core/launch/agent.h"
#include "core/launch/launch_mode.h"
#include "core/launch/slurm_worker.h"
#include "core/model/model_io.h"
#include "core/model/model_shape.h"
#include "core/model/model_spec.h"
#include "core/train/bench_tp.h"
#include "core/train/bench_pipeline.h"
#include "core/train/bench_lora.h"
#include "core/train/bench_cp.h"
#include "core/train/bench_moe.h"
#include "core/train/pipeline_explain.h"
#include "core/train/generate.h"
#include "core/train/planner.h"
#include "core/train/plot.h"
#include "core/train/preemption.h"
#include "core/train/trainer.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/bench_comm.h"
#include "kernels/cpu/bench_host_adamw.h"
#include "parallel/sharding/bench_offload.h"
#include "parallel/topology/topology.h"
#include "parallel/topology/topology_decide.h"
#include "parallel/topology/topology_sources.h"
#include "parallel/topology/topology_launch.h"

namespace fs = std::filesystem;
using namespace trainrun;

namespace {

std::string version_string() {
  std::string s = std::string("trainrun ") + TRAINRUN_VERSION + "\nbackends: cpu (fp32, OpenBLAS + OpenMP)";
#if TRAINRUN_HAVE_CUDA
  s += ", cuda (bf16 + fp32 master weights; plugin libtrainrun_cuda.so)";
#else
  s += ", cuda: no (built without the CUDA toolkit)";
#endif
#if TRAINRUN_HAVE_GLOO
  s += "\ncollectives: gloo (TCP)";
#endif
  // The CUDA library is loaded (and the driver asked) only here, when
  // --version is given: NCCL, cuDNN, cuBLASLt and driver versions, or why not.
  const std::string cuda = cuda_version_report();
  s += "\n" + cuda;
  if (cuda.rfind("cuda: not available", 0) == 0) s += "\nnccl: no\ncudnn: no";
  return s;
}

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path);
  TR_CHECK(f, "cannot write '", path.string(), "'; check that output.dir is writable");
  f << text;
  TR_CHECK(f.good(), "cannot write '", path.string(), "' (disk full?)");
}

void prepare_output_dir(const JobSpec& job) {
  std::error_code ec;
  fs::create_directories(job.output.dir, ec);
  TR_CHECK(!ec, "output.dir: cannot create '", job.output.dir, "': ", ec.message());
}

int cmd_run(const std::string& config, std::vector<std::string> sets, const LaunchFlags& flags, bool explain) {
  // --nnodes/--master-addr/--master-port are job spec fields (launcher.*).
  for (std::string& o : flags.overrides()) sets.push_back(std::move(o));
  JobSpec job = load_resolved_job_spec(config, sets);
  // How this process was started (core/launch/launch_mode.h): an agent for
  // several local workers, restarts or several nodes; a worker placed by
  // srun or by an outside launcher; else one worker right here.
  const LaunchPlan plan = plan_launch(job, flags, current_environment(), this_host_name());
  if (explain) {
    // The mesh and the pipeline's per-rank action lists; nothing starts.
    std::cout << explain_pipeline_job(job, plan.world_size(), plan.nproc_per_node);
    return 0;
  }
  TR_LOG_INFO("launch: ", plan.describe());
  if (!plan.nproc_reason.empty()) TR_LOG_INFO("launch: ", plan.nproc_reason);
  for (const std::string& w : plan.warnings) TR_LOG_WARN("launch: ", w);
  if (const int64_t ms = debug_env_ms("TRAINRUN_DEBUG_START_DELAY_MS")) {
    // Tests: a window in which only main()'s stop handlers watch signals.
    TR_LOG_INFO("debug: start-up pause of ", ms, " ms (TRAINRUN_DEBUG_START_DELAY_MS)");
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (std::chrono::steady_clock::now() < until && stop_signal_received() == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const fs::path resolved = fs::path(job.output.dir) / "job.resolved.yaml";
  if (plan.agent()) {
    // Node 0 writes the resolved spec; the other nodes' workers load it
    // (the agents check that output.dir is shared before they start any).
    if (plan.node_rank == 0) {
      prepare_output_dir(job);
      write_text_file(resolved, job_spec_to_yaml(job));
      TR_LOG_INFO("job: ", job.source, " -> ", resolved.string());
    }
    return run_agent(job, plan, fs::absolute(resolved).string());
  }
  if (plan.mode == LaunchMode::SlurmWorker) {
    if (plan.rank == 0) {
      prepare_output_dir(job);
      write_text_file(resolved, job_spec_to_yaml(job));
      TR_LOG_INFO("job: ", job.source, " -> ", resolved.string());
    }
    return run_slurm_worker(job, plan);
  }
  WorkerInfo w = WorkerInfo::from_env();
  // No agent places this process (one worker, or an outside launcher did),
  // so parallel.topology_file decides nothing here; a bad one is still an
  // error, as it is under the agent, rather than silently ignored.
  if (!job.parallel.topology_file.empty()) {
    topo::node_topology(job);  // read once: plan_launch may have counted its GPUs already
    TR_LOG_INFO("topology: ", job.parallel.topology_file,
                " is used by the agent's placement; this process was started without one, so it runs as placed");
  }
  // Alone, a process that was told to stop before training has no one to
  // agree with: it stops now. With peers (an outside launcher started
  // several), the ranks agree at the start of training and stop there.
  if (w.world == 1 && stop_signal_received() != 0) {
    const int sig = stop_signal_received();
    TR_LOG_WARN(stopped_before_training(sig, ""));
    return exit_code_for_stop_signal(sig);
  }
  if (w.rank == 0) {
    prepare_output_dir(job);
    write_text_file(resolved, job_spec_to_yaml(job));
    TR_LOG_INFO("job: ", job.source, " -> ", job.output.dir, "/job.resolved.yaml");
  }
  return exit_code_for(run_training(job, w));
}

int cmd_validate(const std::string& config, const std::vector<std::string>& sets) {
  JobSpec job = load_resolved_job_spec(config, sets);
  std::cout << job_spec_to_yaml(job);
  return 0;
}

// What `generate` reads and writes text with: --tokenizer, else the
// tokenizer.json of the HF directory it samples from, or of the job's
// model.init_from (a fine-tune of an HF model), or the copy a run made of
// its data's tokenizer (core/train/data_text.h); none: bytes (vocab 256) or
// token ids.
struct GenerateText {
  std::string tokenizer, chat_template;  // chat_template: "" = the tokenizer's default
  bool chat = false, allow_special = false;
  std::string system;
  std::string adapter;  // --adapter: a PEFT LoRA/DoRA directory, applied unmerged
  std::string base_dtype = "auto";  // --base-dtype: the weights as a model.base_dtype run holds them
  std::vector<std::string> stop;    // --stop: texts of single tokens that end the sample
};

namespace {
std::string find_tokenizer(const GenerateText& gt, const std::string& ckpt, bool hf, const std::string& file,
                           std::string* dir_out) {
  if (!gt.tokenizer.empty()) {
    *dir_out = fs::path(gt.tokenizer).parent_path().string();
    return gt.tokenizer;
  }
  const std::string dir = hf ? ckpt : init_from_of_model_file(file);
  *dir_out = dir;
  if (!dir.empty() && fs::exists(fs::path(dir) / "tokenizer.json")) return (fs::path(dir) / "tokenizer.json").string();
  if (hf) return "";
  const std::string run_tok = run_tokenizer_of_model_file(file);
  *dir_out = run_tok.empty() ? "" : fs::path(run_tok).parent_path().string();
  return run_tok;
}

// eos_token_id (a number or a list) of generation_config.json, else config.json, in `dir`.
std::vector<int32_t> eos_ids_of(const std::string& dir) {
  std::vector<int32_t> out;
  for (const char* name : {"generation_config.json", "config.json"}) {
    std::ifstream f(fs::path(dir) / name);
    if (!f) continue;
    try {
      const nlohmann::json j = nlohmann::json::parse(f);
      if (!j.contains("eos_token_id")) continue;
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) out.push_back(e.get<int32_t>());
      if (e.is_array())
        for (const auto& x : e)
          if (x.is_number_integer()) out.push_back(x.get<int32_t>());
      return out;
    } catch (const std::exception&) {
    }
  }
  return out;
}
}  // namespace

int cmd_generate(const std::string& ckpt, const std::string& prompt, SampleOptions so, const GenerateText& gt) {
  // Sampling on the CPU uses every weight at every token: the whole model is read.
  std::vector<float> flat;
  const bool hf = is_hf_model_dir(ckpt);
  const std::string file = hf ? ckpt : resolve_verified_model_file(ckpt, "generate");
  // Held at once while sampling starts: the fp32 weights read (4 bytes per
  // parameter), the CPU backend's copy (4) and its fp32 staging (4).
  constexpr double kGenerateHostBytesPerParam = 12;
  const std::unique_ptr<ModelArch> arch = make_model_arch(
      hf ? load_hf(ckpt, flat, "generate", kGenerateHostBytesPerParam) : load_model_safetensors(file, flat));
  const ModelConfig& cfg = arch->config();
  TR_LOG_INFO("generate: ", file, " (", arch->describe(), ")");
  if (gt.base_dtype != "auto" && gt.base_dtype != "fp32") {
    // As a QLoRA (nf4) or bf16-base run computed: the adapter was trained on
    // these values, not on the file's.
    round_trip_base(*arch, flat, gt.base_dtype);
    TR_LOG_INFO("generate: base weights as model.base_dtype ", gt.base_dtype, " holds them",
                gt.base_dtype == "nf4" ? " (each block linear's weight NF4-quantized and dequantized)" : " (rounded to bf16)");
  }
  if (!gt.adapter.empty())
    TR_LOG_INFO("generate: adapter ", gt.adapter, " applied unmerged (as peft's PeftModel; export --merge folds it in)");
  TR_CHECK(gt.chat || (gt.chat_template.empty() && gt.system.empty()),
           "generate: --chat-template and --system apply to --chat; add --chat");
  std::string tok_dir;
  const std::string tok_path = find_tokenizer(gt, ckpt, hf, file, &tok_dir);
  TR_CHECK(!tok_path.empty() || !gt.chat, "generate --chat: no tokenizer.json with the model (",
           hf ? ckpt : file, "); pass --tokenizer tokenizer.json");
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> ids;
  if (!tok_path.empty()) {
    try {
      tok = std::make_unique<Tokenizer>(Tokenizer::load(tok_path));
    } catch (const Error& e) {
      // One found beside the model that trainrun cannot read (a normalizer,
      // a SentencePiece-style pre-tokenizer): the model still samples, on
      // token ids. Asked for by name (--tokenizer, --chat): an error.
      if (!gt.tokenizer.empty() || gt.chat) throw;
      TR_LOG_WARN("generate: not using ", tok_path, " (", e.what(),
                  "); --prompt is read as token ids and the output printed as ids");
    }
  }
  if (tok) {
    TR_CHECK(int64_t(tok->vocab_size()) <= cfg.V, "generate: the tokenizer '", tok_path, "' has ", tok->vocab_size(),
             " tokens but the model's vocab is ", cfg.V, "; pass the model's own tokenizer (--tokenizer)");
    std::vector<uint32_t> u;
    if (gt.chat) {
      // As apply_chat_template(add_generation_prompt=True): the model's own
      // template (or --chat-template), rendered, encoded whole.
      const chat::ChatTemplate tmpl =
          chat::ChatTemplate::resolve(*tok, tok_path, gt.chat_template, "generate --chat-template");
      std::vector<chat::Message> msgs;
      if (!gt.system.empty()) msgs.push_back({"system", gt.system});
      msgs.push_back({"user", prompt});
      TokenEncoder enc(*tok);
      tmpl.encode(enc, msgs, true, u, nullptr);
      // The reply ends with the template's end of turn.
      if (const int64_t eot = tmpl.end_of_turn(*tok); eot >= 0) so.stop_tokens.push_back(int32_t(eot));
      TR_LOG_INFO("generate: chat template ", tmpl.description());
      ids.assign(u.begin(), u.end());
    } else {
      ids = encode_text_prompt(*tok, prompt, gt.allow_special);  // as HF's encode(): BOS (Llama 3), then the text
    }
    so.vocab_limit = int(tok->vocab_size());  // a padded model vocab's extra rows have no text
    // --stop: an added/special token by its content (<|endoftext|>), else a
    // text that encodes to one token (" cat"); the sample ends after it, as
    // transformers' generate ends after eos_token_id.
    for (const std::string& st : gt.stop) {
      int64_t id = tok->special_id(st);
      if (id < 0) {
        const std::vector<uint32_t> one = tok->encode(st, true);
        TR_CHECK(one.size() == 1, "generate --stop '", st, "': ", tok_path, " encodes it to ", one.size(),
                 " tokens; --stop takes one token: a special token's text (such as <|endoftext|>) or a word the "
                 "vocabulary holds whole");
        id = one[0];
      }
      so.stop_tokens.push_back(int32_t(id));
    }
    if (!tok_dir.empty())
      for (int32_t e : eos_ids_of(tok_dir)) so.stop_tokens.push_back(e);
    TR_LOG_INFO("generate: tokenizer ", tok_path, ", prompt ", ids.size(), " tokens",
                gt.chat ? " (chat template)" : "");
  } else {
    TR_CHECK(gt.chat_template.empty() && !gt.allow_special && gt.stop.empty(), "generate: --chat-template, "
             "--allow-special and --stop need a tokenizer (--tokenizer tokenizer.json, or one next to the model)");
    ids = encode_prompt(prompt, cfg.V);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto toks = sample_tokens(*arch, flat, ids, so, gt.adapter);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const size_t made = toks.size() - ids.size();
  TR_LOG_INFO("generate: ", made, " tokens in ", dt, " s (", dt > 0 ? double(made) / dt : 0.0,
              " tokens/s, KV cache, prefill of ", ids.size(), " included)");
  if (tok) {
    std::cout << decode_text(*tok, toks) << "\n";  // as HF's decode: bytes that end inside a character become U+FFFD
  } else {
    std::cout << decode_tokens(toks, cfg.V);
    if (cfg.V != 256) std::cout << "\n";
  }
  std::cout.flush();
  return 0;
}

// `trainrun plan`: what the job (or a model shape) needs per GPU under
// each sharding strategy. Flags override the job's fields.
struct PlanArgs {
  std::string config, model, gpu = "h100", gpu_memory, checkpointing, offload, host_memory;
  std::string topology, nvidia_smi_topo;  // the node's TP links
  std::string pp_schedule;                // "" = the job's parallel.pipeline_schedule, else 1f1b
  std::string pp_reshard;                 // "" = the job's parallel.pipeline_reshard, else auto
  int pp_virtual_stages = 0;              // 0 = the job's, else 2 for interleaved_1f1b, else 1
  double host_adamw = 0, pcie = 0, nvme_bw = 0;
  std::vector<std::string> sets;
  int gpus = 0, nodes = 1, micro_batch = 0, global_batch = 0;
  // Parameter-efficient fine-tuning: "" = the job's model.adapter (none without a job).
  std::string adapter, base_dtype, target_modules;
  int adapter_rank = 0;
  bool adapter_rank_set = false;  // --rank given (else the job's model.adapter.rank, else 16)
};

int cmd_plan(const PlanArgs& a) {
  PlanRequest req;
  req.gpu = a.gpu;
  bool from_job = false;
  std::string job_topology_file;
  int job_nproc = 0;
  if (!a.config.empty()) {
    JobSpec job = load_resolved_job_spec(a.config, a.sets);
    from_job = true;
    if (a.model.empty()) req.model = ModelConfig::from_spec(job.model);
    req.micro_batch = job.train.micro_batch_size;
    req.global_batch = job.train.derived_global_batch_size();
    req.checkpointing = job.train.activation_checkpointing == "blocks";
    req.job_strategy = job.parallel.sharding;
    req.shard_group_size = job.parallel.shard_group_size;
    req.offload = job.parallel.offload;
    req.sequence_parallel = job.parallel.sequence_parallel_on();
    req.job_tp = job.parallel.tensor_parallel;
    req.job_pp = job.parallel.pipeline_parallel;
    req.job_cp = job.parallel.context_parallel;
    req.cp_mode = job.parallel.cp_mode;
    if (!job.parallel.pipeline_schedule.empty()) req.pp_schedule = job.parallel.pipeline_schedule;
    req.pipeline_reshard = job.parallel.pipeline_reshard;
    if (job.parallel.pipeline_virtual_stages > 1) req.pp_virtual_stages = job.parallel.pipeline_virtual_stages;
    job_topology_file = job.parallel.topology_file;
    job_nproc = job.parallel.nproc_per_node;
    if (job.parallel.nproc_per_node > 0) req.gpus_per_node = job.parallel.nproc_per_node;
    // An adapter job plans as one: the frozen base in model.base_dtype and the adapters' state.
    req.adapter.type = job.model.adapter.type;
    req.adapter.rank = job.model.adapter.rank;
    req.adapter.target_modules = job.model.adapter.target_modules;
    req.adapter.base_dtype = job.model.base_dtype;
  }
  if (!a.adapter.empty()) req.adapter.type = a.adapter;
  if (a.adapter_rank_set) req.adapter.rank = a.adapter_rank;
  else if (!from_job) req.adapter.rank = 16;
  if (!a.target_modules.empty()) req.adapter.target_modules = a.target_modules;
  if (!a.base_dtype.empty()) req.adapter.base_dtype = a.base_dtype;
  TR_CHECK(req.adapter.on() || (!a.adapter_rank_set && a.target_modules.empty() && a.base_dtype.empty()),
           "plan: --rank, --target-modules and --base-dtype describe adapters; add --adapter lora or --adapter dora "
           "(or plan a job with model.adapter)");
  if (!a.model.empty()) req.model = parse_model_shape(a.model);
  if (!a.pp_schedule.empty()) req.pp_schedule = a.pp_schedule;
  if (!a.pp_reshard.empty()) req.pipeline_reshard = a.pp_reshard;
  if (a.pp_virtual_stages > 0) req.pp_virtual_stages = a.pp_virtual_stages;
  if (a.gpus > 0) req.gpus_per_node = a.gpus;
  req.nodes = a.nodes;
  if (!a.gpu_memory.empty()) req.gpu_memory = parse_bytes(a.gpu_memory, "--gpu-memory");
  if (a.micro_batch > 0) req.micro_batch = a.micro_batch;
  if (!a.checkpointing.empty()) req.checkpointing = a.checkpointing == "blocks";
  if (!a.offload.empty()) req.offload = a.offload;
  if (!a.host_memory.empty()) req.host_memory = parse_bytes(a.host_memory, "--host-memory");
  if (a.host_adamw > 0) req.host_adamw_params_per_s = a.host_adamw;
  if (a.pcie > 0) req.pcie_bytes_per_s = a.pcie;
  if (a.nvme_bw > 0) req.nvme_bytes_per_s = a.nvme_bw;
  // TP links from the node's topology: a saved description, nvidia-smi
  // text, or the job's parallel.topology_file. The groups are those a
  // launch would make (topo::tp_groups over decide()'s rank -> GPU order).
  std::string topo_file = a.topology, smi_file = a.nvidia_smi_topo;
  if (topo_file.empty() && smi_file.empty() && !a.config.empty()) topo_file = job_topology_file;
  if (!topo_file.empty() || !smi_file.empty()) {
    const topo::Topology t = !topo_file.empty() ? topo::load_topology(topo_file)
                                                : topo::make_nvidia_smi_source(smi_file)->read();
    TR_CHECK(t.gpu_count() > 0, "plan: the topology in ", !topo_file.empty() ? topo_file : smi_file,
             " has no GPUs; plan needs a GPU node's description (trainrun topo --save on one)");
    if (a.gpus == 0 && !(from_job && job_nproc > 0)) req.gpus_per_node = t.gpu_count();
    req.topology_source = !topo_file.empty() ? topo_file : smi_file;
    req.topology_has_nvlink = false;
    for (const auto& row : t.links)
      for (const auto& l : row) req.topology_has_nvlink = req.topology_has_nvlink || l.kind == topo::LinkKind::NVLink;
    const GpuSpec* spec = find_gpu_spec(req.gpu);
    for (int tp : {2, 4, 8}) {
      if (tp > req.gpus_per_node) break;
      topo::DecisionInputs in;
      in.nproc = req.gpus_per_node;
      in.backend = "cuda";
      const topo::Decisions d = topo::decide(t, in);
      PlanRequest::TpLink link;
      link.tp = tp;
      link.kind = "NVLink";
      int nvlinks = 1 << 30;
      for (const topo::TpGroup& g : topo::tp_groups(t, d, tp)) {
        if (g.kind == topo::TpLinkKind::CrossNode) link.kind = "cross-node";
        else if (g.kind != topo::TpLinkKind::NVLink && link.kind == "NVLink") link.kind = "PCIe", link.detail = topo::describe_tp_group(g);
        else if (g.kind == topo::TpLinkKind::NVLink && g.slowest.kind == topo::LinkKind::NVLink) nvlinks = std::min(nvlinks, g.slowest.nvlinks);
      }
      // NVLink: 25 GB/s per link per direction (NVLink 3 and 4), at most the
      // GPU's; PCIe: --pcie; a group past the node: the network.
      const double nvlink_bw = spec ? spec->nvlink_bytes_per_s : 450e9;
      link.bytes_per_s = link.kind == "PCIe"         ? req.pcie_bytes_per_s
                         : link.kind == "cross-node" ? (spec ? spec->network_bytes_per_s : 50e9)
                         : nvlinks < (1 << 30)       ? std::min(nvlink_bw, 25e9 * nvlinks)
                                                     : nvlink_bw;
      if (link.kind == "NVLink" && nvlinks < (1 << 30)) link.detail = "NV" + std::to_string(nvlinks) + " between its GPUs";
      req.tp_links.push_back(link);
    }
  }
  // Without a job: one micro-batch per GPU per step unless told otherwise.
  if (a.global_batch > 0) req.global_batch = a.global_batch;
  else if (!from_job) req.global_batch = req.micro_batch * req.gpus_per_node * req.nodes;
  std::cout << render_plan(make_plan(req));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) should fail a write with EFBIG, which the
  // checkpoint code reports and survives, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  // A preemption signal may come while a job is still starting: from here
  // on it is noted rather than fatal (core/train/preemption.h). An agent
  // hands its workers these signals blocked; they are delivered now.
  install_stop_handlers();
  unblock_stop_signals();
  CLI::App app{"trainrun: train transformer language models on CPUs and GPUs"};
  app.set_version_flag("--version", std::function<std::string()>(version_string));
  app.require_subcommand(0, 1);
  std::string config;
  std::vector<std::string> sets;
  app.add_option("--config", config, "job spec (YAML)")->check(CLI::ExistingFile);
  app.add_option("--set", sets, "override a job spec field: --set train.lr=3e-4 (repeatable)");
  bool explain = false;
  app.add_flag("--explain", explain,
               "print the mesh and each pipeline rank's schedule (its action list, simulated bubble) and exit");
  // torchrun-style static rendezvous across nodes (outside Slurm; under
  // srun the node rank and count come from SLURM_*), see docs/slurm.md.
  LaunchFlags lflags;
  app.add_option("--nnodes", lflags.nnodes, "nodes in the job, one agent each (launcher.nnodes)")
      ->check(CLI::Range(1, 65536));
  app.add_option("--node-rank", lflags.node_rank, "this node's rank: 0 hosts the rendezvous store")
      ->check(CLI::Range(0, 65535));
  app.add_option("--master-addr", lflags.master_addr, "address of node 0's rendezvous store (launcher.master_addr)");
  app.add_option("--master-port", lflags.master_port, "port of node 0's rendezvous store (launcher.master_port)")
      ->check(CLI::Range(1, 65535));

  auto* validate = app.add_subcommand("validate", "print the fully resolved job spec, or the first error");
  std::string vconfig;
  std::vector<std::string> vsets;
  validate->add_option("--config", vconfig, "job spec (YAML)")->required();
  validate->add_option("--set", vsets, "override a field (repeatable)");

  auto* prepare = app.add_subcommand(
      "prepare", "tokenize text, jsonl or chat data into llm.c shards (byte-level, or an HF tokenizer.json)");
  PrepareOptions popts;
  prepare->add_option("--input", popts.inputs, "text or jsonl files, or directories of them")->required();
  prepare->add_option("--output", popts.output_dir, "output directory")->required();
  prepare->add_option("--val-fraction", popts.val_fraction, "fraction of the data held out for validation (0: no val shard)")
      ->capture_default_str();
  prepare->add_option("--tokenizer", popts.tokenizer, "Hugging Face tokenizer.json (byte-level BPE); default: byte-level, vocab 256");
  prepare->add_option("--format", popts.format, "input format")
      ->capture_default_str()->check(CLI::IsMember({"text", "jsonl", "chat", "alpaca", "sharegpt", "preference"}));
  prepare->add_option("--text-field", popts.text_field, "jsonl: the field holding each document")->capture_default_str();
  prepare->add_option("--seq-len", popts.seq_len, "check that each split holds seq_len + 1 tokens; count longer documents")
      ->check(CLI::NonNegativeNumber);
  prepare->add_option("--threads", popts.threads, "encoding threads (0: all cores)")->capture_default_str()
      ->check(CLI::Range(0, 4096));
  prepare->add_option("--chat-template", popts.chat_template,
                      "chat formats: llama3 | chatml | plain | a template name of tokenizer_config.json | a Jinja file "
                      "(default: the model's chat_template beside --tokenizer)");
  prepare->add_flag("--train-on-input", popts.train_on_input, "chat formats: every token in the loss, not only the replies");
  prepare->add_flag("--allow-special", popts.allow_special,
                    "match special tokens spelled in the text (as HF encode does); default: they are plain text");
  prepare->add_option("--document-separator", popts.document_separator,
                      "text: a line holding only this string ends a document (dropped; the next one starts with the "
                      "document-start token), e.g. '%' for fortune files");
  prepare->add_option("--shard-tokens", popts.shard_tokens, "tokens per shard file")->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}));

  const auto tokenizer_cmd = TokenizerCommand::add(app);

  auto* generate = app.add_subcommand("generate", "sample text from a trained model");
  std::string ckpt, prompt;
  SampleOptions so;
  generate->add_option("--checkpoint", ckpt, "run directory, checkpoint directory, .safetensors file or Hugging Face model directory")->required();
  generate->add_option("--prompt", prompt, "prompt text (token ids if the vocab is not bytes)")->required();
  generate->add_option("--max-tokens", so.max_tokens, "tokens to generate")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  generate->add_option("--temperature", so.temperature, "softmax temperature (0: greedy)")->capture_default_str()->check(CLI::Range(0.0, 100.0));
  generate->add_option("--top-k", so.top_k, "sample from the k most likely tokens (0: all, 1: greedy)")->capture_default_str()->check(CLI::NonNegativeNumber);
  generate->add_option("--seed", so.seed, "sampling seed")->capture_default_str();
  GenerateText gt;
  generate->add_option("--tokenizer", gt.tokenizer, "tokenizer.json for the prompt and the output (default: the one next to the model, its model.init_from's, or the run's copy of its data's tokenizer; none: bytes or token ids)");
  generate->add_flag("--chat", gt.chat, "wrap the prompt as a user message in the chat template and stop at the end of the assistant's turn");
  generate->add_option("--system", gt.system, "with --chat: a system message before the prompt");
  generate->add_option("--chat-template", gt.chat_template, "with --chat: llama3 | chatml | plain | a template name | a Jinja file (default: the model's chat_template beside the tokenizer)");
  generate->add_option("--adapter", gt.adapter, "a PEFT LoRA or DoRA adapter directory (a run's adapter/, or peft's save_pretrained) to sample with, applied unmerged as peft's PeftModel computes (s B A x added after each adapted GEMM)");
  generate->add_option("--base-dtype", gt.base_dtype, "the base's weights as a run with this model.base_dtype held them: nf4 = each block linear's weight NF4-quantized and dequantized (QLoRA), bf16 = rounded; auto/fp32 = as in the file")->capture_default_str()->check(CLI::IsMember({"auto", "fp32", "bf16", "nf4"}));
  generate->add_flag("--allow-special", gt.allow_special, "match special tokens spelled in --prompt (default: they are text)");
  generate->add_option("--stop", gt.stop, "end the sample after this token (repeatable): a special token's text such as '<|endoftext|>' (a document's end), or a text the tokenizer encodes as one token");

  auto* export_cmd = app.add_subcommand("export", "write a model as a Hugging Face directory (GPT2LMHeadModel / LlamaForCausalLM)");
  std::string exp_ckpt, exp_format = "safetensors", exp_out, exp_dtype = "fp32", exp_shard = "5GB", exp_merge;
  export_cmd->add_option("--checkpoint", exp_ckpt, "run directory (its latest checkpoint), checkpoint directory, .safetensors file or Hugging Face model directory")->required();
  export_cmd->add_option("--format", exp_format, "output format")->capture_default_str()->check(CLI::IsMember({"safetensors"}));
  export_cmd->add_option("--out", exp_out, "directory to write; AutoModelForCausalLM.from_pretrained(DIR) loads it")->required();
  export_cmd->add_option("--dtype", exp_dtype, "weights dtype: fp32, or bf16 (round to nearest even)")->capture_default_str()->check(CLI::IsMember({"fp32", "bf16"}));
  export_cmd->add_option("--merge", exp_merge, "a PEFT LoRA or DoRA adapter directory (a run's adapter/, or peft's save_pretrained) to merge into the weights: W + (alpha/r) B A on each adapted linear (DoRA: each row then scaled to its magnitude, m (W + (alpha/r) B A) / ||W + (alpha/r) B A||), as peft's merge_and_unload()");
  export_cmd->add_option("--max-shard-size", exp_shard, "above it, model-0000i-of-0000N.safetensors shards + model.safetensors.index.json (5GB = 5e9 bytes; KB/MB/GB/TB, KiB/MiB/GiB/TiB or bytes)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            try {
              parse_max_shard_size(v);
            } catch (const std::exception& e) {
              const std::string m = e.what(), flag = "--max-shard-size: ";
              return m.rfind(flag, 0) == 0 ? m.substr(flag.size()) : m;  // CLI11 names the flag itself
            }
            return "";
          },
          "SIZE"));

  auto* plot = app.add_subcommand("plot", "draw loss, val loss and throughput of a run to <dir>/plot.svg (needs gnuplot)");
  std::string plot_dir;
  PlotOptions plot_opts;
  plot->add_option("dir", plot_dir, "the run's output.dir (holds metrics.jsonl)")->required();
  plot->add_option("--format", plot_opts.format, "image format")->capture_default_str()->check(CLI::IsMember({"svg", "png"}));
  plot->add_option("--output", plot_opts.output, "image path (default <dir>/plot.<format>)");

  auto* plan = app.add_subcommand("plan", "per-GPU memory, fit, largest micro-batch and step time for each sharding strategy");
  PlanArgs pa;
  plan->add_option("--config", pa.config, "job spec (YAML): model, batch, checkpointing, sharding")->check(CLI::ExistingFile);
  plan->add_option("--set", pa.sets, "override a job spec field (repeatable)");
  plan->add_option("--model", pa.model, "a model shape instead of the job's model: " + model_shape_help());
  plan->add_option("--gpus", pa.gpus, "GPUs per node (default: parallel.nproc_per_node, else 8)")->check(CLI::Range(1, 1024));
  plan->add_option("--nodes", pa.nodes, "nodes")->capture_default_str()->check(CLI::Range(1, 65536));
  plan->add_option("--gpu", pa.gpu, "GPU type: a100, h100, h200 (peak FLOP/s, memory, links)")->capture_default_str();
  plan->add_option("--gpu-memory", pa.gpu_memory, "memory per GPU, e.g. 80GiB or 80GB (default: the GPU's)");
  plan->add_option("--micro-batch", pa.micro_batch, "sequences per GPU per forward (default: the job's, else 1)")->check(CLI::Range(1, 1 << 20));
  plan->add_option("--global-batch", pa.global_batch, "sequences per optimizer step (default: the job's, else one micro-batch per GPU)")->check(CLI::Range(1, 1 << 30));
  plan->add_option("--activation-checkpointing", pa.checkpointing, "none or blocks (default: the job's, else none)")->check(CLI::IsMember({"none", "blocks"}));
  plan->add_option("--offload", pa.offload, "none, cpu or nvme: optimizer state off the GPU (default: the job's parallel.offload, else none)")->check(CLI::IsMember({"none", "cpu", "nvme"}));
  plan->add_option("--host-memory", pa.host_memory, "host memory per node for offload, e.g. 2TB (default: not checked)");
  plan->add_option("--host-adamw", pa.host_adamw, "host AdamW parameters/s per node (default 4e9; measure with trainrun bench optimizer)")->check(CLI::PositiveNumber);
  plan->add_option("--pcie", pa.pcie, "host<->GPU bytes/s per GPU (default 25e9)")->check(CLI::PositiveNumber);
  auto* plan_topo = plan->add_option("--topology", pa.topology, "the node's topology (saved with trainrun topo --save): which TP degrees stay on NVLink (default: the job's parallel.topology_file, else NVLink inside a node)")->check(CLI::ExistingFile);
  plan->add_option("--nvidia-smi-topo", pa.nvidia_smi_topo, "the node's `nvidia-smi topo -m` output, instead of --topology")->check(CLI::ExistingFile)->excludes(plan_topo);
  plan->add_option("--pp-schedule", pa.pp_schedule, "pipeline schedule for the PP table: 1f1b, gpipe, interleaved_1f1b or zero_bubble (default: the job's parallel.pipeline_schedule, else 1f1b)")->check(CLI::IsMember({"1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"}));
  plan->add_option("--pp-reshard", pa.pp_reshard, "parallel.pipeline_reshard for the PP table: auto (true under full_shard and hybrid_shard), true (a stage gathers each unit per use) or false (it holds its units and fp32 gradients all step) (default: the job's, else auto)")->check(CLI::IsMember({"auto", "true", "false"}));
  plan->add_option("--pp-virtual-stages", pa.pp_virtual_stages, "model chunks per pipeline rank for interleaved_1f1b (default: the job's, else 2)")->check(CLI::Range(1, 64));
  plan->add_option("--nvme-bandwidth", pa.nvme_bw, "NVMe bytes/s per node for offload nvme (default 12e9)")->check(CLI::PositiveNumber);
  plan->add_option("--adapter", pa.adapter, "plan a parameter-efficient fine-tune: lora or dora adapters on a frozen base (default: the job's model.adapter, else a full fine-tune)");
  plan->add_option("--rank", pa.adapter_rank, "the adapters' rank r (default: the job's model.adapter.rank, else 16)");
  plan->add_option("--target-modules", pa.target_modules, "the linears to adapt: HF short names, comma-joined (q_proj,v_proj), or all-linear (default: the job's, else all-linear)");
  plan->add_option("--base-dtype", pa.base_dtype, "how the frozen base is held: auto (bf16 on GPUs), fp32, bf16 or nf4 (QLoRA) (default: the job's model.base_dtype, else auto)");

  auto* topo_cmd = app.add_subcommand("topo", "describe this node's GPUs, links, NUMA and NICs, and what a launch would do");
  topo::TopoCommandOptions to;
  auto* topo_smi = topo_cmd->add_option("--nvidia-smi-topo", to.nvidia_smi_file, "read `nvidia-smi topo -m` output from FILE instead of this machine");
  auto* topo_file = topo_cmd->add_option("--topology", to.topology_file, "load a description saved with --save");
  auto* topo_sysfs = topo_cmd->add_option("--sysfs-root", to.sysfs_root, "read /sys under DIR (a copied or fake tree) instead of /");
  topo_smi->excludes(topo_file)->excludes(topo_sysfs);
  topo_file->excludes(topo_sysfs);
  topo_cmd->add_option("--nproc", to.nproc, "ranks to plan for (default: one per GPU, 1 without GPUs)")->check(CLI::Range(1, 1024));
  topo_cmd->add_option("--tp", to.tp, "show the tensor-parallel groups for this degree and their links (default: the --config job's parallel.tensor_parallel)")->check(CLI::Range(1, 1024));
  topo_cmd->add_option("--cp", to.cp, "show the context-parallel groups for this degree (at --tp, default 1) and their links (default: the --config job's parallel.context_parallel)")->check(CLI::Range(1, 1024));
  topo_cmd->add_option("--config", to.config, "job spec: its parallel.tensor_parallel, nproc_per_node and topology_file (flags here win)")->check(CLI::ExistingFile);
  topo_cmd->add_flag("--json", to.json, "print the description and the decisions as JSON");
  topo_cmd->add_option("--save", to.save_file, "write the description to FILE (load it with --topology or parallel.topology_file)");

  auto* bench = app.add_subcommand("bench", "benchmarks that print a table");
  bench->require_subcommand(1);
  auto* bench_comm = bench->add_subcommand("comm", "all_reduce / reduce_scatter / all_gather bandwidth (nccl-tests style)");
  CommBenchOptions cb;
  bench_comm->add_option("--backend", cb.backend, "cpu (Gloo) or cuda (NCCL)")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  bench_comm->add_option("--nproc", cb.nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 64));
  bench_comm->add_option("--min-bytes", cb.min_bytes, "smallest message")->capture_default_str()->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench_comm->add_option("--max-bytes", cb.max_bytes, "largest message")->capture_default_str()->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench_comm->add_option("--iters", cb.iters, "iterations per size (0: adaptive)")->capture_default_str()->check(CLI::NonNegativeNumber);
  TpStepBenchOptions tpb;
  bench_comm->add_option("--tp", cb.tp, "TP group size for the TP rows: bf16 activation collectives, and training steps at tp1 vs this (0: no TP rows)")->capture_default_str()->check(CLI::Range(0, 64));
  bench_comm->add_option("--tp-config", tpb.config, "job spec whose model and micro-batch size the TP rows use (default: the CPU benchmark model, configs/bench_cpu.yaml)")->check(CLI::ExistingFile);
  bench_comm->add_option("--tp-steps", tpb.steps, "training steps per mesh for the tp1 vs tp step rows, the first not counted (0: skip them)")->capture_default_str()->check(CLI::Range(0, 1000));
  auto* bench_ckpt = bench->add_subcommand("checkpoint", "checkpoint write/read GB/s next to the disk's sequential speed; training blocked with async on/off");
  CheckpointBenchOptions cbo;
  bench_ckpt->add_option("--params", cbo.params, "model size in parameters: 124000000, 124M, 1.5B")->capture_default_str();
  bench_ckpt->add_option("--dir", cbo.dir, "directory on the disk to measure (a scratch folder inside is removed after)")->capture_default_str();
  bench_ckpt->add_option("--repeat", cbo.repeat, "repetitions (the table shows medians)")->capture_default_str()->check(CLI::Range(1, 100));
  bench_ckpt->add_option("--tp2", cbo.tp2, "also checkpoint a tp2 Llama trained one step on two ranks: seconds and pwrites")->capture_default_str();

  auto* bench_kernels = bench->add_subcommand("kernels", "CUDA kernels and GEMMs: GB/s or TFLOP/s next to the card's copy bandwidth and cuBLASLt rate");
  KernelBenchOptions kbo;
  bench_kernels->add_option("--device", kbo.device, "GPU index")->capture_default_str()->check(CLI::NonNegativeNumber);
  bench_kernels->add_option("--repeats", kbo.repeats, "timed launches per kernel (median)")->capture_default_str()->check(CLI::Range(3, 1000));
  bench_kernels->add_flag("--quick", kbo.quick, "small sizes (a smoke run)");

  auto* bench_pipe = bench->add_subcommand("pipeline", "each pipeline schedule's measured bubble next to its formula, what the stage costs (model), the ops' time noise (replay) and the runtime itself add to it, and its step time against pp1 (CPU backend, one core per stage)");
  PipelineBenchOptions pbo;
  bench_pipe->add_option("--stages", pbo.stages, "pipeline stages p (ranks)")->capture_default_str()->check(CLI::Range(2, 64));
  bench_pipe->add_option("--microbatches", pbo.microbatches, "microbatches m per step")->capture_default_str()->check(CLI::Range(1, 4096));
  bench_pipe->add_option("--steps", pbo.steps, "steps per job (the first 2 are warm-up)")->capture_default_str()->check(CLI::Range(3, 1000));
  bench_pipe->add_option("--layers", pbo.layers, "GPT-2 blocks")->capture_default_str()->check(CLI::Range(2, 1024));
  bench_pipe->add_option("--width", pbo.width, "GPT-2 n_embd (a multiple of 4)")->capture_default_str()->check(CLI::Range(4, 65536));
  auto* bench_opt = bench->add_subcommand("optimizer", "host AdamW (parallel.offload) parameters/s at 1 and 2 threads next to a memory triad and torch.optim.AdamW");
  OptimizerBenchOptions obo;
  bench_opt->add_option("--params", obo.params, "elements of the optimizer shard: 32M, 100000000")->capture_default_str();
  bench_opt->add_option("--threads", obo.threads, "thread counts to measure")->capture_default_str()->check(CLI::Range(1, 1024));
  bench_opt->add_option("--repeat", obo.repeat, "timed runs per row (median)")->capture_default_str()->check(CLI::Range(1, 1000));
  bench_opt->add_option("--python", obo.python, "interpreter with torch for the PyTorch rows (\"\" skips them)")->capture_default_str();

  auto* bench_off = bench->add_subcommand("offload", "parallel.offload nvme streaming GB/s next to the disk's O_DIRECT sequential read/write, and step time with offload none/cpu/nvme on the benchmark model");
  OffloadBenchOptions offo;
  bench_off->add_option("--params", offo.params, "elements of the optimizer shard: 32M, 100000000")->capture_default_str();
  bench_off->add_option("--dir", offo.dir, "directory on the disk to measure, as parallel.offload_dir (a scratch folder inside is removed after)")->capture_default_str();
  bench_off->add_option("--repeat", offo.repeat, "timed runs per row (median)")->capture_default_str()->check(CLI::Range(1, 100));
  bench_off->add_option("--config", offo.config, "the step-time model (\"\" skips that table)")->capture_default_str();
  bench_off->add_option("--steps", offo.steps, "steps per step-time run (the median skips the first 3)")->capture_default_str()->check(CLI::Range(5, 1000));
  auto* bench_lora = bench->add_subcommand("lora", "step time, trainable parameters and optimizer memory of adapters (LoRA r=16 on every linear) vs a full fine-tune of the CPU benchmark model, at 1 thread and every core, in one run");
  LoraBenchOptions lbo;
  bench_lora->add_option("--config", lbo.config, "the model, batch and data (a job spec)")->capture_default_str();
  bench_lora->add_option("--adapter", lbo.adapter, "lora or dora")->capture_default_str()->check(CLI::IsMember({"lora", "dora"}));
  bench_lora->add_option("--rank", lbo.rank, "the adapters' rank r")->capture_default_str();
  bench_lora->add_option("--target-modules", lbo.target_modules, "the linears to adapt (HF short names, comma-joined, or all-linear)")->capture_default_str();
  bench_lora->add_option("--steps", lbo.steps, "steps per run (the median skips the first 2)")->capture_default_str()->check(CLI::Range(3, 1000));
  bench_lora->add_option("--rounds", lbo.rounds, "full and adapter runs, alternating; the lower median of each is kept")->capture_default_str()->check(CLI::Range(1, 100));
  bench_lora->add_option("--threads", lbo.threads, "OpenMP thread counts, one pair of runs each (default: 1 and every core)")->delimiter(',')->check(CLI::Range(1, 1024));
  auto* bench_cp = bench->add_subcommand("cp", "context parallelism: step time of one long sequence on one rank and split over cp ranks, and the share of it spent waiting on the ring's K/V (CPU backend, one core per rank)");
  CpBenchOptions cpo;
  bench_cp->add_option("--seq-len", cpo.T, "tokens per sequence")->capture_default_str()->check(CLI::Range(8, 1 << 20));
  bench_cp->add_option("--cp", cpo.cps, "cp degrees to measure (1: one rank)")->capture_default_str()->delimiter(',')->check(CLI::Range(1, 64));
  bench_cp->add_option("--mode", cpo.mode, "ring or all_to_all")->capture_default_str()->check(CLI::IsMember({"ring", "all_to_all"}));
  bench_cp->add_option("--steps", cpo.steps, "steps per degree (the first is warm-up)")->capture_default_str()->check(CLI::Range(2, 1000));
  bench_cp->add_option("--layers", cpo.layers, "Llama blocks")->capture_default_str()->check(CLI::Range(1, 1024));
  bench_cp->add_option("--width", cpo.width, "n_embd (a multiple of --heads)")->capture_default_str()->check(CLI::Range(8, 65536));
  bench_cp->add_flag("--documents", cpo.documents, "random documents of ~512 tokens (document masks)");
  auto* bench_moe = bench->add_subcommand("moe", "mixture of experts: step time of a small Mixtral (E experts, top-K) against the dense Llama of equal active parameters (one MLP of K x the expert width), CPU backend, one rank");
  MoeBenchOptions moo;
  bench_moe->add_option("--experts", moo.experts, "experts per block (E)")->capture_default_str()->check(CLI::Range(1, 1024));
  bench_moe->add_option("--top-k", moo.top_k, "experts per token (K)")->capture_default_str()->check(CLI::Range(1, 1024));
  bench_moe->add_option("--expert-ffn", moo.expert_ffn, "each expert's MLP width (the dense MLP's is K x this)")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  bench_moe->add_option("--layers", moo.layers, "blocks")->capture_default_str()->check(CLI::Range(1, 1024));
  bench_moe->add_option("--width", moo.width, "n_embd (a multiple of 4 heads)")->capture_default_str()->check(CLI::Range(8, 65536));
  bench_moe->add_option("--seq-len", moo.seq_len, "tokens per sequence")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  bench_moe->add_option("--batch", moo.batch, "sequences per step")->capture_default_str()->check(CLI::Range(1, 4096));
  bench_moe->add_option("--steps", moo.steps, "steps per model (the first is warm-up)")->capture_default_str()->check(CLI::Range(2, 1000));

  // Hidden: the CUDA peer probe, run by the topology code in a child process
  // (parallel/topology/topology_probe.cpp) so the agent never holds a CUDA context.
  auto* probe_p2p = app.add_subcommand("probe-p2p", "");
  probe_p2p->group("");

  // Hidden: what the agent runs in each worker process (see core/launch/agent.h).
  auto* worker = app.add_subcommand("worker", "");
  worker->group("");
  std::string wconfig;
  worker->add_option("--config", wconfig, "the resolved job spec")->required();

  // Every command's --help ends with the page of docs/ that explains it
  // (tests/test_cli.cpp finds the commands in --help and checks that each
  // names a page that exists); a new subcommand adds its line here.
  app.footer("Docs: docs/quickstart.md (running a job, every command), docs/job-spec.md (the job spec); "
             "every page: docs/README.md");
  const std::pair<CLI::App*, const char*> doc_pages[] = {
      {validate, "docs/job-spec.md"},       {prepare, "docs/data-format.md"},   {generate, "docs/models.md"},
      {export_cmd, "docs/models.md"},       {plot, "docs/monitoring.md"},       {plan, "docs/planner.md"},
      {topo_cmd, "docs/planner.md"},        {bench, "docs/benchmarks.md"},      {bench_comm, "docs/benchmarks.md"},
      {bench_ckpt, "docs/benchmarks.md"},   {bench_kernels, "docs/benchmarks.md"},
      {bench_pipe, "docs/benchmarks.md"},   {bench_opt, "docs/benchmarks.md"},  {bench_off, "docs/benchmarks.md"},
      {bench_lora, "docs/benchmarks.md"},   {bench_cp, "docs/benchmarks.md"},   {bench_moe, "docs/benchmarks.md"},
      {tokenizer_cmd->command(), "docs/data-format.md"},
  };
  for (const auto& [sub, page] : doc_pages) sub->footer(std::string("Docs: ") + page);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    restore_default_stop_handlers();
    // --help / --version are "errors" with exit code 0; everything else is a usage error.
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  // Only running a job stops gracefully; every other command ends on a
  // signal as any program does.
  if (!*worker && !app.get_subcommands().empty()) restore_default_stop_handlers();

  try {
    if (*worker) return run_worker(wconfig);
    if (*probe_p2p) {
      std::vector<std::string> bus;
      std::vector<std::vector<int>> ok;
      std::string why;
      if (!cuda_peer_probe(&bus, &ok, &why)) {
        std::cerr << "trainrun probe-p2p: " << why << "\n";
        return 1;
      }
      std::cout << "bus";
      for (const auto& b : bus) std::cout << " " << b;
      std::cout << "\n";
      for (const auto& row : ok) {
        for (size_t j = 0; j < row.size(); ++j) std::cout << (j ? " " : "") << row[j];
        std::cout << "\n";
      }
      return 0;
    }
    if (*validate) return cmd_validate(vconfig, vsets);
    if (*topo_cmd) return topo::run_topo_command(to, std::cout);
    if (*bench_comm) {
      if (cb.tp == 1) cb.tp = 0;  // tp 1 has no TP traffic
      if (!tpb.config.empty()) {
        // The TP rows' sizes: one micro-batch's activations of that job.
        const JobSpec tj = load_resolved_job_spec(tpb.config, {});
        cb.tp_values = int64_t(tj.train.micro_batch_size) * tj.model.seq_len * tj.model.n_embd;
        cb.tp_shape = std::to_string(tj.train.micro_batch_size) + " x " + std::to_string(tj.model.seq_len) + " x " +
                      std::to_string(tj.model.n_embd) + " (" + tpb.config + ")";
      }
      const int rc = run_comm_bench(cb);
      if (rc != 0 || cb.tp < 2 || tpb.steps == 0) return rc;
      if (cb.backend != "cpu") {
        std::printf("# training-step rows (tp1 vs tp%d) run on the CPU backend only: use --backend cpu\n", cb.tp);
        return rc;
      }
      tpb.tp = cb.tp;
      std::string described;
      const std::vector<TpStepRow> rows = run_tp_step_bench(tpb, &described);
      std::cout << format_tp_step_table(rows, described) << std::flush;
      return rc;
    }
    if (*bench_ckpt) return run_checkpoint_bench(cbo);
    if (*bench_kernels) return run_kernel_bench(kbo);
    if (*bench_opt) return run_optimizer_bench(obo);
    if (*bench_off) return run_offload_bench(offo);
    if (*bench_lora) {
      std::string described;
      const std::vector<LoraBenchRow> rows = run_lora_bench(lbo, &described);
      std::cout << format_lora_bench_table(rows, described) << std::flush;
      return 0;
    }
    if (*bench_pipe) return run_pipeline_bench(pbo);
    if (*bench_cp) {
      std::string described;
      const std::vector<CpBenchRow> rows = run_cp_bench(cpo, &described);
      std::cout << format_cp_table(rows, described, cpo) << std::flush;
      return 0;
    }
    if (*bench_moe) {
      std::cout << format_moe_table(run_moe_bench(moo), moo) << std::flush;
      return 0;
    }
    if (*export_cmd) {
      HfExportOptions eo;
      eo.dtype = exp_dtype;
      eo.max_shard_bytes = parse_max_shard_size(exp_shard);
      const std::string from = exp_merge.empty() ? export_checkpoint_hf(exp_ckpt, exp_out, eo)
                                                 : export_merged_hf(exp_ckpt, exp_merge, exp_out, eo);
      TR_LOG_INFO("export: ", from, " -> ", exp_out, " (Hugging Face directory, ", exp_dtype, ")");
      std::cout << exp_out << "\n";
      return 0;
    }
    if (*prepare) {
      std::cout << prepare_shards(popts) << "\n";
      return 0;
    }
    if (tokenizer_cmd->parsed()) return tokenizer_cmd->run();
    if (*generate) return cmd_generate(ckpt, prompt, so, gt);
    if (*plot) {
      std::cout << plot_run(plot_dir, plot_opts) << "\n";
      return 0;
    }
    if (*plan) {
      if (pa.config.empty() && pa.model.empty()) {
        std::cerr << plan->help() << "\ntrainrun: error: plan needs --config job.yaml or --model SHAPE"
                  << (pa.adapter.empty() ? "" : " (--adapter " + pa.adapter + " adapts a base model: name it)") << "\n";
        return 2;
      }
      pa.adapter_rank_set = plan->get_option("--rank")->count() > 0;
      if (pa.config.empty() && !pa.sets.empty()) {
        std::cerr << "trainrun: error: plan: --set needs --config (it overrides the job's fields)\n";
        return 2;
      }
      return cmd_plan(pa);
    }
    if (config.empty()) {
      std::cerr << app.help() << "\ntrainrun: error: --config is required to run a job\n";
      return 2;
    }
    return cmd_run(config, sets, lflags, explain);
  } catch (const Error& e) {
    std::cerr << "trainrun: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "trainrun: internal error: " << e.what() << std::endl;
    return 1;
  }
}
