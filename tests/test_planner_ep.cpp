// The planner's expert-parallel rows (core/train/planner_ep.cpp): per-rank
// memory with the experts split over ep ranks, the token all-to-alls over
// the ep group's link, and the recommended degree, each against a hand
// computation from the published shapes (Qwen1.5-MoE-A2.7B: 24 layers, 60
// experts of width 1408, top-4, C 2048; Mixtral 8x7B: 32 layers, 8 experts
// of width 14336, top-2, C 4096) and the H100's datasheet NVLink figure.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "core/model/model_shape.h"
#include "core/train/planner.h"
#include "core/train/planner_internal.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

PlanRequest moe_request(const std::string& model) {
  PlanRequest req;
  req.model = parse_model_shape(model);
  req.gpu = "h100";
  req.gpus_per_node = 8;
  req.micro_batch = 1;
  req.global_batch = 8;
  return req;
}

const PlanRow* ep_row(const Plan& p, int ep) {
  for (const PlanRow& r : p.ep_rows)
    if (r.ep == ep) return &r;
  return nullptr;
}

// An ep rank's shard elements under full_shard (ceil per unit, as
// parallel/sharding pads): each unit's dense elements over all W ranks,
// each MoE unit's 1/ep of the experts over its expert-dp group of W/ep.
double split_shard_elements(const ModelArch& m, int ep, int W) {
  const auto ex = planner_detail::expert_unit_numels(m);
  const int G = W / ep;
  double S = 0;
  for (size_t i = 0; i < m.layout().units.size(); ++i) {
    S += double((m.layout().units[i].numel - ex[i] + W - 1) / W);
    if (ex[i] > 0) S += double((ex[i] / ep + G - 1) / G);
  }
  return S;
}

}  // namespace

