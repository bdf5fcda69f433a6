#include "tests/support/inprocess.h"

#include <omp.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "parallel/rendezvous/store.h"

namespace trainrun::test {

std::vector<RankOutcome> run_ranks_inprocess_outcomes(const JobSpec& job, int world,
                                                      const std::function<void(TcpStoreServer&)>& inspect,
                                                      int omp_threads_per_rank) {
  std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<RankOutcome> out(world);
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      if (omp_threads_per_rank > 0) omp_set_num_threads(omp_threads_per_rank);  // this thread's team size
      WorkerInfo w;
      w.rank = r;
      w.world = world;
      w.local_rank = r;
      w.local_world = world;
      w.master_addr = "127.0.0.1";
      w.master_port = server.port();
      w.secret = secret;
      try {
        out[r].summary = run_training(job, w);
      } catch (const std::exception& e) {
        out[r].error = e.what();
        if (out[r].error.empty()) out[r].error = "(an exception with an empty message)";
      } catch (...) {
        out[r].error = "(an exception that is not a std::exception)";
      }
      out[r].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  if (inspect) inspect(server);
  return out;
}

std::vector<TrainSummary> run_ranks_inprocess(const JobSpec& job, int world, int omp_threads_per_rank) {
  std::vector<RankOutcome> outcomes = run_ranks_inprocess_outcomes(job, world, {}, omp_threads_per_rank);
  std::string all;
  for (int r = 0; r < world; ++r)
    if (!outcomes[r].error.empty()) all += "rank " + std::to_string(r) + ": " + outcomes[r].error + "\n";
  if (!all.empty()) throw std::runtime_error(all);
  std::vector<TrainSummary> out;
  for (auto& o : outcomes) out.push_back(std::move(o.summary));
  return out;
}

std::vector<std::string> run_store_ranks(int W, const std::function<void(int, Store&)>& fn) {
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<std::string> errors(static_cast<size_t>(W));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", server.port(), secret, std::chrono::seconds(30));
        fn(r, *store);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
        if (errors[size_t(r)].empty()) errors[size_t(r)] = "(an exception with an empty message)";
      } catch (...) {
        errors[size_t(r)] = "(an exception that is not a std::exception)";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::string> run_gloo_group(int W, const std::string& group, std::chrono::milliseconds timeout,
                                        const std::function<void(Communicator&)>& fn) {
  return run_store_ranks(W, [&](int r, Store& store) {
    auto comm = make_gloo_communicator(store, group + "/", r, W, "127.0.0.1", timeout);
    comm->set_group(group);
    fn(*comm);
  });
}

}  // namespace trainrun::test
