// Expert parallelism's storage split (core/model/moe/expert_parallel_plan.h,
// parallel/expert/ep_split_store.h): what an ep rank holds of a tiny
// Mixtral / Qwen2-MoE, checked element by element against the global
// layout; its two-part store (dense over the dp group, experts over the
// expert-dp group) checked for what it holds, writes, inits, reduces and
// returns to the network, and its bytes against the planner's EP row
// (core/train/planner_ep.cpp) for the same model. In-process, no python.
#include <catch2/catch.hpp>

#include <chrono>
#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/model/moe/expert_parallel_plan.h"
#include "core/train/planner.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/expert/ep_split_store.h"
#include "parallel/rendezvous/store.h"
#include "parallel/sharding/sharding.h"
#include "parallel/tensor/tp_param_store.h"
#include "tests/support/inprocess.h"
#include "tests/support/moe_hf.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

test::MoeShape shape(const std::string& arch) {
  test::MoeShape s;
  s.arch = arch;
  if (arch == "qwen2_moe") s.FS = 24;  // a shared expert: dense, held by every ep rank
  return s;
}

int64_t expert_elements(const ParamLayout& l) {
  int64_t n = 0;
  for (const ParamTensor& t : l.tensors)
    if (expert_of_tensor(t.name) >= 0) n += t.numel;
  return n;
}

// The planner's sharding of a W-rank job without hybrid groups.
Sharding whole_group(const std::string& strategy, int W) {
  Sharding s;
  s.strategy = strategy;
  s.world = W;
  s.group = strategy == "no_shard" ? 1 : W;
  return s;
}

// One rank of a W-rank job at expert-parallel degree E, as the trainer
// builds it (core/train/trainer.cpp): ep groups of E consecutive ranks,
// expert-dp groups of the ranks with the same ep index, and the two-part
// store (dense over all W, experts over the expert-dp group).
struct EpRank {
  std::unique_ptr<Communicator> dp, ep, xdp;
  std::unique_ptr<Backend> be;
  std::unique_ptr<ExpertParallelPlan> plan;
  std::unique_ptr<ParamStore> store;
};

// Runs f(d, rank) on W threads; the errors, one per rank ("" = none).
std::vector<std::string> run_ep_ranks(const ModelArch& model, int W, int E, const std::string& strategy,
                                      const std::function<void(int, EpRank&)>& f) {
  return test::run_store_ranks(W, [&](int d, Store& kv) {
    EpRank k;
    auto gloo = [&](const std::string& name, int rank, int world) {
      return make_gloo_communicator(kv, name + "/", rank, world, "127.0.0.1", std::chrono::seconds(30));
    };
    k.dp = gloo("dp", d, W);
    k.ep = gloo("ep" + std::to_string(d / E), d % E, E);
    k.xdp = gloo("xdp" + std::to_string(d % E), d / E, W / E);
    k.be = make_cpu_backend(1);
    k.plan = std::make_unique<ExpertParallelPlan>(model.layout(), model.config().moe.n_experts, E, d % E);
    const ExpertParallelPlan& p = *k.plan;
    k.store = make_expert_split_store(
        p.local_layout(), make_param_store(strategy, p.dense_layout(), k.be.get(), k.dp.get(), 0, nullptr),
        p.dense_plan(), make_param_store(strategy, p.expert_layout(), k.be.get(), k.xdp.get(), 0, nullptr),
        p.expert_plan(), k.ep.get(), k.be.get());
    f(d, k);
  });
}

}  // namespace

