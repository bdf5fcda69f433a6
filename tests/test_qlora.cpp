// model.base_dtype nf4 (QLoRA) and bf16: the frozen base of an adapter run
// held as bitsandbytes / torch would hold it (parallel/sharding/
// nf4_frozen_store.cpp, frozen_store.h, docs/fine-tuning.md "NF4 storage").
//  - Against peft in fp32 with the base replaced by its NF4 (or bf16) round
//    trip (peft_lora.py make --base-dtype): logits, loss and every adapter
//    gradient to 1e-5, Llama and GPT-2 (whose Conv1D weights are quantized
//    as the (out, in) nn.Linear weight); DoRA's fresh magnitudes are the
//    round trip's row norms.
//  - The NF4 store sharded over 2, 3 and 4 ranks (full_shard, hybrid_shard,
//    shard_grad_op) dequantizes every unit to the very bits of quantizing
//    each whole tensor on one host, on odd sizes where 64-blocks straddle
//    ranks; its memory is the NF4 bytes.
//  - Training: 1 rank equals 2, 3 and 4 ranks under every strategy, with
//    lora (fp32 base) and nf4 (and bf16, DoRA on nf4 once each); a resume
//    re-quantizes the base and continues bit for bit; the memory line shows
//    the NF4 base's bytes.
//  - Meshes: nf4 (LoRA, fresh DoRA) and bf16 under pipeline parallelism
//    (1f1b), bf16 under tensor parallelism and nf4 with offload cpu equal
//    1 rank; a pipeline stage's NF4 store holds the whole model's
//    quantization of its tensors bit for bit (a tied copy and an uneven
//    split included).
//  - Bad input: bf16 / nf4 without an adapter (nf4 with tensor parallelism
//    whose slices cut a 64-block: test_qlora_tp.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <regex>
#include <thread>

#include "core/checkpoint/hf_interop.h"
#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/nf4.h"
#include "core/model/adapter/peft_files.h"
#include "core/model/adapter/qlora.h"
#include "parallel/comm/communicator.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_plan.h"
#include "parallel/pipeline/stage_store.h"
#include "parallel/rendezvous/store.h"
#include "parallel/sharding/frozen_store.h"
#include "parallel/sharding/offload.h"
#include "tests/support/adapted_model.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

constexpr int kRank = 4;
constexpr double kAlpha = 8;

// Bit-equal, not just close.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("qlora: logits, loss and every adapter gradient equal peft's on the NF4 / bf16 round-trip base",
          "[qlora][peft]") {
  // DoRA reads W from the acquired unit, so it sees the dequantized weight
  // (as peft's DoRA does on bitsandbytes' Linear4bit): one DoRA case.
  for (const std::string dtype : {"nf4", "bf16"}) {
    std::vector<PeftCase> cases = {llama_case(), gpt2_case()};
    if (dtype == "nf4") cases.push_back(gpt2_case(true));
    for (const PeftCase& c : cases) {
      SECTION(c.name() + " " + dtype) {
        TempDir tmp("qlora");
        make_peft_case(c, kRank, kAlpha, tmp, dtype);
        // trainrun reads the original fp32 base and quantizes (rounds) it itself.
        AdaptedModel m(tmp / "base", options_for(c, kRank, kAlpha), nullptr, tmp / "adapter", dtype);
        REQUIRE(m.base_store->strategy() == (dtype == "nf4" ? "no_shard, frozen nf4" : "no_shard, frozen bf16"));
        const int V = m.arch->config().V;
        const std::vector<int32_t> in = tokens(1, V), tgt = tokens(2, V);
        const int compared = check_equals_peft(m, tmp / ("base_" + dtype), tmp / "adapter", tmp, in, tgt);
        const std::vector<float> logits = m.logits(in);
        CHECK(compared == (c.dora ? 3 : 2) * int(m.ad->targets().size()));
        if (c.dora) {
          // A fresh DoRA adapter's magnitudes come from W as the store hands
          // it out: the row norms of the NF4 round trip (peft's init on a
          // Linear4bit dequantizes too), not of the fp32 weights.
          const ParamLayout& lay = m.arch->layout();
          std::vector<float> rt(size_t(lay.total)), orig(size_t(lay.total));
          open_hf_source(tmp / ("base_" + dtype), "test")->read(0, lay.total, rt.data());
          open_hf_source(tmp / "base", "test")->read(0, lay.total, orig.data());
          std::vector<float> mags(size_t(m.ad->layout().total), 0.0f);
          for (int l = 0; l < m.arch->config().L; ++l) {
            m.ad->init_magnitudes(l, m.base_store->acquire_params(1 + l), mags.data());
            m.base_store->release_params(1 + l);
          }
          for (const LoraTarget& t : m.ad->targets()) {
            INFO(t.module);
            const ParamTensor& w = lay.get(t.module + ".weight");
            auto row_norms = [&](const std::vector<float>& flat) {
              std::vector<float> n(size_t(t.linear.out));
              for (int64_t o = 0; o < t.linear.out; ++o) {
                double s = 0;
                for (int64_t i = 0; i < t.linear.in; ++i) {
                  const double v = flat[size_t(w.offset + o * t.linear.in + i)];
                  s += v * v;
                }
                n[size_t(o)] = float(std::sqrt(s));
              }
              return n;
            };
            const std::vector<float> got(mags.begin() + m.ad->layout().tensors[size_t(t.m_tensor)].offset,
                                         mags.begin() + m.ad->layout().tensors[size_t(t.m_tensor)].offset +
                                             t.linear.out);
            CHECK(max_abs_diff(got, row_norms(rt)) <= 1e-5f);
            CHECK(max_abs_diff(got, row_norms(orig)) > 1e-4f);
          }
        }
        // The rounding matters at this tolerance: the fp32 base gives other logits.
        AdaptedModel full(tmp / "base", options_for(c, kRank, kAlpha), nullptr, tmp / "adapter");
        CHECK(max_abs_diff(full.logits(in), logits) > (dtype == "nf4" ? 1e-2f : 1e-4f));
      }
    }
  }
}

