// LoRA and DoRA adapters under tensor parallelism and optimizer offload
// (core/model/adapter/lora.h, "Tensor parallelism"; core/train/adapter_training.h).
// Every run is compared with the one-rank run of the same job: 3 steps of
// fine-tuning (dropout on, so the mask's global keys are tested too) on a
// tiny random HF Llama (GQA; one KV head, so tp2 replicates it, or two,
// split) or GPT-2 (fused q|k|v, Conv1D) from peft_lora.py. Losses and the
// final PEFT adapter must agree to 1e-5 relative; the tp2 adapter must load
// in peft with the one-rank adapter's logits; checkpoints reshard between
// tp2 and tp1 both ways; offload cpu keeps only adapter-sized host state,
// and nvme gives the same run.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/lora.h"
#include "core/model/tensor_parallel.h"
#include "kernels/backend_factory.h"
#include "parallel/sharding/offload.h"
#include "tests/support/adapted_model.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

const char* kLlamaAll = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]";
const char* kGpt2All = "[c_attn, c_proj, c_fc]";

// base/ and adapter/ (peft's LoRA on every linear, A and B random) from peft_lora.py.
std::string make_base(const TempDir& tmp, const std::string& arch, int kv_heads = 2) {
  make_peft_case(arch == "llama" ? llama_case() : gpt2_case(), 4, 8, tmp, "", 2, kv_heads);
  return tmp / "base";
}

// `steps` steps of adapter fine-tuning, dropout 0.1, on synthetic data;
// `parallel`: the parallel section's extra keys. The learning rate is
// small beside the weights (1e-3): AdamW's first steps divide each gradient
// by its own magnitude, so an element whose gradient is near zero turns
// float rounding (another summation order over ranks) into a visible
// update difference; at 1e-2, DoRA's A after 3 steps at tp2 differs from
// one rank by 2e-5 relative while every step's gradient norm agrees to
// 5e-8 (measured), at 1e-3 by 6e-7.
std::string job_yaml(const std::string& base, const std::string& out, const std::string& type,
                     const std::string& targets, const std::string& parallel, int steps = 3) {
  return
      "model:\n  init_from: '" + base + "'\n  seq_len: 8\n"
      "  adapter: {type: " + type + ", rank: 4, alpha: 8, dropout: 0.1, target_modules: " + targets + "}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: " + std::to_string(steps) + ", lr: 1.0e-3,\n"
      "        warmup_steps: 0, schedule: cosine, eval_interval: 0, eval_steps: 1, log_interval: 1, weight_decay: 0.1}\n"
      "checkpoint: {interval: 2}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {timeout_s: 60" + (parallel.empty() ? "" : ", " + parallel) + "}\n";
}
// `sets`: --set overrides.
JobSpec job(const std::string& base, const std::string& out, const std::string& type, const std::string& targets,
            const std::string& parallel, int steps = 3, const std::vector<std::string>& sets = {}) {
  return parse_job_spec(job_yaml(base, out, type, targets, parallel, steps), "job.yaml", sets);
}

std::vector<float> adapter_of(const std::string& run) { return adapter_file(run + "/adapter"); }

// The same run to `tol` relative: every step's loss and the final adapter
// (the PEFT file: every tensor, by name, so a layout change cannot hide).
void check_same_run(const std::string& got, const std::string& want, double tol) {
  const std::vector<double> lg = losses_of(got), lw = losses_of(want);
  REQUIRE(lg.size() == lw.size());
  REQUIRE(!lw.empty());
  for (size_t i = 0; i < lg.size(); ++i) {
    INFO("step " << i + 1 << ": " << lg[i] << " vs " << lw[i]);
    CHECK(std::fabs(lg[i] - lw[i]) <= tol * std::fabs(lw[i]));
  }
  const SafeTensorFile fg = read_safetensors(got + "/adapter/adapter_model.safetensors");
  const SafeTensorFile fw = read_safetensors(want + "/adapter/adapter_model.safetensors");
  REQUIRE(fg.tensors.size() == fw.tensors.size());
  for (const SafeTensor& w : fw.tensors) {
    const SafeTensor* g = fg.find(w.name);
    INFO(w.name);
    REQUIRE(g);
    REQUIRE(g->shape == w.shape);
    CHECK(rel_err(g->as_f32(), w.as_f32()) <= tol);
  }
}

