// LoRA adapters (core/model/adapter) against Hugging Face peft 0.12 in fp32
// on the CPU backend: peft_lora.py makes a small random Llama / GPT-2 and a
// peft adapter on it (A and B both random, so every gradient is non-zero);
// trainrun loads the base from the HF directory and the adapter from peft's
// files, and its logits, loss and every adapter gradient must equal peft's
// to 1e-5. The adapter trainrun writes must load back in peft and give the
// same logits. Breaking the scaling (alpha/r) must break the match. DoRA
// (peft's use_dora) runs the same comparisons with its magnitude vector as
// a third adapter tensor per target (the *_dora cases).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/lora.h"
#include "core/model/adapter/peft_files.h"
#include "core/model/model.h"
#include "kernels/backend_factory.h"
#include "tests/support/adapted_model.h"
#include "tests/support/device_io.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

constexpr int kRank = 4;
constexpr double kAlpha = 8;

void make_peft_case(const PeftCase& c, const TempDir& tmp) { make_peft_case(c, kRank, kAlpha, tmp); }
LoraOptions options_for(const PeftCase& c) { return options_for(c, kRank, kAlpha); }

}  // namespace

TEST_CASE("lora: logits, loss and every adapter gradient equal peft's (llama, gpt2, lora, dora)", "[lora][peft]") {
  for (const PeftCase& c : all_cases()) {
    SECTION(c.name()) {
      TempDir tmp("lora");
      make_peft_case(c, tmp);
      AdaptedModel m(tmp / "base", options_for(c), nullptr, tmp / "adapter");
      const int V = m.arch->config().V;
      const std::vector<int32_t> in = tokens(1, V), tgt = tokens(2, V);
      // Logits, loss and every adapter gradient against peft's; every tensor peft trains.
      const int compared = check_equals_peft(m, tmp / "base", tmp / "adapter", tmp, in, tgt);
      const std::vector<float> g = m.adapter_grads();
      CHECK(compared == int(m.ad->targets().size()) * (c.dora ? 3 : 2));

      // Activation checkpointing recomputes the adapters' forward: same gradients.
      const std::vector<float> g_plain = g;
      m.loss_and_grads(in, tgt, true);
      CHECK(max_abs_diff(m.adapter_grads(), g_plain) <= 1e-6f);

      // The scaling is alpha / r: breaking it must break the match with peft.
      m.ad->set_scaling_for_test(float(kAlpha));  // alpha instead of alpha / r
      const SafeTensorFile ref = read_safetensors(tmp / "ref.safetensors");  // check_equals_peft's peft output
      CHECK(max_abs_diff(m.logits(in), ref.find("logits")->as_f32()) > 1e-3f);
    }
  }
}

