// End-to-end tests of the trainrun binary: the commands, their outputs on
// disk, exit codes and messages, and training behaviour that only a whole run
// shows (loss at init, reaching the entropy floor, determinism).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/config/job_spec.h"
#include "core/model/model_io.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

// Tiny synthetic job: 16-state Markov chain, a model that can learn it in seconds.
std::string synthetic_job(const std::string& dir, int steps = 300) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 16, seq_len: 32}\n"
         "data: {format: synthetic, synthetic: {vocab: 16, branching: 3}}\n"
         "train: {global_batch_size: 16, micro_batch_size: 8, max_steps: " + std::to_string(steps) +
         ", lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: " + std::to_string(std::min(20, steps)) + ", log_interval: 10, eval_interval: 100, eval_steps: 8}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {nproc_per_node: 1}\n";
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

// Minimal extraction of a numeric field from one metrics.jsonl line.
double field(const std::string& line, const std::string& key) {
  auto p = line.find("\"" + key + "\":");
  if (p == std::string::npos) return NAN;
  return std::stod(line.substr(p + key.size() + 3));
}

std::string env1() { return "OMP_NUM_THREADS=1 "; }

}  // namespace

TEST_CASE("cli: --version names the backends", "[cli]") {
  auto r = test::run_trainrun("--version");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("trainrun ") && Contains("cpu") && Contains("cuda"));
}

// Test executables hide the GPUs (tests/support/hide_gpus.cpp), so these
// hold on a GPU machine too: auto falls back with the reason, cuda refuses.
TEST_CASE("cli: backend auto falls back to the CPU without a GPU and backend cuda is a clear error", "[cli]") {
  const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
  REQUIRE(vis != nullptr);
  CHECK(std::string(vis).empty());
  test::TempDir dir("cli");
  test::write_file(dir / "job.yaml", synthetic_job(dir / "run", 2));
  auto r = test::run_trainrun("--config " + dir / "job.yaml" + " --set backend=auto");
  REQUIRE(r.exit_code == 0);
  // A binary built without the CUDA plugin falls back quietly (there was
  // never a GPU to expect); one with it says why it could not use one.
  const bool cuda_built = test::run_trainrun("--version").out.find("cuda: not available") == std::string::npos;
  if (cuda_built) CHECK_THAT(r.err + r.out, Contains("no usable GPU") && Contains("using the CPU backend"));
  CHECK(test::file_exists(dir / "run/model.safetensors"));
  test::TempDir dir2("cli");
  test::write_file(dir2 / "job.yaml", synthetic_job(dir2 / "run", 2));
  r = test::run_trainrun("--config " + dir2 / "job.yaml" + " --set backend=cuda");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("backend: 'cuda' was requested but there is no usable GPU") &&
                        Contains("use backend: cpu or auto"));
  CHECK_FALSE(test::file_exists(dir2 / "run/model.safetensors"));
}

TEST_CASE("cli: --help on every subcommand", "[cli]") {
  for (const char* sub : {"", "validate ", "prepare ", "generate "}) {
    auto r = test::run_trainrun(std::string(sub) + "--help");
    INFO(sub);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("Usage") || Contains("OPTIONS"));
  }
}

namespace {

// The commands a --help lists under "Subcommands:" (CLI11 2.x's layout: two
// spaces, the name, its description; the list ends at a blank line), so a
// command added later is checked too.
std::vector<std::string> listed_subcommands(const std::string& help) {
  std::vector<std::string> names;
  bool in = false;
  for (const auto& line : lines_of(help)) {
    if (line == "Subcommands:" || line == "SUBCOMMANDS:") {
      in = true;
      continue;
    }
    if (!in) continue;
    if (line.find_first_not_of(' ') == std::string::npos) break;
    if (line.size() < 3 || line[0] != ' ' || line[2] == ' ') continue;  // a continuation line
    names.push_back(line.substr(2, line.find(' ', 2) - 2));
  }
  return names;
}

}  // namespace

