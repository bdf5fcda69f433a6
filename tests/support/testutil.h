// Shared helpers for the Catch2 tests: temp dirs, running the trainrun binary.
#pragma once
#include <string>
#include <vector>

namespace trainrun::test {

// A fresh empty directory under $TMPDIR (or /tmp), removed at destruction
// unless TRAINRUN_KEEP_TEST_DIRS is set.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "t");
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }
 private:
  std::string path_;
};

struct RunResult {
  int exit_code = -1;      // exit status, or 128+signal
  std::string out;         // stdout
  std::string err;         // stderr
};

// Run a shell command line (through /bin/sh -c), capturing stdout and stderr.
RunResult run_command(const std::string& cmdline);
// Run the trainrun binary with the given argument string (shell syntax).
RunResult run_trainrun(const std::string& args);
std::string trainrun_binary();
std::string source_dir();

void write_file(const std::string& path, const std::string& content);
std::string read_file(const std::string& path);
// The test venv's python (.venv/bin/python) with transformers, safetensors,
// torch and tokenizers. Missing is a FAILURE, not a skip: CI installs it
// (scripts/install-deps.sh --test), and a silently skipped cross-check
// proves nothing.
std::string hf_python();
// Norm-wise relative error ||got - ref|| / ||ref|| in double (robust to
// tiny entries); sizes must match.
double rel_err(const std::vector<float>& got, const std::vector<float>& ref);
bool file_exists(const std::string& path);

}  // namespace trainrun::test
