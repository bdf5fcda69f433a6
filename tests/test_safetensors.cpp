// safetensors reader/writer: round trips, every corruption the reader must
// name, and a cross-check against the real `safetensors` Python package (so
// "we can read what we write" is not the only evidence that the format is
// right).
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/io/safetensors.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
namespace fs = std::filesystem;

namespace {

template <typename T>
SafeTensor typed(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                 const std::vector<T>& v) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  REQUIRE(static_cast<int64_t>(v.size()) == n);
  REQUIRE(safetensors_dtype_size(dtype) == sizeof(T));
  return make_tensor(name, dtype, std::move(shape), v.data());
}

template <typename T>
std::vector<T> values(const SafeTensor& t) {
  REQUIRE(t.data.size() % sizeof(T) == 0);
  std::vector<T> v(t.data.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// Runs fn, requires a trainrun::Error whose message names the path and
// contains `problem`.
template <typename Fn>
void require_error(Fn&& fn, const std::string& path, const std::string& problem) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(problem) != std::string::npos);
    return;
  }
  FAIL("expected trainrun::Error containing '" << problem << "'");
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}
// A hand-made file: length prefix + header + data, for corruption tests.
std::string raw_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// The venv with the real safetensors package. Missing is a FAILURE, not a
// skip: CI installs it, and a silently skipped cross-check proves nothing.
std::string venv_python() {
  std::string py = source_dir() + "/.venv/bin/python";
  if (!file_exists(py) || run_command("'" + py + "' -c 'import safetensors, numpy'").exit_code != 0)
    FAIL("the Python safetensors package is not available (looked for " << py
         << " able to `import safetensors, numpy`); run scripts/install-deps.sh --test to create the venv");
  return py;
}

SafeTensorFile sample_file() {
  SafeTensorFile f;
  f.metadata = {{"n_layer", "2"}, {"format", "pt"}, {"note", "h\xc3\xa9llo \"quoted\" {json}"}};
  std::vector<float> f32(24);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = 0.25f * static_cast<float>(i) - 2.0f;
  f.tensors.push_back(make_f32_tensor("transformer.wte.weight", {4, 6}, f32.data()));
  f.tensors.push_back(typed<double>("f64", "F64", {3}, {1.5, -1e300, 3.141592653589793}));
  f.tensors.push_back(typed<uint16_t>("f16", "F16", {2, 2}, {0x3c00, 0xc000, 0x3555, 0x7bff}));  // 1,-2,~1/3,65504
  f.tensors.push_back(typed<uint16_t>("bf16", "BF16", {3}, {0x3f80, 0xc000, 0x3eab}));         // 1,-2,~0.333984
  f.tensors.push_back(typed<int64_t>("i64", "I64", {2}, {-(int64_t(1) << 40), 7}));
  f.tensors.push_back(typed<int32_t>("i32", "I32", {2, 3}, {-1, 0, 1, 2, 2147483647, -2147483647 - 1}));
  f.tensors.push_back(typed<int16_t>("i16", "I16", {2}, {-32768, 32767}));
  f.tensors.push_back(typed<int8_t>("i8", "I8", {3}, {-128, 0, 127}));
  f.tensors.push_back(typed<uint8_t>("u8", "U8", {5}, {0, 1, 2, 254, 255}));  // odd size: exercises unaligned offsets
  f.tensors.push_back(typed<uint16_t>("u16", "U16", {2}, {0, 65535}));
  f.tensors.push_back(typed<uint32_t>("u32", "U32", {2}, {0, 4294967295u}));
  f.tensors.push_back(typed<uint8_t>("bool", "BOOL", {3}, {1, 0, 1}));
  float scalar = 3.5f;
  f.tensors.push_back(make_f32_tensor("scalar", {}, &scalar));
  f.tensors.push_back(make_f32_tensor("empty", {0, 4}, nullptr));
  return f;
}

void require_same(const SafeTensorFile& a, const SafeTensorFile& b) {
  REQUIRE(a.metadata == b.metadata);
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    INFO("tensor " << a.tensors[i].name);
    CHECK(a.tensors[i].name == b.tensors[i].name);
    CHECK(a.tensors[i].dtype == b.tensors[i].dtype);
    CHECK(a.tensors[i].shape == b.tensors[i].shape);
    CHECK(a.tensors[i].data == b.tensors[i].data);
  }
}

}  // namespace