TEST_CASE("lora: the adapter trainrun writes loads in peft with the same logits (lora, dora)", "[lora][peft]") {
  for (const PeftCase& c : all_cases()) {
    SECTION(c.name()) {
      TempDir tmp("lora_out");
      make_peft_case(c, tmp);
      LoraOptions o = options_for(c);
      // A fresh adapter (kaiming A, B zero) perturbed so the update is visible.
      const ModelConfig cfg = read_hf_model_config(tmp / "base", "test");
      auto arch = make_model_arch(cfg);
      auto be = make_cpu_backend(1);
      LoraAdapters fresh(*arch, o, be.get(), kB * kT);
      std::vector<float> a(size_t(fresh.layout().total));
      fresh.init_params(7, 0, int64_t(a.size()), a.data());
      if (c.dora) {
        // The magnitudes from the base's blocks, one unit at a time, as the trainer does: peft's own init (||W||
        // per output row; B is zero) to float rounding.
        auto src = open_hf_source(tmp / "base", "test");
        const ParamLayout& bl = arch->layout();
        for (int l = 0; l < cfg.L; ++l) {
          const ParamUnit& u = bl.units[size_t(1 + l)];
          std::vector<float> unit(size_t(u.numel));
          src->read(u.offset, u.numel, unit.data());
          DeviceBuffer dev = upload_act(be.get(), unit);
          fresh.init_magnitudes(l, dev.get(), a.data());
        }
        const SafeTensorFile init = read_safetensors(tmp / "dora_init.safetensors");
        int magnitudes = 0;
        for (const ParamTensor& t : fresh.layout().tensors) {
          if (t.name.find("lora_magnitude_vector") == std::string::npos) continue;
          INFO(t.name);
          const SafeTensor* want = init.find("base_model.model." + t.name);
          REQUIRE(want);
          CHECK(max_abs_diff(std::vector<float>(a.begin() + t.offset, a.begin() + t.offset + t.numel),
                             want->as_f32()) <= 1e-6f);
          ++magnitudes;
        }
        CHECK(magnitudes == int(fresh.targets().size()));
      }
      for (const ParamTensor& t : fresh.layout().tensors) {
        const bool is_b = t.name.find("lora_B") != std::string::npos;
        const bool is_a = t.name.find("lora_A") != std::string::npos;
        const bool is_m = t.name.find("lora_magnitude_vector") != std::string::npos;
        REQUIRE((is_a || is_b || (c.dora && is_m)));
        for (int64_t i = 0; i < t.numel; ++i) {
          float& v = a[size_t(t.offset + i)];
          if (is_m) {
            CHECK(v > 0.0f);
            v *= 1.0f + 0.03f * float((i * 13) % 7 - 3);  // off ||W + s B A||, so g - 1 is not zero
          } else if (is_b) {
            CHECK(v == 0.0f);  // peft's init: B zero
            v = 0.05f * float((i * 37) % 11 - 5);
          } else {
            // kaiming-uniform(a=sqrt(5)): inside +-1/sqrt(in)
            CHECK(std::fabs(v) <= 1.0f / std::sqrt(float(t.shape[1])));
          }
        }
      }
      write_peft_adapter(tmp / "ours", *arch, fresh, a, tmp / "base");
      AdaptedModel m(tmp / "base", o, &a);
      const std::vector<int32_t> in = tokens(3, cfg.V);
      const std::vector<float> ours = m.logits(in);
      write_batch(tmp / "batch.safetensors", in, in);
      const auto r = run_reference_script("peft_lora.py", "logits --base '" + tmp / "base" + "' --adapter '" +
                                                              tmp / "ours" + "' --batch '" + tmp / "batch.safetensors" +
                                                              "' --out '" + tmp / "peft.safetensors" + "'");
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      CHECK(max_abs_diff(ours, read_safetensors(tmp / "peft.safetensors").find("logits")->as_f32()) <= 1e-5f);
      // The adapter changes the function (a file peft ignored would match the base instead).
      CHECK(max_abs_diff(ours, logits_of(*arch, [&] {
              auto src = open_hf_source(tmp / "base", "test");
              std::vector<float> f(size_t(arch->layout().total));
              src->read(0, int64_t(f.size()), f.data());
              return f;
            }(), in, kB, kT)) > 1e-3f);
      // And it reads back as written.
      CHECK(read_peft_adapter(tmp / "ours", *arch, fresh, "test") == a);
    }
  }
}

