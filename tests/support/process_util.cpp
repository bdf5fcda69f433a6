#include "tests/support/process_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

extern char** environ;

namespace trainrun::test {

std::string read_proc(pid_t pid, const char* what) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/" + what, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::vector<pid_t> processes_mentioning(const std::string& needle) {
  std::vector<pid_t> out;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (!end || *end || pid <= 0 || pid == getpid()) continue;
    std::string cmd = read_proc(pid_t(pid), "cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find(needle) != std::string::npos) out.push_back(pid_t(pid));
  }
  closedir(d);
  return out;
}

pid_t worker_pid(const std::string& dir, int rank) {
  for (pid_t pid : processes_mentioning(dir)) {
    std::string cmd = read_proc(pid, "cmdline");
    if (cmd.find(std::string("worker") + '\0') == std::string::npos) continue;
    const std::string env = '\0' + read_proc(pid, "environ");
    if (env.find(std::string(1, '\0') + "RANK=" + std::to_string(rank) + '\0') != std::string::npos) return pid;
  }
  return -1;
}

std::vector<double> losses(const std::string& metrics_path) {
  std::vector<double> out;
  std::istringstream in(read_file(metrics_path));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

bool training_started(const TempDir& dir) {
  return read_file(dir / "run/logs/rank0.log").find("step 1/") != std::string::npos;
}

std::vector<std::string> environment_with(const std::vector<std::string>& unset, const std::vector<std::string>& add) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    bool keep = true;
    for (const std::string& name : unset)
      if (std::strncmp(*e, name.c_str(), name.size()) == 0 && (*e)[name.size()] == '=') keep = false;
    if (keep) env.push_back(*e);
  }
  env.insert(env.end(), add.begin(), add.end());
  return env;
}

BackgroundProcess::BackgroundProcess(std::vector<std::string> args, std::vector<std::string> env,
                                     std::string out_path, std::string err_path)
    : out_(std::move(out_path)), err_(std::move(err_path)) {
  // Everything the child needs is made before fork().
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  pid_ = fork();
  REQUIRE(pid_ >= 0);
  if (pid_ == 0) {
    const int o = open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int n = open("/dev/null", O_RDONLY);
    dup2(n, 0);
    dup2(o, 1);
    dup2(e, 2);
    execvpe(argv[0], argv.data(), envp.data());
    _exit(127);
  }
}

BackgroundProcess::~BackgroundProcess() {
  if (pid_ > 0 && !done_) {  // a failed test: do not leave the job running
    kill(pid_, SIGKILL);     // a trainrun agent's workers follow (PR_SET_PDEATHSIG)
    waitpid(pid_, nullptr, 0);
  }
}

int BackgroundProcess::wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  if (done_) return code_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      done_ = true;
      code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return code_;
    }
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace trainrun::test