TEST_CASE("planner: qwen1.5-moe-a2.7b on 8 x H100, every ep row's figures by hand (the dense part sharded over all "
          "ranks, a rank's experts over its expert-dp group), ep2 recommended",
          "[planner][moe]") {
  const PlanRequest req = moe_request("qwen1.5-moe-a2.7b:T=4096");
  const auto arch = make_model_arch(req.model);
  // The routed experts: 24 layers x 60 experts x (gate, up, down) of 1408 x 2048.
  const double X = 24.0 * 60 * 3 * 1408 * 2048;
  CHECK(double(moe_expert_parameters(*arch)) == X);
  CHECK(moe_layers(*arch) == 24);

  const Plan plan = make_plan(req);
  const double GiB = 1024.0 * 1024 * 1024, nvlink = 450e9 * 0.8;  // H100 SXM: 450 GB/s per direction, 80% of it
  REQUIRE(ep_row(plan, 1));
  REQUIRE(ep_row(plan, 2));
  REQUIRE(ep_row(plan, 4));
  CHECK(!ep_row(plan, 8));
  REQUIRE(plan.ep_not_offered.size() == 1);
  CHECK(plan.ep_not_offered[0].first == 8);
  CHECK_THAT(plan.ep_not_offered[0].second, Contains("60 experts do not split over 8 ranks"));

  // ep 1 is the full_shard strategy row: the same memory and step.
  const PlanRow* fs = nullptr;
  for (const PlanRow& r : plan.rows)
    if (r.sharding.strategy == "full_shard") fs = &r;
  REQUIRE(fs);
  CHECK(ep_row(plan, 1)->mem.total() == fs->mem.total());
  CHECK(ep_row(plan, 1)->step_s == Approx(fs->step_s).epsilon(1e-12));
  CHECK(ep_row(plan, 1)->a2a_s == 0);

  const double rows = 1.0 * 4096 * 4;  // micro-batch x T x top-k
  const double arena = estimate_activation_bytes(*arch, 1, false, DeviceModel::gpu());
  for (const int ep : {2, 4}) {
    const PlanRow& r = *ep_row(plan, ep);
    INFO("ep" << ep);
    // The dense part over all 8 ranks, the rank's 60/ep experts over the 8/ep ranks with its ep index.
    const int G = 8 / ep;
    const double S = split_shard_elements(*arch, ep, 8);
    // bf16 copy + fp32 master (6), fp32 gradient (4), AdamW moments (8) per element; its experts' share 1/G.
    CHECK(r.expert_state == Approx(18 * X / ep / G).epsilon(1e-9));
    CHECK(r.mem.params == Approx(6 * S).epsilon(1e-12));
    CHECK(r.mem.grads == Approx(4 * S).epsilon(1e-12));
    CHECK(r.mem.optimizer == Approx(8 * S).epsilon(1e-12));
    // The arena plus the received rows kept for each of the 24 layers and two scratch buffers, micro-batch x T
    // x top-k x C bf16 each, and each layer's local expert offsets (60/ep + 1 int32, 64-byte rounded).
    const double loff = 24.0 * ((4 * (60 / ep + 1) + 63) / 64 * 64);
    CHECK(r.mem.activations == Approx(arena + (24 + 2) * rows * 2048 * 2 + loff).epsilon(1e-12));
    // 24 MoE layers x 4 all-to-alls x rows x C x 2 bytes x (ep-1)/ep, over NVLink, one micro-batch per step.
    const double a2a = 24.0 * 4 * rows * 2048 * 2 * (ep - 1) / ep;
    CHECK(ep_all_to_all_bytes_per_micro_batch(*arch, ep, 1, false, 2) == Approx(a2a).epsilon(1e-12));
    CHECK(r.a2a_s == Approx(a2a / nvlink).epsilon(1e-12));
    CHECK(r.ep_link == "NVLink");
    CHECK(r.compute_s == Approx(fs->compute_s).epsilon(1e-12));  // routing moves tokens, not FLOPs
    // The dp collectives, full_shard's gather (2 x bf16: forward and
    // backward) and fp32 reduce-scatter of every padded unit, (G-1)/G of it
    // over NVLink: the dense units over 8 ranks, the experts over 8/ep.
    const auto ex = planner_detail::expert_unit_numels(*arch);
    double dense_pad = 0, expert_pad = 0;
    for (size_t i = 0; i < arch->layout().units.size(); ++i) {
      dense_pad += double((arch->layout().units[i].numel - ex[i] + 7) / 8 * 8);
      if (ex[i] > 0) expert_pad += double((ex[i] / ep + G - 1) / G * G);
    }
    const double dp_s = (7.0 / 8 * 8 * dense_pad + double(G - 1) / G * 8 * expert_pad) / nvlink;
    CHECK(r.comm_s == Approx(dp_s + r.a2a_s).epsilon(1e-9));
  }
  // Every expert byte is 1/8 of the experts' state at any ep (1/ep of them over 8/ep ranks) and the dense part is
  // sharded over all 8: ep2 and ep4 hold the same state, padding aside, as much as ep1 (everything over 8).
  CHECK(ep_row(plan, 2)->expert_state == Approx(ep_row(plan, 4)->expert_state).epsilon(1e-12));
  CHECK(ep_row(plan, 4)->mem.params == Approx(ep_row(plan, 2)->mem.params).epsilon(1e-6));
  CHECK(ep_row(plan, 2)->mem.params == Approx(ep_row(plan, 1)->mem.params).epsilon(1e-6));
  // Checkpointing reruns the forward: 6 all-to-alls per layer instead of 4.
  CHECK(ep_all_to_all_bytes_per_micro_batch(*arch, 4, 1, true, 2) ==
        Approx(1.5 * ep_all_to_all_bytes_per_micro_batch(*arch, 4, 1, false, 2)).epsilon(1e-12));

  // Both fit; ep2 is the fastest (its all-to-alls are cheaper and its local units gather over 4 ranks, not 8).
  CHECK(ep_row(plan, 2)->expert_state / GiB == Approx(26.10).epsilon(1e-3));
  CHECK(ep_row(plan, 2)->fits);
  CHECK(ep_row(plan, 4)->fits);
  REQUIRE(plan.has_ep_recommendation);
  CHECK(plan.ep_recommended.ep == 2);
  CHECK(plan.ep_recommended.fits);
  CHECK(plan.ep_recommended.mem.total() <= plan.capacity);
  for (const PlanRow& r : plan.ep_rows)
    if (r.fits) CHECK(plan.ep_recommended.step_s <= r.step_s);
  CHECK_THAT(plan.ep_recommendation, Contains("expert parallel: recommended ep2 (parallel.expert_parallel: 2, "
                                              "full_shard for the rest)") &&
                                         Contains("30 experts per rank"));
}

TEST_CASE("planner: mixtral-8x7b on 8 x 80 GB, expert state 1/8 for ep 2, 4, 8, none fits, and the CLI says which "
          "needs least",
          "[planner][moe]") {
  PlanRequest req = moe_request("mixtral-8x7b:T=4096");
  req.checkpointing = true;
  const Plan plan = make_plan(req);
  const double X = 32.0 * 8 * 3 * 14336 * 4096;
  for (const int ep : {2, 4, 8}) {
    REQUIRE(ep_row(plan, ep));
    // 1/ep of the experts over 8/ep ranks: 1/8 of their state (94.5 GiB) whatever ep, plus the dense part.
    CHECK(ep_row(plan, ep)->expert_state == Approx(18 * X / 8).epsilon(1e-9));
    CHECK(!ep_row(plan, ep)->fits);
  }
  CHECK(plan.ep_not_offered.empty());
  CHECK(!plan.has_ep_recommendation);

  const auto r = test::run_trainrun("plan --model mixtral-8x7b:T=4096 --gpus 8 --gpu-memory 80GB "
                                    "--activation-checkpointing blocks");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("\nexpert parallel (ep ranks share the 8 experts, top-2;") &&
                        Contains("\nep8 x dp8         1     94.50") &&
                        Contains("expert parallel: none of the offered degrees fits 74.5 GiB per GPU (the least, ep8, "
                                 "needs"));
  WARN(r.out);
}

