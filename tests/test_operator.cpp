// Operator experience: the live status line and plain log lines, MFU, memory
// by category, metrics.jsonl, TensorBoard event files (read back with
// TensorBoard's own EventAccumulator from the repo venv), the end-of-run
// summary, and `trainrun plot` (gnuplot), with their errors.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/model/model_shape.h"
#include "core/train/planner.h"
#include "core/train/progress.h"
#include "core/train/tensorboard.h"
#include "kernels/backend.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

// A small synthetic job: fast, deterministic, with a validation set.
std::string job_yaml(const std::string& dir, int steps = 40, int nproc = 1, const std::string& sharding = "full_shard") {
  return "model: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 16, seq_len: 32}\n"
         "data: {format: synthetic, synthetic: {vocab: 16, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: " + std::to_string(steps) +
         ", lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 5, log_interval: 10, eval_interval: 20, eval_steps: 2}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {nproc_per_node: " + std::to_string(nproc) + ", sharding: " + sharding + "}\n";
}

std::vector<nlohmann::json> records(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(test::read_file(path));
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(nlohmann::json::parse(l));
  return out;
}

std::string venv_python() { return test::source_dir() + "/.venv/bin/python"; }

// One trained run shared by several tests (a run takes a second or two).
struct TrainedRun {
  test::TempDir dir{"op"};
  test::RunResult result;
  std::string run;
  TrainedRun() {
    run = dir / "run";
    test::write_file(dir / "job.yaml", job_yaml(run));
    // stderr is a file here: not a terminal, so plain lines.
    result = test::run_command("OMP_NUM_THREADS=2 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  }
};
TrainedRun& trained() {
  static TrainedRun r;
  return r;
}

}  // namespace

TEST_CASE("operator: crc32c and TFRecord framing match the standard vectors", "[operator]") {
  // RFC 3720 (iSCSI) appendix B.4 and the usual "123456789" check value.
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  std::string zeros(32, '\0'), ones(32, '\xff');
  CHECK(crc32c(zeros.data(), 32) == 0x8A9136AAu);
  CHECK(crc32c(ones.data(), 32) == 0x62A8AB43u);
  // Continuing a CRC over a split buffer gives the CRC of the whole.
  CHECK(crc32c("6789", 4, crc32c("12345", 5)) == 0xE3069283u);
  const uint32_t c = crc32c("123456789", 9);
  CHECK(masked_crc32c("123456789", 9) == ((c >> 15) | (c << 17)) + 0xa282ead8u);

  const std::string rec = tfrecord_frame("hello");
  REQUIRE(rec.size() == 8 + 4 + 5 + 4);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(rec[i])) << (8 * i);
  CHECK(len == 5);
  auto u32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(uint8_t(rec[at + i])) << (8 * i);
    return v;
  };
  CHECK(u32(8) == masked_crc32c(rec.data(), 8));
  CHECK(rec.substr(12, 5) == "hello");
  CHECK(u32(17) == masked_crc32c("hello", 5));
}

TEST_CASE("operator: TensorBoard's EventAccumulator reads what TensorBoardWriter writes", "[operator]") {
  const std::string py = venv_python();
  INFO("the repo venv needs tensorboard: bash scripts/install-deps.sh --test");
  REQUIRE(test::run_command("'" + py + "' -c 'import tensorboard'").exit_code == 0);
  test::TempDir dir("tb");
  {
    TensorBoardWriter w(dir / "tb");
    w.add_scalars(1, {{"loss/train", 2.5}, {"perf/mfu", 0.125}});
    w.add_scalars(2, {{"loss/train", 2.25}, {"loss/val", 2.375}, {"skipped", std::nan("")}});
    w.add_scalar("loss/train", 3, 2.0);
  }
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n"
      "import sys\n"
      "a = E(sys.argv[1]); a.Reload()\n"
      "for t in sorted(a.Tags()['scalars']):\n"
      "    print(t, ' '.join('%d:%r' % (e.step, e.value) for e in a.Scalars(t)))\n";
  test::write_file(dir / "read.py", script);
  auto r = test::run_command("'" + py + "' " + dir / "read.py" + " " + dir / "tb");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "loss/train 1:2.5 2:2.25 3:2.0\nloss/val 2:2.375\nperf/mfu 1:0.125\n");
}

