// Pipeline schedules (parallel/pipeline/schedule.h): every schedule is
// complete and hang-free for a range of shapes, has the properties it is
// chosen for (1f1b's bounded activations, the smaller bubbles of
// interleaving and zero_bubble), and bad shapes and splits are errors that
// name the numbers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/common/error.h"
#include "core/train/bench_pipeline.h"
#include "parallel/pipeline/links.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/slots.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Matchers::Contains;

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("pipeline: every schedule is complete and hang-free for 1-8 stages and up to 16 microbatches",
          "[pipeline]") {
  for (const char* kind : {"gpipe", "1f1b", "zero_bubble"})
    for (int P = 1; P <= 8; ++P)
      for (int M = P; M <= 16; ++M) {
        INFO(kind << " P=" << P << " M=" << M);
        const PipelineSchedule s = make_pipeline_schedule(kind, P, 1, M);
        CHECK_NOTHROW(check_pipeline_schedule(s));
      }
  for (int P = 1; P <= 4; ++P)
    for (int v = 1; v <= 3; ++v)
      for (int M = P * v; M <= 12; ++M) {
        if (M % P) continue;
        INFO("interleaved_1f1b P=" << P << " v=" << v << " M=" << M);
        CHECK_NOTHROW(check_pipeline_schedule(make_pipeline_schedule("interleaved_1f1b", P, v, M)));
      }
}

TEST_CASE("pipeline: 1f1b bounds activations, interleaving and zero_bubble shrink the bubble", "[pipeline]") {
  const int P = 4, M = 8;
  const PipelineStats gpipe = simulate_pipeline_schedule(make_pipeline_schedule("gpipe", P, 1, M));
  const PipelineStats f1b = simulate_pipeline_schedule(make_pipeline_schedule("1f1b", P, 1, M));
  const PipelineStats zb = simulate_pipeline_schedule(make_pipeline_schedule("zero_bubble", P, 1, M));
  const PipelineStats il = simulate_pipeline_schedule(make_pipeline_schedule("interleaved_1f1b", P, 2, M));
  // gpipe holds every microbatch; 1f1b at most P - r on rank r; ZB-H1 the same as 1f1b.
  for (int r = 0; r < P; ++r) {
    INFO("rank " << r);
    CHECK(gpipe.peak_in_flight[size_t(r)] == M);
    CHECK(f1b.peak_in_flight[size_t(r)] == P - r);
    CHECK(zb.peak_in_flight[size_t(r)] <= P);
  }
  // The same bubble for gpipe and 1f1b: (P - 1) / (M + P - 1) with B = 2 F.
  CHECK(gpipe.length == f1b.length);
  CHECK(f1b.bubble == Approx(double(P - 1) / double(M + P - 1)));
  CHECK(zb.bubble < f1b.bubble);
  CHECK(zb.length < f1b.length);
  // Interleaving: each chunk is half as long; the bubble shrinks, and so
  // does the step (Megatron: the bubble is (P - 1) / v chunks' worth).
  CHECK(il.bubble < f1b.bubble);
  CHECK(il.length < f1b.length);
  CHECK(zb.bubble == Approx(double(P - 1) / zb.length));  // ZB-H1: a third of 1f1b's idle time (F = BI = BW)
}

TEST_CASE("pipeline: the simulator with measured costs gives ZB-H1's general bubble and charges p2p", "[pipeline]") {
  // Qi et al. (arXiv 2401.10241): ZB-H1 idles (p - 1)(F + B - W) per rank,
  // so with BW cheaper than F its bubble is (p-1)(F+BI-BW) / (m (F+BI+BW)),
  // not (p-1)/(3m): what `bench pipeline`'s model column shows.
  for (int P : {2, 4}) {
    const int M = 4 * P;
    const PipelineSchedule zb = make_pipeline_schedule("zero_bubble", P, 1, M);
    const double F = 1, BI = 1, BW = 0.5;
    auto cost = [&](int, PipeOp op) { return op == PipeOp::F ? F : op == PipeOp::BI ? BI : BW; };
    const PipelineStats st = simulate_pipeline_schedule(zb, cost, 0.0);
    INFO("P=" << P);
    CHECK(st.bubble / (1 - st.bubble) == Approx((P - 1) * (F + BI - BW) / (M * (F + BI + BW))));
    // Unit costs: the plain simulation, and the formula (p-1)/(3m).
    const PipelineStats unit = simulate_pipeline_schedule(zb, [](int, PipeOp) { return 1.0; }, 0.0);
    CHECK(unit.length == simulate_pipeline_schedule(zb).length);
    CHECK(unit.bubble / (1 - unit.bubble) == Approx(double(P - 1) / (3.0 * M)));
    // A transfer time lengthens the step and the bubble.
    const PipelineStats slow = simulate_pipeline_schedule(zb, cost, 0.25);
    CHECK(slow.length > st.length);
    CHECK(slow.bubble > st.bubble);
  }
}

