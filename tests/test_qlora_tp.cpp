// model.base_dtype nf4 (QLoRA) under tensor parallelism
// (parallel/sharding/nf4_frozen_store.cpp, "Tensor parallelism";
// core/model/adapter/qlora.h, frozen_format with a plan).
//  - The store of a TP rank, its slice of each NF4 weight made of whole
//    64-blocks of the global tensor, dequantizes every local element to the
//    very bits of quantizing the whole tensor on one host (nf4::quantize +
//    dequantize), column- and row-parallel weights, Llama (GQA, split KV
//    heads) and GPT-2 (fused q|k|v), tp2 and tp2 x dp2 full_shard (each
//    TP slice's image sharded in bytes over dp); its memory is the codes plus an
//    fp32 absmax per block.
//  - Training: nf4 at tp2 (and tp2 x dp2 full_shard) equals nf4 on one rank,
//    losses of 3 steps and the final adapter to 1e-5.
//  - A split that cuts a 64-block is refused at setup, naming the tensor,
//    its shape, the tp size and the fix.
// Models: peft_lora.py's random bases widened to n_embd 128 (Llama ffn 256),
// so that every slice is whole blocks at tp2.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/nf4.h"
#include "core/model/adapter/qlora.h"
#include "core/model/tensor_parallel.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/communicator.h"
#include "parallel/rendezvous/store.h"
#include "parallel/sharding/frozen_store.h"
#include "parallel/tensor/tp_param_store.h"
#include "tests/support/adapted_model.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

ModelConfig small(const std::string& arch) {
  ModelConfig c;
  c.arch = arch;
  c.L = 1;
  c.NH = 4;
  c.NKV = arch == "llama" ? 2 : 0;
  c.C = 128;
  c.F = arch == "llama" ? 256 : 0;
  c.V = 61;
  c.T = 16;
  c.tied = arch == "gpt2";
  return c;
}