TEST_CASE("operator: a resumed run's TensorBoard history replaces the abandoned steps", "[operator]") {
  const std::string py = venv_python();
  REQUIRE(test::run_command("'" + py + "' -c 'import tensorboard'").exit_code == 0);
  test::TempDir dir("tbresume");
  {
    TensorBoardWriter w(dir / "tb");  // the first attempt: steps 1-30, then it died
    w.add_session_start(1);
    for (int s = 1; s <= 30; ++s) w.add_scalar("loss/train", s, 100 + s);
  }
  {
    TensorBoardWriter w(dir / "tb");  // resumed from the checkpoint of step 20, in the same second
    w.add_session_start(21);
    for (int s = 21; s <= 25; ++s) w.add_scalar("loss/train", s, 200 + s);
  }
  test::write_file(dir / "read.py",
                   "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n"
                   "import sys\n"
                   "a = E(sys.argv[1]); a.Reload()\n"
                   "print(' '.join('%d:%g' % (e.step, e.value) for e in a.Scalars('loss/train')))\n");
  auto r = test::run_command("'" + py + "' " + dir / "read.py" + " " + dir / "tb");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::string want;
  for (int s = 1; s <= 20; ++s) want += std::to_string(s) + ":" + std::to_string(100 + s) + " ";
  for (int s = 21; s <= 25; ++s) want += std::to_string(s) + ":" + std::to_string(200 + s) + (s < 25 ? " " : "\n");
  CHECK(r.out == want);
}

TEST_CASE("operator: plain log lines, memory by category, metrics.jsonl with MFU and memory", "[operator]") {
  auto& t = trained();
  INFO(t.result.err);
  REQUIRE(t.result.exit_code == 0);
  const std::string& err = t.result.err;
  // Not a terminal: no carriage returns or escapes, one line per log_interval.
  CHECK(err.find('\r') == std::string::npos);
  CHECK(err.find('\033') == std::string::npos);
  CHECK_THAT(err, Contains("mfu: ") && Contains("MFLOP per token (6N + 12*L*C*T)") && Contains("measured: fp32 sgemm"));
  for (const char* s : {"step 1/40 | loss ", "step 10/40 | ", "step 20/40 | ", "step 40/40 | "}) CHECK_THAT(err, Contains(s));
  CHECK(err.find("step 11/40") == std::string::npos);
  // The fields of the status line, in the plain line.
  std::string line20 = err.substr(err.find("step 20/40"));
  line20 = line20.substr(0, line20.find('\n'));
  CHECK_THAT(line20, Contains(" tok/s | MFU ") && Contains("% | mem ") && Contains(" | elapsed 0:00:") &&
                         Contains(" | ETA 0:00:") && Contains(" | val_loss "));
  CHECK_THAT(err, Contains("memory (rank 0, full_shard, after step 1): peak ") && Contains(": params ") &&
                      Contains(", grads ") && Contains(", optimizer ") && Contains(", activations ") &&
                      Contains(", comm buffers ") && Contains(", workspace "));

  const auto recs = records(t.run + "/metrics.jsonl");
  REQUIRE(recs.size() == 5);  // steps 1, 10, 20, 30, 40
  for (const auto& r : recs) {
    const double mfu = r.at("mfu").get<double>();
    CHECK(mfu > 0);
    CHECK(mfu < 5);  // catches unit mistakes (x1000), not a peak measured on a busy machine
    const double sum = r.at("mem_params_bytes").get<double>() + r.at("mem_grads_bytes").get<double>() +
                       r.at("mem_optimizer_bytes").get<double>() + r.at("mem_activations_bytes").get<double>() +
                       r.at("mem_comm_bytes").get<double>() + r.at("mem_workspace_bytes").get<double>();
    CHECK(sum == Approx(r.at("mem_peak_bytes").get<double>()));
    CHECK(r.at("mem_activations_bytes").get<double>() > 0);
    CHECK(r.at("elapsed_sec").get<double>() > 0);
  }
  // The deterministic prefix of each record is unchanged: step, loss, lr, grad_norm, then tokens_per_sec.
  const std::string first = test::read_file(t.run + "/metrics.jsonl").substr(0, 200);
  CHECK(first.rfind("{\"step\":1,\"loss\":", 0) == 0);
  CHECK(first.find("\"grad_norm\"") < first.find("\"tokens_per_sec\""));
  CHECK(recs[2].contains("val_loss"));
}

