#include "tests/support/testutil.h"

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

namespace fs = std::filesystem;

namespace trainrun::test {

TempDir::TempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string root = base && *base ? base : "/tmp";
  std::random_device rd;
  for (int i = 0; i < 100; ++i) {
    std::string p = root + "/trainrun-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(rd() % 1000000);
    if (fs::create_directories(p)) { path_ = p; return; }
  }
  throw std::runtime_error("cannot create a temp dir under " + root);
}

TempDir::~TempDir() {
  if (std::getenv("TRAINRUN_KEEP_TEST_DIRS")) return;
  std::error_code ec;
  fs::remove_all(path_, ec);
}

static std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

RunResult run_command(const std::string& cmdline) {
  TempDir tmp("cmd");
  std::string out = tmp / "stdout", err = tmp / "stderr";
  std::string full = "(" + cmdline + ") >'" + out + "' 2>'" + err + "' </dev/null";
  int st = std::system(full.c_str());
  RunResult r;
  if (st == -1) r.exit_code = -1;
  else if (WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  else if (WIFSIGNALED(st)) r.exit_code = 128 + WTERMSIG(st);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

std::string trainrun_binary() {
  const char* env = std::getenv("TRAINRUN_BINARY");
  return env && *env ? env : TRAINRUN_BINARY;
}
std::string source_dir() { return TRAINRUN_SOURCE_DIR; }

RunResult run_trainrun(const std::string& args) { return run_command("'" + trainrun_binary() + "' " + args); }

void write_file(const std::string& path, const std::string& content) {
  fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  std::ofstream f(path, std::ios::binary);
  f << content;
  if (!f) throw std::runtime_error("cannot write " + path);
}
std::string read_file(const std::string& path) { return slurp(path); }
bool file_exists(const std::string& path) { return fs::exists(path); }

std::string hf_python() {
  static const std::string checked = [] {
    const std::string py = source_dir() + "/.venv/bin/python";
    if (!file_exists(py) ||
        run_command("'" + py + "' -c 'import transformers, safetensors, torch, tokenizers'").exit_code != 0)
      return std::string();
    return py;
  }();
  if (checked.empty())
    FAIL("transformers is not available (looked for " << source_dir() << "/.venv/bin/python able to `import "
         "transformers, safetensors, torch, tokenizers`); run scripts/install-deps.sh --test");
  return checked;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size())
    throw std::runtime_error("rel_err: " + std::to_string(got.size()) + " values against " +
                             std::to_string(ref.size()));
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace trainrun::test