TEST_CASE("expert parallel plan: an ep rank holds its experts only, its dense and expert parts partition that, the "
          "shared expert is dense",
          "[ep][moe]") {
  for (const std::string arch : {"mixtral", "qwen2_moe"}) {
    const auto model = make_model_arch(test::moe_config(shape(arch)));
    const ParamLayout& g = model->layout();
    const int n = model->config().moe.n_experts;  // 4
    const int64_t X = expert_elements(g);
    REQUIRE(X > 0);
    int moe_units = 0;
    for (size_t u = 0; u < g.units.size(); ++u) {
      bool has = false;
      for (const ParamTensor& t : g.tensors) has |= t.unit == int(u) && expert_of_tensor(t.name) >= 0;
      moe_units += has;
    }
    REQUIRE(moe_units == model->config().L);
    for (const int ep : {1, 2, 4}) {
      std::vector<int> holders(size_t(g.total), 0);
      for (int r = 0; r < ep; ++r) {
        INFO(arch << " ep" << ep << " rank " << r);
        const ExpertParallelPlan plan(g, n, ep, r);
        const ParamLayout& l = plan.local_layout();
        CHECK(l.total == g.total - X + X / ep);
        CHECK(l.units.size() == g.units.size());
        int64_t ex = 0;
        for (const auto& [s, c] : plan.expert_ranges()) ex += c;
        CHECK(ex == X / ep);
        // Every global tensor: held whole iff dense or one of [r*n/ep, (r+1)*n/ep).
        for (const ParamTensor& t : g.tensors) {
          const int e = expert_of_tensor(t.name);
          const bool mine = e < 0 || (e >= r * n / ep && e < (r + 1) * n / ep);
          const ParamTensor* lt = l.find(t.name);
          REQUIRE((lt != nullptr) == mine);
          if (arch == "qwen2_moe" && t.name.find("shared_expert") != std::string::npos) CHECK(e < 0);
          for (const int64_t at : {t.offset, t.offset + t.numel - 1})
            CHECK(plan.local_of(at) == (mine ? lt->offset + (at - t.offset) : -1));
          if (mine) CHECK(lt->shape == t.shape);
        }
        // The two parts: every local tensor in exactly one (experts in the
        // expert part), the dense part with every unit and the ties, the
        // expert part with the MoE units only; each part's plan maps its
        // tensors to their global offsets.
        const ParamLayout& D = plan.dense_layout();
        const ParamLayout& XL = plan.expert_layout();
        CHECK(D.units.size() == g.units.size());
        CHECK(int(XL.units.size()) == moe_units);
        CHECK(D.ties.size() == g.ties.size());
        CHECK(XL.total == X / ep);
        CHECK(D.total + XL.total == l.total);
        int misplaced = 0, mismapped = 0;
        for (const ParamTensor& t : l.tensors) {
          const bool expert = expert_of_tensor(t.name) >= 0;
          const ParamTensor* in = (expert ? XL : D).find(t.name);
          misplaced += !in || (expert ? D : XL).find(t.name) != nullptr || in->shape != t.shape;
          if (!in) continue;
          const TensorParallelPlan& pp = expert ? plan.expert_plan() : plan.dense_plan();
          const int64_t gt = g.get(t.name).offset;
          mismapped += pp.local_of(gt) != in->offset || pp.local_of(gt + t.numel - 1) != in->offset + t.numel - 1;
        }
        CHECK(misplaced == 0);
        CHECK(mismapped == 0);
        CHECK(plan.dense_plan().size() == 1);
        CHECK(plan.expert_plan().size() == ep);
        for (const TpRun& run : plan.runs())
          for (int64_t i = 0; i < run.count; ++i) ++holders[size_t(run.global + i)];
        // held_global is what the store's held_ranges will answer in global
        // coordinates: rank 1 of ep2 holds none of experts 0 and 1.
        int64_t held = 0;
        for (const auto& [s, c] : plan.held_global()) held += c;
        CHECK(held == l.total);
        if (ep == 2 && r == 1)
          for (const auto& [s, c] : plan.held_global())
            for (const ParamTensor& t : g.tensors)
              if (expert_of_tensor(t.name) == 0 || expert_of_tensor(t.name) == 1)
                CHECK((t.offset + t.numel <= s || t.offset >= s + c));
      }
      // Over the group: experts held once, dense elements by every rank.
      int bad_holder = 0;
      for (const ParamTensor& t : g.tensors)
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i)
          bad_holder += holders[size_t(i)] != (expert_of_tensor(t.name) >= 0 ? 1 : ep);
      CHECK(bad_holder == 0);
    }
  }
}