TEST_CASE("operator: the run's TensorBoard files hold the same scalars as metrics.jsonl", "[operator]") {
  auto& t = trained();
  REQUIRE(t.result.exit_code == 0);
  const std::string py = venv_python();
  INFO("the repo venv needs tensorboard: bash scripts/install-deps.sh --test");
  REQUIRE(test::run_command("'" + py + "' -c 'import tensorboard'").exit_code == 0);
  test::write_file(t.dir / "read.py",
                   "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n"
                   "import sys, json\n"
                   "a = E(sys.argv[1]); a.Reload()\n"
                   "print(json.dumps({t: [[e.step, e.value] for e in a.Scalars(t)] for t in a.Tags()['scalars']}))\n");
  auto r = test::run_command("'" + py + "' " + t.dir / "read.py" + " " + t.run + "/tb");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto tb = nlohmann::json::parse(r.out);
  for (const char* tag : {"loss/train", "loss/val", "opt/lr", "opt/grad_norm", "perf/tokens_per_sec", "perf/mfu",
                          "memory/peak_mib", "memory/params_mib", "memory/activations_mib"})
    CHECK(tb.contains(tag));
  const auto recs = records(t.run + "/metrics.jsonl");
  const auto& loss = tb.at("loss/train");
  REQUIRE(loss.size() == recs.size());
  for (size_t i = 0; i < recs.size(); ++i) {
    CHECK(loss[i][0].get<int>() == recs[i].at("step").get<int>());
    CHECK(loss[i][1].get<double>() == Approx(recs[i].at("loss").get<double>()).epsilon(1e-6));  // stored as float32
  }
  const auto& val = tb.at("loss/val");
  REQUIRE(val.size() == 2);  // steps 20 and 40
  CHECK(val[1][0].get<int>() == 40);
  CHECK(val[1][1].get<double>() == Approx(recs.back().at("val_loss").get<double>()).epsilon(1e-6));
  CHECK(tb.at("memory/peak_mib")[0][1].get<double>() ==
        Approx(recs[0].at("mem_peak_bytes").get<double>() / 1048576.0).epsilon(1e-6));
}

TEST_CASE("operator: the end-of-run summary fits one screen and names the outputs", "[operator]") {
  auto& t = trained();
  REQUIRE(t.result.exit_code == 0);
  const std::string& err = t.result.err;
  const size_t at = err.find("run summary ");
  REQUIRE(at != std::string::npos);
  const std::string summary = err.substr(at);
  int lines = 0;
  for (char c : summary) lines += c == '\n';
  CHECK(lines <= 20);
  CHECK_THAT(summary, Contains("steps       40/40, 10,240 tokens in this run (256 per step)") &&
                          Contains(" tok/s mean, MFU ") && Contains("best val_loss ") &&
                          Contains("entropy floor ") && Contains("rank 0 peak ") &&
                          Contains(t.run + "/model.safetensors") && Contains(t.run + "/metrics.jsonl") &&
                          Contains(t.run + "/plot.svg") && Contains("tensorboard --logdir " + t.run + "/tb"));
  CHECK(test::file_exists(t.run + "/plot.svg"));
}