// The adapter trained: B moved off its zero init, so the runs compared
// above are not two copies of the untouched adapter.
void check_trained(const std::string& run) {
  const SafeTensorFile f = read_safetensors(run + "/adapter/adapter_model.safetensors");
  int bs = 0;
  for (const SafeTensor& t : f.tensors) {
    if (t.name.find("lora_B") == std::string::npos) continue;
    const std::vector<float> v = t.as_f32();
    INFO(t.name);
    CHECK(*std::max_element(v.begin(), v.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }) != 0);
    ++bs;
  }
  CHECK(bs > 0);
}

// peft (PeftModel.from_pretrained) loads the tp2 run's adapter and gives
// the one-rank run's logits; both differ from the base's.
void check_in_peft(const std::string& base, const std::string& tp_run, const std::string& one_run,
                   const TempDir& tmp) {
  const ModelConfig cfg = read_hf_model_config(base, "test");
  std::vector<int32_t> in(size_t(kB) * kT);
  for (size_t i = 0; i < in.size(); ++i) in[i] = int32_t((i * 7 + 5) % size_t(cfg.V));
  const std::vector<float> tp = peft_logits(base, tp_run + "/adapter", in, tmp);
  const std::vector<float> one = peft_logits(base, one_run + "/adapter", in, tmp);
  CHECK(max_abs_diff(tp, one) <= 1e-5f);
  auto arch = make_model_arch(cfg);
  std::vector<float> flat(size_t(arch->layout().total));
  open_hf_source(base, "test")->read(0, int64_t(flat.size()), flat.data());
  CHECK(max_abs_diff(tp, logits_of(*arch, flat, in, kB, kT)) > 1e-4f);
}

}  // namespace

TEST_CASE("lora tp: the ops a rank's slice needs (CPU): dropout of a column slice, row_sum_squares, sqrt_in_place",
          "[lora][tp][cpu_ops]") {
  auto be = make_cpu_backend(1);
  // Rows of 12 features, 3 rows from global row 5: columns [4, 9) of the
  // whole rows' dropout are the slice's dropout, element for element.
  const int N = 3, W = 12, c0 = 4, C = 5;
  std::vector<float> whole(size_t(N) * W), slice(size_t(N) * C);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = 1.0f + float(i);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) slice[size_t(n * C + c)] = whole[size_t(n * W + c0 + c)];
  std::vector<float> dw(whole.size()), ds(slice.size());
  be->dropout_forward(dw.data(), whole.data(), N, W, 0.5f, 99, 5);
  be->dropout_forward(ds.data(), slice.data(), N, C, 0.5f, 99, 5, W, c0);
  int dropped = 0;
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      CHECK(ds[size_t(n * C + c)] == dw[size_t(n * W + c0 + c)]);
      dropped += ds[size_t(n * C + c)] == 0.0f;
    }
  CHECK(dropped > 0);
  CHECK(dropped < N * C);
  // The slice keyed as its own rows would be another mask (the bug this guards against).
  std::vector<float> own(slice.size());
  be->dropout_forward(own.data(), slice.data(), N, C, 0.5f, 99, 5);
  CHECK(own != ds);
  // A row's norm from two column halves' sums of squares.
  const std::vector<float> w = {3, 4, 0, 12, 1, 2, 2, 4};  // rows of 4: norms 13 and 5
  std::vector<float> left(2), right(2), norms(2);
  const std::vector<float> wl = {3, 4, 1, 2}, wr = {0, 12, 2, 4};
  be->row_sum_squares(left.data(), wl.data(), 2, 2);
  be->row_sum_squares(right.data(), wr.data(), 2, 2);
  for (int i = 0; i < 2; ++i) left[size_t(i)] += right[size_t(i)];
  be->sqrt_in_place(left.data(), 2);
  be->row_norms(norms.data(), w.data(), 2, 4);
  CHECK(left == std::vector<float>({13.0f, 5.0f}));
  CHECK(norms == left);
}