TEST_CASE("expert parallel plan: the two-part store holds, writes and inits the dense part over dp and the experts "
          "over the expert-dp group, in global coordinates, and hands the network its local units",
          "[ep][moe][checkpoint]") {
  auto mark = [](std::vector<int>& v, const ParamStore::Range& r) {
    for (int64_t k = 0; k < r.reps; ++k)
      for (int64_t i = 0; i < r.count; ++i) ++v[size_t(r.global + k * r.stride + i)];
  };
  struct Case {
    int W, E;
    const char* strategy;
    int L;
    bool tied;
  };
  // L 4, tied: the no_shard dense part's ranges fold into a strided range
  // across the middle blocks, around the experts (cut into rows), and the
  // embeddings pass through for the tied head.
  for (const Case c : {Case{2, 2, "no_shard", 2, false}, Case{4, 2, "full_shard", 2, false},
                       Case{2, 2, "no_shard", 4, true}, Case{4, 2, "full_shard", 4, true}}) {
    INFO(c.strategy << " dp" << c.W << " x ep" << c.E << ", " << c.L << " layers" << (c.tied ? ", tied" : ""));
    test::MoeShape sh = shape("qwen2_moe");
    sh.L = c.L;
    sh.tied = c.tied;
    const auto model = make_model_arch(test::moe_config(sh));
    const ParamLayout& g = model->layout();
    const int n = model->config().moe.n_experts;
    std::vector<float> init(size_t(g.total));
    model->init_params(11, 0, g.total, init.data());
    // Per rank: how often it holds / writes each global element (threads write their own row).
    std::vector<std::vector<int>> held(size_t(c.W), std::vector<int>(size_t(g.total), 0)), wrote = held;
    std::vector<int> bad_init(size_t(c.W), -1), bad_unit(size_t(c.W), -1);
    const auto errors = run_ep_ranks(*model, c.W, c.E, c.strategy, [&](int d, EpRank& k) {
      k.store->init_params(*model, 11);
      int bad = 0;
      for (const ParamStore::Range& h : k.store->held_ranges()) {
        mark(held[size_t(d)], h);
        std::vector<float> mine(size_t(h.numel()));
        k.store->copy_state_range(0, h, mine.data());
        bad += !std::equal(mine.begin(), mine.end(), init.begin() + h.global);
      }
      for (const ParamStore::Range& w : k.store->write_ranges()) mark(wrote[size_t(d)], w);
      bad_init[size_t(d)] = bad;
      // What the network reads: each local unit, dense tensors and this
      // rank's experts in the local layout's order (assembled from the
      // two parts for a block), the global init at each element.
      const ParamLayout& l = k.plan->local_layout();
      int wrong = 0;
      std::vector<float> host;
      k.store->begin_pass(false, false);
      for (size_t u = 0; u < l.units.size(); ++u) {
        const ParamUnit& U = l.units[u];
        host.assign(size_t(U.numel), 0.0f);
        k.be->copy_to_host(host.data(), k.store->acquire_params(int(u)), host.size() * 4);
        k.store->release_params(int(u));
        for (int64_t i = 0; i < U.numel; i += 7) {
          int64_t glob = -1;
          for (const TpRun& r : k.plan->runs())
            if (U.offset + i >= r.local && U.offset + i < r.local + r.count) glob = r.global + (U.offset + i - r.local);
          wrong += glob < 0 || host[size_t(i)] != init[size_t(glob)];
        }
      }
      bad_unit[size_t(d)] = wrong;
    });
    CHECK(errors == std::vector<std::string>(size_t(c.W)));
    CHECK(bad_init == std::vector<int>(size_t(c.W), 0));
    CHECK(bad_unit == std::vector<int>(size_t(c.W), 0));
    // Every element is written by exactly one rank. no_shard: the dense part
    // is held by every rank, an expert by the W/E ranks of its ep index;
    // full_shard: both parts partitioned, every element held once.
    int wrong_held = 0, wrong_written = 0;
    for (const ParamTensor& t : g.tensors) {
      const int e = expert_of_tensor(t.name);
      for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
        int holders = 0, writers = 0;
        for (int d = 0; d < c.W; ++d) {
          holders += held[size_t(d)][size_t(i)];
          writers += wrote[size_t(d)][size_t(i)];
          if (e >= 0 && e / (n / c.E) != d % c.E) wrong_held += held[size_t(d)][size_t(i)];  // another ep index's
        }
        const int want = std::string(c.strategy) == "full_shard" ? 1 : e < 0 ? c.W : c.W / c.E;
        wrong_held += holders != want;
        wrong_written += writers != 1;
      }
    }
    CHECK(wrong_held == 0);
    CHECK(wrong_written == 0);
  }
}

