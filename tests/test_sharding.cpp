// Sharded training equals single-rank training. Ranks run as threads of this
// process, each a full trainer (run_training) talking Gloo over loopback
// through a real TcpStoreServer, so the whole path is exercised: store,
// communicators, the comm thread, padding, clipping across shards.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "core/config/job_spec.h"
#include "core/model/gpt2/gpt2.h"
#include "core/model/gpt2/gpt2_arch.h"
#include "core/model/model_io.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"
#include "parallel/rendezvous/store.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;

namespace {

// A model whose units do not divide evenly by 3, 4 or 5 ranks (padding is exercised).
std::string job_yaml(const std::string& dir, const std::string& strategy, int group, const std::string& ckpt) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 18, vocab_size: 23, seq_len: 12}\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 12, micro_batch_size: 1, max_steps: 10, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, eval_interval: 5, eval_steps: 2, log_interval: 1, grad_clip: 0.5,\n"
         "        activation_checkpointing: " + ckpt + "}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) + ", timeout_s: 60}\n";
}

struct RunOut {
  std::vector<double> losses;
  std::vector<float> weights;
  std::vector<TrainSummary> per_rank;
};

// micro_batch_size is chosen so that 12 sequences split into whole micro-batches.
RunOut run_ranks(int world, const std::string& strategy, int group, const std::string& ckpt = "none") {
  test::TempDir dir("shard");
  // Gradient accumulation is exercised at every world size but 4.
  const int mb = world == 3 ? 2 : 3;
  JobSpec job = parse_job_spec(job_yaml(dir.path(), strategy, group, ckpt), "job.yaml",
                               {"train.micro_batch_size=" + std::to_string(mb)});
  RunOut out;
  out.per_rank = test::run_ranks_inprocess(job, world);
  out.losses = out.per_rank[0].losses;
  load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

double rel_diff(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

void require_same(const RunOut& got, const RunOut& ref, const std::string& what) {
  REQUIRE(got.losses.size() == ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    INFO(what << " step " << i + 1 << ": " << got.losses[i] << " vs " << ref.losses[i]);
    REQUIRE(rel_diff(got.losses[i], ref.losses[i]) <= 1e-5);
  }
  REQUIRE(got.weights.size() == ref.weights.size());
  double num = 0, den = 0, worst = 0;
  for (size_t i = 0; i < ref.weights.size(); ++i) {
    double d = double(got.weights[i]) - ref.weights[i];
    num += d * d;
    den += double(ref.weights[i]) * ref.weights[i];
    worst = std::max(worst, std::fabs(d));
  }
  INFO(what << ": final weights relative L2 difference " << std::sqrt(num / den) << ", worst element " << worst);
  REQUIRE(std::sqrt(num / den) <= 1e-5);
}

}  // namespace

TEST_CASE("sharding: every strategy at world sizes 1-4 matches the single-rank run", "[sharding]") {
  const RunOut ref = run_ranks(1, "no_shard", 0);
  REQUIRE(ref.losses.size() == 10);
  REQUIRE(ref.losses.back() < ref.losses.front());
  for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    for (int world : {1, 2, 3, 4}) {
      // hybrid: groups of 2 where the world splits into them, else one group.
      int group = std::string(strategy) == "hybrid_shard" ? (world % 2 == 0 ? 2 : world) : 0;
      SECTION(std::string(strategy) + " world " + std::to_string(world)) {
        require_same(run_ranks(world, strategy, group), ref,
                     std::string(strategy) + " x" + std::to_string(world));
      }
    }
  }
}

TEST_CASE("sharding: hybrid_shard with groups of one rank (pure replication) matches", "[sharding]") {
  const RunOut ref = run_ranks(1, "no_shard", 0);
  require_same(run_ranks(2, "hybrid_shard", 1), ref, "hybrid_shard x2 groups of 1");
}

TEST_CASE("sharding: full_shard over 4 ranks holds a quarter of the optimizer state", "[sharding]") {
  const RunOut one = run_ranks(1, "no_shard", 0);
  const RunOut four = run_ranks(4, "full_shard", 0);
  const size_t full = one.per_rank[0].optimizer_bytes;
  // Padding: each of the 4 units rounds up to a multiple of 4 elements (2 moments, 4 bytes each).
  const size_t padding = 4 /*units*/ * 3 /*max pad*/ * 2 * 4;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << " optimizer bytes " << four.per_rank[r].optimizer_bytes << " vs 1-rank " << full);
    REQUIRE(four.per_rank[r].optimizer_bytes <= full / 4 + padding);
    REQUIRE(four.per_rank[r].params_bytes <= one.per_rank[0].params_bytes / 4 + padding);
    REQUIRE(four.per_rank[r].grads_bytes <= one.per_rank[0].grads_bytes / 4 + padding);
  }
}

TEST_CASE("sharding: activation checkpointing gives identical losses with less activation memory", "[sharding]") {
  const RunOut none = run_ranks(1, "no_shard", 0, "none");
  const RunOut blocks = run_ranks(1, "no_shard", 0, "blocks");
  REQUIRE(none.losses == blocks.losses);  // bit-identical: the recompute is the same arithmetic
  REQUIRE(none.weights == blocks.weights);
  INFO("activations: none " << none.per_rank[0].activation_bytes << " B, blocks " << blocks.per_rank[0].activation_bytes << " B");
  REQUIRE(blocks.per_rank[0].activation_bytes < none.per_rank[0].activation_bytes);
  const RunOut blocks2 = run_ranks(2, "full_shard", 0, "blocks");
  require_same(blocks2, none, "full_shard x2 with activation checkpointing");
}