TEST_CASE("pipeline: a replay with each action's own time is the simulation when the times agree, and charges "
          "one slow op to both ranks", "[pipeline][bench]") {
  // Constant times per (stage, op): the replay is the simulation.
  for (const char* kind : {"gpipe", "1f1b", "zero_bubble"}) {
    const PipelineSchedule s = make_pipeline_schedule(kind, 2, 1, 4);
    auto cost = [](int stage, PipeOp op) { return (op == PipeOp::B ? 2.0 : 1.0) + 0.25 * stage; };
    const PipelineStats sim = simulate_pipeline_schedule(s, cost, 0.0);
    const PipelineStats rep = replay_pipeline_schedule(s, [&](const PipeAction& a) { return cost(a.stage, a.op); }, 0.0);
    INFO(kind);
    CHECK(rep.length == sim.length);
    CHECK(rep.bubble == sim.bubble);
  }
  // 1f1b, p = 2, m = 2, F = 1, B = 2, but rank 1's forward of microbatch 0
  // takes 2. By hand: rank 0 F0 [0,1] F1 [1,2]; rank 1 F0 [1,3] B0 [3,5]
  // F1 [5,6] B1 [6,8]; rank 0 B0 [5,7] B1 [8,10]. Length 10; idle 4 + 3.
  const PipelineSchedule s = make_pipeline_schedule("1f1b", 2, 1, 2);
  const PipelineStats st = replay_pipeline_schedule(s, [](const PipeAction& a) {
    if (a.op == PipeOp::F) return a.stage == 1 && a.microbatch == 0 ? 2.0 : 1.0;
    return 2.0;
  }, 0.0);
  CHECK(st.length == 10.0);
  CHECK(st.bubble == Approx(7.0 / 20.0));
}

namespace {
// One compute span of trace.json as core/common/trace.h writes it.
std::string span(int pid, const std::string& name, int64_t ts, int64_t dur, int step) {
  return "{\"name\":\"" + name + "\",\"cat\":\"compute\",\"ph\":\"X\",\"ts\":" + std::to_string(ts) +
         ",\"dur\":" + std::to_string(dur) + ",\"pid\":" + std::to_string(pid) + ",\"tid\":0,\"args\":{\"step\":" +
         std::to_string(step) + "}}";
}
}  // namespace

