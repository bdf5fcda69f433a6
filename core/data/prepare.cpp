// `trainrun prepare`: byte-level tokenisation of text into llm.c shards, and
// the shard writer it shares with the tests.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <vector>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/dataset.h"
#include "core/data/llmc_format.h"
#include "core/data/prepare_common.h"

namespace fs = std::filesystem;

namespace trainrun {
namespace prep {

// Writes to a temp name and renames, so a crash or a full disk never leaves
// a truncated shard under the final name for a later job to pick up.
void write_shard_file(const std::string& path, const void* tokens, int64_t ntok, int version) {
  TR_CHECK(ntok <= INT32_MAX, "cannot write '", path, "': ", ntok,
           " tokens exceed the llm.c header's int32 count; write smaller shards");
  int32_t header[llmc::kHeaderInts] = {};
  header[0] = version == llmc::kVersionU16 ? llmc::kMagicU16 : llmc::kMagicU32;
  header[1] = version;
  header[2] = static_cast<int32_t>(ntok);
  const size_t tok_bytes = version == llmc::kVersionU16 ? 2 : 4;
  // One buffer (header + tokens) through the one atomic writer: shards are
  // at most a few hundred MB, and the writer's checks stay in one place.
  std::vector<char> buf(sizeof header + size_t(ntok) * tok_bytes);
  std::memcpy(buf.data(), header, sizeof header);
  if (ntok > 0) std::memcpy(buf.data() + sizeof header, tokens, size_t(ntok) * tok_bytes);
  write_file_atomic(path, buf.data(), buf.size(), true);
}

void write_file_atomic(const std::string& path, const void* data, size_t bytes, bool commit) {
  std::string tmp = commit ? path + ".tmp." + std::to_string(::getpid()) : path;
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) TR_FAIL("cannot create '", tmp, "': ", detail::errno_string(), "; check that the directory is writable");
  bool ok = bytes == 0 || std::fwrite(data, 1, bytes, f) == bytes;
  ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  std::string err = ok ? "" : detail::errno_string();
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = detail::errno_string();
  }
  if (!ok) {
    std::remove(tmp.c_str());
    TR_FAIL("cannot write '", path, "': ", err, " (is the disk full?)");
  }
  if (commit && std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = detail::errno_string();
    std::remove(tmp.c_str());
    TR_FAIL("cannot rename '", tmp, "' to '", path, "': ", err);
  }
}

std::string shard_name(const std::string& prefix, int index) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s_%06d.bin", prefix.c_str(), index);
  return buf;
}

int remove_stale_shards(const std::string& dir, const std::set<std::string>& keep) {
  static const std::regex shard_re("(train|val)_[0-9]{6}\\.(bin|mask)");
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (std::regex_match(name, shard_re) && !keep.count(name) && fs::remove(e.path(), ec)) ++removed;
  }
  return removed;
}

// A NUL byte in the first 4 KiB is what grep and git use to call a file binary.
bool looks_binary(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char buf[4096];
  f.read(buf, sizeof buf);
  return std::memchr(buf, 0, static_cast<size_t>(f.gcount())) != nullptr;
}

// Inputs in the order given, each directory's files sorted by path.
std::vector<std::string> collect_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    auto st = fs::status(in, ec);
    if (ec || !fs::exists(st))
      TR_FAIL("--input: '", in, "' does not exist; pass text files or directories of text files");
    if (fs::is_directory(st)) {
      std::vector<std::string> found;
      fs::recursive_directory_iterator it(in, ec), end;
      for (; !ec && it != end; it.increment(ec))
        if (it->is_regular_file(ec)) found.push_back(it->path().string());
      if (ec) TR_FAIL("--input: cannot walk directory '", in, "': ", ec.message());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(st)) {
      files.push_back(in);
    } else {
      TR_FAIL("--input: '", in, "' is neither a regular file nor a directory");
    }
  }
  return files;
}

