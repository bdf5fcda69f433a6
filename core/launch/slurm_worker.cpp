#include "core/launch/slurm_worker.h"

#include <cstdlib>
#include <thread>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/launch/node_group.h"
#include "core/train/trainer.h"
#include "parallel/rendezvous/net_address.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

namespace {

void set_env(const char* name, const std::string& value) { ::setenv(name, value.c_str(), 1); }


}  // namespace

int run_slurm_worker(const JobSpec& job, const LaunchPlan& plan) {
  TR_CHECK(plan.mode == LaunchMode::SlurmWorker, "run_slurm_worker: not a Slurm worker launch");
  const EnvMap env = current_environment();
  const auto timeout = std::chrono::milliseconds(int64_t(job.parallel.timeout_s * 1000));
  const auto io_timeout = node_timeout(job);
  std::unique_ptr<TcpStoreServer> server;
  std::unique_ptr<Store> store;
  std::string secret;
  if (plan.world > 1) {
    if (plan.rank == 0) {
      secret = secret_for_new_store(env);
      server = std::make_unique<TcpStoreServer>("", plan.master_port, secret);
      store =
          connect_tcp_store(plan.master_addr, plan.master_port, secret, std::chrono::milliseconds(5000), io_timeout);
      publish_rendezvous(*store, job.output.dir, secret, plan.host, plan.master_addr, plan.master_port);
    } else {
      Node0Contact c = contact_node0(job.output.dir, plan.master_addr, plan.master_port, env, timeout, io_timeout,
                                     "rank " + std::to_string(plan.rank) + " (host " + plan.host + ")", nullptr);
      store = std::move(c.store);
      secret = c.secret;
    }
  }
  // The torchrun contract, in this process's own environment (the trainer
  // and everything it starts read it from there).
  set_env("RANK", std::to_string(plan.rank));
  set_env("LOCAL_RANK", std::to_string(plan.local_rank));
  set_env("WORLD_SIZE", std::to_string(plan.world));
  set_env("LOCAL_WORLD_SIZE", std::to_string(plan.local_world));
  set_env("GROUP_RANK", std::to_string(plan.node_rank));
  set_env("GROUP_WORLD_SIZE", std::to_string(plan.nnodes));
  set_env("MASTER_ADDR", plan.master_addr);
  set_env("MASTER_PORT", std::to_string(plan.master_port));
  set_env("TRAINRUN_STORE_SECRET", secret);
  set_env("TRAINRUN_RESTART_COUNT", "0");
  if (plan.world > 1 && !std::getenv("TRAINRUN_GLOO_HOST")) {
    std::string note;
    set_env("TRAINRUN_GLOO_HOST", worker_bind_address(plan.master_addr, &note));
    if (!note.empty()) TR_LOG_WARN(note);
  }
  const int code = exit_code_for(run_training(job, WorkerInfo::from_env()));
  if (store) {
    try {
      store->set("trainrun/done/" + std::to_string(plan.rank), store_bytes(std::to_string(code)));
      if (plan.rank == 0) {
        std::vector<std::string> keys;
        for (int r = 0; r < plan.world; ++r) keys.push_back("trainrun/done/" + std::to_string(r));
        store->wait(keys, timeout);
      }
    } catch (const Error& e) {
      TR_LOG_WARN("rank ", plan.rank, ": after training: ", e.what());
    }
  }
  return code;
}

}  // namespace trainrun