TEST_CASE("pipeline: bench pipeline reads a trace's op times back and replays each traced step", "[pipeline][bench]") {
  TempDir dir("pp_replay");
  // The hand-computed 1f1b above as a trace (microseconds), twice: step 3
  // with the slow forward, step 4 without; plus spans that are no
  // pipeline's (the one-rank trainer's "forward mb0", a p2p span).
  const std::vector<std::tuple<int, std::string, int64_t>> ops = {
      {0, "forward mb0 stage 0", 1000}, {0, "forward mb1 stage 0", 1000}, {0, "backward mb0 stage 0", 2000},
      {0, "backward mb1 stage 0", 2000}, {1, "forward mb0 stage 1", 2000}, {1, "backward mb0 stage 1", 2000},
      {1, "forward mb1 stage 1", 1000}, {1, "backward mb1 stage 1", 2000}};
  std::string events = "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"rank 0\"}}";
  for (int step : {3, 4})
    for (const auto& [pid, name, dur] : ops)
      events += "," + span(pid, name, 0, step == 4 && name == "forward mb0 stage 1" ? 1000 : dur, step);
  events += "," + span(0, "forward mb0", 0, 5, 3);
  events += ",{\"name\":\"send_act mb0 stage 0\",\"cat\":\"p2p\",\"ph\":\"X\",\"ts\":0,\"dur\":9,\"pid\":0,"
            "\"tid\":1,\"args\":{\"step\":3}}";
  write_file(dir / "trace.json", "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[" + events + "]}");
  const PipelineTraceTimes t = read_pipeline_trace(dir / "trace.json");
  REQUIRE(t.steps.size() == 2);
  CHECK(t.steps.at(3).size() == 8);
  CHECK(t.steps.at(3).at({1, PipeOp::F, 0}) == 2.0);
  CHECK(t.steps.at(4).at({1, PipeOp::F, 0}) == 1.0);
  CHECK(t.mean.at({1, PipeOp::F}) == Approx(1.25));  // 2, 1, 1, 1
  CHECK(t.mean.at({0, PipeOp::B}) == 2.0);
  // Noise: only stage 1's F varies (stdev sqrt(3)/4 over mean 5/4), averaged over the 4 (stage, op)s.
  CHECK(t.cv == Approx(std::sqrt(3.0) / 5.0 / 4.0));
  const std::map<int, double> rep = replay_traced_steps(make_pipeline_schedule("1f1b", 2, 1, 2), t);
  REQUIRE(rep.size() == 2);
  CHECK(rep.at(3) == Approx(7.0 / 13.0));  // idle / busy: 7 / (6 + 7)
  CHECK(rep.at(4) == Approx(0.5));         // (p-1)/m with equal stages
  // A schedule the trace did not run: the missing action is named.
  CHECK_THAT(error_of([&] { replay_traced_steps(make_pipeline_schedule("1f1b", 2, 1, 4), t); }),
             Contains("the trace of step 3 has no F of microbatch 2 on stage 0"));
  // Bad files name the file and what is wrong.
  CHECK_THAT(error_of([&] { read_pipeline_trace(dir / "none.json"); }),
             Contains("no trace at") && Contains("none.json"));
  write_file(dir / "bad.json", "{\"traceEvents\": [");
  CHECK_THAT(error_of([&] { read_pipeline_trace(dir / "bad.json"); }), Contains("bad.json is not JSON"));
  write_file(dir / "other.json", "{\"events\": []}");
  CHECK_THAT(error_of([&] { read_pipeline_trace(dir / "other.json"); }), Contains("has no traceEvents array"));
  write_file(dir / "onerank.json", "{\"traceEvents\":[" + span(0, "forward mb0", 0, 5, 3) + "]}");
  CHECK_THAT(error_of([&] { read_pipeline_trace(dir / "onerank.json"); }), Contains("holds no pipeline compute spans"));
  write_file(dir / "odd.json", "{\"traceEvents\":[" + span(0, "sideways mb0 stage 0", 0, 5, 3) + "]}");
  CHECK_THAT(error_of([&] { read_pipeline_trace(dir / "odd.json"); }), Contains("unknown compute span 'sideways'"));
}

TEST_CASE("pipeline: the checker finds hangs, missing work and misrouted messages", "[pipeline]") {
  // Two ranks that both receive first: a hang, reported with both blocked actions.
  PipelineSchedule s = make_pipeline_schedule("gpipe", 2, 1, 2);
  std::swap(s.actions[0][0], s.actions[0][s.actions[0].size() - 1]);
  CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }), Contains("rank 0"));
  // A rank that waits for a gradient before sending the activation it depends on.
  s = make_pipeline_schedule("1f1b", 2, 1, 2);
  auto& r0 = s.actions[0];
  // rank 0: recv_grad for mb0 moved ahead of everything.
  for (size_t i = 0; i < r0.size(); ++i)
    if (r0[i].op == PipeOp::RecvGrad) {
      const PipeAction a = r0[i];
      r0.erase(r0.begin() + long(i));
      r0.insert(r0.begin(), a);
      break;
    }
  CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }), Contains("would hang") && Contains("recv_grad mb0"));
  // A dropped backward.
  s = make_pipeline_schedule("1f1b", 2, 1, 3);
  for (size_t i = 0; i < s.actions[0].size(); ++i)
    if (s.actions[0][i].op == PipeOp::B) {
      s.actions[0].erase(s.actions[0].begin() + long(i));
      break;
    }
  CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }), Contains("send_grad") || Contains("backward"));
  // Messages out of order between a pair.
  s = make_pipeline_schedule("gpipe", 2, 1, 2);
  std::vector<PipeAction>& r1 = s.actions[1];
  std::swap(r1[0], r1[3]);  // rank 1: recv_act mb1 before recv_act mb0
  CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }), Contains("match in order") || Contains("not received"));
  // The schedule prints; each rank's line lists its actions.
  const std::string ex = explain_pipeline_schedule(make_pipeline_schedule("zero_bubble", 2, 1, 2));
  CHECK_THAT(ex, Contains("rank 0:") && Contains("rank 1:") && Contains("BW") && Contains("bubble"));
}

