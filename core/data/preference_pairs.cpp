// Preference pairs: the .pairs index and the source that cuts rows from it
// (the format is at the top of preference_pairs.h).
#include "core/data/preference_pairs.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/common/log.h"

namespace fs = std::filesystem;

namespace trainrun {
namespace {
constexpr char kMagic[8] = {'T', 'R', 'P', 'A', 'I', 'R', 'S', '1'};
constexpr size_t kHeaderBytes = 16;
}  // namespace

PairIndexWriter::PairIndexWriter(std::string final_path)
    : final_(std::move(final_path)), tmp_(final_ + ".tmp." + std::to_string(::getpid())) {
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) TR_FAIL("cannot create '", tmp_, "': ", detail::errno_string(), "; check that --output is writable");
  const uint64_t zero = 0;
  std::fwrite(kMagic, 1, 8, f_);
  std::fwrite(&zero, 8, 1, f_);  // the count, written by commit()
}

PairIndexWriter::~PairIndexWriter() {
  if (f_) {
    std::fclose(f_);
    std::remove(tmp_.c_str());
  }
}

void PairIndexWriter::add(const std::array<int64_t, 3>& rec) {
  if (std::fwrite(rec.data(), sizeof(int64_t), 3, f_) != 3)
    TR_FAIL("cannot write '", tmp_, "': ", detail::errno_string(), " (is the disk full?)");
  ++count_;
}

void PairIndexWriter::commit() {
  const uint64_t n = static_cast<uint64_t>(count_);
  bool ok = std::fseek(f_, 8, SEEK_SET) == 0 && std::fwrite(&n, 8, 1, f_) == 1 && std::fflush(f_) == 0 &&
            ::fsync(fileno(f_)) == 0;
  const std::string err = ok ? "" : detail::errno_string();
  ok = std::fclose(f_) == 0 && ok;
  f_ = nullptr;
  if (!ok || std::rename(tmp_.c_str(), final_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    TR_FAIL("cannot write '", final_, "': ", err.empty() ? detail::errno_string() : err);
  }
}

std::vector<std::array<int64_t, 3>> read_pair_index(const std::string& path, int64_t stream_tokens) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    TR_FAIL("cannot open '", path, "': ", detail::errno_string(),
            "; preference data needs the .pairs file `trainrun prepare --format preference` writes beside its shards");
  char head[kHeaderBytes];
  f.read(head, kHeaderBytes);
  TR_CHECK(f.gcount() == std::streamsize(kHeaderBytes) && std::memcmp(head, kMagic, 8) == 0, "'", path,
           "' is not a preference pair index (no TRPAIRS1 header); prepare the data again");
  uint64_t n = 0;
  std::memcpy(&n, head + 8, 8);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  // Compared by division: a hostile count can wrap kHeaderBytes + n * 24
  // around 2^64 to the file's real size and then cost an exabyte vector.
  TR_CHECK(!ec && size >= kHeaderBytes && (size - kHeaderBytes) % 24 == 0 && n == (size - kHeaderBytes) / 24, "'",
           path, "': its header says ", n, " pairs but the file has ", ec ? 0 : size, " bytes (", kHeaderBytes,
           " + 24 per pair); it is truncated or changed: prepare the data again");
  std::vector<std::array<int64_t, 3>> pairs(n);
  if (n) f.read(reinterpret_cast<char*>(pairs.data()), std::streamsize(n * 24));
  int64_t end = 0;
  for (uint64_t p = 0; p < n; ++p) {
    const auto& r = pairs[p];
    TR_CHECK(r[0] >= end && r[1] >= 2 && r[2] >= 2 && r[0] + r[1] + r[2] <= stream_tokens, "'", path, "': pair ", p,
             " {offset ", r[0], ", chosen ", r[1], ", rejected ", r[2], "} does not fit the shards' ", stream_tokens,
             " tokens after the previous pair (ending at ", end, "); the index and the shards are from different runs: "
             "prepare the data again");
    end = r[0] + r[1] + r[2];
  }
  return pairs;
}

