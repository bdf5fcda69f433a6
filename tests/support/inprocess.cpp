#include "tests/support/inprocess.h"

#include <stdexcept>
#include <string>
#include <thread>

#include "parallel/store.h"

namespace trainrun::test {

std::vector<TrainSummary> run_ranks_inprocess(const JobSpec& job, int world) {
  std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<TrainSummary> out(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      WorkerInfo w;
      w.rank = r;
      w.world = world;
      w.local_rank = r;
      w.local_world = world;
      w.master_addr = "127.0.0.1";
      w.master_port = server.port();
      w.secret = secret;
      try {
        out[r] = run_training(job, w);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string all;
  for (int r = 0; r < world; ++r)
    if (!errors[r].empty()) all += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  if (!all.empty()) throw std::runtime_error(all);
  return out;
}

}  // namespace trainrun::test