TEST_CASE("operator: a terminal gets one live status line", "[operator]") {
  test::TempDir dir("tty");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 30));
  // script(1) runs the command on a pseudo-terminal, so isatty(2) is true
  // exactly as for a person at a terminal.
  const std::string cmd = "OMP_NUM_THREADS=2 TRAINRUN_PLOT=0 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml";
  auto r = test::run_command("script -qefc \"" + cmd + "\" /dev/null");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const std::string& out = r.out;  // the pty's output, stderr included
  CHECK_THAT(out, Contains("\r\033[Kstep 30/30 | loss "));
  // The status line carries every field.
  const size_t s = out.rfind("\r\033[Kstep 30/30");
  std::string status = out.substr(s + 4);
  status = status.substr(0, status.find_first_of("\r\n"));
  CHECK_THAT(status, Contains(" tok/s | MFU ") && Contains("% | mem ") && Contains(" | elapsed ") && Contains(" | ETA "));
  // The log_interval lines still scroll above it, and the summary ends the run.
  CHECK_THAT(out, Contains("step 10/30 | loss ") && Contains("run summary "));

  // TRAINRUN_PROGRESS=plain turns it off on a terminal too.
  auto p = test::run_command("script -qefc \"TRAINRUN_PROGRESS=plain " + cmd + " --set output.dir=" + dir / "run2" +
                             "\" /dev/null");
  REQUIRE(p.exit_code == 0);
  CHECK(p.out.find("\033[K") == std::string::npos);
  CHECK_THAT(p.out, Contains("step 30/30 | loss "));
}

TEST_CASE("operator: with several workers the agent draws rank 0's status line on its terminal", "[operator]") {
  test::TempDir dir("tty2");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 30, 2));
  const std::string cmd = "OMP_NUM_THREADS=1 TRAINRUN_PLOT=0 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml";
  auto r = test::run_command("script -qefc \"" + cmd + "\" /dev/null");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const std::string& out = r.out;
  // Drawn in place by the agent, with every field, and the plain
  // log_interval lines (echoed with the rank) still scroll above it.
  CHECK_THAT(out, Contains("\r\033[Kstep 30/30 | loss "));
  const size_t s = out.rfind("\r\033[Kstep 30/30");
  REQUIRE(s != std::string::npos);
  std::string status = out.substr(s + 4);
  status = status.substr(0, status.find_first_of("\r\n"));
  CHECK_THAT(status, Contains(" tok/s | MFU ") && Contains(" | ETA "));
  CHECK_THAT(out, Contains("[rank 0] ") && Contains("step 10/30 | loss "));
  // The relay marker never reaches the screen or the rank's log.
  CHECK(out.find('\x1e') == std::string::npos);
  const std::string log = test::read_file(dir / "run/logs/rank0.log");
  CHECK(log.find('\x1e') == std::string::npos);
  CHECK(log.find("step 30/30 | loss ") != std::string::npos);  // the plain last-step line is logged
  // Not a terminal (a pipe, as in CI or Slurm): no status line at all.
  auto p = test::run_command(cmd + " --set output.dir=" + dir / "run2");
  REQUIRE(p.exit_code == 0);
  CHECK((p.out + p.err).find("\033[K") == std::string::npos);
  CHECK((p.out + p.err).find('\x1e') == std::string::npos);
}

