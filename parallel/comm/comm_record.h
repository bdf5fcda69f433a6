// Tests: a communicator that records every call it passes on, per global
// rank, across all that rank's groups, in the order the calls reach the
// communicator below it (inside the rank's EnqueueOrder turn when it wraps
// the inner communicator and the turn-taker wraps it): the enqueue order
// that NCCL needs to be the same on every rank (enqueue_order.h).
//
//   TRAINRUN_DEBUG_COMM_RECORD=1
//
// Unset: no wrapper. The records live in this process (the in-process
// multi-rank tests read them with take_comm_records()).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/communicator.h"

namespace trainrun {

struct CommRecord {
  std::string group;  // the communicator's group ("tp0", "dp_shard1", "world")
  std::string op;     // "all_gather", "reduce_scatter_bf16", "send_recv", ...
  uint64_t bytes = 0; // the payload this rank passes (its share for all_gather / reduce_scatter)
  // "tp#:all_reduce:4096": the group's kind (its name with every index
  // as '#', the same for every group of that dimension), op and bytes.
  std::string key() const;
};

// `inner` wrapped in a recorder for `global_rank` when
// TRAINRUN_DEBUG_COMM_RECORD is set; unchanged otherwise.
std::unique_ptr<Communicator> maybe_record_comm(std::unique_ptr<Communicator> inner, int global_rank);
// Every rank's calls so far (global rank -> calls in order), and forgets them.
std::map<int, std::vector<CommRecord>> take_comm_records();

}  // namespace trainrun
