// Runs a job with W ranks as threads of the test process: each thread is a
// full trainer (run_training) talking Gloo over loopback through a real
// TcpStoreServer. Throws (with every failing rank's message) if any rank fails.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/train/trainer.h"
#include "parallel/comm/communicator.h"

namespace trainrun {
class Store;
class TcpStoreServer;
}

namespace trainrun::test {

// omp_threads_per_rank > 0: each rank's thread sets its OpenMP team to
// that size (the CPU backend's GEMMs and ops pick it up); 0 leaves the
// process default.
std::vector<TrainSummary> run_ranks_inprocess(const JobSpec& job, int world, int omp_threads_per_rank = 0);

// One rank of run_ranks_inprocess_outcomes: its summary, or what it threw.
struct RankOutcome {
  TrainSummary summary;
  std::string error;     // "" when the rank returned normally
  double seconds = 0;    // from the start of the run until the rank returned or threw
};

// The same, but every rank's outcome instead of one exception: for tests
// of failures (which rank says what, and how soon). `inspect`, when given,
// runs once every rank has returned, while the store server still serves,
// to look at what the job left in it.
std::vector<RankOutcome> run_ranks_inprocess_outcomes(const JobSpec& job, int world,
                                                      const std::function<void(TcpStoreServer&)>& inspect = {},
                                                      int omp_threads_per_rank = 0);

// W threads, each connected to one real TcpStoreServer over loopback,
// running fn(rank, store) (to build the communicators it needs). Returns
// each rank's error text ("" = returned normally) once every thread has
// finished.
std::vector<std::string> run_store_ranks(int W, const std::function<void(int, Store&)>& fn);

// One communicator group without a trainer: W threads, each with a Gloo
// communicator over loopback (a real TcpStoreServer), named `group` (the
// name collective errors carry), running fn(comm). Returns each rank's
// error text ("" = returned normally) once every thread has finished:
// tests of parallel/ pieces that need several ranks (context parallelism).
std::vector<std::string> run_gloo_group(int W, const std::string& group, std::chrono::milliseconds timeout,
                                        const std::function<void(Communicator&)>& fn);

}  // namespace trainrun::test
