// `trainrun --config job.yaml --explain`: what the pipeline of a job would
// run, without starting it: the mesh, each virtual stage's layers, and
// every pp rank's action list (schedule.h) with its simulated bubble next
// to the schedule's formula.
#pragma once
#include <string>

#include "core/config/job_spec.h"

namespace trainrun {

// world: the ranks the launch would start. Errors (a bad split, too few
// microbatches) are thrown as at launch.
std::string explain_pipeline_job(const JobSpec& job, int world, int ranks_per_node = 0);  // 0 = world

}  // namespace trainrun