namespace {
// A one-rank communicator whose deferred all-gathers behave like NCCL's on
// a GPU: the result is not there until order_compute_after(). Until then
// `out` holds NaN, so a read before the wait poisons the loss, and the
// result lands only at the wait, so a buffer reused before it is clobbered.
class LateGatherComm final : public Communicator {
 public:
  int issued = 0, waited = 0, never_waited = 0;
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "late-gather"; }
  void all_reduce(float*, int64_t, ReduceOp) override {}
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp) override {
    if (out != in) std::memcpy(out, in, size_t(n) * 4);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    if (out != in) std::memcpy(out, in, bytes);
  }
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}

  // The collective "runs" at the wait: it copies `src` (read then, so a
  // source overwritten early gives wrong values) or the data captured at
  // the issue (a gather's shard, which may legitimately change afterwards).
  class Late final : public PendingCollective {
   public:
    Late(LateGatherComm* c, void* out, const void* src, std::vector<char> data, size_t bytes)
        : c_(c), out_(out), src_(src), data_(std::move(data)), bytes_(bytes) {}
    ~Late() override {
      if (!done_) ++c_->never_waited;
    }
    void order_compute_after() override {
      REQUIRE_FALSE(done_);
      std::memcpy(out_, src_ ? src_ : data_.data(), bytes_);
      done_ = true;
      ++c_->waited;
    }

   private:
    LateGatherComm* c_;
    void* out_;
    const void* src_;
    std::vector<char> data_;
    size_t bytes_;
    bool done_ = false;
  };
  static void poison(void* p, size_t bytes) {
    std::vector<float> nan(bytes / 4, std::nanf(""));
    std::memcpy(p, nan.data(), nan.size() * 4);
  }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes,
                                                         const std::shared_ptr<void>&) override {
    ++issued;
    std::vector<char> data(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    poison(out, bytes);
    return std::make_unique<Late>(this, out, nullptr, std::move(data), bytes);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t n, ReduceOp,
                                                             const std::shared_ptr<void>&) override {
    ++issued;
    ++reduces;
    poison(out, size_t(n) * 4);
    return std::make_unique<Late>(this, out, in, std::vector<char>(), size_t(n) * 4);
  }
  int reduces = 0;
};

std::vector<double> train_steps(ParamStore& store, GPT2& model, Backend* be, const GPT2Config& cfg, int B) {
  std::vector<double> losses;
  std::mt19937 rng(3);
  std::vector<int32_t> in(size_t(B) * cfg.T), tgt(in.size());
  DeviceBuffer din(be, in.size() * 4), dtgt(be, in.size() * 4);
  std::vector<float> l(in.size());
  for (int step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < in.size(); ++i) in[i] = int32_t(rng() % unsigned(cfg.V)), tgt[i] = int32_t(rng() % unsigned(cfg.V));
    be->copy_to_device(din.get(), in.data(), in.size() * 4);
    be->copy_to_device(dtgt.get(), tgt.data(), tgt.size() * 4);
    store.zero_grads();
    model.forward(store, din.as<int32_t>(), dtgt.as<int32_t>(), B, cfg.T, true, 1.0f / float(in.size()));
    model.backward(store);
    store.finish_grads();
    AdamWParams p;
    p.lr = 1e-2f;
    store.optimizer_step(p, step, 1.0f);
    be->copy_to_host(l.data(), model.losses(), l.size() * 4);
    double s = 0;
    for (float x : l) s += x;
    losses.push_back(s / double(l.size()));
  }
  // A forward-only pass (evaluation) leaves prefetches behind for drain().
  model.forward(store, din.as<int32_t>(), dtgt.as<int32_t>(), B, cfg.T, false, 0.0f);
  be->copy_to_host(l.data(), model.losses(), l.size() * 4);
  double s = 0;
  for (float x : l) s += x;
  losses.push_back(s / double(l.size()));
  return losses;
}
}  // namespace

TEST_CASE("sharding: full_shard waits for each deferred all-gather and reduce-scatter before using or reusing its buffers",
          "[sharding]") {
  const GPT2Config cfg = GPT2Config::of(3, 2, 16, 29, 8);
  const int B = 2;
  std::vector<double> ref;
  {
    auto be = make_cpu_backend(1);
    auto comm = make_single_communicator();
    GPT2 model(cfg, be.get(), B, false);
    auto store = make_param_store("no_shard", model.layout(), be.get(), comm.get(), 0, nullptr);
    store->init_params(GPT2Arch(cfg), 7);
    ref = train_steps(*store, model, be.get(), cfg, B);
  }
  for (const char* ckpt : {"none", "blocks"}) {
    auto be = make_cpu_backend(1);
    LateGatherComm comm;
    GPT2 model(cfg, be.get(), B, std::string(ckpt) == "blocks");
    {
      auto store = make_param_store("full_shard", model.layout(), be.get(), &comm, 0, nullptr);
      store->init_params(GPT2Arch(cfg), 7);
      const std::vector<double> got = train_steps(*store, model, be.get(), cfg, B);
      INFO("activation checkpointing " << ckpt);
      REQUIRE(got.size() == ref.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO("loss " << i);
        CHECK(std::isfinite(got[i]));  // NaN: a unit was read before its gather was waited for
        CHECK(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
      }
      CHECK(comm.issued > 0);
      CHECK(comm.reduces > 0);
    }  // the store drains: every issued gather has been waited for
    CHECK(comm.waited == comm.issued);
    CHECK(comm.never_waited == 0);
  }
}