TEST_CASE("safetensors: round trip keeps metadata, every dtype, file order", "[safetensors]") {
  TempDir dir("st");
  const std::string path = dir / "model.safetensors";
  SafeTensorFile in = sample_file();
  write_safetensors(path, in);
  SafeTensorFile out = read_safetensors(path);
  require_same(in, out);

  CHECK(out.find("i32") != nullptr);
  CHECK(out.find("nope") == nullptr);
  CHECK(out.find("scalar")->numel() == 1);
  CHECK(out.find("empty")->numel() == 0);
  CHECK(out.find("empty")->as_f32().empty());
  CHECK(values<int64_t>(*out.find("i64"))[0] == -(int64_t(1) << 40));

  // The header is space-padded so the data area starts 8-byte aligned, and
  // the atomic write leaves no temp file behind.
  std::string bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  CHECK(n % 8 == 0);
  CHECK(bytes[8] == '{');
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) { (void)e; ++files; }
  CHECK(files == 1);

  // Overwriting replaces the file as a whole.
  SafeTensorFile small;
  float one = 1.0f;
  small.tensors.push_back(make_f32_tensor("x", {1}, &one));
  write_safetensors(path, small);
  require_same(small, read_safetensors(path));

  // A file with no tensors and no metadata is valid ("{}" padded).
  write_safetensors(dir / "empty.safetensors", SafeTensorFile{});
  SafeTensorFile none = read_safetensors(dir / "empty.safetensors");
  CHECK(none.tensors.empty());
  CHECK(none.metadata.empty());
}

TEST_CASE("safetensors: as_f32 converts F32, BF16, F16 (and F64)", "[safetensors]") {
  SafeTensorFile f = sample_file();
  std::vector<float> w = f.find("transformer.wte.weight")->as_f32();
  REQUIRE(w.size() == 24);
  CHECK(w[0] == -2.0f);
  CHECK(w[23] == 0.25f * 23 - 2.0f);

  std::vector<float> bf = f.find("bf16")->as_f32();
  CHECK(bf == std::vector<float>{1.0f, -2.0f, 0.333984375f});

  std::vector<float> h = f.find("f16")->as_f32();
  CHECK(h == std::vector<float>{1.0f, -2.0f, 0.333251953125f, 65504.0f});
  // F16 edge cases: subnormals, signed zero, infinities, NaN.
  SafeTensor edge = typed<uint16_t>("e", "F16", {6}, {0x0001, 0x03ff, 0x8000, 0x7c00, 0xfc00, 0x7e00});
  std::vector<float> e = edge.as_f32();
  CHECK(e[0] == std::ldexp(1.0f, -24));
  CHECK(e[1] == std::ldexp(1023.0f, -24));
  CHECK(e[2] == 0.0f);
  CHECK(std::signbit(e[2]));
  CHECK(e[3] == std::numeric_limits<float>::infinity());
  CHECK(e[4] == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(e[5]));

  std::vector<float> d = f.find("f64")->as_f32();
  CHECK(d[0] == 1.5f);
  CHECK(d[2] == static_cast<float>(3.141592653589793));

  try {
    (void)f.find("i32")->as_f32();
    FAIL("as_f32 on I32 should throw");
  } catch (const Error& err) {
    CHECK(std::string(err.what()).find("'i32' has dtype I32") != std::string::npos);
  }
}

TEST_CASE("safetensors: the writer rejects bad tensors and unwritable paths", "[safetensors]") {
  TempDir dir("stw");
  const std::string path = dir / "w.safetensors";
  float v[4] = {1, 2, 3, 4};

  SECTION("data size does not match the shape") {
    SafeTensorFile f;
    f.tensors.push_back(make_f32_tensor("a", {4}, v));
    f.tensors[0].shape = {5};
    require_error([&] { write_safetensors(path, f); }, path, "has shape [5] of F32 (20 bytes) but holds 16 bytes");
  }
  SECTION("duplicate names") {
    SafeTensorFile f;
    f.tensors.push_back(make_f32_tensor("a", {4}, v));
    f.tensors.push_back(make_f32_tensor("a", {4}, v));
    require_error([&] { write_safetensors(path, f); }, path, "tensor name 'a' appears twice");
  }
  SECTION("unknown dtype") {
    SafeTensorFile f;
    f.tensors.push_back(make_f32_tensor("a", {4}, v));
    f.tensors[0].dtype = "F8_E4M3";
    require_error([&] { write_safetensors(path, f); }, path, "unknown dtype 'F8_E4M3'");
  }
  SECTION("directory does not exist") {
    const std::string bad = dir / "no/such/dir/x.safetensors";
    SafeTensorFile f;
    f.tensors.push_back(make_f32_tensor("a", {4}, v));
    require_error([&] { write_safetensors(bad, f); }, bad, "No such file or directory");
  }
  // Nothing was created: validation happens before the temp file.
  CHECK_FALSE(file_exists(path));
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) { (void)e; ++files; }
  CHECK(files == 0);
}

