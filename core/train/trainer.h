// The training loop of one worker. Built in a fixed order (device ->
// distributed -> model -> sharded state -> data), then: data -> forward ->
// backward -> gradient reduction -> clip -> AdamW -> log/eval.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

// Where this worker sits in the job (from the torchrun-style environment).
struct WorkerInfo {
  int rank = 0, world = 1, local_rank = 0, local_world = 1, group_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::string bind_addr = "127.0.0.1";  // this rank's own address for Gloo (TRAINRUN_GLOO_HOST)
  std::string secret;
  static WorkerInfo from_env();  // RANK, WORLD_SIZE, ... (defaults: a single rank)
};

struct TrainSummary {
  int steps = 0;
  double final_loss = 0, best_val_loss = -1, entropy_floor = -1;
  double tokens_per_sec = 0, wall_seconds = 0;
  int64_t tokens = 0;
  // This rank's bytes by category (see ShardMemory) and activations.
  size_t params_bytes = 0, grads_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  size_t host_bytes = 0;  // parallel.offload's host memory (master weights, moments, grad shard)
  size_t comm_bytes = 0;  // peak of the store's gathered units and full-size gradient buffers
  std::vector<double> losses;  // every step's loss (all ranks)
  double checkpoint_blocked_seconds = 0;
  size_t checkpoint_host_bytes = 0;  // the most host memory a save held for the state (one piece)
  int skipped_steps = 0;
  int stop_signal = 0;  // the signal that stopped the run early (checkpoint saved), else 0
};

TrainSummary run_training(const JobSpec& job, const WorkerInfo& worker);
// 0; or after a stop signal (checkpoint saved): 75 (kExitRequeue,
// "checkpointed, please requeue") for SIGTERM/SIGUSR1, 130 for SIGINT.
int exit_code_for(const TrainSummary& s);

}  // namespace trainrun