TEST_CASE("expert parallel plan: at dp4 x ep2 dense gradients sum over all 4 ranks, experts over their 2 holders, "
          "micro-batches accumulate, the norm counts each once and the bytes are the planner's row",
          "[ep][moe][sharding][planner]") {
  const auto model = make_model_arch(test::moe_config(shape("qwen2_moe")));
  const ParamLayout& g = model->layout();
  const int n = model->config().moe.n_experts, W = 4, E = 2;
  // Rank d contributes (d+1) * c(i) to global element i per micro-batch
  // when it computes it: every rank the dense elements, the ranks of ep
  // index k (d % E == k) the experts [k*n/E, (k+1)*n/E). Two micro-batches,
  // reduced: dense 2 x 10 c, expert 2 x (2k+4) c.
  auto c = [](int64_t i) { return float(int(i % 7) + 1) * 1e-3f; };
  double want = 0;
  for (const ParamTensor& t : g.tensors) {
    const int e = expert_of_tensor(t.name);
    const double f = 2 * (e < 0 ? 10.0 : 2.0 * (e / (n / E)) + 4.0);
    for (int64_t i = t.offset; i < t.offset + t.numel; ++i) want += (f * c(i)) * (f * c(i));
  }
  for (const std::string strategy : {"no_shard", "full_shard"}) {
    INFO(strategy);
    const MemoryBreakdown row = estimate_ep_memory(*model, E, whole_group(strategy, W), 1, false, DeviceModel::cpu());
    std::vector<double> norms(size_t(W), -1);
    std::vector<ShardMemory> mem(static_cast<size_t>(W));
    const auto errors = run_ep_ranks(*model, W, E, strategy, [&](int d, EpRank& k) {
      const ParamLayout& l = k.plan->local_layout();
      k.store->zero_grads();
      std::vector<float> host;
      for (int mb = 0; mb < 2; ++mb) {
        k.store->begin_pass(true, false);
        for (int u = int(l.units.size()) - 1; u >= 0; --u) {  // the backward's order
          const ParamUnit& U = l.units[size_t(u)];
          host.assign(size_t(U.numel), 0.0f);
          for (const TpRun& r : k.plan->runs())
            for (int64_t i = 0; i < r.count; ++i)
              if (r.local + i >= U.offset && r.local + i < U.offset + U.numel)
                host[size_t(r.local + i - U.offset)] = float(d + 1) * c(r.global + i);
          // Accumulated with += as a network does (UnitAccess::unit_grads).
          float* gbuf = k.store->unit_grads(u);
          std::vector<float> have(host.size());
          k.be->copy_to_host(have.data(), gbuf, have.size() * 4);
          for (size_t i = 0; i < host.size(); ++i) host[i] += have[i];
          k.be->copy_to_device(gbuf, host.data(), host.size() * 4);
          k.store->grads_done(u);
        }
      }
      k.store->finish_grads();
      norms[size_t(d)] = k.store->grad_norm_squared();
      mem[size_t(d)] = k.store->memory();
    });
    CHECK(errors == std::vector<std::string>(static_cast<size_t>(W)));
    for (int d = 0; d < W; ++d) {
      INFO("rank " << d);
      CHECK(norms[size_t(d)] == Approx(want).epsilon(1e-5));
      // The planner's EP row: the dense part over 4 ranks, the experts over 2 (CPU: fp32).
      CHECK(double(mem[size_t(d)].params) == row.params);
      CHECK(double(mem[size_t(d)].grads) == row.grads);
      CHECK(double(mem[size_t(d)].optimizer) == row.optimizer);
    }
  }
}