TEST_CASE("safetensors: a failed write leaves the old file intact and no temp file", "[safetensors]") {
  TempDir dir("sto");
  const std::string path = dir / "keep.safetensors";
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  SafeTensorFile good = sample_file();
  write_safetensors(path, good);
  SafeTensorFile other;
  float one = 1.0f;
  other.tensors.push_back(make_f32_tensor("x", {1}, &one));

  SECTION("invalid data") {
    SafeTensorFile bad = good;
    bad.tensors[0].data.pop_back();
    CHECK_THROWS_AS(write_safetensors(path, bad), Error);
  }
  SECTION("the temp file cannot be created") {
    fs::create_directories(tmp);  // open(O_WRONLY) on a directory fails (EISDIR)
    require_error([&] { write_safetensors(path, other); }, path, "cannot create");
    fs::remove(tmp);
  }
  require_same(good, read_safetensors(path));
  CHECK_FALSE(file_exists(tmp));

  SECTION("the rename fails") {
    // The target is a non-empty directory: rename(2) fails after the temp
    // file was fully written; the temp file must be cleaned up.
    const std::string target = dir / "occupied";
    fs::create_directories(target + "/inner");
    require_error([&] { write_safetensors(target, other); }, target, "rename from");
    CHECK_FALSE(file_exists(target + ".tmp." + std::to_string(getpid())));
  }
}

TEST_CASE("safetensors: the reader names every kind of corruption", "[safetensors]") {
  TempDir dir("stc");
  const std::string path = dir / "bad.safetensors";
  auto read = [&] { (void)read_safetensors(path); };
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

  SECTION("missing file") {
    require_error(read, path, "cannot open");
  }
  SECTION("file too short") {
    write_file(path, std::string("\x05\x00\x00", 3));
    require_error(read, path, "file too short (3 bytes");
  }
  SECTION("empty file") {
    write_file(path, "");
    require_error(read, path, "file too short (0 bytes");
  }
  SECTION("header length larger than the file") {
    write_file(path, le64(1000) + "{}");
    require_error(read, path, "header length 1000 is larger than the file (10 bytes)");
  }
  SECTION("header length near 2^64 does not overflow") {
    write_file(path, le64(~uint64_t(0)) + "{}");
    require_error(read, path, "is larger than the file");
  }
  SECTION("JSON parse error") {
    write_file(path, raw_file("{\"a\": {\"dtype\": ", std::string(8, '\0')));
    require_error(read, path, "JSON parse error");
  }
  SECTION("header is not an object") {
    write_file(path, raw_file("[1,2]   ", ""));
    require_error(read, path, "not an object");
  }
  SECTION("unknown dtype") {
    write_file(path, raw_file(R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')));
    require_error(read, path, "tensor 'a': unknown dtype 'F7'");
  }
  SECTION("shape/offset size mismatch") {
    write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(16, '\0')));
    require_error(read, path, "tensor 'a': shape/offset size mismatch: shape [3] of F32 needs 12 bytes but data_offsets [0, 8] span 8");
  }
  SECTION("shape whose byte size overflows") {
    write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""));
    require_error(read, path, "shape/offset size mismatch");
  }
  SECTION("negative shape") {
    write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, '\0')));
    require_error(read, path, "shape entries must be non-negative integers");
  }
  SECTION("offsets outside the data area (truncated file)") {
    std::string good = raw_file("{" + ok_entry + "}", std::string(8, '\0'));
    write_file(path, good.substr(0, good.size() - 3));
    require_error(read, path, "tensor 'a': data_offsets [0, 8] are outside the data area (5 bytes after the header)");
  }
  SECTION("a real file truncated by one byte") {
    write_safetensors(path, sample_file());
    std::string bytes = read_file(path);
    write_file(path, bytes.substr(0, bytes.size() - 1));
    require_error(read, path, "are outside the data area");
  }
  SECTION("begin after end") {
    write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, '\0')));
    require_error(read, path, "end before they begin");
  }
  SECTION("overlapping tensors") {
    write_file(path, raw_file("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              std::string(12, '\0')));
    require_error(read, path, "overlapping tensors 'a' [0, 8) and 'b' [4, 12)");
  }
  SECTION("a tensor nested inside another overlaps too") {
    write_file(path, raw_file(R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},)"
                              R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
                              R"("c":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})",
                              std::string(16, '\0')));
    require_error(read, path, "overlapping tensors 'a' [0, 16) and 'b' [2, 4)");
  }
  SECTION("a tensor named twice") {
    write_file(path, raw_file("{" + ok_entry + "," + ok_entry + "}", std::string(8, '\0')));
    require_error(read, path, "the header names 'a' twice");
  }
  SECTION("missing data_offsets") {
    write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')));
    require_error(read, path, "tensor 'a': 'data_offsets' must be an array [begin, end]");
  }
  SECTION("metadata value that is not a string") {
    write_file(path, raw_file(R"({"__metadata__":{"n_layer":2},)" + ok_entry + "}", std::string(8, '\0')));
    require_error(read, path, "__metadata__ value for 'n_layer' is number, expected a string");
  }
  SECTION("a directory instead of a file") {
    fs::create_directories(path);
    require_error(read, path, "is not a regular file");
  }
}