TEST_CASE("pipeline: too few microbatches, bad chunks and bad layer splits are errors naming the numbers",
          "[pipeline]") {
  CHECK_THAT(error_of([] { make_pipeline_schedule("1f1b", 4, 1, 3); }),
             Contains("at least as many microbatches as pipeline stages (4); the step has 3"));
  CHECK_THAT(error_of([] { make_pipeline_schedule("interleaved_1f1b", 2, 2, 3); }),
             Contains("multiple of parallel.pipeline_parallel (2) microbatches, at least 4"));
  CHECK_THAT(error_of([] { make_pipeline_schedule("1f1b", 2, 2, 4); }),
             Contains("parallel.pipeline_virtual_stages: 2 needs parallel.pipeline_schedule: interleaved_1f1b"));
  CHECK_THAT(error_of([] { make_pipeline_schedule("pipedream", 2, 1, 4); }),
             Contains("unknown schedule 'pipedream'"));
  CHECK(split_pipeline_layers(3, 2, {}) == std::vector<int>{2, 1});  // uneven: 3 layers over 2 stages
  CHECK(split_pipeline_layers(8, 4, {}) == std::vector<int>{2, 2, 2, 2});
  CHECK(split_pipeline_layers(5, 2, {1, 4}) == std::vector<int>{1, 4});
  CHECK_THAT(error_of([] { split_pipeline_layers(5, 2, {2, 2}); }),
             Contains("[2, 2] covers 4 layers but the model has 5") && Contains("dropped"));
  CHECK_THAT(error_of([] { split_pipeline_layers(5, 2, {3, 3}); }), Contains("duplicated"));
  CHECK_THAT(error_of([] { split_pipeline_layers(5, 2, {5, 0}); }), Contains("gives stage 1 0 layers"));
  CHECK_THAT(error_of([] { split_pipeline_layers(5, 3, {2, 3}); }), Contains("has 2 entries for 3 stages"));
  CHECK_THAT(error_of([] { split_pipeline_layers(2, 3, {}); }), Contains("3 stages for 2 layers"));
}

// Swaps the microbatches of rank r's i-th and j-th receives of kind `op`
// (the lists stay complete; only the order on the link changes).
static void swap_receives(PipelineSchedule& s, int r, PipeOp op, size_t i, size_t j) {
  auto& list = s.actions[size_t(r)];
  std::vector<size_t> recvs;
  for (size_t k = 0; k < list.size(); ++k)
    if (list[k].op == op) recvs.push_back(k);
  REQUIRE(recvs.size() > std::max(i, j));
  std::swap(list[recvs[i]].microbatch, list[recvs[j]].microbatch);
}