void prepare_output_dir(const std::string& dir) {
  TR_CHECK(!dir.empty(), "--output: no output directory given");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    TR_FAIL("--output: cannot create directory '", dir, "': ", ec ? ec.message() : "a file of that name exists",
            "; choose another --output");
  std::string probe = dir + "/.trainrun-write-test." + std::to_string(::getpid());
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    TR_FAIL("--output: directory '", dir, "' is not writable: ", detail::errno_string(),
            "; fix its permissions or choose another --output");
  ::close(fd);
  ::unlink(probe.c_str());
}

std::string shard_range(const std::vector<std::string>& names) {
  if (names.empty()) return "no shard";
  if (names.size() == 1) return "1 shard (" + names[0] + ")";
  return std::to_string(names.size()) + " shards (" + names.front() + " .. " + names.back() + ")";
}

InputSet select_text_files(const std::vector<std::string>& inputs) {
  InputSet in;
  std::vector<std::string> candidates = collect_inputs(inputs);
  std::set<std::string> seen;
  int empty = 0;
  for (const auto& p : candidates) {
    std::error_code ec;
    std::string canon = fs::weakly_canonical(p, ec).string();
    // Symlinks (fortunes' *.u8 -> *) and repeated inputs would duplicate text.
    if (!seen.insert(ec ? p : canon).second) { ++in.duplicates; continue; }
    if (fs::file_size(p, ec) == 0 && !ec) { ++empty; continue; }
    if (looks_binary(p)) in.binary.push_back(p);
    else in.texts.push_back(p);
  }
  if (!in.binary.empty()) {
    std::string list;
    for (size_t i = 0; i < in.binary.size() && i < 5; ++i) list += (i ? ", " : "") + in.binary[i];
    if (in.binary.size() > 5) list += ", ...";
    TR_LOG_INFO("prepare: skipped ", in.binary.size(), " binary file", in.binary.size() == 1 ? "" : "s",
                " (NUL byte in the first 4 KiB): ", list);
  }
  if (in.duplicates) TR_LOG_INFO("prepare: skipped ", in.duplicates, " duplicate path(s) (symlinks or repeated inputs)");
  if (in.texts.empty())
    TR_FAIL("--input: no text found in ", candidates.size(), " file(s) (", in.binary.size(), " binary, ", empty,
            " empty); pass text files or directories that contain text");
  return in;
}

}  // namespace prep

namespace {
using namespace prep;

// Accumulates byte tokens and writes a shard each time shard_tokens are full.
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string prefix, int64_t shard_tokens)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), cap_(shard_tokens) {}
  void add(const unsigned char* p, int64_t n) {
    while (n > 0) {
      int64_t take = std::min<int64_t>(n, cap_ - static_cast<int64_t>(buf_.size()));
      buf_.insert(buf_.end(), p, p + take);  // widening uint8 -> uint16
      p += take;
      n -= take;
      tokens_ += take;
      if (static_cast<int64_t>(buf_.size()) == cap_) flush();
    }
  }
  void finish() {
    if (!buf_.empty()) flush();
  }
  int64_t tokens() const { return tokens_; }
  const std::vector<std::string>& written() const { return written_; }

 private:
  void flush() {
    std::string name = shard_name(prefix_, static_cast<int>(written_.size()));
    write_shard_file(dir_ + "/" + name, buf_.data(), static_cast<int64_t>(buf_.size()), llmc::kVersionU16);
    written_.push_back(name);
    buf_.clear();
  }
  std::string dir_, prefix_;
  int64_t cap_;
  std::vector<uint16_t> buf_;
  std::vector<std::string> written_;
  int64_t tokens_ = 0;
};

}  // namespace

void write_llmc_shard(const std::string& path, const std::vector<uint32_t>& tokens, int version) {
  if (version == llmc::kVersionU16) {
    std::vector<uint16_t> narrow(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      TR_CHECK(tokens[i] <= 0xFFFF, "cannot write '", path, "': token ", tokens[i], " at index ", i,
               " does not fit uint16 (llm.c version 1); use version 7 (uint32)");
      narrow[i] = static_cast<uint16_t>(tokens[i]);
    }
    write_shard_file(path, narrow.data(), static_cast<int64_t>(narrow.size()), version);
  } else if (version == llmc::kVersionU32) {
    write_shard_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), version);
  } else {
    TR_FAIL("cannot write '", path, "': llm.c shard version ", version, " is not supported (1 = uint16, 7 = uint32)");
  }
}

