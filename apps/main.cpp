// trainrun: the command line. Thin by design: parse, dispatch, turn errors
// into one paragraph and an exit code. CLI11 lives in this file only.
//
// Exit codes: 0 ok, 1 error (message on stderr), 2 usage error.
#include <CLI/CLI.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/config/job_spec.h"
#include "core/data/dataset.h"
#include "core/launch/agent.h"
#include "core/model/model_io.h"
#include "core/train/generate.h"
#include "core/train/trainer.h"
#include "parallel/bench_comm.h"

namespace fs = std::filesystem;
using namespace trainrun;

namespace {

std::string version_string() {
  std::string s = std::string("trainrun ") + TRAINRUN_VERSION + "\nbackends: cpu (fp32, OpenBLAS + OpenMP)";
#if TRAINRUN_HAVE_CUDA
  s += ", cuda (compiled in)";
#else
  s += ", cuda: no (built without the CUDA toolkit)";
#endif
#if TRAINRUN_HAVE_GLOO
  s += "\ncollectives: gloo (TCP)";
#endif
  s += "\nnccl: no\ncudnn: no";
  return s;
}

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream f(path);
  TR_CHECK(f, "cannot write '", path.string(), "'; check that output.dir is writable");
  f << text;
  TR_CHECK(f.good(), "cannot write '", path.string(), "' (disk full?)");
}

int cmd_run(const std::string& config, const std::vector<std::string>& sets) {
  JobSpec job = load_job_spec(config, sets);
  // Several local workers (or restarts) need an agent; one worker, or a
  // process that an outside launcher (torchrun, srun) already placed via
  // RANK/WORLD_SIZE, trains right here.
  if (should_run_agent(job)) {
    std::error_code ec;
    fs::create_directories(job.output.dir, ec);
    TR_CHECK(!ec, "output.dir: cannot create '", job.output.dir, "': ", ec.message());
    const fs::path resolved = fs::path(job.output.dir) / "job.resolved.yaml";
    write_text_file(resolved, job_spec_to_yaml(job));
    TR_LOG_INFO("job: ", job.source, " -> ", resolved.string());
    return run_agent(job, fs::absolute(resolved).string());
  }
  WorkerInfo w = WorkerInfo::from_env();
  if (w.rank == 0) {
    std::error_code ec;
    fs::create_directories(job.output.dir, ec);
    TR_CHECK(!ec, "output.dir: cannot create '", job.output.dir, "': ", ec.message());
    write_text_file(fs::path(job.output.dir) / "job.resolved.yaml", job_spec_to_yaml(job));
    TR_LOG_INFO("job: ", job.source, " -> ", job.output.dir, "/job.resolved.yaml");
  }
  run_training(job, w);
  return 0;
}

int cmd_validate(const std::string& config, const std::vector<std::string>& sets) {
  JobSpec job = load_job_spec(config, sets);
  std::cout << job_spec_to_yaml(job);
  return 0;
}

int cmd_generate(const std::string& ckpt, const std::string& prompt, const SampleOptions& so) {
  const std::string file = resolve_model_file(ckpt);
  std::vector<float> flat;
  GPT2Config cfg = load_model_safetensors(file, flat);
  TR_LOG_INFO("generate: ", file, " (gpt2 L=", cfg.L, " C=", cfg.C, " V=", cfg.V, ")");
  auto toks = sample_tokens(cfg, flat, encode_prompt(prompt, cfg.V), so);
  std::cout << decode_tokens(toks, cfg.V);
  if (cfg.V != 256) std::cout << "\n";
  std::cout.flush();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) should fail a write with EFBIG, which the
  // checkpoint code reports and survives, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"trainrun: train transformer language models on CPUs and GPUs"};
  app.set_version_flag("--version", version_string());
  app.require_subcommand(0, 1);
  std::string config;
  std::vector<std::string> sets;
  app.add_option("--config", config, "job spec (YAML)")->check(CLI::ExistingFile);
  app.add_option("--set", sets, "override a job spec field: --set train.lr=3e-4 (repeatable)");

  auto* validate = app.add_subcommand("validate", "print the fully resolved job spec, or its errors");
  std::string vconfig;
  std::vector<std::string> vsets;
  validate->add_option("--config", vconfig, "job spec (YAML)")->required();
  validate->add_option("--set", vsets, "override a field (repeatable)");

  auto* prepare = app.add_subcommand("prepare", "tokenize text at byte level into llm.c shards");
  PrepareOptions popts;
  prepare->add_option("--input", popts.inputs, "text files or directories")->required();
  prepare->add_option("--output", popts.output_dir, "output directory")->required();
  prepare->add_option("--val-fraction", popts.val_fraction, "fraction of each input held out for validation")
      ->capture_default_str();

  auto* generate = app.add_subcommand("generate", "sample text from a trained model");
  std::string ckpt, prompt;
  SampleOptions so;
  generate->add_option("--checkpoint", ckpt, "run directory, checkpoint directory or .safetensors file")->required();
  generate->add_option("--prompt", prompt, "prompt text (token ids if the vocab is not bytes)")->required();
  generate->add_option("--max-tokens", so.max_tokens, "tokens to generate")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  generate->add_option("--temperature", so.temperature, "softmax temperature (0: greedy)")->capture_default_str()->check(CLI::Range(0.0, 100.0));
  generate->add_option("--top-k", so.top_k, "sample from the k most likely tokens (0: all, 1: greedy)")->capture_default_str()->check(CLI::NonNegativeNumber);
  generate->add_option("--seed", so.seed, "sampling seed")->capture_default_str();

  // Hidden: what the agent runs in each worker process (see core/launch/agent.h).
  auto* bench = app.add_subcommand("bench", "benchmarks that print a table");
  bench->require_subcommand(1);
  auto* bench_comm = bench->add_subcommand("comm", "all_reduce / reduce_scatter / all_gather bandwidth (nccl-tests style)");
  CommBenchOptions cb;
  bench_comm->add_option("--backend", cb.backend, "cpu (Gloo) or cuda (NCCL)")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  bench_comm->add_option("--nproc", cb.nproc, "ranks")->capture_default_str()->check(CLI::Range(1, 64));
  bench_comm->add_option("--min-bytes", cb.min_bytes, "smallest message")->capture_default_str()->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench_comm->add_option("--max-bytes", cb.max_bytes, "largest message")->capture_default_str()->check(CLI::Range(int64_t(4), int64_t(1) << 40));
  bench_comm->add_option("--iters", cb.iters, "iterations per size (0: adaptive)")->capture_default_str()->check(CLI::NonNegativeNumber);

  auto* worker = app.add_subcommand("worker", "");
  worker->group("");
  std::string wconfig;
  worker->add_option("--config", wconfig, "the resolved job spec")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help / --version are "errors" with exit code 0; everything else is a usage error.
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  try {
    if (*worker) return run_worker(wconfig);
    if (*validate) return cmd_validate(vconfig, vsets);
    if (*bench_comm) return run_comm_bench(cb);
    if (*prepare) {
      std::cout << prepare_byte_shards(popts) << "\n";
      return 0;
    }
    if (*generate) return cmd_generate(ckpt, prompt, so);
    if (config.empty()) {
      std::cerr << app.help() << "\ntrainrun: error: --config is required to run a job\n";
      return 2;
    }
    return cmd_run(config, sets);
  } catch (const Error& e) {
    std::cerr << "trainrun: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "trainrun: internal error: " << e.what() << std::endl;
    return 1;
  }
}