TEST_CASE("operator: TRAINRUN_LOG_ALL_RANKS=1 shows every rank's lines, each prefixed once", "[operator]") {
  test::TempDir dir("allranks");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 10, 2));
  auto r = test::run_command("TRAINRUN_LOG_ALL_RANKS=1 OMP_NUM_THREADS=1 TRAINRUN_PLOT=0 '" + test::trainrun_binary() +
                             "' --config " + dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  for (const char* rank : {"[rank 0] ", "[rank 1] "})
    CHECK_THAT(r.err, Contains(std::string(rank) + "step 10/10 | loss "));
  CHECK_THAT(r.err, !Contains("[rank 0] [rank 0]") && !Contains("[rank 1] [rank 1]"));
  // The per-rank log files hold the rank's lines unprefixed.
  const std::string log1 = test::read_file(dir / "run/logs/rank1.log");
  CHECK_THAT(log1, Contains("\nstep 10/10 | loss ") && !Contains("[rank 1]"));
  // Without it only rank 0 reaches the terminal.
  auto q = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_PLOT=0 '" + test::trainrun_binary() + "' --config " +
                             dir / "job.yaml" + " --set output.dir=" + dir / "run2");
  REQUIRE(q.exit_code == 0);
  CHECK_THAT(q.err, Contains("[rank 0] step 10/10") && !Contains("[rank 1] step"));
}

TEST_CASE("operator: MFU's FLOPs per token and the GPU peak table", "[operator]") {
  // GPT-2 124M at T=1024: N = 124,439,808 parameters - 786,432 (wpe) =
  // 123,653,376; 6N + 12*L*C*T = 741,920,256 + 113,246,208.
  const auto m = make_model_arch(parse_model_shape("gpt2:L=12,C=768,heads=12,V=50257,T=1024"));
  CHECK(m->num_parameters() == 124439808);
  CHECK(m->matmul_parameters() == 123653376);
  CHECK(m->flops_per_token() == 855166464.0);
  // Datasheet dense bf16 peaks, found by key or by the device's own name.
  REQUIRE(find_gpu_spec("NVIDIA H100 80GB HBM3"));
  CHECK(find_gpu_spec("NVIDIA H100 80GB HBM3")->bf16_flops == 989.4e12);
  CHECK(find_gpu_spec("NVIDIA H100 80GB HBM3")->fp8_flops == 1978.9e12);
  CHECK(find_gpu_spec("cuda:0 (NVIDIA A100-SXM4-80GB)")->bf16_flops == 312e12);
  CHECK(find_gpu_spec("NVIDIA H200")->bf16_flops == 989.4e12);
  CHECK(find_gpu_spec("h200")->memory_bytes > find_gpu_spec("h100")->memory_bytes);
  CHECK(find_gpu_spec("Tesla V100") == nullptr);
}

TEST_CASE("operator: the CPU peak is measured once and cached", "[operator]") {
  test::TempDir cache("cache");
  ::setenv("XDG_CACHE_HOME", cache.path().c_str(), 1);  // not the user's cache
  auto be = make_cpu_backend(0);
  const PeakFlops a = device_peak_flops(*be);
  CHECK(a.flops > 1e9);  // any x86-64-v3 core does several GFLOP/s in sgemm
  CHECK_THAT(a.source, Contains("measured: fp32 sgemm"));
  CHECK(device_peak_flops(*be).flops == a.flops);
  CHECK(test::file_exists(cache / "trainrun/cpu_peak.tsv"));
  // The measurement leaves the caller's backend untouched.
  CHECK(be->peak_bytes() == 0);
  // A plausible rate for one CPU socket, in FLOP/s (guards against unit
  // mistakes; the machine may be shared, so nothing tighter).
  const double direct = measure_matmul_flops(*be, 256);
  CHECK(direct > 1e8);
  CHECK(direct < 1e13);
  CHECK(a.flops < 1e13);
}

TEST_CASE("operator: trainrun plot draws SVG and PNG from metrics.jsonl", "[operator]") {
  auto& t = trained();
  REQUIRE(t.result.exit_code == 0);
  auto r = test::run_trainrun("plot " + t.run + " --output " + t.dir / "p.svg");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == t.dir / "p.svg\n");
  const std::string svg = test::read_file(t.dir / "p.svg");
  CHECK_THAT(svg, Contains("<svg") && Contains("tokens/s") && Contains("MFU (%)") && Contains("val") &&
                      Contains("best val loss"));
  CHECK_THAT(test::read_file(t.run + "/plot.gp"), Contains("$loss << EOD\n1 "));

  r = test::run_trainrun("plot " + t.run + " --format png");
  REQUIRE(r.exit_code == 0);
  const std::string png = test::read_file(t.run + "/plot.png");
  REQUIRE(png.size() > 1000);
  CHECK(png.substr(0, 8) == "\x89PNG\r\n\x1a\n");
}