TEST_CASE("cli: every command's --help names the docs page that explains it, and the page exists", "[cli][docs]") {
  std::vector<std::string> commands = {""};
  for (const auto& s : listed_subcommands(test::run_trainrun("--help").out)) commands.push_back(s + " ");
  for (const auto& s : listed_subcommands(test::run_trainrun("bench --help").out)) commands.push_back("bench " + s + " ");
  // validate prepare generate export plot plan topo bench + bench's six, at least.
  CHECK(commands.size() >= 15);
  for (const auto& cmd : commands) {
    INFO("trainrun " << cmd << "--help");
    auto r = test::run_trainrun(cmd + "--help");
    REQUIRE(r.exit_code == 0);
    const auto p = r.out.find("Docs: docs/");
    REQUIRE(p != std::string::npos);  // add the command to doc_pages in apps/main.cpp
    // Every page the footer names (top level: several) exists in the checkout.
    for (auto q = r.out.find("docs/", p); q != std::string::npos; q = r.out.find("docs/", q + 1)) {
      const auto e = r.out.find(".md", q);
      REQUIRE(e != std::string::npos);
      const std::string page = r.out.substr(q, e + 3 - q);
      INFO(page);
      CHECK(test::file_exists(test::source_dir() + "/" + page));
    }
  }
  CHECK_THAT(test::run_trainrun("plan --help").out, Contains("Docs: docs/planner.md"));
  CHECK_THAT(test::run_trainrun("--help").out, Contains("docs/quickstart.md") && Contains("docs/job-spec.md"));
}

TEST_CASE("cli: usage errors exit 2", "[cli]") {
  auto r = test::run_trainrun("");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--config is required"));
  r = test::run_trainrun("--config /nonexistent/job.yaml");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("/nonexistent/job.yaml"));
  r = test::run_trainrun("generate --prompt hi");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--checkpoint"));
}

TEST_CASE("cli: validate prints the resolved spec or the error", "[cli]") {
  test::TempDir dir("cli");
  test::write_file(dir / "job.yaml", synthetic_job(dir / "run"));
  auto r = test::run_trainrun("validate --config " + dir / "job.yaml" + " --set train.lr=5e-3");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("lr: 0.005") && Contains("sharding: full_shard") && Contains("max_steps: 300"));

  test::write_file(dir / "bad.yaml", "model:\n  n_layer: 2\n  n_haed: 4\n");
  r = test::run_trainrun("validate --config " + dir / "bad.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("bad.yaml:3:3: model.n_haed: unknown key; did you mean 'model.n_head'?"));
  CHECK(r.out.empty());

  r = test::run_trainrun("validate --config " + dir / "job.yaml" + " --set train.lr=abc");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("--set train.lr=abc: train.lr: expected a number, got 'abc'"));
}

