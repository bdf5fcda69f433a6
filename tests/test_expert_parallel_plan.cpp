// Expert parallelism's storage split (core/model/moe/expert_parallel_plan.h):
// what an ep rank holds of a tiny Mixtral / Qwen2-MoE, checked element by
// element against the global layout, and the bytes a parameter store over
// that local layout reports against the planner's EP row
// (core/train/planner_ep.cpp) for the same model. In-process, no python.
#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/model/moe/expert_parallel_plan.h"
#include "core/train/planner.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/expert/ep_grad_store.h"
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

}  // namespace

TEST_CASE("expert parallel plan: an ep rank holds its experts only, every element has one owner, shared expert "
          "dense",
          "[ep][moe]") {
  for (const std::string arch : {"mixtral", "qwen2_moe"}) {
    const auto model = make_model_arch(test::moe_config(shape(arch)));
    const ParamLayout& g = model->layout();
    const int n = model->config().moe.n_experts;  // 4
    const int64_t X = expert_elements(g);
    REQUIRE(X > 0);
    for (const int ep : {1, 2, 4}) {
      std::vector<int> owners(size_t(g.total), 0), holders(size_t(g.total), 0);
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
        for (const TpRun& run : plan.runs())
          for (int64_t i = 0; i < run.count; ++i) {
            ++holders[size_t(run.global + i)];
            owners[size_t(run.global + i)] += run.owner;
          }
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
      // Over the group: every element owned exactly once (checkpoint writes,
      // the grad norm); experts held once, dense elements by every rank.
      int bad_owner = 0, bad_holder = 0;
      for (const ParamTensor& t : g.tensors)
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
          bad_owner += owners[size_t(i)] != 1;
          bad_holder += holders[size_t(i)] != (expert_of_tensor(t.name) >= 0 ? 1 : ep);
        }
      CHECK(bad_owner == 0);
      CHECK(bad_holder == 0);
    }
  }
}

