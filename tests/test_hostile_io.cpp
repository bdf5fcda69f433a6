// Storage that refuses what a local disk allows, and files written to cost
// memory or time (issue #30): each must end in a clear error, or work, in
// seconds and without the memory the file asks for.
//  - A filesystem without fallocate (NFSv3, BeeGFS class), as an LD_PRELOAD
//    shim (tests/support/no_fallocate_shim.c) in a real job: checkpoints
//    and final weights are still written, and verify.
//  - A checkpoint manifest whose segment claims 2^60 runs: verify, export
//    and resume refuse it at once, naming the file.
//  - A tokenizer.json with a token id of 2^31 - 1 (which HF's tokenizers
//    loads): refused before any table is sized.
//  - `generate` on an HF directory of a 70B Llama (sparse files, headers
//    only): refused from config.json, naming the GiB needed and available.
//  - `export` reads and verifies the model file only: a damaged optimizer
//    file does not stop it, a damaged model file does.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/hf_interop.h"
#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/data/tokenizer/tokenizer.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using json = nlohmann::json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A 6-step run of the checkpoint tests' job (tests/support/checkpoint_jobs.h)
// at one rank with checkpoints at steps 3 and 6, in this process.
std::string small_run_with_checkpoints(const test::TempDir& dir) {
  const std::string run = dir / "run";
  test::run_ranks_inprocess(
      test::checkpoint_job(run, "full_shard", 1, {"train.max_steps=6", "checkpoint.interval=3"}), 1);
  REQUIRE(test::latest_of(run) == "step_00000006");
  return run;
}

// Flips one byte at `from_end` bytes before the end of `path`.
void flip_byte_from_end(const std::string& path, off_t from_end) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const off_t at = ::lseek(fd, 0, SEEK_END) - from_end;
  unsigned char b = 0;
  REQUIRE(::pread(fd, &b, 1, at) == 1);
  b ^= 0x5a;
  REQUIRE(::pwrite(fd, &b, 1, at) == 1);
  ::close(fd);
}

}  // namespace

// Under the shim, fallocate(2) fails with EOPNOTSUPP and posix_fallocate with
// EBADF (glibc's emulation on a write-only descriptor). Before, the code used
// posix_fallocate and fell back to truncate only on EINVAL/EOPNOTSUPP, so
// every checkpoint and the final weights failed ("cannot allocate").
TEST_CASE("hostile storage: without fallocate (NFSv3, BeeGFS) checkpoints and final weights are written sparse",
          "[storage]") {
  test::TempDir dir("nofalloc");
  const std::string run = dir / "run", log = dir / "shim.log";
  test::write_file(dir / "job.yaml", test::checkpoint_job_yaml(run, "full_shard", "checkpoint: {interval: 3}\n"));
  const test::RunResult r = test::run_command(
      "OMP_NUM_THREADS=1 TRAINRUN_SHIM_LOG='" + log + "' LD_PRELOAD='" + std::string(TRAINRUN_NO_FALLOCATE_SHIM) +
      "' '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
      "' --set train.max_steps=6 --set parallel.nproc_per_node=2");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // The shim was in the processes that laid the files out: the binary
  // asked it (and was refused) rather than some other path.
  CHECK_THAT(test::read_file(log), Contains("fallocate"));
  CHECK(test::latest_of(run) == "step_00000006");
  for (const char* step : {"step_00000003", "step_00000006"}) {
    INFO(step);
    CHECK(Checkpointer::verify(run + "/checkpoints/" + step) == "");
  }
  const std::vector<float> w = test::weights_of(run);
  const JobSpec job = test::checkpoint_job(run, "full_shard", 2);
  CHECK(int64_t(w.size()) == make_model_arch(ModelConfig::from_spec(job.model))->layout().total);
}

// The nvme offload file (4 x the shard's state, 100+ GB a rank at 70B) is
// sized with fallocate(2) and made sparse where that is refused. Before, it
// used posix_fallocate, whose glibc emulation on such a filesystem writes
// every 4 KiB block of it, one syscall each (the shim would have logged
// "posix_fallocate").
TEST_CASE("hostile storage: without fallocate the nvme offload file is made sparse, never block by block",
          "[storage][offload]") {
  test::TempDir dir("nofalloc_nvme");
  const std::string run = dir / "run", log = dir / "shim.log", off = dir / "offload";
  std::filesystem::create_directories(off);
  test::write_file(dir / "job.yaml", test::checkpoint_job_yaml(run, "full_shard", ""));
  const test::RunResult r = test::run_command(
      "OMP_NUM_THREADS=1 TRAINRUN_SHIM_LOG='" + log + "' LD_PRELOAD='" + std::string(TRAINRUN_NO_FALLOCATE_SHIM) +
      "' '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
      "' --set train.max_steps=2 --set parallel.nproc_per_node=2 --set parallel.offload=nvme --set "
      "parallel.offload_dir='" + off + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err + test::read_file(run + "/logs/rank0.log"), Contains("nvme state under"));
  const std::string calls = test::read_file(log);
  CHECK_THAT(calls, Contains("fallocate"));
  CHECK_THAT(calls, !Contains("posix_fallocate"));
  CHECK(test::weights_of(run).size() > 0);
}