TEST_CASE("expert parallel plan: an ep rank's bytes are the planner's EP row, the experts' share shrinking with ep "
          "and the dense part sharded over every rank",
          "[ep][moe][planner]") {
  const auto model = make_model_arch(test::moe_config(shape("qwen2_moe")));
  const double X = double(expert_elements(model->layout()));
  const double P = double(model->layout().total);
  std::map<int, ShardMemory> got;
  for (const int ep : {2, 4}) {
    INFO("ep" << ep);
    for (const std::string strategy : {"no_shard", "full_shard"}) {
      INFO(strategy);
      const MemoryBreakdown pred =
          estimate_ep_memory(*model, ep, whole_group(strategy, ep), 1, false, DeviceModel::cpu());
      std::vector<ShardMemory> m(static_cast<size_t>(ep));
      const auto errors =
          run_ep_ranks(*model, ep, ep, strategy, [&](int d, EpRank& k) { m[size_t(d)] = k.store->memory(); });
      CHECK(errors == std::vector<std::string>(size_t(ep)));
      for (int r = 0; r < ep; ++r) {
        CHECK(double(m[size_t(r)].params) == pred.params);
        CHECK(double(m[size_t(r)].grads) == pred.grads);
        CHECK(double(m[size_t(r)].optimizer) == pred.optimizer);
      }
      if (strategy == "no_shard") got[ep] = m[0];
      // full_shard at ep = W: the dense part 1/ep per rank, the rank's own
      // experts whole (its expert-dp group is itself): fp32 params about
      // (P - X) / ep + X / ep, padding aside.
      if (strategy == "full_shard") CHECK(double(m[0].params) == Approx(4 * P / ep).epsilon(0.02));
    }
  }
  // no_shard: ep4 holds a quarter of the experts where ep2 holds half.
  CHECK(double(got[2].params - got[4].params) == 4 * X / 4);
  CHECK(double(got[2].optimizer - got[4].optimizer) == 8 * X / 4);
}

TEST_CASE("expert parallel plan: bad input is refused by name", "[ep][moe][config]") {
  const auto moe = make_model_arch(test::moe_config(shape("mixtral")));
  CHECK_THROWS_WITH(ExpertParallelPlan(moe->layout(), 4, 3, 0),
                    Contains("parallel.expert_parallel 3") && Contains("model.n_experts (4)") &&
                        Contains("use a divisor of 4"));
  CHECK_THROWS_WITH(ExpertParallelPlan(moe->layout(), 4, 2, 2), Contains("ep rank 2 is outside the group of 2"));
  test::MoeShape dense_shape = shape("mixtral");
  ModelConfig dense = test::moe_config(dense_shape);
  dense.arch = "llama";  // the same shape with a dense MLP
  dense.moe = MoeConfig{};
  const auto d = make_model_arch(dense);
  CHECK_THROWS_WITH(ExpertParallelPlan(d->layout(), 4, 2, 0),
                    Contains("no routed-expert tensor") && Contains("model.n_experts > 0"));
  CHECK(expert_of_tensor("model.layers.0.block_sparse_moe.experts.12.w1.weight") == 12);
  CHECK(expert_of_tensor("model.layers.0.mlp.shared_expert.up_proj.weight") == -1);
  CHECK(expert_of_tensor("model.layers.0.mlp.experts.x.up_proj.weight") == -1);
}