std::string prepare_byte_shards(const PrepareOptions& opts) {
  const double f = opts.val_fraction;
  TR_CHECK(f >= 0.0 && f <= 0.5, "--val-fraction: ", f,
           " is outside [0, 0.5]; it is the fraction of each input's bytes kept for validation (e.g. 0.01)");
  TR_CHECK(opts.shard_tokens > 0 && opts.shard_tokens <= INT32_MAX, "prepare: shard size ", opts.shard_tokens,
           " tokens must be in [1, ", INT32_MAX, "]");
  TR_CHECK(!opts.inputs.empty(), "--input: no input given; pass text files or directories");

  const InputSet in = select_text_files(opts.inputs);
  const std::vector<std::string>& texts = in.texts;
  const std::vector<std::string>& binary = in.binary;
  const int duplicates = in.duplicates;

  prepare_output_dir(opts.output_dir);
  ShardWriter train(opts.output_dir, "train", opts.shard_tokens), val(opts.output_dir, "val", opts.shard_tokens);
  std::vector<unsigned char> chunk(1 << 20);
  for (const auto& p : texts) {
    std::error_code ec;
    int64_t n = static_cast<int64_t>(fs::file_size(p, ec));
    if (ec) TR_FAIL("--input: cannot stat '", p, "': ", ec.message());
    // ceil keeps val non-empty for every non-empty input when f > 0.
    int64_t nval = static_cast<int64_t>(std::ceil(static_cast<double>(n) * f));
    int64_t ntrain = n - nval, pos = 0;
    std::ifstream in(p, std::ios::binary);
    if (!in) TR_FAIL("--input: cannot open '", p, "': ", detail::errno_string());
    while (pos < n) {
      in.read(reinterpret_cast<char*>(chunk.data()), static_cast<std::streamsize>(std::min<int64_t>(n - pos, chunk.size())));
      int64_t got = in.gcount();
      if (got <= 0) TR_FAIL("--input: '", p, "' ended after ", pos, " of ", n, " bytes; did it change while being read?");
      int64_t to_train = std::clamp<int64_t>(ntrain - pos, 0, got);
      train.add(chunk.data(), to_train);
      val.add(chunk.data() + to_train, got - to_train);
      pos += got;
    }
  }
  train.finish();
  val.finish();
  TR_CHECK(train.tokens() > 0, "--input: the inputs hold only ", val.tokens(),
           " bytes, all of which went to validation; pass more text or lower --val-fraction");

  // Replaces a tokenizer run's record, which would describe other shards:
  // these are bytes (no tokenizer), one token per byte of text, so a job's
  // val loss converts to bits per byte (prepare_meta.h). No shard records or
  // vocab_size: the ids are scanned at open, and any model vocab >= their
  // largest id reads them.
  const nlohmann::json meta = {{"tokenizer", ""},
                               {"format", "text"},
                               {"train_tokens", train.tokens()},
                               {"val_tokens", val.tokens()},
                               {"val_bytes", val.tokens()}};
  const std::string meta_text = meta.dump(2) + "\n";
  write_file_atomic(opts.output_dir + "/prepare.json", meta_text.data(), meta_text.size(), true);
  std::set<std::string> keep(train.written().begin(), train.written().end());
  keep.insert(val.written().begin(), val.written().end());
  if (int removed = remove_stale_shards(opts.output_dir, keep))
    TR_LOG_INFO("prepare: removed ", removed, " stale shard(s) from an earlier run in ", opts.output_dir);

  std::ostringstream os;
  os << "prepared " << texts.size() << " text file" << (texts.size() == 1 ? "" : "s");
  if (!binary.empty() || duplicates) os << " (skipped " << binary.size() << " binary, " << duplicates << " duplicate)";
  os << " -> " << opts.output_dir << ": " << train.tokens() << " train tokens in "
     << shard_range(train.written()) << ", " << val.tokens() << " val tokens in "
     << shard_range(val.written()) << "; byte-level, vocab 256";
  return os.str();
}

}  // namespace trainrun
