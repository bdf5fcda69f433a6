// Shared helpers for the tests that run trainrun jobs as real processes
// (launcher, multinode, slurm): finding a job's processes in /proc, waiting
// with a deadline, a process started in the background, and the losses a
// run logged.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/testutil.h"

namespace trainrun::test {

// The contents of /proc/<pid>/<what> ("" when the process is gone).
std::string read_proc(pid_t pid, const char* what);

// Live processes (not zombies: their cmdline is empty) whose command line
// mentions `needle`, other than this test.
std::vector<pid_t> processes_mentioning(const std::string& needle);

// The `trainrun worker` process whose command line mentions `dir` and whose
// environment has RANK=<rank>; -1 if there is none.
pid_t worker_pid(const std::string& dir, int rank);

// Polls `pred` every 20 ms until it holds or `timeout` has passed; the
// result of a last call after the deadline.
template <typename Pred>
bool wait_until(Pred pred, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// The "loss" of every line of a metrics.jsonl.
std::vector<double> losses(const std::string& metrics_path);

// Whether rank 0 of the run in <dir>/run has logged step 1: from then on all
// workers are past the rendezvous and inside the step loop.
bool training_started(const TempDir& dir);

// This process's environment (NAME=value strings) without the variables
// named in `unset`, with `add` appended.
std::vector<std::string> environment_with(const std::vector<std::string>& unset, const std::vector<std::string>& add);

// A process started in the background (fork + execvpe: argv[0] is looked up
// in PATH) with stdin from /dev/null and stdout/stderr to files. One that is
// still running at destruction (a failed test) is killed with SIGKILL.
class BackgroundProcess {
 public:
  BackgroundProcess(std::vector<std::string> argv, std::vector<std::string> env, std::string out_path,
                    std::string err_path);
  ~BackgroundProcess();
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Exit code (128+signal when killed), or -1 if it did not end in time.
  // Once it has ended, every later call returns the same code.
  int wait(std::chrono::milliseconds timeout);
  std::string err() const { return read_file(err_); }

 private:
  std::string out_, err_;
  pid_t pid_ = -1;
  bool done_ = false;
  int code_ = -1;
};

}  // namespace trainrun::test
