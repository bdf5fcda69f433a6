// Runs a job with W ranks as threads of the test process: each thread is a
// full trainer (run_training) talking Gloo over loopback through a real
// TcpStoreServer. Throws (with every failing rank's message) if any rank fails.
#pragma once
#include <vector>

#include "core/config/job_spec.h"
#include "core/train/trainer.h"

namespace trainrun::test {

std::vector<TrainSummary> run_ranks_inprocess(const JobSpec& job, int world);

}  // namespace trainrun::test