// A header of 200 MB (over safetensors' 100 MB limit) in a sparse file:
// refused from its length alone, before a byte of it is read. The reader
// runs in a child process whose peak resident set (wait4's ru_maxrss) is
// compared: before the cap, reading it took the header's size and more.
TEST_CASE("safetensors: a header over 100 MB is refused from its length, without reading it", "[safetensors]") {
  TempDir dir("sthuge");
  const std::string path = dir / "huge_header.safetensors";
  const uint64_t n = 200'000'000;
  write_file(path, le64(n) + "{");
  REQUIRE(::truncate(path.c_str(), off_t(8 + n + 8)) == 0);  // sparse: costs no disk
  for (const bool mapped : {false, true}) {
    INFO((mapped ? "MappedSafeTensors" : "read_safetensors"));
    int pipefd[2];
    REQUIRE(::pipe(pipefd) == 0);
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(pipefd[0]);
      std::string msg = "no error";
      try {
        if (mapped) MappedSafeTensors m(path);
        else (void)read_safetensors(path);
      } catch (const std::exception& e) {
        msg = e.what();
      }
      const ssize_t w = ::write(pipefd[1], msg.data(), msg.size());
      ::_exit(w == ssize_t(msg.size()) ? 0 : 1);
    }
    REQUIRE(child > 0);
    ::close(pipefd[1]);
    std::string msg;
    char buf[4096];
    for (ssize_t k; (k = ::read(pipefd[0], buf, sizeof buf)) > 0;) msg.append(buf, size_t(k));
    ::close(pipefd[0]);
    int status = 0;
    struct rusage ru {};
    REQUIRE(::wait4(child, &status, 0, &ru) == child);
    INFO("message: " << msg);
    CHECK(WIFEXITED(status));
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("header length 200000000 bytes is over the 100000000-byte limit") != std::string::npos);
    // The child starts as a copy of this process (a few MB to tens of MB
    // resident); reading the header would add 200 MB.
    struct rusage self {};
    ::getrusage(RUSAGE_SELF, &self);
    CHECK(ru.ru_maxrss < self.ru_maxrss + 50 * 1024);  // KiB
  }
}

TEST_CASE("safetensors: empty tensors share offsets, gaps and trailing bytes are refused, as safetensors does",
          "[safetensors]") {
  // safetensors' reader (Metadata::validate) wants the tensors back to back
  // from offset 0 to the end of the file; empty tensors take no bytes.
  TempDir dir("stg");
  const std::string path = dir / "gap.safetensors";
  auto read = [&] { (void)read_safetensors(path); };
  std::string data(24, '\0');
  float a[2] = {1.5f, -2.0f};
  std::memcpy(&data[16], a, 8);
  write_file(path, raw_file(R"({"y":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},)"
                            R"("z":{"dtype":"F32","shape":[0],"data_offsets":[16,16]},)"
                            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
                            data));
  SafeTensorFile f = read_safetensors(path);
  REQUIRE(f.tensors.size() == 3);
  CHECK(f.tensors[1].name == "z");
  CHECK(f.find("a")->as_f32() == std::vector<float>{1.5f, -2.0f});

  // The first 16 bytes belong to no tensor: a gap before 'a'.
  write_file(path, raw_file(R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[16,16]},)"
                            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})",
                            data));
  require_error(read, path, "a gap of 16 bytes before tensor 'z' (data_offsets [16, 16]");
  CHECK_THROWS_AS(MappedSafeTensors(path), Error);
  // 8 bytes after the last tensor.
  write_file(path, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(16, '\0')));
  require_error(read, path, "8 bytes after the last tensor (the tensors end at 8 of the data area's 16 bytes)");
}