TEST_CASE("lora tp: tensor parallelism equals one rank (llama GQA, gpt2, lora, dora, sequence parallel, tp x dp)",
          "[lora][tp]") {
  SECTION("llama, one KV head (replicated at tp2), lora: tp2, tp2 + sequence parallel; the tp2 adapter in peft; "
          "peft's adapter as model.adapter.init_from at tp2") {
    TempDir tmp("lora_tp_llama");
    const std::string base = make_base(tmp, "llama", 1);
    run_ranks_inprocess(job(base, tmp / "one", "lora", kLlamaAll, ""), 1);
    run_ranks_inprocess(job(base, tmp / "tp2", "lora", kLlamaAll, "tensor_parallel: 2"), 2);
    run_ranks_inprocess(job(base, tmp / "sp", "lora", kLlamaAll, "tensor_parallel: 2, sequence_parallel: true"), 2);
    check_trained(tmp / "one");
    check_same_run(tmp / "tp2", tmp / "one", 1e-5);
    check_same_run(tmp / "sp", tmp / "one", 1e-5);
    check_in_peft(base, tmp / "tp2", tmp / "one", tmp);
    // A global PEFT directory (every B non-zero) loads into the TP slices.
    const std::string from = "model.adapter.init_from=" + tmp / "adapter";
    run_ranks_inprocess(job(base, tmp / "one_init", "lora", kLlamaAll, "", 3, {from}), 1);
    run_ranks_inprocess(job(base, tmp / "tp2_init", "lora", kLlamaAll, "tensor_parallel: 2", 3, {from}), 2);
    check_same_run(tmp / "tp2_init", tmp / "one_init", 1e-5);
    CHECK(std::fabs(losses_of(tmp / "one_init")[0] - losses_of(tmp / "one")[0]) > 1e-3);  // it started elsewhere
  }
  SECTION("llama, one KV head, dora: tp2 + sequence parallel + activation checkpointing") {
    TempDir tmp("lora_tp_llama_dora");
    const std::string base = make_base(tmp, "llama", 1);
    run_ranks_inprocess(job(base, tmp / "one", "dora", kLlamaAll, ""), 1);
    run_ranks_inprocess(job(base, tmp / "sp", "dora", kLlamaAll, "tensor_parallel: 2, sequence_parallel: true", 3,
                            {"train.activation_checkpointing=blocks"}),
                        2);
    check_trained(tmp / "one");
    check_same_run(tmp / "sp", tmp / "one", 1e-5);
  }
  SECTION("llama, two KV heads (split at tp2), dora: tp2 x dp2 full_shard (4 ranks)") {
    TempDir tmp("lora_tp_dp");
    const std::string base = make_base(tmp, "llama", 2);
    const auto one = run_ranks_inprocess(job(base, tmp / "one", "dora", kLlamaAll, ""), 1);
    const auto tpdp =
        run_ranks_inprocess(job(base, tmp / "tpdp", "dora", kLlamaAll, "tensor_parallel: 2, sharding: full_shard"), 4);
    check_same_run(tmp / "tpdp", tmp / "one", 1e-5);
    // Each rank holds about a quarter of the frozen base (its TP half, sharded over dp): no rank holds it all.
    for (const TrainSummary& s : tpdp) CHECK(double(s.params_bytes) < 0.35 * double(one[0].params_bytes));
  }
  SECTION("gpt2 (fused q|k|v, Conv1D), lora tp2 and dora tp2 + sequence parallel; the dora adapter in peft") {
    TempDir tmp("lora_tp_gpt2");
    const std::string base = make_base(tmp, "gpt2");
    run_ranks_inprocess(job(base, tmp / "one", "lora", kGpt2All, ""), 1);
    run_ranks_inprocess(job(base, tmp / "tp2", "lora", kGpt2All, "tensor_parallel: 2"), 2);
    check_trained(tmp / "one");
    check_same_run(tmp / "tp2", tmp / "one", 1e-5);
    run_ranks_inprocess(job(base, tmp / "done", "dora", kGpt2All, ""), 1);
    run_ranks_inprocess(job(base, tmp / "dsp", "dora", kGpt2All, "tensor_parallel: 2, sequence_parallel: true"), 2);
    check_same_run(tmp / "dsp", tmp / "done", 1e-5);
    check_in_peft(base, tmp / "dsp", tmp / "done", tmp);
  }
}