// Weights whose block absmaxes vary (so offset, qabsmax and absmax2 do).
std::vector<float> weights(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t s = 777;
  for (size_t i = 0; i < v.size(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float u = float(int64_t(s >> 40) - (int64_t(1) << 23)) / float(1 << 23);  // [-1, 1)
    v[i] = u * (0.05f + 0.01f * float((i / 64) % 13));
  }
  return v;
}

struct TpStoreRun {
  std::vector<std::vector<float>> local;  // per rank: its local flat vector, every unit acquired
  std::vector<std::vector<float>> want;   // per rank: the single-host round trip at its local elements
  std::vector<size_t> params;             // per rank: the store's bytes
  std::vector<size_t> exact;              // per rank: codes + fp32 block absmaxes + fp32 plain, no alignment
};

// The frozen NF4 store of a tp x dp mesh (threads, Gloo over loopback; tp
// innermost, as the trainer's mesh), wrapped in the TP store and loaded from
// the global weights through it (load_full_params -> load_from).
TpStoreRun run_tp_store(const ModelConfig& cfg, int tp, int dp, const std::string& strategy) {
  const std::unique_ptr<ModelArch> arch = make_model_arch(cfg);
  const std::vector<float> flat = weights(arch->layout().total);
  std::vector<float> ref = flat;
  round_trip_base(*arch, ref, "nf4");
  REQUIRE(max_abs_diff(ref, flat) > 1e-3f);  // the NF4 tensors did change
  const int world = tp * dp;
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  TpStoreRun out;
  out.local.resize(size_t(world));
  out.want.resize(size_t(world));
  out.params.resize(size_t(world));
  out.exact.resize(size_t(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        using namespace std::chrono_literals;
        const int t = r % tp, d = r / tp;
        auto kv = connect_tcp_store("127.0.0.1", server.port(), secret, 30s);
        auto tpc = make_gloo_communicator(*kv, "tp" + std::to_string(d) + "/", t, tp, "127.0.0.1", 30s);
        auto dpc = dp > 1 ? make_gloo_communicator(*kv, "dp" + std::to_string(t) + "/", d, dp, "127.0.0.1", 30s)
                          : make_single_communicator();
        CommFactory factory = [&](const std::string& prefix, int rank, int w) {
          return make_gloo_communicator(*kv, "t" + std::to_string(t) + prefix, rank, w, "127.0.0.1", 30s);
        };
        const TensorParallelPlan plan(*arch, tp, t);
        auto be = make_cpu_backend(1);
        const FrozenFormat fmt = frozen_format(*arch, "nf4", plan, tpc.get());
        if (fmt.nf4_tp.size() != fmt.nf4_tensors.size() || fmt.nf4_tensors.empty())  // (Catch is not thread-safe)
          throw std::runtime_error("frozen_format gave no tensor-parallel slices");
        auto store = make_tensor_parallel_store(
            make_frozen_param_store(strategy, plan.local_layout(), be.get(), dpc.get(), dp, factory, fmt), plan,
            tpc.get());
        store->load_full_params(flat);
        const ParamLayout& lay = plan.local_layout();
        std::vector<float>& got = out.local[size_t(r)];
        got.assign(size_t(lay.total), -99.0f);
        for (size_t u = 0; u < lay.units.size(); ++u) {
          const void* p = store->acquire_params(int(u));
          const std::vector<float> v = download_act(be.get(), p, size_t(lay.units[u].numel));
          std::copy(v.begin(), v.end(), got.begin() + lay.units[u].offset);
          store->release_params(int(u));
        }
        std::vector<float>& want = out.want[size_t(r)];
        want.assign(size_t(lay.total), 0.0f);  // vocabulary padding rows: zero
        for (const TpRun& run : plan.runs())
          if (run.global >= 0)
            std::copy_n(ref.begin() + run.global, run.count, want.begin() + run.local);
        out.params[size_t(r)] = store->memory().params;
        size_t exact = size_t(lay.total) * 4;
        for (int i : fmt.nf4_tensors) {
          const int64_t n = lay.tensors[size_t(i)].numel;
          exact += size_t(n / 2 + 4 * (n / 64)) - size_t(n) * 4;
        }
        out.exact[size_t(r)] = exact;
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << errors[size_t(r)]);
    REQUIRE(errors[size_t(r)].empty());
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("qlora tp: a TP rank's NF4 store dequantizes to the whole tensor's single-host quantization bit for bit",
          "[qlora][tp][nf4]") {
  SECTION("tp2: llama (GQA, 2 KV heads split) and gpt2 (fused q|k|v)") {
    for (const std::string arch : {"llama", "gpt2"}) {
      INFO(arch);
      const ModelConfig cfg = small(arch);
      // Both kinds of slice are present: column-parallel (q|k|v, gate|up /
      // c_attn, c_fc: row ranges) and row-parallel (o_proj, down_proj /
      // c_proj: a column range of every row, so a rank's blocks are no run
      // of the global tensor's and its double quantization is the global one).
      const TpStoreRun s = run_tp_store(cfg, 2, 1, "no_shard");
      for (int r = 0; r < 2; ++r) {
        INFO("tp rank " << r);
        CHECK(same_bits(s.local[size_t(r)], s.want[size_t(r)]));
        // The codes plus one fp32 absmax per block (~0.5625 bytes per NF4 element), 16-byte alignment aside.
        CHECK(s.params[size_t(r)] >= s.exact[size_t(r)]);
        CHECK(s.params[size_t(r)] <= s.exact[size_t(r)] + 16 * 32);
      }
      CHECK(!same_bits(s.local[0], s.local[1]));  // two different slices
    }
  }
  SECTION("tp2 x dp2 full_shard: each TP slice's image sharded in bytes over dp") {
    const TpStoreRun s = run_tp_store(small("llama"), 2, 2, "full_shard");
    for (int r = 0; r < 4; ++r) {
      INFO("rank " << r);
      CHECK(same_bits(s.local[size_t(r)], s.want[size_t(r)]));
      CHECK(s.params[size_t(r)] <= s.exact[size_t(r)] / 2 + 16 * 32);  // half of its TP slice
    }
  }
}

namespace {

// base/ and adapter/ from peft_lora.py, n_embd 128 (`width`) and 1 layer.
std::string make_base(const TempDir& tmp, const std::string& arch, int width) {
  const auto r = run_reference_script(
      "peft_lora.py", "make --arch " + arch + " --out '" + tmp.path() + "' --r 4 --alpha 8 --layers 1 --width " +
                          std::to_string(width) + " --ffn " + std::to_string(2 * width) + " --targets " +
                          (arch == "llama" ? "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
                                           : "c_attn,c_proj,c_fc"));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return tmp / "base";
}

// 3 steps of LoRA fine-tuning from peft's adapter on an NF4 base, dropout 0.1.
JobSpec nf4_job(const std::string& base, const std::string& out, const std::string& arch, const std::string& parallel) {
  const std::string targets =
      arch == "llama" ? "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]" : "[c_attn, c_proj, c_fc]";
  const std::string yaml =
      "model:\n  init_from: '" + base + "'\n  seq_len: 8\n  base_dtype: nf4\n"
      "  adapter: {type: lora, init_from: '" + base + "/../adapter', rank: 4, alpha: 8, dropout: 0.1,\n"
      "            target_modules: " + targets + "}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 3, lr: 1.0e-3,\n"
      "        warmup_steps: 0, schedule: constant, eval_interval: 0, eval_steps: 1, log_interval: 1}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {timeout_s: 60" + (parallel.empty() ? "" : ", " + parallel) + "}\n";
  return parse_job_spec(yaml, "job.yaml");
}

std::vector<float> adapter_of(const std::string& run) { return adapter_file(run + "/adapter"); }

void check_same_run(const std::string& got, const std::string& want) {
  const std::vector<double> lg = losses_of(got), lw = losses_of(want);
  REQUIRE(lw.size() == 3);
  REQUIRE(lg.size() == lw.size());
  for (size_t i = 0; i < lg.size(); ++i) {
    INFO("step " << i + 1 << ": " << lg[i] << " vs " << lw[i]);
    CHECK(std::fabs(lg[i] - lw[i]) <= 1e-5 * std::fabs(lw[i]));
  }
  const std::vector<float> ag = adapter_of(got), aw = adapter_of(want);
  REQUIRE(ag.size() == aw.size());
  CHECK(rel_err(ag, aw) <= 1e-5);
}

}  // namespace

TEST_CASE("qlora tp: nf4 at tp2 (and tp2 x dp2 full_shard) equals nf4 on one rank", "[qlora][tp][train]") {
  SECTION("llama (2 KV heads, split)") {
    TempDir tmp("qlora_tp_llama");
    const std::string base = make_base(tmp, "llama", 128);
    run_ranks_inprocess(nf4_job(base, tmp / "one", "llama", ""), 1, 1);
    run_ranks_inprocess(nf4_job(base, tmp / "tp2", "llama", "tensor_parallel: 2"), 2, 1);
    check_same_run(tmp / "tp2", tmp / "one");
    // It trained: the adapter moved off peft's.
    const std::vector<float> a0 = adapter_file(tmp / "adapter");
    REQUIRE(a0.size() == adapter_of(tmp / "one").size());
    CHECK(max_abs_diff(adapter_of(tmp / "one"), a0) > 1e-4f);
    run_ranks_inprocess(nf4_job(base, tmp / "tpdp", "llama", "tensor_parallel: 2, sharding: full_shard"), 4, 1);
    check_same_run(tmp / "tpdp", tmp / "one");
  }
  SECTION("gpt2 (fused q|k|v, Conv1D)") {
    TempDir tmp("qlora_tp_gpt2");
    const std::string base = make_base(tmp, "gpt2", 128);
    run_ranks_inprocess(nf4_job(base, tmp / "one", "gpt2", ""), 1, 1);
    run_ranks_inprocess(nf4_job(base, tmp / "tp2", "gpt2", "tensor_parallel: 2"), 2, 1);
    check_same_run(tmp / "tp2", tmp / "one");
  }
}

TEST_CASE("qlora tp: a tensor-parallel split that cuts a 64-block is refused at setup, naming the tensor",
          "[qlora][tp]") {
  // n_embd 32: o_proj (32, 32) splits into 16 columns per rank.
  TempDir tmp("qlora_tp_cut");
  const std::string base = make_base(tmp, "llama", 32);
  try {
    run_ranks_inprocess(nf4_job(base, tmp / "tp2", "llama", "tensor_parallel: 2"), 2, 1);
    FAIL("tp2 with NF4 slices of 16 elements ran");
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains("model.base_dtype nf4 with parallel.tensor_parallel 2: tensor "
                                    "model.layers.0.self_attn.") &&
                        Catch::Contains("not whole 64-element blocks") &&
                        Catch::Contains("parallel.sharding: full_shard"));
  }
}