// The last segment (by offset) of model.safetensors made to claim 2^60 runs
// of its bytes. Before, the tiling check walked the runs one by one past
// the end of the file: verify, export and resume hung.
TEST_CASE("hostile files: a manifest segment with 2^60 runs is refused at once by verify, export and resume",
          "[checkpoint][hostile]") {
  test::TempDir dir("hugereps");
  const std::string run = small_run_with_checkpoints(dir);
  const std::string ck = run + "/checkpoints/step_00000006";
  json m = json::parse(test::read_file(ck + "/manifest.json"));
  json& segs = m["files"]["model.safetensors"]["segments"];
  REQUIRE(segs.size() >= 1);
  size_t last = 0;
  for (size_t i = 0; i < segs.size(); ++i)
    if (segs[i]["offset"].get<uint64_t>() > segs[last]["offset"].get<uint64_t>()) last = i;
  segs[last]["reps"] = uint64_t(1) << 60;
  segs[last]["stride"] = segs[last]["bytes"];
  test::write_file(ck + "/manifest.json", m.dump(1));

  auto t0 = Clock::now();
  CHECK_THAT(Checkpointer::verify(ck), Contains("the segments of model.safetensors do not tile the file") &&
                                           Contains("1152921504606846976 runs") && Contains("ends past the file's"));
  CHECK(seconds_since(t0) < 5);

  t0 = Clock::now();
  const test::RunResult e = test::run_trainrun("export --checkpoint '" + ck + "' --out '" + dir / "hf" + "'");
  CHECK(e.exit_code != 0);
  CHECK_THAT(e.err, Contains(ck) && Contains("model.safetensors do not tile the file"));
  CHECK(seconds_since(t0) < 20);

  t0 = Clock::now();
  const auto out = test::run_ranks_inprocess_outcomes(
      test::checkpoint_job(run, "full_shard", 1, {"train.max_steps=9", "checkpoint.resume=" + ck}), 1);
  REQUIRE(out.size() == 1);
  CHECK_THAT(out[0].error, Contains("checkpoint.resume") && Contains("model.safetensors do not tile the file"));
  CHECK(seconds_since(t0) < 20);
}

// Before, export verified every file of the checkpoint: at 70B it read the
// 847 GB of optimizer state to write the 282 GB model, and refused a
// checkpoint whose optimizer file alone was damaged.
TEST_CASE("hostile files: export verifies the model file it reads, not the optimizer file", "[checkpoint][export]") {
  test::TempDir dir("expverify");
  const std::string run = small_run_with_checkpoints(dir);
  const std::string ck = run + "/checkpoints/step_00000006";
  flip_byte_from_end(ck + "/optimizer.safetensors", 5);
  REQUIRE_THAT(Checkpointer::verify(ck), Contains("optimizer.safetensors: checksum mismatch"));
  const test::RunResult ok = test::run_trainrun("export --checkpoint '" + ck + "' --out '" + dir / "hf" + "'");
  INFO(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(test::file_exists(dir / "hf/model.safetensors"));

  flip_byte_from_end(ck + "/model.safetensors", 5);
  const test::RunResult bad = test::run_trainrun("export --checkpoint '" + ck + "' --out '" + dir / "hf2" + "'");
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.err, Contains("is damaged") && Contains("model.safetensors: checksum mismatch"));
  CHECK_FALSE(test::file_exists(dir / "hf2/model.safetensors"));
}