TEST_CASE("lora tp: a checkpoint saved at tp2 resumes at tp1 and the reverse", "[lora][tp][checkpoint]") {
  TempDir tmp("lora_tp_ckpt");
  const std::string base = make_base(tmp, "llama", 1);
  const std::string straight = tmp / "straight";
  run_ranks_inprocess(job(base, straight, "dora", kLlamaAll, "", 4), 1);
  REQUIRE(losses_of(straight).size() == 4);
  SECTION("tp2 -> tp1") {
    const std::string split = tmp / "split";
    run_ranks_inprocess(job(base, split, "dora", kLlamaAll, "tensor_parallel: 2", 4, {"train.exit_interval=2"}), 2);
    REQUIRE(latest_of(split) == "step_00000002");
    run_ranks_inprocess(job(base, split, "dora", kLlamaAll, "", 4), 1);
    check_same_run(split, straight, 1e-5);
  }
  SECTION("tp1 -> tp2 (sequence parallel)") {
    const std::string split = tmp / "split";
    run_ranks_inprocess(job(base, split, "dora", kLlamaAll, "", 4, {"train.exit_interval=2"}), 1);
    REQUIRE(latest_of(split) == "step_00000002");
    run_ranks_inprocess(job(base, split, "dora", kLlamaAll, "tensor_parallel: 2, sequence_parallel: true", 4), 2);
    check_same_run(split, straight, 1e-5);
  }
}

TEST_CASE("lora offload: parallel.offload cpu equals no offload and holds only the adapters' state on the host",
          "[lora][offload]") {
  TempDir tmp("lora_offload");
  const std::string base = make_base(tmp, "llama", 1);
  const std::string plain = tmp / "plain";
  run_ranks_inprocess(job(base, plain, "lora", kLlamaAll, ""), 1);
  const ModelConfig cfg = read_hf_model_config(base, "test");
  auto arch = make_model_arch(cfg);
  auto be = make_cpu_backend(1);
  LoraOptions o;
  o.rank = 4;
  o.alpha = 8;
  o.target_modules = "all-linear";
  const int64_t adapter_total = LoraAdapters(*arch, o, be.get(), kB * kT).layout().total;

  SECTION("one rank: host state = 16 bytes per adapter element") {
    const auto sums = run_ranks_inprocess(job(base, tmp / "off", "lora", kLlamaAll, "offload: cpu"), 1);
    check_same_run(tmp / "off", plain, 1e-5);
    CHECK(sums[0].host_bytes == offload_host_bytes(adapter_total));
    CHECK(sums[0].host_bytes < size_t(arch->layout().total) * 4);  // less than the base's fp32 bytes
  }
  SECTION("nvme, tp2 x dp2 full_shard: the same run") {
    run_ranks_inprocess(job(base, tmp / "nvme", "lora", kLlamaAll,
                            "tensor_parallel: 2, sharding: full_shard, offload: nvme, offload_dir: '" + tmp / "state" +
                                "'"),
                        4);
    check_same_run(tmp / "nvme", plain, 1e-5);
  }
  SECTION("tp2 worker processes: the memory line shows each rank's adapter slice on the host") {
    // Rank 0's slice at tp2 (the local layout of the adapters beside tp rank 0 of the base).
    const TensorParallelPlan plan(*arch, 2, 0);
    TensorParallel tpc;
    tpc.plan = &plan;
    const int64_t local = LoraAdapters(*arch, o, be.get(), kB * kT, &tpc).local_layout().total;
    REQUIRE(local < adapter_total);
    write_file(tmp / "job.yaml", job_yaml(base, tmp / "off2", "lora", kLlamaAll, "tensor_parallel: 2"));
    const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config " + tmp / "job.yaml" +
                               " --set parallel.nproc_per_node=2 --set parallel.offload=cpu");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    check_same_run(tmp / "off2", plain, 1e-5);
    // "memory (rank 0, adapters, no_shard): params ..., host (parallel.offload: cpu) 12.4 KiB"
    std::smatch m;
    REQUIRE(std::regex_search(r.err, m, std::regex(R"(memory \(rank 0, adapters, [a-z_]+\): [^\n]*host \(parallel\.offload: cpu\) ([0-9.]+) (B|KiB|MiB))")));
    const double unit = m[2] == "B" ? 1 : m[2] == "KiB" ? 1024 : 1024 * 1024;
    const double host = std::stod(m[1]) * unit;
    INFO("host line: " << m[0]);
    CHECK(std::fabs(host - double(offload_host_bytes(local))) <= 0.01 * double(offload_host_bytes(local)));
    // The base's line has no host state: the frozen base has no optimizer.
    CHECK_FALSE(std::regex_search(r.err, std::regex(R"(memory \(rank 0, no_shard\): [^\n]*host)")));
  }
}
