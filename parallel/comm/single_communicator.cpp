// The single-rank communicator: world size 1, so every collective is a copy
// or a no-op. Used when a job runs one rank, so the trainer has one code path
// (no "if (comm)" branches) and needs neither Gloo nor a rendezvous store.
#include <cstring>
#include <memory>

#include "core/common/error.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

namespace {

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single"; }

  // Sum, Avg and Max over one rank all leave the value as it is.
  void all_reduce(float*, int64_t count, ReduceOp) override {
    TR_CHECK(count >= 0, "all_reduce (single rank): negative count ", count);
  }

  void reduce_scatter(float* out, const float* in, int64_t count_per_rank, ReduceOp) override {
    TR_CHECK(count_per_rank >= 0, "reduce_scatter (single rank): negative count ", count_per_rank);
    if (count_per_rank > 0 && out != in)
      std::memmove(out, in, static_cast<size_t>(count_per_rank) * sizeof(float));
  }

  void all_gather(void* out, const void* in, size_t bytes_per_rank) override {
    if (bytes_per_rank > 0 && out != in) std::memmove(out, in, bytes_per_rank);
  }

  void broadcast(void*, size_t, int root) override {
    TR_CHECK(root == 0, "broadcast (single rank): root ", root, " is not a rank of a group of 1");
  }

  void barrier() override {}
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

}  // namespace trainrun