TEST_CASE("pipeline: on every link the send order is the receive order (NCCL matches by order, not tags)",
          "[pipeline][links]") {
  SECTION("every built-in schedule passes, and its links are the neighbour pairs (interleaved: and the wrap)") {
    for (const char* kind : {"gpipe", "1f1b", "zero_bubble"})
      for (int P = 2; P <= 6; ++P)
        for (int M = P; M <= 12; M += 3) {
          INFO(kind << " P=" << P << " M=" << M);
          const PipelineSchedule s = make_pipeline_schedule(kind, P, 1, M);
          CHECK_NOTHROW(check_pipeline_schedule(s));
          std::vector<std::pair<int, int>> want;
          for (int r = 0; r + 1 < P; ++r) want.push_back({r, r + 1});
          for (int r = 0; r + 1 < P; ++r) want.push_back({r + 1, r});
          std::sort(want.begin(), want.end());
          CHECK(pipeline_link_pairs(s) == want);
        }
    for (int P = 2; P <= 4; ++P)
      for (int v = 2; v <= 3; ++v) {
        const PipelineSchedule s = make_pipeline_schedule("interleaved_1f1b", P, v, P * v * 2);
        INFO("interleaved_1f1b P=" << P << " v=" << v);
        CHECK_NOTHROW(check_pipeline_schedule(s));
        const auto links = pipeline_link_pairs(s);
        CHECK(std::count(links.begin(), links.end(), std::make_pair(P - 1, 0)) == 1);  // the wrap, both ways
        CHECK(std::count(links.begin(), links.end(), std::make_pair(0, P - 1)) == 1);
        CHECK(links.size() == (P == 2 ? 2u : size_t(2 * P)));
      }
    CHECK(pipeline_link_pairs(make_pipeline_schedule("1f1b", 1, 1, 3)).empty());
  }
  SECTION("a schedule whose receiver swaps two receives on a link is refused, naming the link and microbatches") {
    // 1f1b at pp2, rank 1 (the last stage): swap its first two recv_act,
    // moving their forwards along so the lists stay complete. The buffered
    // simulation alone would also object, but as a hang or a mismatch; the
    // link check names the link, both ranks and both messages.
    PipelineSchedule s = make_pipeline_schedule("1f1b", 2, 1, 4);
    swap_receives(s, 1, PipeOp::RecvAct, 0, 1);
    const std::string e = error_of([&] { check_pipeline_schedule(s); });
    CHECK_THAT(e, Contains("the link from rank 0 to rank 1") && Contains("message 1") &&
                      Contains("the activation of microbatch 0 (stage 0 -> 1) as rank 0 sends") &&
                      Contains("rank 1 receives the activation of microbatch 1") && Contains("match in order"));
  }
  SECTION("a gradient received out of order on the backward link is refused too") {
    PipelineSchedule s = make_pipeline_schedule("gpipe", 2, 1, 3);
    swap_receives(s, 0, PipeOp::RecvGrad, 1, 2);
    CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }),
               Contains("the link from rank 1 to rank 0") && Contains("message 2") &&
                   Contains("the gradient of microbatch 1 (stage 1 -> 0)") &&
                   Contains("rank 0 receives the gradient of microbatch 2"));
  }
  SECTION("a message that is sent and never received on its link is counted") {
    PipelineSchedule s = make_pipeline_schedule("gpipe", 2, 1, 2);
    auto& r1 = s.actions[1];
    for (size_t i = 0; i < r1.size(); ++i)
      if (r1[i].op == PipeOp::RecvAct && r1[i].microbatch == 1) {
        r1.erase(r1.begin() + long(i));
        break;
      }
    CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }),
               Contains("the link from rank 0 to rank 1") && Contains("rank 0 sends 2 message(s) on it and rank 1 "
                                                                       "receives 1"));
  }
}

TEST_CASE("pipeline: the check runs the executor's buffer reuse too (slots.h), and refuses a list that hangs on it",
          "[pipeline][slots]") {
  SECTION("1f1b's last stage has one slot: each receive after the first waits for the gradient sent from it") {
    const PipelineSchedule s = make_pipeline_schedule("1f1b", 2, 1, 3);
    const PipelineSlotPlan p = plan_pipeline_slots(s, 1);
    REQUIRE(p.slots_per_chunk == std::vector<int>{1});
    const auto& list = s.actions[1];
    int waits = 0;
    for (size_t i = 0; i < list.size(); ++i)
      for (int w : p.waits[i]) {
        ++waits;
        CHECK(list[i].op == PipeOp::RecvAct);
        CHECK(list[size_t(w)].op == PipeOp::SendGrad);
        CHECK(list[size_t(w)].microbatch == list[i].microbatch - 1);
      }
    CHECK(waits == 2);
  }
  SECTION("a list that passes with sends that never wait, but hangs once a slot waits for its last send") {
    // interleaved_1f1b, 3 ranks: rank 2 sends microbatch 2's activation
    // five actions late. Buffered, every list still runs to the end; with
    // the executor's reuse rank 2 cannot take the slot back before its
    // gradient to rank 1 is received, and rank 1 waits for that activation.
    PipelineSchedule s = make_pipeline_schedule("interleaved_1f1b", 3, 2, 6);
    auto& l = s.actions[2];
    REQUIRE(l[8].op == PipeOp::SendAct);
    REQUIRE(l[8].microbatch == 2);
    const PipeAction a = l[8];
    l.erase(l.begin() + 8);
    l.insert(l.begin() + 13, a);
    CHECK_THAT(error_of([&] { check_pipeline_schedule(s); }),
               Contains("would hang") && Contains("rank 2 at recv_act mb1 stage5") &&
                   Contains("first waiting for its send_grad mb0 stage5 to rank 1 to be received"));
  }
}