TEST_CASE("safetensors: the Python safetensors package reads what we write", "[safetensors][python]") {
  const std::string py = venv_python();
  TempDir dir("stpy");
  const std::string path = dir / "ours.safetensors";
  SafeTensorFile in = sample_file();

  // numpy has no bfloat16, so safetensors.numpy.load_file reads a copy
  // without the BF16 tensor, and safetensors.torch (Debian's torch, seen
  // through --system-site-packages) reads a file holding it.
  SafeTensorFile np_part = in, bf_part;
  np_part.tensors.clear();
  for (const auto& t : in.tensors) (t.dtype == "BF16" ? bf_part : np_part).tensors.push_back(t);
  bf_part.tensors.push_back(in.tensors[0]);
  const std::string bf_path = dir / "ours_bf16.safetensors";
  write_safetensors(path, np_part);
  write_safetensors(bf_path, bf_part);

  // Dump what Python sees as JSON: dtype, shape and values (as doubles) per
  // tensor, plus the metadata.
  const std::string script = dir / "dump.py";
  write_file(script, R"PY(
import json, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
path, bf_path = sys.argv[1], sys.argv[2]
out = {"tensors": {}, "metadata": None}
with safe_open(path, framework="np") as f:
    out["metadata"] = f.metadata()
for n, a in load_file(path).items():
    out["tensors"][n] = {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.astype(np.float64).flatten().tolist()}
import torch
from safetensors.torch import load_file as load_torch
for n, t in load_torch(bf_path).items():
    if t.dtype == torch.bfloat16:
        out["tensors"][n] = {"dtype": "bfloat16", "shape": list(t.shape), "values": t.double().flatten().tolist()}
json.dump(out, sys.stdout)
)PY");
  RunResult r = run_command("'" + py + "' '" + script + "' '" + path + "' '" + bf_path + "'");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  nlohmann::json got = nlohmann::json::parse(r.out);

  CHECK(got["metadata"].get<std::map<std::string, std::string>>() == in.metadata);
  const std::map<std::string, std::string> np_dtype = {
      {"F32", "float32"}, {"F64", "float64"}, {"F16", "float16"}, {"BF16", "bfloat16"}, {"I64", "int64"},
      {"I32", "int32"},   {"I16", "int16"},   {"I8", "int8"},     {"U8", "uint8"},      {"U16", "uint16"},
      {"U32", "uint32"},  {"BOOL", "bool"}};
  REQUIRE(got["tensors"].size() == in.tensors.size());
  for (const auto& t : in.tensors) {
    INFO("tensor " << t.name);
    REQUIRE(got["tensors"].contains(t.name));
    const auto& g = got["tensors"][t.name];
    CHECK(g["dtype"].get<std::string>() == np_dtype.at(t.dtype));
    CHECK(g["shape"].get<std::vector<int64_t>>() == t.shape);
    std::vector<double> expect;
    if (t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16") {
      for (float x : t.as_f32()) expect.push_back(x);
    } else if (t.dtype == "F64") {
      for (double x : values<double>(t)) expect.push_back(x);
    } else if (t.dtype == "I64") {
      for (auto x : values<int64_t>(t)) expect.push_back(static_cast<double>(x));
    } else if (t.dtype == "I32") {
      for (auto x : values<int32_t>(t)) expect.push_back(x);
    } else if (t.dtype == "I16") {
      for (auto x : values<int16_t>(t)) expect.push_back(x);
    } else if (t.dtype == "I8") {
      for (auto x : values<int8_t>(t)) expect.push_back(x);
    } else if (t.dtype == "U16") {
      for (auto x : values<uint16_t>(t)) expect.push_back(x);
    } else if (t.dtype == "U32") {
      for (auto x : values<uint32_t>(t)) expect.push_back(x);
    } else {  // U8, BOOL
      for (auto x : values<uint8_t>(t)) expect.push_back(x);
    }
    // Exact: every value is representable in double on both sides.
    CHECK(g["values"].get<std::vector<double>>() == expect);
  }
}