TEST_CASE("operator: plot tolerates a torn last record and a resumed run's repeated steps", "[operator]") {
  test::TempDir dir("plot");
  test::write_file(dir / "metrics.jsonl",
                   "{\"step\":1,\"loss\":3.0,\"tokens_per_sec\":100}\n"
                   "{\"step\":10,\"loss\":2.5,\"tokens_per_sec\":110}\n"
                   "{\"step\":20,\"loss\":2.4,\"tokens_per_sec\":110}\n"
                   "{\"step\":10,\"loss\":2.6,\"tokens_per_sec\":90}\n"  // resumed from step 9
                   "{\"step\":20,\"loss\":2.3,\"tokens_per_sec\":95,\"val_loss\":2.35}\n"
                   "{\"step\":30,\"lo");  // killed mid-write
  auto r = test::run_trainrun("plot " + dir.path());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("skipping an incomplete last record"));
  CHECK_THAT(test::read_file(dir / "plot.gp"), Contains("$loss << EOD\n1 3\n10 2.6\n20 2.3\nEOD\n"));
  CHECK(test::file_exists(dir / "plot.svg"));
}

TEST_CASE("operator: bad input to plot gets a clear error and exit code", "[operator]") {
  test::TempDir dir("plotbad");
  struct Case {
    std::string args, env;
    int code;
    std::string message;
  };
  test::write_file(dir / "empty/x", "");
  test::write_file(dir / "garbage/metrics.jsonl", "{\"step\":1,\"loss\":2}\nnot json\n{\"step\":2,\"loss\":1}\n");
  test::write_file(dir / "noloss/metrics.jsonl", "{\"step\":1,\"loss\":null}\n");
  test::write_file(dir / "ok/metrics.jsonl", "{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\":1.5}\n");
  const std::vector<Case> cases = {
      {"plot " + dir / "missing", "", 1, "plot: '" + dir / "missing" + "' is not a directory; give a run's output.dir"},
      {"plot " + dir / "empty", "", 1, "plot: no metrics.jsonl in '" + dir / "empty" + "'"},
      {"plot " + dir / "garbage", "", 1,
       "plot: " + dir / "garbage/metrics.jsonl" + ":2: not a metrics record (a JSON object with a numeric \"step\")"},
      {"plot " + dir / "noloss", "", 1, "has no loss values to plot (1 records)"},
      {"plot " + dir / "ok", "TRAINRUN_GNUPLOT=/nonexistent/gnuplot ", 1,
       "plot: cannot run '/nonexistent/gnuplot': No such file or directory; install gnuplot (Debian: apt-get install "
       "gnuplot-nox"},
      {"plot " + dir / "ok", "TRAINRUN_GNUPLOT=false ", 1, "plot: false failed on "},
      {"plot", "", 2, "dir is required"},
      {"plot " + dir / "ok" + " --format gif", "", 2, "--format: gif not in {svg,png}"},
  };
  for (const auto& c : cases) {
    auto r = test::run_command(c.env + "'" + test::trainrun_binary() + "' " + c.args);
    INFO(c.env << c.args << "\n" << r.err);
    CHECK(r.exit_code == c.code);
    CHECK_THAT(r.err, Contains(c.message));
  }
}

TEST_CASE("operator: a bad TRAINRUN_PROGRESS value stops the run with a clear error", "[operator]") {
  test::TempDir dir("prog");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 6));
  auto r = test::run_command("TRAINRUN_PROGRESS=sideways '" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("environment variable TRAINRUN_PROGRESS='sideways' is not one of auto, live, plain"));
  r = test::run_command("TRAINRUN_PLOT=maybe '" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("environment variable TRAINRUN_PLOT='maybe' is not a boolean; use 1 or 0"));
}