PreferenceSource::PreferenceSource(std::unique_ptr<TokenSource> stream, std::vector<std::array<int64_t, 3>> pairs,
                                   bool packed, int seq_len, std::string key)
    : stream_(std::move(stream)), pairs_(std::move(pairs)), packed_(packed), key_(std::move(key)) {
  TR_CHECK(!pairs_.empty(), key_, ": the .pairs file lists no pair; prepare more data");
  // A side of n tokens is n - 1 predictions: it fits a row of T when n <= T + 1.
  int64_t too_long = 0, worst = 0, worst_len = 0;
  for (size_t p = 0; p < pairs_.size(); ++p) {
    const auto& r = pairs_[p];
    const int64_t need = packed_ ? r[1] + r[2] : std::max(r[1], r[2]);
    if (need > int64_t(seq_len) + 1) {
      if (need > worst_len) worst = int64_t(p), worst_len = need;
      ++too_long;
    }
  }
  TR_CHECK(too_long == 0, key_, ": ", too_long, " of ", pairs_.size(), " pairs do not fit a row of model.seq_len + 1 = ",
           int64_t(seq_len) + 1, " tokens (", packed_ ? "both sides together, data.document_mask packs them" : "a side",
           "; the longest is pair ", worst, " with ", worst_len, " tokens); raise model.seq_len",
           packed_ ? ", turn data.document_mask off (a row per side)" : "",
           " or prepare with --seq-len to count them and drop the long rows from the jsonl");
}

int64_t PreferenceSource::num_samples(int T) const { return num_pairs() * rows_per_pair(); }

std::string PreferenceSource::describe() const {
  return std::to_string(pairs_.size()) + " preference pairs (" + (packed_ ? "both sides in one row" : "a row per side") +
         ") in " + stream_->describe();
}

int64_t PreferenceSource::pair_of_row(int64_t row) const {
  const int64_t ns = num_samples(0);
  int64_t s = row % ns;
  if (s < 0) s += ns;
  return s / rows_per_pair();
}

void PreferenceSource::side(int64_t p, int s, std::vector<int32_t>& tok, std::vector<uint8_t>& mask) const {
  const auto& r = pairs_[size_t(p)];
  const int64_t off = s == 0 ? r[0] : r[0] + r[1], n = r[1 + s];
  tok.resize(size_t(n));
  mask.resize(size_t(n));
  stream_->read_span(off, n, tok.data(), mask.data());
}

void PreferenceSource::read_samples(int64_t first, int B, int T, int32_t* inputs, int32_t* targets) const {
  std::vector<int32_t> tok, part;
  std::vector<uint8_t> mask, mpart;
  for (int b = 0; b < B; ++b) {
    const int64_t row = first + b, p = pair_of_row(row);
    tok.clear();
    mask.clear();
    for (int s = 0; s < 2; ++s) {
      if (!packed_ && ((row % 2 + 2) % 2) != s) continue;
      side(p, s, part, mpart);
      tok.insert(tok.end(), part.begin(), part.end());
      mask.insert(mask.end(), mpart.begin(), mpart.end());
    }
    int32_t* in = inputs + int64_t(b) * T;
    int32_t* tg = targets + int64_t(b) * T;
    const int64_t n = int64_t(tok.size());  // <= T + 1 (checked at open)
    for (int t = 0; t < T; ++t) {
      in[t] = t < n ? tok[size_t(t)] : 0;
      tg[t] = t + 1 < n && mask[size_t(t + 1)] ? tok[size_t(t + 1)] : -1;
    }
  }
}