TEST_CASE("cli: a synthetic run writes its outputs, starts at ln(V) and reaches the entropy floor", "[cli]") {
  test::TempDir dir("cli");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", synthetic_job(run));
  auto r = test::run_command(env1() + "'" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(test::file_exists(run + "/job.resolved.yaml"));
  REQUIRE(test::file_exists(run + "/model.safetensors"));
  CHECK_THAT(r.err, Contains("entropy floor"));

  auto lines = lines_of(test::read_file(run + "/metrics.jsonl"));
  REQUIRE(lines.size() == 31);  // step 1 and every 10th
  for (const char* k : {"step", "loss", "lr", "grad_norm", "tokens_per_sec"}) CHECK(!std::isnan(field(lines[0], k)));
  // Loss at initialisation: uniform predictions over V = 16 tokens.
  CHECK(std::fabs(field(lines[0], "loss") - std::log(16.0)) < 0.1);
  // The entropy floor is printed in the log; the final val loss must be within 0.05 nats.
  auto p = r.err.find("entropy floor (the lowest reachable loss) H = ");
  REQUIRE(p != std::string::npos);
  double H = std::stod(r.err.substr(p + 46));
  double val = field(lines.back(), "val_loss");
  INFO("final val_loss " << val << " vs entropy floor " << H);
  CHECK(val - H < 0.05);
  CHECK(val > H - 0.02);  // cannot beat the floor by more than sampling noise

  // Other tools read the weights: the real safetensors package.
  std::string py = test::source_dir() + "/.venv/bin/python";
  INFO("needs the venv: scripts/install-deps.sh --test");
  REQUIRE(test::file_exists(py));
  auto pr = test::run_command("'" + py + "' -c \"from safetensors.numpy import load_file; from safetensors import safe_open; "
                              "t = load_file('" + run + "/model.safetensors'); "
                              "m = safe_open('" + run + "/model.safetensors', 'np').metadata(); "
                              "print(len(t), t['transformer.wte.weight'].shape, t['transformer.h.1.mlp.c_fc.weight'].shape, m['n_layer'])\"");
  INFO(pr.err);
  REQUIRE(pr.exit_code == 0);
  CHECK(pr.out == "28 (16, 32) (128, 32) 2\n");
}

TEST_CASE("cli: two identical runs give identical losses", "[cli]") {
  test::TempDir dir("cli");
  std::string metrics[2];
  for (int i = 0; i < 2; ++i) {
    const std::string run = dir / ("run" + std::to_string(i));
    test::write_file(dir / "job.yaml", synthetic_job(run, 30));
    auto r = test::run_command("OMP_NUM_THREADS=2 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
    REQUIRE(r.exit_code == 0);
    // Compare everything but the timing fields.
    for (const auto& l : lines_of(test::read_file(run + "/metrics.jsonl")))
      metrics[i] += std::to_string(field(l, "step")) + " " + l.substr(0, l.find(",\"tokens_per_sec\"")) + "\n";
  }
  REQUIRE(!metrics[0].empty());
  CHECK(metrics[0] == metrics[1]);
}

TEST_CASE("cli: prepare, train on llm.c shards, generate greedily", "[cli]") {
  test::TempDir dir("cli");
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  test::write_file(dir / "in/a.txt", text);
  auto r = test::run_trainrun("prepare --input " + dir / "in" + " --output " + dir / "data" + " --val-fraction 0.1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("train tokens") && Contains("val tokens"));
  REQUIRE(test::file_exists(dir / "data/train_000000.bin"));
  REQUIRE(test::file_exists(dir / "data/val_000000.bin"));

  test::write_file(dir / "job.yaml",
                   "model: {n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 256, seq_len: 32}\n"
                   "data: {format: llmc, train: '" + dir / "data/train_*.bin" + "', val: '" + dir / "data/val_*.bin" + "'}\n"
                   "train: {global_batch_size: 8, micro_batch_size: 8, max_steps: 150, lr: 1.0e-2, min_lr: 1.0e-3, warmup_steps: 10, eval_interval: 50, eval_steps: 2}\n"
                   "output: {dir: '" + dir / "run" + "', sample_tokens: 20, sample_prompt: 'the '}\n");
  r = test::run_command(env1() + "'" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("sample:"));
  auto lines = lines_of(test::read_file(dir / "run/metrics.jsonl"));
  CHECK(field(lines.back(), "val_loss") < 1.0);  // a repeated sentence is easy

  // Greedy generation: only prompt + continuation on stdout, deterministic,
  // and the same from the run directory and from the .safetensors file.
  const std::string g = "generate --prompt 'the quick' --max-tokens 30 --top-k 1 --checkpoint ";
  auto g1 = test::run_trainrun(g + dir / "run");
  auto g2 = test::run_trainrun(g + dir / "run/model.safetensors");
  INFO(g1.err);
  REQUIRE(g1.exit_code == 0);
  CHECK(g1.out.size() == 9 + 30);
  CHECK(g1.out.rfind("the quick", 0) == 0);
  CHECK(g1.out == g2.out);
  CHECK_THAT(g1.out, Contains("brown fox"));  // the model learned the sentence

  // Sampling with a seed is reproducible, and differs across seeds.
  const std::string s = "generate --prompt 'the ' --max-tokens 40 --temperature 1.5 --top-k 0 --checkpoint " + dir / "run";
  auto s1 = test::run_trainrun(s + " --seed 1"), s1b = test::run_trainrun(s + " --seed 1"), s2 = test::run_trainrun(s + " --seed 2");
  CHECK(s1.out == s1b.out);
  CHECK(s1.out != s2.out);
}

TEST_CASE("cli: bad inputs give a clear error and exit 1", "[cli]") {
  test::TempDir dir("cli");
  // Missing data file.
  test::write_file(dir / "job.yaml", "model: {vocab_size: 256, seq_len: 16, n_layer: 1, n_embd: 16, n_head: 2}\n"
                                     "data: {format: llmc, train: '" + dir / "nope_*.bin" + "'}\n"
                                     "output: {dir: '" + dir / "run" + "'}\n");
  auto r = test::run_trainrun("--config " + dir / "job.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("data.train") && Contains("nope_*.bin"));

  // Truncated shard.
  std::string hdr(1024, '\0');
  int32_t h[3] = {20240520, 1, 1000};
  std::memcpy(&hdr[0], h, sizeof h);
  test::write_file(dir / "short.bin", hdr + std::string(100, 'a'));
  test::write_file(dir / "job2.yaml", "model: {vocab_size: 256, seq_len: 16, n_layer: 1, n_embd: 16, n_head: 2}\n"
                                      "data: {format: llmc, train: '" + dir / "short.bin" + "'}\n"
                                      "output: {dir: '" + dir / "run" + "'}\n");
  r = test::run_trainrun("--config " + dir / "job2.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("short.bin") && Contains("truncated"));

  // Tokens beyond the model's vocabulary.
  test::write_file(dir / "job3.yaml", "model: {vocab_size: 100, seq_len: 8, n_layer: 1, n_embd: 16, n_head: 2}\n"
                                      "data: {format: raw_uint16, train: '" + dir / "raw.bin" + "'}\n"
                                      "output: {dir: '" + dir / "run" + "'}\n");
  std::string raw;
  for (uint16_t t : {1, 2, 3, 250, 4, 5, 6, 7, 8, 9, 10, 11}) raw.append(reinterpret_cast<char*>(&t), 2);
  test::write_file(dir / "raw.bin", raw);
  r = test::run_trainrun("--config " + dir / "job3.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("raw.bin") && Contains("250"));

  // Batch that does not split into micro-batches.
  test::write_file(dir / "job4.yaml", synthetic_job(dir / "run4") + "train: {global_batch_size: 10, micro_batch_size: 4}\n");
  r = test::run_trainrun("validate --config " + dir / "job4.yaml");
  CHECK(r.exit_code == 1);

  // generate with a path that holds no model.
  r = test::run_trainrun("generate --checkpoint " + dir.path() + " --prompt x");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("neither checkpoints/latest nor model.safetensors"));
  // generate with a corrupt safetensors file.
  test::write_file(dir / "bad.safetensors", "garbage that is not a safetensors file");
  r = test::run_trainrun("generate --checkpoint " + dir / "bad.safetensors" + " --prompt x");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("bad.safetensors"));
  // A prompt with non-byte tokens for a non-byte vocab.
  test::write_file(dir / "job5.yaml", synthetic_job(dir / "run5", 2));
  REQUIRE(test::run_trainrun("--config " + dir / "job5.yaml").exit_code == 0);
  r = test::run_trainrun("generate --checkpoint " + dir / "run5" + " --prompt 'hello'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("token ids"));
  r = test::run_trainrun("generate --checkpoint " + dir / "run5" + " --prompt '1 2 3' --max-tokens 5 --top-k 1");
  CHECK(r.exit_code == 0);
  CHECK(lines_of(r.out).size() == 1);
}

// ---- the shipped configs ------------------------------------------------------------

namespace {

// The SFT example's two configs (sft_*.yaml) read what scripts/sft/run.sh
// makes first (a tokenizer, its shards, the exported base model): the
// script's own test below runs them.
// The configs that build on the SFT example's outputs (sft_*.yaml, and
// dpo_example.yaml from its runs/sft_example/base) are the SFT example's
// to run (scripts/sft); here they must still parse.
std::vector<std::string> shipped_configs() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(test::source_dir() + "/configs")) {
    if (e.path().extension() != ".yaml" || e.path().filename().string().rfind("sft_", 0) == 0) continue;
    if (load_job_spec(e.path().string()).model.init_from.find("runs/sft_example/") != std::string::npos) continue;
    out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// What the smoke run's warning says for a config whose warmup outlasts 3 steps.
std::string warmup_warning(int warmup) {
  return "train.warmup_steps (" + std::to_string(warmup) + ") > train.max_steps (3): warming up over all 3 steps";
}

}  // namespace

// "Does this config still work?" is asked with a short run: `--set
// train.max_steps=3` must give a valid job for every config we ship, whatever
// its warmup (the warmup shrinks to the run, with the warning).
TEST_CASE("cli: every shipped config validates as a 3-step smoke run", "[cli]") {
  const std::vector<std::string> configs = shipped_configs();
  REQUIRE(configs.size() >= 3);
  for (const std::string& cfg : configs) {
    INFO(cfg);
    const int warmup = load_job_spec(cfg).train.warmup_steps;
    const auto r = test::run_trainrun("validate --config '" + cfg + "' --set train.max_steps=3");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const JobSpec resolved = parse_job_spec(r.out, "resolved.yaml");
    CHECK(resolved.train.max_steps == 3);
    CHECK(resolved.train.warmup_steps == std::min(warmup, 3));
    if (warmup > 3)
      CHECK_THAT(r.err, Contains(warmup_warning(warmup)));
    else
      CHECK(r.err.find("warming up") == std::string::npos);
  }
}

// And the smoke run itself, 3 steps of each config on this machine's CPU
// backend, from a scratch directory (the configs' relative output and data
// paths land there). What is changed, and why:
//   - output.dir: the scratch directory, not the checkout's runs/;
//   - data: configs that read prepared shards (quickstart) get them the
//     way scripts/quickstart.sh prepares them, from the fortunes corpus
//     (with a BPE of the model's vocab when it is not bytes); only where
//     Debian's fortunes is not installed do they fall back to synthetic data;
//   - configs made for a GPU (backend: cuda, GPT-2 124M at 32 x 1024 tokens a
//     step, about a minute per step on 2 cores) run on the CPU with one
//     sequence of 64 tokens: the model's width, depth and vocabulary, the data,
//     optimizer and schedule stay the config's. Their GPU run is
//     scripts/gpu-check.sh's;
//   - and GPU configs of a billion parameters (Llama-3.2-1B: fp32 weights,
//     grads and AdamW state alone are 20 GB, about this machine's memory)
//     also shrink to 2 layers, 256 wide, F 512 and a 1024-token vocabulary,
//     keeping the architecture, heads, RoPE scaling and tying.
TEST_CASE("cli: every shipped config runs a 3-step smoke run", "[cli]") {
  const bool have_fortunes = test::file_exists("/usr/share/games/fortunes");
  for (const std::string& cfg : shipped_configs()) {
    INFO(cfg);
    const JobSpec job = load_job_spec(cfg);
    test::TempDir dir("smoke");
    std::string sets = " --set train.max_steps=3 --set output.dir='" + dir / "run" + "'";
    if (job.data.format != "synthetic") {
      if (have_fortunes) {
        // Into data.train's directory: bytes for a vocab of 256, else a BPE
        // of the model's vocab first, as scripts/quickstart.sh trains it.
        const std::string bin = "'" + test::trainrun_binary() + "'";
        std::string prep = "cd '" + dir.path() + "' && ";
        std::string tok;
        if (job.model.vocab_size != 256) {
          prep += bin + " tokenizer train --input /usr/share/games/fortunes --vocab-size " +
                  std::to_string(job.model.vocab_size) + " --special-tokens '<|endoftext|>' --output tok --quiet && ";
          tok = " --tokenizer tok/tokenizer.json";
        }
        prep += bin + " prepare --input /usr/share/games/fortunes --output '" +
                std::filesystem::path(job.data.train).parent_path().string() + "' --val-fraction 0.02" + tok;
        const auto prep_run = test::run_command(prep);
        INFO(prep_run.err);
        REQUIRE(prep_run.exit_code == 0);
      } else {
        WARN("fortunes is not installed: " << cfg << " runs on synthetic data");
        sets += " --set data.format=synthetic";
      }
    }
    if (job.backend == "cuda")
      sets += " --set backend=cpu --set train.global_batch_size=1 --set train.micro_batch_size=1 --set model.seq_len=64";
    const double approx_params = double(job.model.vocab_size) * job.model.n_embd +
                                 12.0 * job.model.n_layer * double(job.model.n_embd) * job.model.n_embd;
    // A GPU config's size means nothing on the CPU (gpt2_124m took 44 s of
    // this case at full size): 2 layers of width 8 per head, vocab 1024;
    // every other field is the config's. gpt2's MLP (arch auto is gpt2) is 4 n_embd (0).
    if (job.backend == "cuda" && approx_params > 5e7)
      sets += " --set model.n_layer=2 --set model.n_embd=" + std::to_string(8 * job.model.n_head) +
              " --set model.ffn_dim=" + (job.model.arch == "gpt2" || job.model.arch == "auto" ? "0" : "512") +
              " --set model.vocab_size=1024 --set data.synthetic.vocab=1024";
    const auto r = test::run_command("cd '" + dir.path() + "' && '" + test::trainrun_binary() + "' --config '" + cfg +
                                     "'" + sets);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("step 3/3 |"));
    if (job.train.warmup_steps > 3) CHECK_THAT(r.err, Contains(warmup_warning(job.train.warmup_steps)));
    CHECK(lines_of(test::read_file(dir / "run/metrics.jsonl")).size() >= 1);
  }
}

TEST_CASE("cli: the SFT example (scripts/sft/run.sh) runs end to end: tokenizer, pretrain, export, masked chat "
          "fine-tune, generate --chat", "[cli][sft]") {
  if (!test::file_exists("/usr/share/games/fortunes")) {
    WARN("fortunes is not installed: the SFT example has no corpus");
    return;
  }
  test::hf_python();  // the example trains its tokenizer with the test venv's HF tokenizers
  test::TempDir dir("sft");
  const auto r = test::run_command("cd '" + test::source_dir() + "' && SFT_DIR='" + dir.path() +
                                   "' OMP_NUM_THREADS=2 bash scripts/sft/run.sh --smoke");
  INFO(r.err);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  // The chat shards carry loss masks; the fine-tune started from the export, the shape from its config.json.
  CHECK(test::file_exists(dir / "chat_data/train_000000.mask"));
  CHECK(test::file_exists(dir / "base/tokenizer.json"));
  CHECK_THAT(r.err, Contains("model.init_from: initial weights from " + dir / "base"));
  CHECK(test::read_file(dir / "chat/job.resolved.yaml").find("\n  arch: llama ") != std::string::npos);
  // generate --chat rendered the built-in llama3 template (Meta's Llama 3.1
  // one: its system block with the knowledge cutoff comes first, as
  // apply_chat_template gives) around the question.
  CHECK_THAT(r.out, Contains("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                             "December 2023\n"));
  CHECK_THAT(r.out, Contains("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a fortune about "
                             "computers.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));
}
