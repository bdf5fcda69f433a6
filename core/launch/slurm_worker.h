// `srun --ntasks-per-node=<gpus> trainrun --config job.yaml`: every Slurm
// task is one worker and there is no agent (launch_mode.h, "Slurm worker").
//
// Rank 0 hosts the rendezvous store in-process (all interfaces, the port
// derived from SLURM_JOB_ID unless configured) and publishes the secret and
// marker files in output.dir like a node-0 agent (node_group.h); the other
// ranks run the same shared-directory check and join. Each process then
// gets the torchrun contract in its own environment (RANK = SLURM_PROCID,
// LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = SLURM_NTASKS, LOCAL_WORLD_SIZE =
// tasks on its node, GROUP_RANK = SLURM_NODEID, ...) and trains. Slurm
// delivers --signal=USR1@T to every task itself, so preemption works as
// with an agent (all ranks checkpoint, exit 75); one that comes during the
// rendezvous is noted (main()'s handlers) and acted on at the first step
// boundary, where the ranks agree, so no rank is left waiting for one that
// left. Rank 0 keeps the store up
// until every rank has finished, or parallel.timeout_s.
#pragma once
#include "core/config/job_spec.h"
#include "core/launch/launch_mode.h"

namespace trainrun {

// Returns the exit code (0, 75 after a checkpoint on a signal, 130).
int run_slurm_worker(const JobSpec& job, const LaunchPlan& plan);

}  // namespace trainrun