TEST_CASE("operator: two ranks under the agent log plain lines with comm wait and MFU over both", "[operator]") {
  test::TempDir dir("op2");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 20, 2, "shard_grad_op"));
  auto r = test::run_command("'" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("[rank 0] step 20/20 | loss ") && Contains("| comm wait ") &&
                        Contains("[rank 0] memory (rank 0, shard_grad_op, after step 1)") &&
                        Contains("[rank 0] run summary") && Contains(" x 2 ranks ("));
  // Only rank 0 reports; rank 1's log has no step lines.
  CHECK(test::read_file(dir / "run/logs/rank1.log").find("step 1/") == std::string::npos);
  CHECK(records(dir / "run/metrics.jsonl").size() == 3);  // 1, 10, 20
}

TEST_CASE("operator: MFU in metrics.jsonl is tokens/s x (6N + 12LCT) / peak, and the peak is cached", "[operator]") {
  test::TempDir dir("mfu");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 10));
  const std::string bin = "OMP_NUM_THREADS=2 TRAINRUN_PLOT=0 XDG_CACHE_HOME=" + dir / "cache" + " ";
  // An explicit peak: the arithmetic can be checked exactly.
  auto r = test::run_command(bin + "TRAINRUN_CPU_PEAK_FLOPS=1e11 '" + test::trainrun_binary() + "' --config " +
                             dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("peak 100.0 GFLOP/s per rank (TRAINRUN_CPU_PEAK_FLOPS)"));
  const auto m = make_model_arch(parse_model_shape("gpt2:L=2,C=32,heads=2,V=16,T=32"));
  for (const auto& rec : records(dir / "run/metrics.jsonl"))
    CHECK(rec.at("mfu").get<double>() ==
          Approx(rec.at("tokens_per_sec").get<double>() * m->flops_per_token() / 1e11).epsilon(1e-9));

  // Measured: the best figure is remembered per CPU model and thread count.
  r = test::run_command(bin + "'" + test::trainrun_binary() + "' --config " + dir / "job.yaml" + " --set output.dir=" +
                        dir / "run2");
  REQUIRE(r.exit_code == 0);
  const std::string cache = test::read_file(dir / "cache/trainrun/cpu_peak.tsv");
  CHECK_THAT(cache, Contains(" | threads 2 | n 1024\t"));
  // A better figure from an earlier run (here: planted) wins over a lower measurement.
  test::write_file(dir / "cache/trainrun/cpu_peak.tsv", cache.substr(0, cache.find('\t')) + "\t5e14\n");
  r = test::run_command(bin + "'" + test::trainrun_binary() + "' --config " + dir / "job.yaml" + " --set output.dir=" +
                        dir / "run3");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("peak 500.0 TFLOP/s per rank (measured: fp32 sgemm 1024^3 with 2 threads, best seen"));

  r = test::run_command(bin + "TRAINRUN_CPU_PEAK_FLOPS=fast '" + test::trainrun_binary() + "' --config " +
                        dir / "job.yaml --set output.dir=" + dir / "run4");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("environment variable TRAINRUN_CPU_PEAK_FLOPS='fast' is not a positive number"));
}

TEST_CASE("operator: a run without gnuplot still succeeds and says how to get the plot", "[operator]") {
  test::TempDir dir("nognuplot");
  test::write_file(dir / "job.yaml", job_yaml(dir / "run", 6));
  auto r = test::run_command("OMP_NUM_THREADS=2 TRAINRUN_GNUPLOT=/nonexistent/gnuplot '" + test::trainrun_binary() +
                             "' --config " + dir / "job.yaml");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("warning: plot: cannot run '/nonexistent/gnuplot'") &&
                        Contains("  plot        none (see the warning above)"));
  CHECK(test::file_exists(dir / "run/plot.gp"));  // ready for `gnuplot plot.gp` once it is installed
  CHECK(test::file_exists(dir / "run/model.safetensors"));
}