TEST_CASE("planner: expert-parallel rows only for MoE models, with offload each part's state on the host, with "
          "hybrid_shard inside the shard groups, over the topology's link, and a degree that does not divide the "
          "experts is an error naming both",
          "[planner][moe]") {
  const Plan dense = make_plan(moe_request("llama3.2-1b:T=1024"));
  CHECK(dense.ep_rows.empty());
  CHECK(dense.ep_not_offered.empty());
  CHECK(dense.ep_recommendation.empty());

  // Offload: each part's state on the host, 16 bytes per element of the
  // rank's shards (the dense units over 8 ranks, its experts over 8/ep),
  // 8 ranks a node; the device keeps the bf16 copy of its experts' shard.
  PlanRequest req = moe_request("qwen1.5-moe-a2.7b:T=1024");
  req.offload = "cpu";
  const Plan off = make_plan(req);
  const auto oa = make_model_arch(req.model);
  const auto ex = planner_detail::expert_unit_numels(*oa);
  REQUIRE(off.ep_rows.size() == 3);
  for (const PlanRow& r : off.ep_rows) {
    INFO("ep" << r.ep);
    const int G = 8 / r.ep;
    double S = 0, Sx = 0;
    for (size_t i = 0; i < oa->layout().units.size(); ++i) {
      const int64_t dense = oa->layout().units[i].numel - (r.ep > 1 ? ex[i] : 0);
      S += double((dense + 7) / 8);
      if (r.ep > 1 && ex[i] > 0) Sx += double((ex[i] / r.ep + G - 1) / G);
    }
    CHECK(r.host_bytes_per_node == Approx(8 * 16 * (S + Sx)).epsilon(1e-12));
    CHECK(r.mem.optimizer == 0);
    CHECK(r.mem.params == Approx(2 * (S + Sx)).epsilon(1e-12));
    if (r.ep > 1) CHECK(r.expert_state == Approx(2 * Sx).epsilon(1e-12));
    CHECK(r.offload_s > 0);
  }
  CHECK(off.ep_not_offered.size() == 1);  // 60 experts over 8
  // hybrid_shard on 2 nodes (W 16, shard groups of 8): the dense part 1/8
  // per rank, a rank's experts over the 8/ep members of its shard group
  // with its ep index (both replicated across the 2 groups); an ep that
  // does not divide the shard group is not offered.
  PlanRequest hy = moe_request("qwen1.5-moe-a2.7b:T=1024");
  hy.job_strategy = "hybrid_shard";
  hy.nodes = 2;
  hy.global_batch = 16;
  const Plan hp = make_plan(hy);
  REQUIRE(hp.ep_rows.size() == 3);
  for (const PlanRow& r : hp.ep_rows) {
    INFO("hybrid ep" << r.ep);
    const int Gx = 8 / r.ep;
    double S = 0;
    for (size_t i = 0; i < oa->layout().units.size(); ++i) {
      S += double((oa->layout().units[i].numel - (r.ep > 1 ? ex[i] : 0) + 7) / 8);
      if (r.ep > 1 && ex[i] > 0) S += double((ex[i] / r.ep + Gx - 1) / Gx);
    }
    CHECK(r.mem.params == Approx(6 * S).epsilon(1e-12));
    CHECK(r.mem.optimizer == Approx(8 * S).epsilon(1e-12));
  }
  PlanRequest hy2 = moe_request("qwen1.5-moe-a2.7b:T=1024");
  hy2.job_strategy = "hybrid_shard";
  hy2.shard_group_size = 2;
  const Plan hp2 = make_plan(hy2);
  REQUIRE(ep_row(hp2, 2));
  CHECK(!ep_row(hp2, 4));
  bool said = false;
  for (const auto& n : hp2.ep_not_offered)
    said |= n.first == 4 && n.second.find("shard group of 2 ranks does not split into ep groups of 4") != std::string::npos;
  CHECK(said);

  // The ep group's link is the topology's for a group of that size (here: ep4 over PCIe).
  PlanRequest pcie = moe_request("qwen1.5-moe-a2.7b:T=1024");
  pcie.tp_links.push_back({4, "PCIe", 32e9, "ranks 0-3: PCIe"});
  const Plan pp = make_plan(pcie);
  REQUIRE(ep_row(pp, 4));
  CHECK(ep_row(pp, 4)->ep_link == "PCIe");
  const auto pa = make_model_arch(pcie.model);
  CHECK(ep_row(pp, 4)->a2a_s == Approx(ep_all_to_all_bytes_per_micro_batch(*pa, 4, 1, false, 2) / (32e9 * 0.8)));
  CHECK(ep_row(pp, 2)->ep_link == "NVLink");

  const auto arch = make_model_arch(parse_model_shape("qwen1.5-moe-a2.7b:T=1024"));
  Sharding s;
  s.world = s.group = 8;
  CHECK_THROWS_WITH(estimate_ep_memory(*arch, 8, s, 1, false, DeviceModel::gpu()),
                    Contains("expert-parallel degree 8 must divide the model's 60 experts"));
}