// Early receives (slots.h plan_receive_posts, run by the executor over
// stream-ordered links): each receive is posted after its slot's last
// reader, never before an earlier receive from the same peer, and the
// receive that takes a slot over only when the executor allows it.
TEST_CASE("pipeline: receives are posted once their slot's last reader is done, in each link's order",
          "[pipeline][slots]") {
  auto is_recv = [](const PipeAction& a) { return a.op == PipeOp::RecvAct || a.op == PipeOp::RecvGrad; };
  auto check_list = [&](const PipelineSchedule& s, int r, bool takeover_early) {
    const PipelineSlotPlan slots = plan_pipeline_slots(s, r);
    const std::vector<int> post = plan_receive_posts(s, r, slots, takeover_early);
    const auto& list = s.actions[size_t(r)];
    REQUIRE(post.size() == list.size());
    std::map<int, int> last_post;  // peer -> post point of its last receive
    int early = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const PipeAction& a = list[i];
      INFO(s.kind << " P=" << s.ranks << " v=" << s.virtual_stages << " M=" << s.microbatches << " rank " << r
                  << " action " << i << " " << pipe_op_name(a.op) << " mb" << a.microbatch);
      if (!is_recv(a)) {
        CHECK(post[i] == int(i));
        continue;
      }
      CHECK(post[i] <= int(i));
      // The slot's last earlier action (its buffer's last reader) comes first.
      int last = -1;
      bool takeover = true;
      for (size_t j = 0; j < i; ++j)
        if ((list[j].stage - r) / s.ranks == (a.stage - r) / s.ranks && slots.slot[j] == slots.slot[i]) {
          last = int(j);
          takeover = list[j].microbatch != a.microbatch;
        }
      CHECK(post[i] >= last);
      if (takeover && !takeover_early) CHECK(post[i] == int(i));
      const int peer = (a.op == PipeOp::RecvAct ? a.stage - 1 : a.stage + 1) % s.ranks;
      if (last_post.count(peer)) CHECK(post[i] >= last_post[peer]);
      last_post[peer] = post[i];
      if (post[i] < int(i) - 1) ++early;
    }
    return early;
  };
  int early = 0;
  for (const char* kind : {"gpipe", "1f1b", "zero_bubble"})
    for (int P = 2; P <= 4; ++P)
      for (int M = P; M <= 9; M += 3) {
        const PipelineSchedule s = make_pipeline_schedule(kind, P, 1, M);
        for (int r = 0; r < P; ++r) early += check_list(s, r, true) + check_list(s, r, false);
      }
  for (int P = 2; P <= 3; ++P) {
    const PipelineSchedule s = make_pipeline_schedule("interleaved_1f1b", P, 2, P * 4);
    for (int r = 0; r < P; ++r) early += check_list(s, r, true) + check_list(s, r, false);
  }
  CHECK(early > 0);
  // 1f1b at pp2, rank 0: microbatch 0's gradient is posted right after its
  // activation went out, not when the compute stream reaches the receive
  // (after microbatch 1's forward and send).
  const PipelineSchedule s = make_pipeline_schedule("1f1b", 2, 1, 4);
  const auto& l = s.actions[0];
  const std::vector<int> post = plan_receive_posts(s, 0, plan_pipeline_slots(s, 0), true);
  size_t g = 0, a = 0;
  while (!(l[g].op == PipeOp::RecvGrad && l[g].microbatch == 0)) ++g;
  while (!(l[a].op == PipeOp::SendAct && l[a].microbatch == 0)) ++a;
  CHECK(a + 1 < g);
  CHECK(post[g] == int(a));
}