TEST_CASE("expert parallel plan: an ep2 rank's store holds, writes and inits only its experts, in global "
          "coordinates",
          "[ep][moe][checkpoint]") {
  const auto model = make_model_arch(test::moe_config(shape("qwen2_moe")));
  const ParamLayout& g = model->layout();
  const int n = model->config().moe.n_experts;
  // Per rank: how often it holds / writes each global element (threads write their own row).
  std::vector<std::vector<int>> held(2, std::vector<int>(size_t(g.total), 0)), wrote = held;
  std::vector<int> init_mismatch(2, -1);
  auto mark = [](std::vector<int>& v, const ParamStore::Range& r) {
    for (int64_t k = 0; k < r.reps; ++k)
      for (int64_t i = 0; i < r.count; ++i) ++v[size_t(r.global + k * r.stride + i)];
  };
  const auto errors = test::run_gloo_group(2, "ep", std::chrono::seconds(30), [&](Communicator& ep) {
    const int r = ep.rank();
    auto be = make_cpu_backend(1);
    auto single = make_single_communicator(), single_g = make_single_communicator();
    const ExpertParallelPlan plan(g, n, 2, r);
    auto store = make_tensor_parallel_store(
        make_param_store("no_shard", plan.local_layout(), be.get(), single.get(), 0, nullptr), plan.storage_plan(),
        &ep);
    auto whole = make_param_store("no_shard", g, be.get(), single_g.get(), 0, nullptr);
    store->init_params(*model, 11);
    whole->init_params(*model, 11);
    int bad = 0;
    for (const ParamStore::Range& h : store->held_ranges()) {
      mark(held[size_t(r)], h);
      std::vector<float> mine(size_t(h.numel())), ref(size_t(h.numel()));
      store->copy_state_range(0, h, mine.data());
      whole->copy_state_range(0, h, ref.data());
      bad += mine != ref;
    }
    for (const ParamStore::Range& w : store->write_ranges()) mark(wrote[size_t(r)], w);
    init_mismatch[size_t(r)] = bad;
    // The store's own bytes: the local layout, fp32 on the CPU.
    CHECK(store->memory().params == size_t(plan.local_layout().total) * 4);
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(init_mismatch == std::vector<int>{0, 0});
  int wrong_held = 0, wrong_written = 0;
  for (const ParamTensor& t : g.tensors) {
    const int e = expert_of_tensor(t.name);
    for (int64_t i = t.offset; i < t.offset + t.numel; ++i)
      for (int r = 0; r < 2; ++r) {
        // Rank r holds the dense tensors and experts [2r, 2r+2); it writes
        // its experts, and rank 0 the dense tensors too: one writer each.
        const bool holds = e < 0 || e / 2 == r;
        wrong_held += held[size_t(r)][size_t(i)] != int(holds);
        wrong_written += wrote[size_t(r)][size_t(i)] != int(e < 0 ? r == 0 : holds);
      }
  }
  CHECK(wrong_held == 0);
  CHECK(wrong_written == 0);
}

TEST_CASE("expert parallel plan: at dp4 x ep2 dense gradients sum over all 4 ranks, experts over their 2 holders, "
          "the norm counts each once",
          "[ep][moe][sharding]") {
  const auto model = make_model_arch(test::moe_config(shape("qwen2_moe")));
  const ParamLayout& g = model->layout();
  const int n = model->config().moe.n_experts, W = 4, E = 2;
  // Rank d contributes (d+1) * c(i) to global element i when it computes it:
  // every rank the dense elements, the ranks of ep index k (d % E == k) the
  // experts [k*n/E, (k+1)*n/E). Reduced: dense 10 c, expert (2k+4) c.
  auto c = [](int64_t i) { return float(int(i % 7) + 1) * 1e-3f; };
  double want = 0;
  for (const ParamTensor& t : g.tensors) {
    const int e = expert_of_tensor(t.name);
    const double f = e < 0 ? 10.0 : 2.0 * (e / (n / E)) + 4.0;
    for (int64_t i = t.offset; i < t.offset + t.numel; ++i) want += (f * c(i)) * (f * c(i));
  }
  for (const std::string strategy : {"no_shard", "full_shard"}) {
    INFO(strategy);
    const std::string secret = make_job_secret();
    TcpStoreServer server("127.0.0.1", 0, secret);
    std::vector<double> norms(size_t(W), -1);
    std::vector<std::string> errors(static_cast<size_t>(W));
    std::vector<std::thread> threads;
    for (int d = 0; d < W; ++d)
      threads.emplace_back([&, d] {
        try {
          auto kv = connect_tcp_store("127.0.0.1", server.port(), secret, std::chrono::seconds(30));
          // ep group: E consecutive dp ranks; expert-dp group: the same ep index.
          auto ep = make_gloo_communicator(*kv, "ep" + std::to_string(d / E) + "/", d % E, E, "127.0.0.1",
                                           std::chrono::seconds(30));
          auto xdp = make_gloo_communicator(*kv, "xdp" + std::to_string(d % E) + "/", d / E, W / E, "127.0.0.1",
                                            std::chrono::seconds(30));
          auto be = make_cpu_backend(1);
          const ExpertParallelPlan plan(g, n, E, d % E);
          const ParamLayout& l = plan.local_layout();
          auto store = make_tensor_parallel_store(
              make_expert_grad_store(make_param_store(strategy, l, be.get(), xdp.get(), 0, nullptr), l,
                                     plan.dense_ranges(), ep.get()),
              plan.storage_plan(), ep.get());
          store->zero_grads();
          std::vector<float> host;
          for (int u = int(l.units.size()) - 1; u >= 0; --u) {  // the backward's order
            const ParamUnit& U = l.units[size_t(u)];
            host.assign(size_t(U.numel), 0.0f);
            for (const TpRun& r : plan.runs())
              for (int64_t i = 0; i < r.count; ++i)
                if (r.local + i >= U.offset && r.local + i < U.offset + U.numel)
                  host[size_t(r.local + i - U.offset)] = float(d + 1) * c(r.global + i);
            be->copy_to_device(store->unit_grads(u), host.data(), host.size() * 4);
            store->grads_done(u);
          }
          store->finish_grads();
          norms[size_t(d)] = store->grad_norm_squared();
        } catch (const std::exception& e) {
          errors[size_t(d)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    CHECK(errors == std::vector<std::string>(static_cast<size_t>(W)));
    for (int d = 0; d < W; ++d) CHECK(norms[size_t(d)] == Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("expert parallel plan: a store over an ep rank's layout reports the planner's EP row, the expert share "
          "halving at ep2",
          "[ep][moe][planner]") {
  const auto model = make_model_arch(test::moe_config(shape("qwen2_moe")));
  const int n = model->config().moe.n_experts;
  const double X = double(expert_elements(model->layout()));
  auto be = make_cpu_backend(1);
  auto comm = make_single_communicator();
  std::vector<ShardMemory> got;
  for (const int ep : {1, 2, 4}) {
    INFO("ep" << ep);
    // One rank per expert-dp group (world = ep): no_shard over a group of one
    // holds the whole local layout, which is the planner's EP model.
    Sharding s;
    s.strategy = "no_shard";
    s.world = ep;
    s.group = 1;
    const MemoryBreakdown pred = estimate_ep_memory(*model, ep, s, 1, false, DeviceModel::cpu());
    for (int r = 0; r < ep; ++r) {
      INFO("ep rank " << r);
      const ExpertParallelPlan plan(model->layout(), n, ep, r);
      auto store = make_param_store("no_shard", plan.local_layout(), be.get(), comm.get(), 0, nullptr);
      const ShardMemory m = store->memory();
      CHECK(double(m.params) == pred.params);
      CHECK(double(m.grads) == pred.grads);
      CHECK(double(m.optimizer) == pred.optimizer);
      if (r == 0) got.push_back(m);
    }
  }
  // fp32 on the CPU: 4 bytes of parameter, 4 of gradient, 8 of moments per
  // element; ep2 drops half the experts, ep4 three quarters.
  CHECK(double(got[0].params - got[1].params) == 4 * X / 2);
  CHECK(double(got[0].grads - got[1].grads) == 4 * X / 2);
  CHECK(double(got[0].optimizer - got[1].optimizer) == 8 * X / 2);
  CHECK(double(got[0].params - got[2].params) == 4 * X * 3 / 4);
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