namespace {

// A layout with the edges that matter: odd element counts (a half-filled
// last byte), tensors of a few blocks and of more than 256 blocks (two
// absmax2 runs), NF4 tensors back to back and between plain ones.
ParamLayout edge_layout() {
  LayoutBuilder b;
  b.begin_unit("embeddings");
  b.add("emb", {37, 3}, false, ParamTensor::Split::Replicated);
  b.end_unit();
  b.begin_unit("block 0");
  b.add("norm", {5}, false, ParamTensor::Split::Replicated);
  b.add("w1", {7, 45}, true, ParamTensor::Split::Replicated);     // 315: 5 blocks, the last partial, odd
  b.add("bias", {3}, false, ParamTensor::Split::Replicated);
  b.add("w2", {19, 1000}, true, ParamTensor::Split::Replicated);  // 19000: 297 blocks, 2 absmax2 runs
  b.add("w3", {64, 65}, true, ParamTensor::Split::Replicated);    // right after w2
  b.end_unit();
  b.begin_unit("head");
  b.add("h", {9}, false, ParamTensor::Split::Replicated);
  b.end_unit();
  return b.finish();
}
const std::vector<int> kEdgeNf4 = {2, 4, 5};  // w1, w2, w3

std::vector<float> edge_values(const ParamLayout& lay) {
  std::vector<float> v(size_t(lay.total));
  uint64_t s = 12345;
  for (size_t i = 0; i < v.size(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float u = float(int64_t(s >> 40) - (int64_t(1) << 23)) / float(1 << 23);  // [-1, 1)
    v[i] = u * (0.05f + 0.01f * float((i / 64) % 13));  // block absmaxes vary, so offset and qabsmax do
  }
  const ParamTensor& w2 = lay.get("w2");
  std::fill(v.begin() + w2.offset + 640, v.begin() + w2.offset + 704, 0.0f);  // an all-zero block
  return v;
}

// The reference: each NF4 tensor quantized whole on one host, dequantized.
std::vector<float> edge_reference(const ParamLayout& lay, const std::vector<float>& flat) {
  std::vector<float> out = flat;
  for (int t : kEdgeNf4) {
    const ParamTensor& pt = lay.tensors[size_t(t)];
    const nf4::Nf4Tensor q = nf4::quantize(flat.data() + pt.offset, pt.numel, pt.name);
    nf4::dequantize(q, out.data() + pt.offset);
  }
  return out;
}

struct StoreRun {
  std::vector<std::vector<float>> units;  // per rank: every unit acquired, concatenated
  std::vector<ShardMemory> memory;
  std::vector<std::string> errors;  // per rank: what it threw, "" if nothing
  void require_ok() const {
    for (size_t r = 0; r < errors.size(); ++r) {
      INFO("rank " << r << ": " << errors[r]);
      REQUIRE(errors[r].empty());
    }
  }
};

// The NF4 store on `world` ranks (threads, Gloo over loopback), loaded from
// `flat` through load_from; each rank acquires every unit.
StoreRun run_store(const std::string& strategy, int world, int group, const std::vector<float>& flat) {
  static const ParamLayout lay = edge_layout();
  FrozenFormat fmt;
  fmt.dtype = "nf4";
  fmt.nf4_tensors = kEdgeNf4;
  fmt.codec = nf4_codec();
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  StoreRun out;
  out.units.resize(size_t(world));
  out.memory.resize(size_t(world));
  std::vector<std::string>& errors = out.errors;
  errors.resize(size_t(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        using namespace std::chrono_literals;
        auto kv = connect_tcp_store("127.0.0.1", server.port(), secret, 30s);
        std::unique_ptr<Communicator> comm =
            world > 1 ? make_gloo_communicator(*kv, "world/", r, world, "127.0.0.1", 30s) : make_single_communicator();
        CommFactory factory = [&](const std::string& prefix, int rank, int w) {
          return make_gloo_communicator(*kv, prefix, rank, w, "127.0.0.1", 30s);
        };
        auto be = make_cpu_backend(1);
        auto store = make_frozen_param_store(strategy, lay, be.get(), comm.get(), group, factory, fmt);
        store->load_full_params(flat);
        for (size_t u = 0; u < lay.units.size(); ++u) {
          const void* p = store->acquire_params(int(u));
          const std::vector<float> v = download_act(be.get(), p, size_t(lay.units[u].numel));
          out.units[size_t(r)].insert(out.units[size_t(r)].end(), v.begin(), v.end());
          store->release_params(int(u));
        }
        out.memory[size_t(r)] = store->memory();
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("qlora: a sharded NF4 store dequantizes to the single-host quantization bit for bit", "[qlora][nf4]") {
  const ParamLayout lay = edge_layout();
  const std::vector<float> flat = edge_values(lay);
  const std::vector<float> want = edge_reference(lay, flat);
  REQUIRE(max_abs_diff(want, flat) > 1e-3f);  // the NF4 tensors did change
  // What NF4 holds of the three tensors, and the plain tensors in fp32.
  size_t nf4_bytes = 0, plain = size_t(lay.total);
  for (int t : kEdgeNf4) {
    nf4_bytes += nf4::stored_bytes(lay.tensors[size_t(t)].numel) - 4;  // the offset lives on the host
    plain -= size_t(lay.tensors[size_t(t)].numel);
  }
  const size_t exact = nf4_bytes + 4 * plain;
  const StoreRun one = run_store("no_shard", 1, 1, flat);
  one.require_ok();
  CHECK(same_bits(one.units[0], want));
  // 16-byte alignment of each section (at most 15 bytes each, 14 sections) and nothing else.
  CHECK(one.memory[0].params >= exact);
  CHECK(one.memory[0].params <= exact + 15 * 14);
  struct Mesh {
    std::string strategy;
    int world, group;
  };
  for (const Mesh& m : {Mesh{"full_shard", 2, 1}, Mesh{"full_shard", 3, 1}, Mesh{"full_shard", 4, 1},
                        Mesh{"hybrid_shard", 4, 2}, Mesh{"shard_grad_op", 3, 1}}) {
    INFO(m.strategy << " on " << m.world << " ranks (group " << m.group << ")");
    const StoreRun s = run_store(m.strategy, m.world, m.group, flat);
    s.require_ok();
    const int G = m.strategy == "full_shard" ? m.world : m.strategy == "hybrid_shard" ? m.group : 1;
    for (int r = 0; r < m.world; ++r) {
      INFO("rank " << r);
      CHECK(same_bits(s.units[size_t(r)], want));
      // Each rank holds 1/G of the image (rounded up to 16 bytes per unit).
      CHECK(s.memory[size_t(r)].params >= one.memory[0].params / size_t(G));
      CHECK(s.memory[size_t(r)].params <= one.memory[0].params / size_t(G) + 16 * lay.units.size());
    }
  }
}

TEST_CASE("qlora: a non-finite weight is an error naming the tensor and element, on every rank layout",
          "[qlora][nf4]") {
  const ParamLayout lay = edge_layout();
  std::vector<float> flat = edge_values(lay);
  flat[size_t(lay.get("w2").offset + 777)] = std::nanf("");
  const StoreRun one = run_store("no_shard", 1, 1, flat);
  REQUIRE(one.errors.size() == 1);
  CHECK_THAT(one.errors[0], Catch::Contains("model.base_dtype nf4: tensor w2 element 777 is nan") &&
                                Catch::Contains("check the weights file"));
  // 3 ranks: the rank holding element 777 says so; the others stop at the
  // same tensor (no hang) and their first acquire says the load failed.
  const StoreRun three = run_store("full_shard", 3, 1, flat);
  int naming = 0;
  for (const std::string& e : three.errors) {
    INFO(e);
    CHECK((e.find("tensor w2 element 777 is nan") != std::string::npos ||
           e.find("the frozen base was not loaded") != std::string::npos));
    naming += e.find("element 777") != std::string::npos;
  }
  CHECK(naming == 1);
}

namespace {

// A 3-step adapter fine-tune of peft_lora.py's Llama (from its peft-written
// adapter; fresh_dora: a fresh DoRA adapter, whose magnitudes are the row
// norms of the base as the store hands it out) at model.base_dtype `dtype`, global batch 12 (so 1, 2, 3 and 4
// ranks all take whole micro-batches), dropout 0.1.
JobSpec qlora_job(const TempDir& peft, const std::string& out, const std::string& dtype, const std::string& strategy,
                  int world, int group = 1, bool fresh_dora = false, const std::vector<std::string>& overrides = {}) {
  const std::string adapter = fresh_dora ? "type: dora" : "type: lora, init_from: '" + peft / "adapter" + "'";
  const std::string yaml =
      "model:\n  init_from: '" + peft / "base" + "'\n  seq_len: 8\n  base_dtype: " + dtype + "\n"
      "  adapter: {" + adapter + ", rank: 4, alpha: 8, dropout: 0.1,\n"
      "            target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 12, micro_batch_size: " + std::to_string(12 / world / (world == 1 ? 3 : 1)) +
      ", max_steps: 3, lr: 1.0e-2,\n"
      "        warmup_steps: 0, schedule: constant, eval_interval: 0, eval_steps: 1, log_interval: 1}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {sharding: " + strategy + ", timeout_s: 60" +
      (strategy == "hybrid_shard" ? ", shard_group_size: " + std::to_string(group) : std::string()) + "}\n";
  return parse_job_spec(yaml, "job.yaml", overrides);
}

}  // namespace

TEST_CASE("qlora training: 1 rank equals 2, 3 and 4 ranks under every strategy (lora fp32 base, nf4, bf16)",
          "[qlora][train]") {
  TempDir peft("qlora_train");
  make_peft_case(llama_case(), kRank, kAlpha, peft);
  struct Mesh {
    std::string strategy;
    int world, group;
  };
  // lora (fp32) at 2 ranks under every strategy is test_lora's; here the
  // uneven 3-rank shards, 4 ranks and hybrid groups of 2. nf4: every
  // strategy, and full_shard at 2, 3 and 4 (a 64-block cut between ranks).
  // bf16 rounds each element alone: one sharded case.
  const std::vector<std::pair<std::string, std::vector<Mesh>>> plan = {
      {"fp32", {{"full_shard", 3, 1}, {"shard_grad_op", 3, 1}, {"hybrid_shard", 4, 2}, {"no_shard", 4, 1}}},
      {"bf16", {{"full_shard", 3, 1}}},
      {"nf4",
       {{"no_shard", 2, 1}, {"shard_grad_op", 3, 1}, {"full_shard", 2, 1}, {"full_shard", 3, 1},
        {"full_shard", 4, 1}, {"hybrid_shard", 4, 2}}}};
  std::vector<double> fp32_losses;
  for (const auto& [dtype, meshes] : plan) {
    INFO("model.base_dtype " << dtype);
    const std::string one = peft / ("one_" + dtype);
    const std::vector<TrainSummary> s1 = run_ranks_inprocess(qlora_job(peft, one, dtype, "no_shard", 1), 1);
    const std::vector<double> losses = losses_of(one);
    REQUIRE(losses.size() == 3);
    const std::vector<float> trained = adapter_file(one + "/adapter");
    CHECK(max_abs_diff(trained, adapter_file(peft / "adapter")) > 1e-3f);  // it trained
    if (dtype == "fp32") {
      fp32_losses = losses;
    } else if (dtype == "bf16") {
      CHECK(std::fabs(losses[0] - fp32_losses[0]) > 1e-6);  // rounded: not the fp32 base
    } else {
      // The NF4 base is another function: its losses are not the fp32 base's.
      CHECK(std::fabs(losses[0] - fp32_losses[0]) > 1e-4);
      // The base's bytes: NF4 for the block linears, fp32 for the rest.
      AdaptedModel m(peft / "base", options_for(llama_case(), kRank, kAlpha), nullptr, peft / "adapter");
      const ParamLayout& lay = m.arch->layout();
      size_t exact = size_t(lay.total) * 4;
      for (int t : nf4_base_tensors(*m.arch)) exact += nf4::stored_bytes(lay.tensors[size_t(t)].numel) - 4 -
                                                       size_t(lay.tensors[size_t(t)].numel) * 4;
      const size_t base = s1[0].params_bytes - size_t(m.ad->layout().total) * 4;
      CHECK(base >= exact);
      CHECK(base <= exact + 16 * 3 * nf4_base_tensors(*m.arch).size() + 16 * lay.units.size() * 2);
      CHECK(double(base) < 0.4 * double(lay.total) * 4);
    }
    for (const Mesh& mesh : meshes) {
      INFO(mesh.strategy << " on " << mesh.world << " ranks (group " << mesh.group << ")");
      const std::string dir = peft / (dtype + "_" + mesh.strategy + std::to_string(mesh.world));
      const std::vector<TrainSummary> s =
          run_ranks_inprocess(qlora_job(peft, dir, dtype, mesh.strategy, mesh.world, mesh.group), mesh.world);
      if (mesh.strategy == "full_shard") CHECK(s[0].params_bytes < s1[0].params_bytes / size_t(mesh.world) + 4096);
      const std::vector<double> l = losses_of(dir);
      REQUIRE(l.size() == losses.size());
      for (size_t i = 0; i < l.size(); ++i) CHECK(std::fabs(l[i] - losses[i]) <= 1e-5 * std::fabs(losses[i]));
      CHECK(max_abs_diff(adapter_file(dir + "/adapter"), trained) <= 1e-5f);
    }
  }
}

TEST_CASE("qlora training: a fresh DoRA adapter on an NF4 base, 3 ranks (full_shard) equal 1",
          "[qlora][train]") {
  TempDir peft("qlora_dora");
  make_peft_case(llama_case(), kRank, kAlpha, peft);
  const std::string one = peft / "one", three = peft / "three";
  run_ranks_inprocess(qlora_job(peft, one, "nf4", "no_shard", 1, 1, true), 1);
  run_ranks_inprocess(qlora_job(peft, three, "nf4", "full_shard", 3, 1, true), 3);
  const std::vector<double> l1 = losses_of(one), l3 = losses_of(three);
  REQUIRE(l1.size() == 3);
  REQUIRE(l3.size() == 3);
  for (size_t i = 0; i < l1.size(); ++i) CHECK(std::fabs(l3[i] - l1[i]) <= 1e-5 * std::fabs(l1[i]));
  CHECK(max_abs_diff(adapter_file(three + "/adapter"), adapter_file(one + "/adapter")) <= 1e-5f);
}

TEST_CASE("qlora training: a resume re-quantizes the base from model.init_from and continues bit for bit",
          "[qlora][train]") {
  TempDir peft("qlora_resume");
  make_peft_case(llama_case(), kRank, kAlpha, peft);
  const std::vector<std::string> four = {"train.max_steps=4", "checkpoint.interval=2"};
  const std::string straight = peft / "straight", resumed = peft / "resumed";
  run_ranks_inprocess(qlora_job(peft, straight, "nf4", "full_shard", 3, 1, false, four), 3);
  std::vector<std::string> stop = four;
  stop.push_back("train.exit_interval=2");
  run_ranks_inprocess(qlora_job(peft, resumed, "nf4", "full_shard", 3, 1, false, stop), 3);
  REQUIRE(losses_of(resumed).size() == 2);
  run_ranks_inprocess(qlora_job(peft, resumed, "nf4", "full_shard", 3, 1, false, four), 3);
  CHECK(losses_of(resumed) == losses_of(straight));
  CHECK(adapter_file(resumed + "/adapter") == adapter_file(straight + "/adapter"));
}

TEST_CASE("qlora training: the memory line shows the NF4 base's bytes", "[qlora][train]") {
  TempDir peft("qlora_log");
  make_peft_case(llama_case(), kRank, kAlpha, peft);
  write_file(peft / "job.yaml", "model:\n  init_from: '" + peft / "base" +
                                    "'\n  seq_len: 8\n  base_dtype: nf4\n"
                                    "  adapter: {type: lora, rank: 4, alpha: 8}\n"
                                    "data: {format: synthetic, synthetic: {branching: 3}}\n"
                                    "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 1}\n"
                                    "output: {dir: '" + peft / "run" + "', sample_tokens: 0}\n");
  const RunResult r = run_trainrun("--config '" + peft / "job.yaml" + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  std::smatch m;
  // The log wraps long lines (a newline and two spaces): join them back.
  const std::string all = std::regex_replace(r.out + r.err, std::regex("\n  "), " ");
  REQUIRE(std::regex_search(all, m, std::regex(R"(memory \(rank 0, full_shard, frozen nf4\): params ([0-9.]+) KiB)")));
  // The same bytes as the store holds in the in-process model (no_shard: on one rank full_shard holds as much).
  AdaptedModel mod(peft / "base", options_for(llama_case(), kRank, kAlpha), nullptr, peft / "adapter", "nf4");
  const double kib = double(mod.base_store->memory().params) / 1024;
  CHECK(std::fabs(std::stod(m[1]) - kib) <= 0.051);
  CHECK(kib < 0.4 * double(mod.arch->layout().total) * 4 / 1024);  // well under the fp32 base
}

TEST_CASE("qlora training: nf4 and bf16 under pipeline parallelism, bf16 under tensor parallelism and nf4 with "
          "offload equal 1 rank",
          "[qlora][train]") {
  TempDir peft("qlora_mesh");
  make_peft_case(llama_case(), kRank, kAlpha, peft);
  const std::vector<std::string> pp2 = {"parallel.pipeline_parallel=2", "parallel.pipeline_schedule=1f1b"};
  struct Run {
    std::string dtype, name;
    int world;
    std::vector<std::string> overrides;
    std::string lr = "1.0e-2";
    bool fresh_dora = false;  // DoRA's magnitudes: each stage's from its own NF4 units
  };
  // Each against the 1-rank run of its dtype: a stage's store quantizes
  // (rounds) its tensors as the whole model's does, a TP slice rounds
  // element by element, and offload moves only the adapters' state. tp2
  // sums its rows' products in another order; at lr 1e-2 AdamW's first
  // steps turn that into 1.0e-5 on an adapter element (measured), so it
  // and its 1-rank run take lr 1e-3 (test_lora_parallel.cpp's job_yaml says why).
  const std::vector<Run> runs = {{"nf4", "pp2", 2, pp2},
                                 {"nf4", "pp2_dora", 2, pp2, "1.0e-2", true},
                                 {"nf4", "offload", 1, {"parallel.offload=cpu"}},
                                 {"bf16", "pp2", 2, pp2},
                                 {"bf16", "tp2", 2, {"parallel.tensor_parallel=2"}, "1.0e-3"}};
  std::map<std::string, std::vector<TrainSummary>> one_summary;
  for (Run run : runs) {
    INFO("model.base_dtype " << run.dtype << ", " << run.name);
    const std::string key = run.dtype + "_lr" + run.lr + (run.fresh_dora ? "_dora" : "");
    const std::string one = peft / ("one_" + key);
    run.overrides.push_back("train.lr=" + run.lr);
    if (!one_summary.count(key))
      one_summary[key] =
          run_ranks_inprocess(qlora_job(peft, one, run.dtype, "no_shard", 1, 1, run.fresh_dora, {"train.lr=" + run.lr}),
                              1, 1);
    const std::vector<double> losses = losses_of(one);
    REQUIRE(losses.size() == 3);
    const std::vector<float> trained = adapter_file(one + "/adapter");
    if (!run.fresh_dora)  // (a fresh DoRA adapter has no file to start from)
      CHECK(max_abs_diff(trained, adapter_file(peft / "adapter")) > 1e-4f);  // it trained, also at lr 1e-3
    const std::string dir = peft / (run.dtype + "_" + run.name);
    const std::vector<TrainSummary> s = run_ranks_inprocess(
        qlora_job(peft, dir, run.dtype, "no_shard", run.world, 1, run.fresh_dora, run.overrides), run.world, 1);
    INFO("adapter max |difference| " << max_abs_diff(adapter_file(dir + "/adapter"), trained));
    const std::vector<double> l = losses_of(dir);
    REQUIRE(l.size() == losses.size());
    for (size_t i = 0; i < l.size(); ++i) CHECK(std::fabs(l[i] - losses[i]) <= 1e-5 * std::fabs(losses[i]));
    CHECK(max_abs_diff(adapter_file(dir + "/adapter"), trained) <= 1e-5f);
    const size_t whole = one_summary[key][0].params_bytes;
    if (run.world > 1) {
      // Each rank holds its stage's (its slice's) part of the base, not all of it.
      for (const TrainSummary& r : s) CHECK(r.params_bytes < whole * 3 / 4);
    } else {
      // Offload: the host holds the adapters' optimizer state and nothing of the base.
      AdaptedModel m(peft / "base", options_for(llama_case(), kRank, kAlpha), nullptr, peft / "adapter");
      CHECK(s[0].host_bytes == offload_host_bytes(m.ad->layout().total));
      CHECK(s[0].params_bytes <= whole);
      // The same AdamW on the host: bit for bit (measured).
      CHECK(l == losses);
      CHECK(adapter_file(dir + "/adapter") == trained);
    }
  }
}

TEST_CASE("qlora: a pipeline stage's NF4 store quantizes its tensors to the whole model's bits", "[qlora][nf4]") {
  // Llama, tied (the last stage holds a copy of the embedding), 3 layers
  // over 2 stages (2 + 1); k_proj and v_proj (12 x 24) end in half a
  // 64-block. Each stage's units, acquired, are those of quantizing each
  // tensor of the whole model on one host, bit for bit.
  ModelConfig c;
  c.arch = "llama";
  c.L = 3;
  c.NH = 4;
  c.NKV = 2;
  c.C = 24;
  c.F = 40;
  c.V = 23;
  c.T = 8;
  c.tied = true;
  const std::unique_ptr<ModelArch> arch = make_model_arch(c);
  std::vector<float> want(size_t(arch->layout().total));
  arch->init_params(7, 0, arch->layout().total, want.data());
  const std::vector<float> init = want;
  round_trip_base(*arch, want, "nf4");
  REQUIRE(max_abs_diff(want, init) > 1e-3f);
  const std::vector<int> split = split_pipeline_layers(c.L, 2, {});
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<std::string> errors(2);
  std::vector<int> units(2, 0), differing(2, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        using namespace std::chrono_literals;
        auto kv = connect_tcp_store("127.0.0.1", server.port(), secret, 30s);
        std::unique_ptr<Communicator> pp = make_gloo_communicator(*kv, "pp/", r, 2, "127.0.0.1", 30s);
        std::unique_ptr<Communicator> dp = make_single_communicator();
        auto be = make_cpu_backend(1);
        const PipelineStagePlan plan(arch->layout(), 2, 1, r, split);
        auto inner = make_frozen_param_store("no_shard", plan.stage_layout(), be.get(), dp.get(), 1, nullptr,
                                             frozen_format(*arch, "nf4", plan.stage_layout()));
        ParamStore* held = inner.get();
        auto store = make_pipeline_stage_store(std::move(inner), plan, pp.get(), be.get(), false, true);
        store->init_params(*arch, 7);  // through load_if_quantizing: stage offsets read at model offsets
        for (const StageRun& run : plan.runs()) {
          const int u = units[size_t(r)]++;
          TR_CHECK(plan.stage_layout().units[size_t(u)].offset == run.local, "stage unit ", u, " is not run ", u);
          const std::vector<float> got = download_act(be.get(), held->acquire_params(u), size_t(run.count));
          held->release_params(u);
          const std::vector<float> ref(want.begin() + run.outer, want.begin() + run.outer + run.count);
          differing[size_t(r)] += !same_bits(got, ref);
        }
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO("stage " << r << ": " << errors[size_t(r)]);
    CHECK(errors[size_t(r)].empty());
    CHECK(units[size_t(r)] >= 2);
    CHECK(differing[size_t(r)] == 0);
  }
}

TEST_CASE("qlora: model.base_dtype bf16 / nf4 without an adapter, or nf4 with tensor parallelism, is refused",
          "[qlora]") {
  const std::string base = "data:\n  format: synthetic\nmodel:\n  base_dtype: ";
  for (const std::string dtype : {"nf4", "bf16"}) {
    INFO(dtype);
    CHECK_THROWS_WITH(parse_job_spec(base + dtype + "\n", "job.yaml"),
                      Catch::Contains("model.base_dtype") && Catch::Contains("model.adapter.type") &&
                          Catch::Contains(dtype + " holds a frozen base, which needs model.adapter.type: lora or dora"));
    const std::string with = base + dtype + "\n  adapter: {type: lora}\n";
    CHECK(parse_job_spec(with, "job.yaml").model.base_dtype == dtype);
    // Offload (the adapters' state), pipeline stages and tensor parallelism run with both (nf4 under TP
    // where each slice is whole 64-blocks: setup checks, test_qlora_tp.cpp).
    CHECK(parse_job_spec(with, "job.yaml", {"parallel.offload=cpu"}).parallel.offload == "cpu");
    CHECK(parse_job_spec(with, "job.yaml", {"parallel.pipeline_parallel=2"}).parallel.pipeline_parallel == 2);
    CHECK(parse_job_spec(with, "job.yaml", {"parallel.tensor_parallel=2"}).parallel.tensor_parallel == 2);
  }
  CHECK(parse_job_spec(base + "fp32\n", "job.yaml").model.base_dtype == "fp32");
}

TEST_CASE("qlora: generate --base-dtype samples with the base a QLoRA / bf16 run trained on", "[qlora][peft]") {
  for (const std::string dtype : {"nf4", "bf16"}) {
    INFO(dtype);
    TempDir tmp("qlora_gen");
    make_peft_case(gpt2_case(), kRank, kAlpha, tmp, dtype);
    // The in-memory round trip is the reference's base_<dtype>/ bit for bit
    // (GPT-2's Conv1D weights quantized as nn.Linear's (out, in)).
    std::vector<float> ours, theirs;
    const std::unique_ptr<ModelArch> arch = make_model_arch(load_hf(tmp / "base", ours, "test"));
    load_hf(tmp / ("base_" + dtype), theirs, "test");
    const std::vector<float> original = ours;
    round_trip_base(*arch, ours, dtype);
    REQUIRE(ours.size() == theirs.size());
    CHECK(std::memcmp(ours.data(), theirs.data(), ours.size() * 4) == 0);
    CHECK(max_abs_diff(ours, original) > 1e-4f);  // it changed the weights
    // The CLI: sampling from the file's base with --base-dtype is sampling
    // from the round-tripped base, with the adapter unmerged on top.
    auto gen = [&](const std::string& base, const std::string& extra) {
      const auto r = run_trainrun("generate --checkpoint '" + base + "' --adapter '" + tmp / "adapter" +
                                  "' --prompt '1 2 3' --top-k 0 --temperature 1 --seed 7 --max-tokens 8" + extra);
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      return r;
    };
    const auto r = gen(tmp / "base", " --base-dtype " + dtype);
    CHECK_THAT(r.err, Catch::Contains("as model.base_dtype " + dtype + " holds them"));
    CHECK(r.out == gen(tmp / ("base_" + dtype), "").out);
  }
  const auto bad = run_trainrun("generate --checkpoint x --base-dtype int8");
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.err, Catch::Contains("--base-dtype"));
}
