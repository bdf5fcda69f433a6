#include "parallel/comm/comm_record.h"

#include <cctype>
#include <cstdlib>
#include <mutex>

#include "parallel/comm/forwarding_communicator.h"

namespace trainrun {

namespace {

std::mutex g_mu;
std::map<int, std::vector<CommRecord>> g_records;

// "dp_shard1" -> "dp_shard#", "pp0.link0to1" -> "pp#.link#to#".
std::string group_kind(const std::string& g) {
  std::string k;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(g[i]))) {
      if (k.empty() || k.back() != '#') k += '#';
    } else {
      k += g[i];
    }
  }
  return k;
}

class RecordingCommunicator final : public ForwardingCommunicator {
 public:
  RecordingCommunicator(std::unique_ptr<Communicator> inner, int global_rank)
      : ForwardingCommunicator(std::move(inner)), global_rank_(global_rank) {}

  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    note("all_reduce", uint64_t(count) * 4);
    inner_->all_reduce(buf, count, op);
  }
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    note("reduce_scatter", uint64_t(n) * 4);
    inner_->reduce_scatter(out, in, n, op);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    note("all_gather", bytes);
    inner_->all_gather(out, in, bytes);
  }
  void all_to_all(void* out, const void* in, size_t bytes) override {
    note("all_to_all", bytes);
    inner_->all_to_all(out, in, bytes);
  }
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    uint64_t sent = 0;
    for (int p = 0; p < world_size(); ++p) sent += send_bytes[p];
    note("all_to_all_v", sent);
    inner_->all_to_all_v(out, recv_bytes, in, send_bytes);
  }
  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes,
                                                         const std::shared_ptr<void>& after) override {
    note("all_gather", bytes);
    return inner_->all_gather_deferred(out, in, bytes, after);
  }
  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t n, ReduceOp op,
                                                             const std::shared_ptr<void>& after) override {
    note("reduce_scatter", uint64_t(n) * 4);
    return inner_->reduce_scatter_deferred(out, in, n, op, after);
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    note("broadcast", bytes);
    inner_->broadcast(buf, bytes, root);
  }
  void barrier() override {
    note("barrier", 0);
    inner_->barrier();
  }
  void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) override {
    note("all_reduce_bf16", uint64_t(count) * 2);
    inner_->all_reduce_bf16(buf, count, op);
  }
  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t n, ReduceOp op) override {
    note("reduce_scatter_bf16", uint64_t(n) * 2);
    inner_->reduce_scatter_bf16(out, in, n, op);
  }
  void send_recv(const void* sb, size_t sn, int to, void* rb, size_t rn, int from, uint32_t tag) override {
    note(to < 0 ? "recv" : from < 0 ? "send" : "send_recv", to < 0 ? rn : sn);
    inner_->send_recv(sb, sn, to, rb, rn, from, tag);
  }
  std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    note("send", bytes);
    return inner_->send_deferred(buf, bytes, to, tag, after);
  }
  std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    note("recv", bytes);
    return inner_->recv_deferred(buf, bytes, from, tag, after);
  }

 private:
  void note(const char* op, uint64_t bytes) {
    std::lock_guard<std::mutex> lk(g_mu);
    g_records[global_rank_].push_back(CommRecord{group(), op, bytes});
  }
  int global_rank_;
};

}  // namespace

std::string CommRecord::key() const { return group_kind(group) + ":" + op + ":" + std::to_string(bytes); }

std::unique_ptr<Communicator> maybe_record_comm(std::unique_ptr<Communicator> inner, int global_rank) {
  const char* s = std::getenv("TRAINRUN_DEBUG_COMM_RECORD");
  if (!s || !*s || std::string(s) == "0") return inner;
  return std::make_unique<RecordingCommunicator>(std::move(inner), global_rank);
}

std::map<int, std::vector<CommRecord>> take_comm_records() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::map<int, std::vector<CommRecord>> out;
  out.swap(g_records);
  return out;
}

}  // namespace trainrun