TEST_CASE("safetensors: we read what the Python safetensors package writes", "[safetensors][python]") {
  const std::string py = venv_python();
  TempDir dir("stpy2");
  const std::string np_path = dir / "numpy.safetensors";
  const std::string pt_path = dir / "torch.safetensors";
  const std::string script = dir / "write.py";
  write_file(script, R"PY(
import sys
import numpy as np
from safetensors.numpy import save_file
t = {
    "w": (np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5 - 1.0),
    "f64": np.array([1.25, -3.5], dtype=np.float64),
    "f16": np.array([1.0, -2.0, 65504.0], dtype=np.float16),
    "i64": np.array([-(1 << 40), 5], dtype=np.int64),
    "i32": np.array([[1, -2], [3, -4]], dtype=np.int32),
    "i16": np.array([-32768, 32767], dtype=np.int16),
    "i8": np.array([-128, 127, 0], dtype=np.int8),
    "u8": np.array([0, 255, 7], dtype=np.uint8),
    "u16": np.array([65535], dtype=np.uint16),
    "u32": np.array([4294967295], dtype=np.uint32),
    "flag": np.array([True, False, True]),
    "scalar": np.array(3.5, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.float32),
}
save_file(t, sys.argv[1], metadata={"n_layer": "2", "note": "written by safetensors.numpy"})
import torch
from safetensors.torch import save_file as save_torch
save_torch({"bf": torch.tensor([1.0, -2.0, 0.333984375], dtype=torch.bfloat16),
            "x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, sys.argv[2], metadata={"k": "v"})
)PY");
  RunResult r = run_command("'" + py + "' '" + script + "' '" + np_path + "' '" + pt_path + "'");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);

  SafeTensorFile f = read_safetensors(np_path);
  CHECK(f.metadata == std::map<std::string, std::string>{{"n_layer", "2"}, {"note", "written by safetensors.numpy"}});
  CHECK(f.tensors.size() == 13);
  const SafeTensor* w = f.find("w");
  REQUIRE(w);
  CHECK(w->dtype == "F32");
  CHECK(w->shape == std::vector<int64_t>{3, 4});
  std::vector<float> wv = w->as_f32();
  for (int i = 0; i < 12; ++i) CHECK(wv[i] == 0.5f * i - 1.0f);
  CHECK(values<double>(*f.find("f64")) == std::vector<double>{1.25, -3.5});
  CHECK(f.find("f16")->as_f32() == std::vector<float>{1.0f, -2.0f, 65504.0f});
  CHECK(values<int64_t>(*f.find("i64")) == std::vector<int64_t>{-(int64_t(1) << 40), 5});
  CHECK(f.find("i32")->shape == std::vector<int64_t>{2, 2});
  CHECK(values<int32_t>(*f.find("i32")) == std::vector<int32_t>{1, -2, 3, -4});
  CHECK(values<int16_t>(*f.find("i16")) == std::vector<int16_t>{-32768, 32767});
  CHECK(values<int8_t>(*f.find("i8")) == std::vector<int8_t>{-128, 127, 0});
  CHECK(values<uint8_t>(*f.find("u8")) == std::vector<uint8_t>{0, 255, 7});
  CHECK(values<uint16_t>(*f.find("u16")) == std::vector<uint16_t>{65535});
  CHECK(values<uint32_t>(*f.find("u32")) == std::vector<uint32_t>{4294967295u});
  CHECK(f.find("flag")->dtype == "BOOL");
  CHECK(values<uint8_t>(*f.find("flag")) == std::vector<uint8_t>{1, 0, 1});
  CHECK(f.find("scalar")->shape.empty());
  CHECK(f.find("scalar")->as_f32() == std::vector<float>{3.5f});
  CHECK(f.find("empty")->shape == std::vector<int64_t>{0, 4});
  CHECK(f.find("empty")->data.empty());

  SafeTensorFile t = read_safetensors(pt_path);
  CHECK(t.metadata == std::map<std::string, std::string>{{"k", "v"}});
  CHECK(t.find("bf")->dtype == "BF16");
  CHECK(t.find("bf")->as_f32() == std::vector<float>{1.0f, -2.0f, 0.333984375f});
  CHECK(t.find("x")->as_f32() == std::vector<float>{0, 1, 2, 3, 4, 5});

  // And our writer re-emits what we read byte-for-byte in content.
  write_safetensors(dir / "again.safetensors", f);
  require_same(f, read_safetensors(dir / "again.safetensors"));
}
