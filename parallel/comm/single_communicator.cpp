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

  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    if (bytes_per_rank > 0 && out != in) std::memmove(out, in, bytes_per_rank);
  }
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    TR_CHECK(recv_bytes[0] == send_bytes[0], "all_to_all_v (single rank): receives ", recv_bytes[0],
             " bytes from itself but sends ", send_bytes[0]);
    if (send_bytes[0] > 0 && out != in) std::memmove(out, in, send_bytes[0]);
  }

  // Buffers may be device memory (a one-GPU job): nothing here touches them
  // on the host. Over one rank a reduction is the identity.
  void all_reduce_bf16(uint16_t*, int64_t count, ReduceOp) override {
    TR_CHECK(count >= 0, "all_reduce_bf16 (single rank): negative count ", count);
  }
  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t count_per_rank, ReduceOp) override {
    TR_CHECK(count_per_rank >= 0, "reduce_scatter_bf16 (single rank): negative count ", count_per_rank);
    if (count_per_rank > 0 && out != in) std::memmove(out, in, size_t(count_per_rank) * 2);
  }
  // A pipeline of one stage talks only to itself.
  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t) override {
    if (send_to < 0 && recv_from < 0) return;
    TR_CHECK(send_to == 0 && recv_from == 0 && send_bytes == recv_bytes,
             "send_recv (single rank): the only peer is rank 0, as a matched send and receive of the same size");
    if (send_bytes > 0 && send_buf != recv_buf) std::memmove(recv_buf, send_buf, send_bytes);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

}  // namespace trainrun