// HF's tokenizers loads a vocab or added token with id 2^31 - 1 (its tables
// are hash maps); ours are dense, and before this check the load asked for
// 2^31 table entries (~66 GiB) and died of std::bad_alloc, or worse.
TEST_CASE("hostile files: a tokenizer id of 2^31 - 1 is refused before any table is sized", "[tokenizer][hostile]") {
  test::TempDir dir("tokhuge");
  const std::string base = dir / "base.json";
  // A byte-level BPE with the 256 byte symbols, "hi" and one merge, from
  // HF's tokenizers; then each hostile variant must still load there.
  const std::string script = dir / "make.py";
  test::write_file(script, R"PY(
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
vocab = {c: i for i, c in enumerate(alpha)}
vocab["hi"] = len(vocab)
tok = Tokenizer(models.BPE(vocab, [("h", "i")]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.save(sys.argv[1])
for path in sys.argv[2:]:
    Tokenizer.from_file(path)  # the reference loads the hostile files
    print("loaded", path)
)PY");
  test::RunResult r = test::run_command("'" + test::hf_python() + "' '" + script + "' '" + base + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE_NOTHROW(Tokenizer::load(base));

  const uint64_t huge = (uint64_t(1) << 31) - 1;
  json in_vocab = json::parse(test::read_file(base));
  in_vocab["model"]["vocab"]["hi"] = huge;
  json added = json::parse(test::read_file(base));
  added["added_tokens"] = json::array({{{"id", huge}, {"content", "<|huge|>"}, {"single_word", false},
                                        {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                        {"special", true}}});
  test::write_file(dir / "vocab.json", in_vocab.dump());
  test::write_file(dir / "added.json", added.dump());
  r = test::run_command("'" + test::hf_python() + "' '" + script + "' '" + dir / "unused.json" + "' '" +
                        dir / "vocab.json" + "' '" + dir / "added.json" + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);

  for (const auto& [file, key] : {std::pair<std::string, std::string>{"vocab.json", "model.vocab[\"hi\"]"},
                                  {"added.json", "added_tokens[0].id"}}) {
    INFO(file);
    const auto t0 = Clock::now();
    REQUIRE_THROWS_WITH(Tokenizer::load(dir / file),
                        Contains(dir / file) && Contains(key) && Contains("id 2147483647 is above the 4194303") &&
                            Contains("66.0 GiB for this one"));
    CHECK(seconds_since(t0) < 2);
  }
}

// A Llama-3 70B directory: config.json and one model.safetensors whose
// header lists every tensor (bf16) and whose data is a hole (sparse: no
// disk). Before, generate mapped it and asked for 282 GB of fp32 at once.
TEST_CASE("hostile files: generate on a 70B HF directory says how much memory it needs instead of loading it",
          "[generate][hostile]") {
  test::TempDir dir("gen70b");
  const std::string hf = dir / "llama70b";
  fs::create_directories(hf);
  test::write_file(hf + "/config.json", json{{"architectures", {"LlamaForCausalLM"}},
                                             {"model_type", "llama"},
                                             {"hidden_size", 8192},
                                             {"intermediate_size", 28672},
                                             {"num_hidden_layers", 80},
                                             {"num_attention_heads", 64},
                                             {"num_key_value_heads", 8},
                                             {"vocab_size", 128256},
                                             {"max_position_embeddings", 8192},
                                             {"rms_norm_eps", 1e-5},
                                             {"rope_theta", 500000.0},
                                             {"hidden_act", "silu"},
                                             {"tie_word_embeddings", false},
                                             {"torch_dtype", "bfloat16"}}
                                            .dump(2));
  const std::unique_ptr<ModelArch> arch = make_model_arch(read_hf_model_config(hf, "test"));
  std::vector<SafeTensorEntry> entries;
  uint64_t data = 0;
  for (const auto& t : arch->layout().tensors) {
    const HfTensor h = arch->hf_tensor(t);
    const std::vector<int64_t> shape = h.transposed ? std::vector<int64_t>{t.shape[1], t.shape[0]} : t.shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    entries.push_back({h.name, "BF16", shape, uint64_t(n) * 2});
    data += uint64_t(n) * 2;
  }
  const std::string header = encode_safetensors_header(entries, {{"format", "pt"}});
  test::write_file(hf + "/model.safetensors", header);
  REQUIRE(::truncate((hf + "/model.safetensors").c_str(), off_t(header.size() + data)) == 0);
  const int64_t params = arch->layout().total;
  REQUIRE(params > 70'000'000'000);

  // 12 bytes per parameter: the fp32 weights, the CPU backend's copy and its staging.
  char needed[64];
  std::snprintf(needed, sizeof needed, "%.1f GiB are needed", double(params) * 12 / double(uint64_t(1) << 30));
  const auto t0 = Clock::now();
  const test::RunResult r = test::run_trainrun("generate --checkpoint '" + hf + "' --prompt '1 2 3' --max-tokens 1");
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("generate: '" + hf + "' is a llama") && Contains("12.0 bytes per parameter") &&
                        Contains(needed) && Contains("GiB are available"));
  CHECK(seconds_since(t0) < 20);
}