void PreferenceSource::read_segments(int64_t first, int B, int T, int32_t* seq, int64_t* pair_ids) const {
  std::vector<int32_t> part;
  std::vector<uint8_t> m0, m1;
  for (int b = 0; b < B; ++b) {
    const int64_t row = first + b, p = pair_of_row(row);
    int32_t* sq = seq + int64_t(b) * T;
    std::fill(sq, sq + T, -1);
    if (packed_) {
      pair_ids[b] = p;
      side(p, 0, part, m0);
      side(p, 1, part, m1);
      const int64_t nc = int64_t(m0.size());
      // Target t predicts row token t + 1; a row holds T + 1 tokens, so t
      // runs to T - 1 (read_samples sets that target when the row is full).
      for (int t = 0; t < T; ++t) {
        const int64_t k = t + 1;
        if (k < nc && m0[size_t(k)]) sq[t] = 2 * b;
        else if (k >= nc && k - nc < int64_t(m1.size()) && m1[size_t(k - nc)]) sq[t] = 2 * b + 1;
      }
    } else {
      const int s = int((row % 2 + 2) % 2);
      if (s == 0) pair_ids[b / 2] = p;
      side(p, s, part, m0);
      for (int t = 0; t < T && t + 1 < int64_t(m0.size()); ++t)
        if (m0[size_t(t + 1)]) sq[t] = b;
    }
  }
}

int64_t PreferenceSource::count_targets(int64_t first, int B, int T) const {
  std::vector<int32_t> part;
  std::vector<uint8_t> m;
  int64_t n = 0;
  for (int b = 0; b < B; ++b) {
    const int64_t row = first + b, p = pair_of_row(row);
    for (int s = 0; s < 2; ++s) {
      if (!packed_ && ((row % 2 + 2) % 2) != s) continue;
      side(p, s, part, m);
      for (size_t i = 1; i < m.size(); ++i) n += m[i];
    }
  }
  return n;
}

int64_t PreferenceSource::count_chosen_targets(int64_t first, int B, int T) const {
  std::vector<int32_t> part;
  std::vector<uint8_t> m;
  int64_t n = 0;
  for (int b = 0; b < B; ++b) {
    const int64_t row = first + b;
    if (!packed_ && (row % 2 + 2) % 2 != 0) continue;
    side(pair_of_row(row), 0, part, m);
    for (size_t i = 1; i < m.size(); ++i) n += m[i];
  }
  return n;
}

namespace {
nlohmann::json prepare_record(const std::string& pattern) {
  const fs::path meta = fs::path(pattern).parent_path() / "prepare.json";
  std::ifstream f(meta);
  if (!f) return nlohmann::json();
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception&) {
    return nlohmann::json();  // token_files.cpp reports a broken prepare.json
  }
}
}  // namespace

bool is_preference_data(const std::string& pattern) {
  const nlohmann::json j = prepare_record(pattern);
  return j.is_object() && j.value("format", std::string()) == "preference";
}

std::unique_ptr<PreferenceSource> open_preference_source(const JobSpec& job, const std::string& pattern,
                                                         const std::string& key) {
  const fs::path dir = fs::path(pattern).parent_path();
  TR_CHECK(is_preference_data(pattern), key, ": '", pattern, "' is not preference data (", (dir / "prepare.json").string(),
           " does not say format preference); train.objective ", job.train.objective,
           " reads pairs: prepare them with `trainrun prepare --format preference`");
  const std::string name = fs::path(pattern).filename().string();
  const std::string split = name.substr(0, name.find('_'));
  TR_CHECK(split == "train" || split == "val", key, ": '", pattern,
           "': preference shards are named train_*.bin / val_*.bin (the .pairs file is chosen by that prefix)");
  auto stream = open_token_files(pattern, job.data.format, job.model.vocab_size, key);
  TR_CHECK(stream->has_mask(), key, ": '", pattern, "' has no .mask files; prepare the data again");
  auto pairs = read_pair_index((dir / (split + ".pairs")).string(), stream->num_tokens());
  return std::make_unique<PreferenceSource>(std::move(stream), std::move(pairs), job.data.document_mask_on(),
                                            job.model.seq_len, key);
}

}  // namespace trainrun