TEST_CASE("lora: bad adapters and specs are errors naming the key, file and both values", "[lora]") {
  TempDir tmp("lora_bad");
  make_peft_case(llama_case(), tmp);
  const ModelConfig cfg = read_hf_model_config(tmp / "base", "test");
  auto arch = make_model_arch(cfg);
  auto be = make_cpu_backend(1);
  const LoraOptions good = options_for(llama_case());
  LoraOptions o = good;

  {  // a target module that matches nothing
    o.target_modules = "q_proj,qkv_proj";
    CHECK_THROWS_WITH(LoraAdapters(*arch, o, be.get(), 4),
                      Catch::Contains("model.adapter.target_modules: 'qkv_proj' matches no linear of the Llama model") &&
                          Catch::Contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"));
  }
  o = good;
  {  // a rank other than the file's
    o.rank = 8;
    LoraAdapters ad(*arch, o, be.get(), 4);
    CHECK_THROWS_WITH(read_peft_adapter(tmp / "adapter", *arch, ad, "model.adapter.init_from"),
                      Catch::Contains("model.adapter.init_from: '" + tmp / "adapter/adapter_config.json" +
                                      "' has r = 4 but model.adapter.rank is 8"));
  }
  o = good;
  {  // an adapter whose base shape differs
    ModelConfig wider = cfg;
    wider.F = cfg.F + 16;  // another intermediate_size: gate/up B and down A change shape
    auto other = make_model_arch(wider);
    LoraAdapters ad(*other, o, be.get(), 4);
    CHECK_THROWS_WITH(read_peft_adapter(tmp / "adapter", *other, ad, "model.adapter.init_from"),
                      Catch::Contains("adapter_model.safetensors': tensor base_model.model.model.layers.0.mlp.gate_proj."
                                      "lora_B.weight has shape [" + std::to_string(cfg.F) + ", 4] but this model's "
                                      "module needs [" + std::to_string(wider.F) + ", 4]"));
  }
  {  // peft options trainrun does not implement
    LoraAdapters ad(*arch, o, be.get(), 4);
    const std::string cfg_path = tmp / "adapter/adapter_config.json";
    const std::string text = read_file(cfg_path);
    for (const auto& [from, to, want] :
         std::vector<std::tuple<std::string, std::string, std::string>>{
             {"\"use_rslora\": false", "\"use_rslora\": true", "sets use_rslora = true, which trainrun does not implement"},
             {"\"modules_to_save\": null", "\"modules_to_save\": [\"lm_head\"]",
              "sets modules_to_save = [\"lm_head\"], which trainrun does not implement"},
             {"\"use_dora\": false", "\"use_dora\": true",
              "has use_dora = true (a DoRA adapter) but model.adapter.type is lora; set model.adapter.type: dora"}}) {
      INFO(from);
      REQUIRE(text.find(from) != std::string::npos);
      std::string t = text;
      t.replace(t.find(from), from.size(), to);
      write_file(cfg_path, t);
      CHECK_THROWS_WITH(read_peft_adapter(tmp / "adapter", *arch, ad, "model.adapter.init_from"),
                        Catch::Contains(cfg_path) && Catch::Contains(want));
    }
    write_file(cfg_path, text);
  }
  {  // a DoRA job on a LoRA adapter: the type and the file disagree
    LoraOptions d = good;
    d.dora = true;
    LoraAdapters ad(*arch, d, be.get(), 4);
    CHECK_THROWS_WITH(read_peft_adapter(tmp / "adapter", *arch, ad, "model.adapter.init_from"),
                      Catch::Contains(tmp / "adapter/adapter_config.json") &&
                          Catch::Contains("has use_dora = false (a LoRA adapter) but model.adapter.type is dora; "
                                          "set model.adapter.type: lora"));
  }
  {  // the job spec's adapter keys
    const std::string base = "data:\n  format: synthetic\nmodel:\n  adapter:\n";
    JobSpec s = parse_job_spec(base + "    type: lora\n    rank: 16\n    alpha: 32\n    dropout: 0.05\n"
                               "    target_modules: [q_proj, v_proj]\n", "job.yaml");
    CHECK(s.model.adapter.on());
    CHECK(s.model.adapter.rank == 16);
    CHECK(s.model.adapter.target_modules == "q_proj,v_proj");
    CHECK_THROWS_WITH(parse_job_spec(base + "    type: lora\n    rank: 0\n", "job.yaml"),
                      Catch::Contains("model.adapter.rank: 0 is out of range"));
    CHECK(parse_job_spec(base + "    type: dora\n", "job.yaml").model.adapter.type == "dora");
    CHECK(LoraOptions::from_spec(parse_job_spec(base + "    type: dora\n", "job.yaml").model.adapter).dora);
    CHECK_THROWS_WITH(parse_job_spec(base + "    type: qlora\n", "job.yaml"),
                      Catch::Contains("model.adapter.type") && Catch::Contains("unknown value 'qlora'") &&
                          Catch::Contains("none, lora, dora"));
    CHECK_THROWS_WITH(parse_job_spec(base + "    init_from: /x\n", "job.yaml"),
                      Catch::Contains("model.adapter.init_from: needs model.adapter.type: lora"));
  }
}

namespace {
// A 3-step LoRA fine-tune of peft_lora.py's Llama from its peft-written
// adapter (model.adapter.init_from), with dropout, on synthetic data.
// fresh_dora: a DoRA adapter from trainrun's own init instead (magnitudes
// from the base's row norms), with the same dropout.
std::string lora_yaml(const TempDir& peft, const std::string& out, const std::string& strategy, int micro_batch,
                      bool fresh_dora = false) {
  const std::string adapter = fresh_dora ? "type: dora" : "type: lora, init_from: '" + peft / "adapter" + "'";
  const std::string yaml =
      "model:\n  init_from: '" + peft / "base" + "'\n  seq_len: 8\n"
      "  adapter: {" + adapter + ", rank: 4, alpha: 8, dropout: 0.1,\n"
      "            target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: " + std::to_string(micro_batch) + ", max_steps: 3, lr: 1.0e-2,\n"
      "        warmup_steps: 0, schedule: constant, eval_interval: 0, eval_steps: 1, log_interval: 1, weight_decay: 0.1}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {sharding: " + strategy + ", timeout_s: 60" +
      (strategy == "hybrid_shard" ? ", shard_group_size: 1" : "") + "}\n";
  return yaml;
}
JobSpec lora_job(const TempDir& peft, const std::string& out, const std::string& strategy, int micro_batch,
                 bool fresh_dora = false) {
  return parse_job_spec(lora_yaml(peft, out, strategy, micro_batch, fresh_dora), "job.yaml");
}
}  // namespace

TEST_CASE("lora training: adapter/ loads in peft with trainrun's logits, 2 ranks equal 1 under every strategy",
          "[lora][peft][train]") {
  TempDir peft("lora_train");
  make_peft_case(llama_case(), peft);
  const std::string one = peft / "run1";
  // 1 rank: 4 micro-batches of 1 sequence; 2 ranks: 1 of 2 each. Dropout must
  // draw the same mask for a sequence wherever it lands.
  const std::vector<TrainSummary> s1 = test::run_ranks_inprocess(lora_job(peft, one, "no_shard", 1), 1);
  // Only the adapters have gradients and AdamW state: the base (all-linear
  // r=4 on this tiny Llama is ~40% of its size) adds parameters only.
  {
    AdaptedModel m(peft / "base", options_for(llama_case()), nullptr, peft / "adapter");
    const size_t adapter_bytes = size_t(m.ad->layout().total) * 4, base_bytes = size_t(m.arch->layout().total) * 4;
    CHECK(s1[0].grads_bytes == adapter_bytes);
    CHECK(s1[0].optimizer_bytes == 2 * adapter_bytes);  // the two AdamW moments (fp32 master = the parameters)
    CHECK(s1[0].params_bytes >= base_bytes);
  }
  REQUIRE(file_exists(one + "/adapter/adapter_config.json"));
  const std::vector<float> trained = adapter_file(one + "/adapter");
  const std::vector<float> initial = adapter_file(peft / "adapter");
  REQUIRE(trained.size() == initial.size());
  CHECK(max_abs_diff(trained, initial) > 1e-3f);  // it trained
  const std::vector<double> losses = losses_of(one);
  REQUIRE(losses.size() == 3);

  // peft loads the trained adapter and computes what trainrun computes with it.
  {
    AdaptedModel m(peft / "base", options_for(llama_case()), nullptr, one + "/adapter");
    const std::vector<int32_t> in = tokens(5, m.arch->config().V);
    write_batch(peft / "b.safetensors", in, in);
    const auto r = run_reference_script("peft_lora.py", "logits --base '" + peft / "base" + "' --adapter '" + one +
                                                            "/adapter' --batch '" + peft / "b.safetensors" +
                                                            "' --out '" + peft / "l.safetensors" + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(max_abs_diff(m.logits(in), read_safetensors(peft / "l.safetensors").find("logits")->as_f32()) <= 1e-5f);
  }

  // One loop, not SECTIONs: a section would rerun the 1-rank run and peft for each strategy.
  for (const std::string strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    INFO(strategy);
    {
      const std::string two = peft / ("run2_" + strategy);
      const std::vector<TrainSummary> s2 = test::run_ranks_inprocess(lora_job(peft, two, strategy, 2), 2);
      // full_shard: each rank holds about half the frozen base (no rank holds all of it).
      if (strategy == "full_shard") CHECK(s2[0].params_bytes < s1[0].params_bytes * 0.6);
      const std::vector<double> l2 = losses_of(two);
      REQUIRE(l2.size() == losses.size());
      for (size_t i = 0; i < l2.size(); ++i) CHECK(std::fabs(l2[i] - losses[i]) <= 1e-5 * std::fabs(losses[i]));
      CHECK(max_abs_diff(adapter_file(two + "/adapter"), trained) <= 1e-5f);
    }
  }
}

TEST_CASE("lora training: the end-of-run sample (2 ranks, full_shard) is `generate --adapter`'s on the run's adapter",
          "[lora][train][sample]") {
  TempDir peft("lora_sample");
  make_peft_case(llama_case(), peft);
  const std::string run = peft / "run";
  const JobSpec job = lora_job(peft, run, "full_shard", 1);
  write_file(peft / "job.yaml", lora_yaml(peft, run, "full_shard", 1));
  const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + peft / "job.yaml" +
                             "' --set parallel.nproc_per_node=2 --set output.sample_tokens=6 --set "
                             "output.sample_prompt='7 3'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string log = read_file(run + "/logs/rank0.log");
  CHECK(log.find("sample: skipped") == std::string::npos);
  // The same base, the adapter the run wrote, the sampler's seed, temperature and top-k.
  const auto g = run_trainrun("generate --checkpoint '" + peft / "base" + "' --adapter '" + run +
                              "/adapter' --prompt '7 3' --max-tokens 6 --temperature 0.8 --top-k 40 --seed " +
                              std::to_string(job.train.seed));
  INFO(g.err);
  REQUIRE(g.exit_code == 0);
  // 2 + 6 tokens: within the run's seq_len of 8 (generate reads the HF config's 16), so
  // neither sampler outgrows its cache and refills it.
  REQUIRE(std::count(g.out.begin(), g.out.end(), ' ') >= 7);  // the prompt and 6 ids
  INFO("generate: " << g.out << "\nrank 0's log: " << log.substr(log.rfind("sample")));
  CHECK(log.find("sample:\n" + g.out) != std::string::npos);
  // The base alone samples something else: the run's sample used its adapters.
  const auto plain = run_trainrun("generate --checkpoint '" + peft / "base" +
                                  "' --prompt '7 3' --max-tokens 6 --temperature 0.8 --top-k 40 --seed " +
                                  std::to_string(job.train.seed));
  REQUIRE(plain.exit_code == 0);
  CHECK(plain.out != g.out);
}

TEST_CASE("lora: export --merge equals peft's merge_and_unload() (llama, gpt2, lora, dora)", "[lora][peft]") {
  for (const PeftCase& c : all_cases()) {
    SECTION(c.name()) {
      TempDir tmp("lora_merge");
      make_peft_case(c, tmp);
      auto r = run_trainrun("export --checkpoint '" + tmp / "base" + "' --merge '" + tmp / "adapter" + "' --out '" +
                            tmp / "ours" + "'");
      INFO(r.out << r.err);
      REQUIRE(r.exit_code == 0);
      r = run_reference_script("peft_lora.py", "merge --base '" + tmp / "base" + "' --adapter '" + tmp / "adapter" +
                                                   "' --out '" + tmp / "theirs" + "'");
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      const SafeTensorFile ours = read_safetensors(tmp / "ours/model.safetensors");
      const SafeTensorFile theirs = read_safetensors(tmp / "theirs/model.safetensors");
      const SafeTensorFile base = read_safetensors(tmp / "base/model.safetensors");
      REQUIRE(ours.tensors.size() == theirs.tensors.size());
      int changed = 0;
      for (const SafeTensor& t : ours.tensors) {
        INFO(t.name);
        const SafeTensor* want = theirs.find(t.name);
        REQUIRE(want);
        CHECK(max_abs_diff(t.as_f32(), want->as_f32()) <= 1e-5f);
        if (const SafeTensor* b = base.find(t.name); b && max_abs_diff(t.as_f32(), b->as_f32()) > 1e-4f) ++changed;
      }
      // Every adapted weight changed (llama: 7 per layer, gpt2: 4 per layer, 2 layers).
      CHECK(changed == (c.arch == "llama" ? 14 : 8));
    }
  }
}

TEST_CASE("lora: generate --adapter (unmerged) samples what transformers samples from peft's model (llama, gpt2, lora, dora)",
          "[lora][peft]") {
  const bool dora = GENERATE(false, true);
  const bool gpt2 = GENERATE(false, true);
  INFO((dora ? "dora" : "lora") << (gpt2 ? " gpt2" : " llama"));
  TempDir tmp("lora_gen");
  make_peft_case(gpt2 ? gpt2_case(dora) : llama_case(dora), tmp);
  // peft's merged model (saved, reloaded by transformers) samples what its
  // unmerged PeftModel samples; trainrun applies the adapter unmerged, in
  // the decoder's hooks. One Python process merges and generates.
  const auto want = run_reference_script("peft_lora.py", "merge --base '" + tmp / "base" + "' --adapter '" +
                                                             tmp / "adapter" + "' --out '" + tmp / "merged" +
                                                             "' --generate '1 2 3' --max-new-tokens 8");
  INFO(want.err);
  REQUIRE(want.exit_code == 0);
  const auto got = run_trainrun("generate --checkpoint '" + tmp / "base" + "' --adapter '" + tmp / "adapter" +
                                "' --prompt '1 2 3' --top-k 1 --max-tokens 8");
  INFO(got.err);
  REQUIRE(got.exit_code == 0);
  CHECK_THAT(got.err, Catch::Contains("applied unmerged"));
  CHECK(got.out == want.out);
  // Without the adapter the base samples something else (the adapter is not ignored).
  const auto plain =
      run_trainrun("generate --checkpoint '" + tmp / "base" + "' --prompt '1 2 3' --top-k 1 --max-tokens 8");
  REQUIRE(plain.exit_code == 0);
  CHECK(plain.out != got.out);
}

TEST_CASE("dora training: fresh magnitudes from the sharded base, with dropout 2 ranks (full_shard) equal 1, peft loads the result",
          "[lora][peft][train]") {
  TempDir peft("dora_train");
  make_peft_case(llama_case(true), peft);
  // 1 rank, 4 micro-batches of 1; 2 ranks under full_shard, 1 of 2 each:
  // each rank holds half the base, so the magnitudes' init gathers it one
  // block at a time.
  const std::string one = peft / "run1", two = peft / "run2";
  const std::vector<TrainSummary> s1 = test::run_ranks_inprocess(lora_job(peft, one, "no_shard", 1, true), 1);
  const std::vector<TrainSummary> s2 = test::run_ranks_inprocess(lora_job(peft, two, "full_shard", 2, true), 2);
  CHECK(s2[0].params_bytes < s1[0].params_bytes * 0.6);
  const std::vector<double> l1 = losses_of(one), l2 = losses_of(two);
  REQUIRE(l1.size() == 3);
  REQUIRE(l2.size() == l1.size());
  for (size_t i = 0; i < l1.size(); ++i) CHECK(std::fabs(l2[i] - l1[i]) <= 1e-5 * std::fabs(l1[i]));
  const std::vector<float> trained = adapter_file(one + "/adapter");
  // The adapters after 3 AdamW steps at lr 1e-2: 2 ranks sum the gradient
  // in another order, and an element whose gradient is near zero moves by
  // lr x m / sqrt(v), which amplifies that rounding. Measured (max over the
  // elements, 2026-12-04): 4.0e-7 at dropout 0, 1.6e-5 at 0.1, 2.2e-7 at
  // 0.3; a wrong mask on one rank layout moves the losses above by far
  // more than their 1e-5.
  CHECK(max_abs_diff(adapter_file(two + "/adapter"), trained) <= 5e-5f);

  // The run wrote a DoRA adapter whose magnitudes started at peft's init
  // (||W|| per row) and trained away from it.
  const std::string cfg_text = read_file(one + "/adapter/adapter_config.json");
  CHECK(cfg_text.find("\"use_dora\": true") != std::string::npos);
  const SafeTensorFile got = read_safetensors(one + "/adapter/adapter_model.safetensors");
  const SafeTensorFile init = read_safetensors(peft / "dora_init.safetensors");
  REQUIRE(init.tensors.size() == 14);  // 7 targets x 2 layers
  for (const SafeTensor& want : init.tensors) {
    INFO(want.name);
    const SafeTensor* m = got.find(want.name);
    REQUIRE(m);
    const float moved = max_abs_diff(m->as_f32(), want.as_f32());
    CHECK(moved > 1e-4f);   // it trained (lr 1e-2, 3 AdamW steps)
    CHECK(moved < 0.05f);   // from ||W||: 3 steps of lr 1e-2 move it by at most ~0.03
  }

  // peft loads it and computes trainrun's logits.
  AdaptedModel m(peft / "base", options_for(llama_case(true)), nullptr, one + "/adapter");
  const std::vector<int32_t> in = tokens(5, m.arch->config().V);
  write_batch(peft / "b.safetensors", in, in);
  const auto r = run_reference_script("peft_lora.py", "logits --base '" + peft / "base" + "' --adapter '" + one +
                                                          "/adapter' --batch '" + peft / "b.safetensors" + "' --out '" +
                                                          peft / "l.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(max_abs_diff(m.logits(in), read_safetensors(peft / "l.safetensors").find("logits")->as_f32()) <= 1e-5f);
}

TEST_CASE("lora: with dropout on, every adapter gradient equals the loss's finite difference (lora, dora)", "[lora]") {
  // peft's reference runs without dropout (eval mode); this checks the
  // dropout path of the backward against the loss itself, for the largest
  // gradient element of each A and B (and DoRA's magnitude) of one target
  // per layer. DoRA's weight norm is detached, as peft's is: its A and B
  // gradients are those of the loss with the norm held constant, so the
  // finite differences replay the norms of the pass that took the
  // gradients (without that they are 10-30% off, with or without dropout).
  for (const PeftCase& c : {llama_case(false), gpt2_case(false), llama_case(true), gpt2_case(true)}) {
    SECTION(c.name()) {
      TempDir tmp("dora_fd");
      make_peft_case(c, tmp);
      LoraOptions o = options_for(c);
      o.dropout = 0.25;
      AdaptedModel m(tmp / "base", o, nullptr, tmp / "adapter");
      m.ad->set_training(true);
      m.ad->set_dropout_rows(12345, 0);
      const int V = m.arch->config().V;
      const std::vector<int32_t> in = tokens(1, V), tgt = tokens(2, V);
      m.ad->hold_dora_norms_for_test(LoraAdapters::NormHold::Record);
      m.loss_and_grads(in, tgt);
      m.ad->hold_dora_norms_for_test(LoraAdapters::NormHold::Replay);
      const std::vector<float> g = m.adapter_grads();
      std::vector<float> p = m.adapter_params();
      const std::string module = c.arch == "llama" ? "mlp.down_proj" : "attn.c_attn";  // down_proj: in = F
      int checked = 0;
      for (const ParamTensor& t : m.ad->layout().tensors) {
        if (t.name.find("." + module + ".") == std::string::npos) continue;
        INFO(t.name);
        int64_t at = t.offset;
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i)
          if (std::fabs(g[size_t(i)]) > std::fabs(g[size_t(at)])) at = i;
        const float keep = p[size_t(at)], eps = 5e-3f;
        p[size_t(at)] = keep + eps;
        m.set_adapter_params(p);
        const double up = m.loss(in, tgt);
        p[size_t(at)] = keep - eps;
        m.set_adapter_params(p);
        const double down = m.loss(in, tgt);
        p[size_t(at)] = keep;
        m.set_adapter_params(p);
        const double fd = (up - down) / (2.0 * eps);
        INFO("grad " << g[size_t(at)] << " finite difference " << fd);
        CHECK(std::fabs(g[size_t(at)]) > 1e-3f);
        CHECK(std::fabs(fd - g[size_t(at)]) <= 1e-3 + 0.02 * std::fabs(fd));
        ++checked;
      }
      CHECK(checked == 2 * (c.dora ? 3 : 2));  // A, B (and m) in each of the 2 layers
    }
  }
}
