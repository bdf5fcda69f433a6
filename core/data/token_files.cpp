// Memory-mapped token files: llm.c shards (v1 uint16, v7 uint32) and
// headerless raw uint16 / uint32 files, concatenated in sorted path order
// into one virtual token stream.
//
// Everything that can be wrong with a file's shape is checked once at open
// (header, size) so that a bad shard fails the job before step 0. Token ids
// against the vocabulary: shards that `prepare` wrote come with their token
// count and largest id in prepare.json, checked at open against the header
// and model.vocab_size without reading the tokens; each token and mask byte
// is then checked as a sample reads it (an error names the file and the
// offset). Files without that record are scanned once at open.
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <iomanip>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/dataset.h"
#include "core/data/prepare_meta.h"
#include "core/data/document_mask.h"
#include "core/data/llmc_format.h"

namespace trainrun {
namespace {

struct Shard {
  std::string path;
  void* map = nullptr;
  size_t map_bytes = 0;
  const uint8_t* tokens = nullptr;  // first token, inside map
  int64_t ntok = 0;
  int tok_bytes = 2;
  int64_t start = 0;  // global index of this shard's first token
  // The loss-mask sidecar (prepare's chat formats): one byte per token,
  // 1 = a target in the loss. Null when the shard has none.
  std::string mask_path;
  void* mask_map = nullptr;
  size_t mask_bytes = 0;
  const uint8_t* mask = nullptr;
  // Ids at or above this are refused when read: model.vocab_size, or the
  // largest id prepare.json records + 1 when that is lower.
  uint32_t id_bound = UINT32_MAX;
  bool recorded = false;  // counts and largest id from prepare.json
};

// prepare.json's record of one shard.
struct ShardRecord {
  std::string meta_path;
  int64_t tokens = 0;
  uint32_t max_token_id = 0;
};

std::string human_count(int64_t n) {
  if (n < 10000) return std::to_string(n);
  const char* suffix[] = {"K", "M", "B", "T"};
  double v = static_cast<double>(n);
  int i = -1;
  while (v >= 1000.0 && i < 3) { v /= 1000.0; ++i; }
  std::ostringstream os;
  os << std::fixed << std::setprecision(v < 10 ? 2 : 1) << v << suffix[i];
  return os.str();
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// Text looks like text: no NUL bytes and almost all printable. Used only to
// pick the more helpful hint when a file is not what data.format says.
bool looks_like_text(const uint8_t* p, size_t n) {
  n = std::min<size_t>(n, 4096);
  if (n == 0) return false;
  size_t printable = 0;
  for (size_t i = 0; i < n; ++i) {
    uint8_t c = p[i];
    if (c == 0) return false;
    if (c >= 0x20 || c == '\n' || c == '\r' || c == '\t') ++printable;
  }
  return printable * 100 >= n * 95;
}

std::vector<std::string> expand_pattern(const std::string& pattern, const std::string& key) {
  if (!has_glob_chars(pattern)) return {pattern};  // a missing literal path fails at open with errno
  glob_t g;
  std::memset(&g, 0, sizeof g);
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);  // glob(3) sorts its results unless GLOB_NOSORT
  std::vector<std::string> paths;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
    TR_FAIL(key, ": no file matches '", pattern,
            "'; check the path and glob (e.g. data/train_*.bin), or create shards with `trainrun prepare`");
  if (rc != 0) TR_FAIL(key, ": cannot expand the glob '", pattern, "' (glob error ", rc, "); check the directory's permissions");
  std::sort(paths.begin(), paths.end());  // glob sorts by locale; we want byte order everywhere
  return paths;
}

class TokenFileSource : public TokenSource {
 public:
  TokenFileSource(std::string pattern, std::string format, std::string key)
      : pattern_(std::move(pattern)), format_(std::move(format)), key_(std::move(key)) {}
  ~TokenFileSource() override {
    for (auto& s : shards_) {
      if (s.map) ::munmap(s.map, s.map_bytes);
      if (s.mask_map) ::munmap(s.mask_map, s.mask_bytes);
    }
  }
  TokenFileSource(const TokenFileSource&) = delete;
  TokenFileSource& operator=(const TokenFileSource&) = delete;

  // Maps and validates one file; the shard is owned by *this from the moment
  // it is mapped so a failure half-way through still unmaps everything.
  void add_file(const std::string& path, int vocab_size, const ShardRecord* rec) {
    shards_.emplace_back();
    Shard& sh = shards_.back();
    sh.path = path;
    map_file(sh);
    if (format_ == "llmc") parse_llmc(sh);
    else parse_raw(sh);
    sh.start = total_;
    total_ += sh.ntok;
    if (vocab_size > 0) sh.id_bound = static_cast<uint32_t>(vocab_size);
    if (rec) check_record(sh, *rec, vocab_size);
    else check_tokens(sh, vocab_size);
    if (format_ == "llmc") map_mask(sh);
  }

  // Every shard has a mask or none does: a half-masked stream would train on
  // the prompts of some conversations and not others, silently.
  void check_masks() const {
    size_t with = 0;
    for (const auto& s : shards_) with += s.mask != nullptr;
    if (with == 0 || with == shards_.size()) return;
    for (const auto& s : shards_)
      if (!s.mask)
        TR_FAIL(key_, ": ", with, " of ", shards_.size(), " shards have a loss mask (.mask) but '", s.path,
                "' has none ('", s.mask_path, "'); re-run `trainrun prepare` for all of them or remove the .mask files");
  }
  bool has_mask() const override { return !shards_.empty() && shards_[0].mask != nullptr; }

  int64_t count_targets(int64_t first, int B, int T) const override {
    if (!has_mask()) return int64_t(B) * T;
    const int64_t ns = num_samples(T);
    if (ns == 0) check_source_length(*this, T, key_);
    int64_t n = 0;
    for (int b = 0; b < B; ++b) {
      int64_t s = (first + b) % ns;
      if (s < 0) s += ns;
      for_mask(s * T + 1, T, [&](const Shard& sh, int64_t off, int64_t k) {
        const uint8_t* m = sh.mask + off;
        for (int64_t i = 0; i < k; ++i) {
          if (m[i] > 1) bad_mask(sh, off + i);
          n += m[i];
        }
      });
    }
    return n;
  }

  int64_t num_samples(int T) const override {
    TR_CHECK(T > 0, key_, ": sequence length must be positive, got ", T);
    return (total_ - 1) / T;
  }

  void read_samples(int64_t first, int B, int T, int32_t* inputs, int32_t* targets) const override {
    int64_t ns = num_samples(T);
    if (ns == 0) check_source_length(*this, T, key_);
    for (int b = 0; b < B; ++b) {
      int64_t s = (first + b) % ns;
      if (s < 0) s += ns;
      int64_t start = s * T;
      int32_t* in = inputs + static_cast<int64_t>(b) * T;
      int32_t* tg = targets + static_cast<int64_t>(b) * T;
      copy_tokens(start, T, in);
      if (T > 1) std::memcpy(tg, in + 1, sizeof(int32_t) * (T - 1));
      copy_tokens(start + T, 1, tg + T - 1);
      if (has_mask()) {
        // Target t is token start+t+1; a masked one is -1, which the
        // cross-entropy ops skip (PyTorch's ignore_index).
        int64_t t = 0;
        for_mask(start + 1, T, [&](const Shard& sh, int64_t off, int64_t k) {
          const uint8_t* m = sh.mask + off;
          for (int64_t i = 0; i < k; ++i, ++t) {
            if (m[i] > 1) bad_mask(sh, off + i);
            if (!m[i]) tg[t] = -1;
          }
        });
      }
    }
  }

  void read_span(int64_t pos, int64_t n, int32_t* tokens, uint8_t* mask) const override {
    TR_CHECK(pos >= 0 && n >= 0 && pos + n <= total_, key_, ": tokens [", pos, ", ", pos + n,
             ") are outside the stream of ", total_, " tokens (does the .pairs file belong to these shards?)");
    if (n == 0) return;
    copy_tokens(pos, n, tokens);
    if (!mask) return;
    if (!has_mask()) {
      std::memset(mask, 1, size_t(n));
      return;
    }
    int64_t t = 0;
    for_mask(pos, n, [&](const Shard& sh, int64_t off, int64_t k) {
      for (int64_t i = 0; i < k; ++i, ++t) {
        if (sh.mask[off + i] > 1) bad_mask(sh, off + i);
        mask[t] = sh.mask[off + i];
      }
    });
  }

  int vocab_bound() const override { return static_cast<int>(max_token_ + 1); }
  int64_t num_tokens() const override { return total_; }

  std::string describe() const override {
    bool u16 = false, u32 = false;
    for (const auto& s : shards_) (s.tok_bytes == 2 ? u16 : u32) = true;
    std::string kind = format_ == "llmc" ? "llm.c shard" : format_ + " file";
    std::string width = u16 && u32 ? "uint16+uint32" : u16 ? "uint16" : "uint32";
    std::ostringstream os;
    os << "'" << pattern_ << "': " << shards_.size() << " " << kind << (shards_.size() == 1 ? "" : "s");
    if (format_ == "llmc") os << " (" << width << ")";
    os << ", " << human_count(total_) << " tokens";
    if (has_mask()) os << ", with loss masks";
    return os.str();
  }

 private:
  void map_file(Shard& sh) {
    int fd = ::open(sh.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      TR_FAIL(key_, ": cannot open '", sh.path, "': ", detail::errno_string(),
              "; check the path and its permissions");
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      std::string err = detail::errno_string();
      ::close(fd);
      TR_FAIL(key_, ": cannot stat '", sh.path, "': ", err);
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      TR_FAIL(key_, ": '", sh.path, "' is a directory; point ", key_,
              " at token files, e.g. '", sh.path, "/*.bin'");
    }
    if (st.st_size == 0) {
      ::close(fd);
      TR_FAIL(key_, ": file '", sh.path, "' is empty (0 bytes); re-create it with `trainrun prepare` or remove it");
    }
    sh.map_bytes = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, sh.map_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    std::string err = p == MAP_FAILED ? detail::errno_string() : "";
    ::close(fd);  // the mapping keeps the file alive
    if (p == MAP_FAILED) TR_FAIL(key_, ": cannot memory-map '", sh.path, "': ", err);
    sh.map = p;
  }

  void parse_llmc(Shard& sh) {
    const auto* bytes = static_cast<const uint8_t*>(sh.map);
    int64_t size = static_cast<int64_t>(sh.map_bytes);
    if (size < llmc::kHeaderBytes)
      TR_FAIL(key_, ": file '", sh.path, "' is ", size, " bytes, shorter than the ", llmc::kHeaderBytes,
              "-byte llm.c header; ", hint_for_non_llmc(bytes, sh.map_bytes));
    int32_t hdr[3];
    std::memcpy(hdr, bytes, sizeof hdr);  // little-endian, as llm.c writes it
    int32_t magic = hdr[0], version = hdr[1];
    if (magic == llmc::kMagicU16) {
      if (version != llmc::kVersionU16)
        TR_FAIL(key_, ": file '", sh.path, "' has llm.c magic ", magic, " with unsupported version ", version,
                " (supported: magic ", llmc::kMagicU16, " version ", llmc::kVersionU16, " = uint16 tokens, magic ",
                llmc::kMagicU32, " version ", llmc::kVersionU32, " = uint32 tokens); re-create it with a current llm.c or `trainrun prepare`");
      sh.tok_bytes = 2;
    } else if (magic == llmc::kMagicU32) {
      if (version != llmc::kVersionU32)
        TR_FAIL(key_, ": file '", sh.path, "' has llm.c magic ", magic, " with unsupported version ", version,
                " (supported: magic ", llmc::kMagicU16, " version ", llmc::kVersionU16, " = uint16 tokens, magic ",
                llmc::kMagicU32, " version ", llmc::kVersionU32, " = uint32 tokens); re-create it with a current llm.c");
      sh.tok_bytes = 4;
    } else {
      TR_FAIL(key_, ": file '", sh.path, "' has bad magic ", magic, " (accepted llm.c magics: ", llmc::kMagicU16,
              " = uint16 tokens, ", llmc::kMagicU32, " = uint32 tokens); ", hint_for_non_llmc(bytes, sh.map_bytes));
    }
    int64_t ntok = hdr[2];
    if (ntok < 0)
      TR_FAIL(key_, ": file '", sh.path, "' has a negative token count ", ntok, " in its header; the file is corrupt, re-create it");
    if (ntok == 0)
      TR_FAIL(key_, ": file '", sh.path, "' is empty (its header says 0 tokens); re-create it or remove it");
    int64_t expected = llmc::kHeaderBytes + ntok * sh.tok_bytes;
    if (size < expected)
      TR_FAIL(key_, ": file '", sh.path, "' is truncated: its header says ", ntok, " tokens of ", sh.tok_bytes,
              " bytes, so expected ", expected, " bytes, but the file has ", size,
              " bytes; copy it again or re-create it with `trainrun prepare`");
    if (size > expected)
      TR_FAIL(key_, ": file '", sh.path, "' has ", size, " bytes but its header says ", ntok, " tokens of ",
              sh.tok_bytes, " bytes, so expected ", expected,
              " bytes; the file is corrupt or was appended to, re-create it");
    sh.ntok = ntok;
    sh.tokens = bytes + llmc::kHeaderBytes;
  }

  void parse_raw(Shard& sh) {
    sh.tok_bytes = format_ == "raw_uint16" ? 2 : 4;
    const auto* bytes = static_cast<const uint8_t*>(sh.map);
    if (sh.map_bytes % sh.tok_bytes != 0) {
      int32_t magic = 0;
      if (sh.map_bytes >= 4) std::memcpy(&magic, bytes, 4);
      bool is_llmc = magic == llmc::kMagicU16 || magic == llmc::kMagicU32;
      TR_FAIL(key_, ": file '", sh.path, "' has ", sh.map_bytes, " bytes, not a multiple of the ", sh.tok_bytes,
              "-byte token size of data.format ", format_, "; ",
              is_llmc ? "it starts with an llm.c magic: set data.format: llmc"
                      : "check data.format (raw_uint16 or raw_uint32?) or whether the file is truncated");
    }
    sh.ntok = static_cast<int64_t>(sh.map_bytes) / sh.tok_bytes;
    sh.tokens = bytes;
  }

  static std::string hint_for_non_llmc(const uint8_t* bytes, size_t n) {
    if (looks_like_text(bytes, n))
      return "it looks like a text file: tokenise it first with `trainrun prepare --input FILE --output DIR`";
    return "if it is a headerless token file (e.g. nanoGPT's train.bin), set data.format: raw_uint16 (or raw_uint32)";
  }

  template <typename U>
  static uint32_t max_of(const U* p, int64_t n) {
    uint32_t m = 0;
#pragma omp parallel for reduction(max : m) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      uint32_t v = p[i];
      m = v > m ? v : m;
    }
    return m;
  }

  template <typename U>
  static int64_t first_at_least(const U* p, int64_t n, uint32_t bound) {
    for (int64_t i = 0; i < n; ++i)
      if (static_cast<uint32_t>(p[i]) >= bound) return i;
    return -1;
  }

  // One parallel max-reduction per shard; the (serial) search for the first
  // offending index only runs when there is one, to name it in the error.
  void check_tokens(const Shard& sh, int vocab_size) {
    const auto* p16 = reinterpret_cast<const uint16_t*>(sh.tokens);
    const auto* p32 = reinterpret_cast<const uint32_t*>(sh.tokens);
    uint32_t m = sh.tok_bytes == 2 ? max_of(p16, sh.ntok) : max_of(p32, sh.ntok);
    if (vocab_size > 0 && m >= static_cast<uint32_t>(vocab_size)) {
      int64_t i = sh.tok_bytes == 2 ? first_at_least(p16, sh.ntok, vocab_size) : first_at_least(p32, sh.ntok, vocab_size);
      uint32_t v = sh.tok_bytes == 2 ? p16[i] : p32[i];
      TR_FAIL(key_, ": file '", sh.path, "' has token id ", v, " at token index ", i, ", not below model.vocab_size = ",
              vocab_size, " (largest id in the file: ", m, "); the data was tokenised for a larger vocabulary: "
              "set model.vocab_size to at least ", static_cast<int64_t>(m) + 1, " or re-tokenise the data");
    }
    if (m >= static_cast<uint32_t>(INT32_MAX))
      TR_FAIL(key_, ": file '", sh.path, "' has token id ", m, ", which does not fit an int32 token id; the file is corrupt");
    max_token_ = std::max<int64_t>(max_token_, m);
  }

  // prepare.json's counts against the header, its largest id against the
  // vocabulary: no token is read.
  void check_record(Shard& sh, const ShardRecord& rec, int vocab_size) {
    if (rec.tokens != sh.ntok)
      TR_FAIL(key_, ": '", rec.meta_path, "' records ", rec.tokens, " tokens for '", sh.path, "' but the file holds ",
              sh.ntok, "; the shard and its prepare.json are from different runs: re-run `trainrun prepare`");
    if (vocab_size > 0 && rec.max_token_id >= static_cast<uint32_t>(vocab_size))
      TR_FAIL(key_, ": file '", sh.path, "' has token ids up to ", rec.max_token_id, " (", rec.meta_path,
              "), not below model.vocab_size = ", vocab_size, "; the data was tokenised for a larger vocabulary: "
              "set model.vocab_size to at least ", static_cast<int64_t>(rec.max_token_id) + 1, " or re-tokenise the data");
    if (rec.max_token_id >= static_cast<uint32_t>(INT32_MAX))
      TR_FAIL(key_, ": '", rec.meta_path, "' records token id ", rec.max_token_id, ", which does not fit an int32");
    sh.id_bound = std::min(sh.id_bound, rec.max_token_id + 1);
    sh.recorded = true;
    max_token_ = std::max<int64_t>(max_token_, rec.max_token_id);
  }

  [[noreturn]] void bad_token(const Shard& sh, int64_t off, uint32_t v) const {
    TR_FAIL(key_, ": file '", sh.path, "' has token id ", v, " at token index ", off, " (byte offset ",
            (sh.tokens - static_cast<const uint8_t*>(sh.map)) + off * sh.tok_bytes, "), not below ", sh.id_bound,
            sh.recorded ? " (its prepare.json's largest id + 1, or model.vocab_size)" : " (model.vocab_size)",
            "; the file is corrupt or changed since `trainrun prepare`: re-create it");
  }
  [[noreturn]] void bad_mask(const Shard& sh, int64_t off) const {
    TR_FAIL(key_, ": loss mask '", sh.mask_path, "' has byte ", int(sh.mask[off]), " at index ", off,
            " (only 0 and 1 are allowed); the file is corrupt, re-run `trainrun prepare`");
  }

  // Sibling "<stem>.mask" of "<stem>.bin": mapped and checked when present.
  void map_mask(Shard& sh) {
    const size_t dot = sh.path.rfind(".bin");
    if (dot == std::string::npos || dot + 4 != sh.path.size()) return;
    sh.mask_path = sh.path.substr(0, dot) + ".mask";
    struct stat st;
    if (::stat(sh.mask_path.c_str(), &st) != 0) return;
    if (static_cast<int64_t>(st.st_size) != sh.ntok)
      TR_FAIL(key_, ": loss mask '", sh.mask_path, "' has ", static_cast<int64_t>(st.st_size), " bytes but '", sh.path,
              "' has ", sh.ntok, " tokens (one mask byte per token); the two are from different runs: re-run `trainrun prepare`");
    int fd = ::open(sh.mask_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) TR_FAIL(key_, ": cannot open '", sh.mask_path, "': ", detail::errno_string());
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    std::string err = p == MAP_FAILED ? detail::errno_string() : "";
    ::close(fd);
    if (p == MAP_FAILED) TR_FAIL(key_, ": cannot memory-map '", sh.mask_path, "': ", err);
    sh.mask_map = p;
    sh.mask_bytes = static_cast<size_t>(st.st_size);
    sh.mask = static_cast<const uint8_t*>(p);
    if (sh.recorded) return;  // checked byte by byte as samples read it
    for (int64_t i = 0; i < sh.ntok; ++i)
      if (sh.mask[i] > 1) bad_mask(sh, i);
  }

  // Calls f(shard, offset, k) over the mask bytes of tokens [pos, pos + n)
  // of the stream, one call per shard the span touches.
  template <typename F>
  void for_mask(int64_t pos, int64_t n, F&& f) const {
    auto it = std::upper_bound(shards_.begin(), shards_.end(), pos,
                               [](int64_t p, const Shard& s) { return p < s.start; });
    size_t si = static_cast<size_t>(it - shards_.begin()) - 1;
    while (n > 0) {
      const Shard& sh = shards_[si];
      const int64_t off = pos - sh.start;
      const int64_t take = std::min(n, sh.ntok - off);
      f(sh, off, take);
      pos += take;
      n -= take;
      ++si;
    }
  }

  void copy_tokens(int64_t pos, int64_t n, int32_t* out) const {
    // Find the shard holding `pos`: the last one whose start <= pos.
    auto it = std::upper_bound(shards_.begin(), shards_.end(), pos,
                               [](int64_t p, const Shard& s) { return p < s.start; });
    size_t si = static_cast<size_t>(it - shards_.begin()) - 1;
    while (n > 0) {
      const Shard& sh = shards_[si];
      int64_t off = pos - sh.start;
      int64_t take = std::min(n, sh.ntok - off);
      // Each id is checked as it is read (cheap next to the copy).
      if (sh.tok_bytes == 2) {
        const auto* p = reinterpret_cast<const uint16_t*>(sh.tokens) + off;
        for (int64_t i = 0; i < take; ++i) {
          if (p[i] >= sh.id_bound) bad_token(sh, off + i, p[i]);
          out[i] = p[i];
        }
      } else {
        const auto* p = reinterpret_cast<const uint32_t*>(sh.tokens) + off;
        for (int64_t i = 0; i < take; ++i) {
          if (p[i] >= sh.id_bound) bad_token(sh, off + i, p[i]);
          out[i] = static_cast<int32_t>(p[i]);
        }
      }
      out += take;
      pos += take;
      n -= take;
      ++si;
    }
  }

  std::string pattern_, format_, key_;
  std::vector<Shard> shards_;
  int64_t total_ = 0;
  int64_t max_token_ = 0;
};

// `prepare --tokenizer` leaves prepare.json beside its shards: `visit` gets
// each one found in the directories of `paths` (in directory order), parsed,
// one at a time, so that the first bad file stops the walk. A file that is
// not JSON is an error naming `key` and the file.
template <class Visit>
void for_each_prepare_json(const std::vector<std::string>& paths, const std::string& key, Visit visit) {
  std::set<std::string> dirs;
  for (const auto& p : paths) {
    const size_t slash = p.rfind('/');
    dirs.insert(slash == std::string::npos ? "." : p.substr(0, slash));
  }
  for (const auto& dir : dirs) {
    const std::string meta_path = dir + "/prepare.json";
    std::ifstream f(meta_path);
    if (!f) continue;
    nlohmann::json meta;
    try {
      meta = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
      TR_FAIL(key, ": '", meta_path, "' is not valid JSON (", e.what(), "); re-run `trainrun prepare` or remove it");
    }
    visit(dir, meta_path, meta);
  }
}

// A model vocab smaller than the tokenizer's is refused even when these
// shards happen not to hold a high id: generation and later data would.
void check_prepared_vocab(const std::vector<std::string>& paths, int vocab_size, const std::string& key) {
  if (vocab_size <= 0) return;
  for_each_prepare_json(paths, key, [&](const std::string& dir, const std::string& meta_path,
                                        const nlohmann::json& meta) {
    if (!meta.is_object() || !meta.contains("vocab_size") || !meta["vocab_size"].is_number_unsigned()) return;
    const uint64_t v = meta["vocab_size"].get<uint64_t>();
    if (v > static_cast<uint64_t>(vocab_size))
      TR_FAIL(key, ": the data in '", dir, "' was prepared with the tokenizer '", meta.value("tokenizer", "?"),
              "' of ", v, " ids (", meta_path, "), more than model.vocab_size = ", vocab_size,
              "; set model.vocab_size to at least ", v, " (or the model's own tokenizer's size)");
  });
}

// The "shards" of each prepare.json: path -> its token count and largest id.
std::map<std::string, ShardRecord> prepared_shard_records(const std::vector<std::string>& paths,
                                                          const std::string& key) {
  std::map<std::string, ShardRecord> out;
  for_each_prepare_json(paths, key, [&](const std::string& dir, const std::string& meta_path,
                                        const nlohmann::json& meta) {
    if (!meta.is_object() || !meta.contains("shards")) return;
    const auto& shards = meta["shards"];
    if (!shards.is_object())
      TR_FAIL(key, ": '", meta_path, "' \"shards\" is not an object; re-run `trainrun prepare` or remove the file");
    for (auto it = shards.begin(); it != shards.end(); ++it) {
      const auto& v = it.value();
      if (!v.is_object() || !v.contains("tokens") || !v["tokens"].is_number_unsigned() || !v.contains("max_token_id") ||
          !v["max_token_id"].is_number_unsigned())
        TR_FAIL(key, ": '", meta_path, "' shards.", it.key(),
                " needs unsigned \"tokens\" and \"max_token_id\"; re-run `trainrun prepare` or remove the file");
      ShardRecord r;
      r.meta_path = meta_path;
      r.tokens = v["tokens"].get<int64_t>();
      r.max_token_id = v["max_token_id"].get<uint32_t>();
      out[dir + "/" + it.key()] = r;
    }
  });
  return out;
}

}  // namespace

int prepared_document_start(const std::string& pattern, const std::string& key) {
  if (pattern.empty()) return -1;
  int id = -1;
  std::string from;
  for_each_prepare_json(expand_pattern(pattern, key), key, [&](const std::string&, const std::string& meta_path,
                                                              const nlohmann::json& meta) {
    if (!meta.is_object() || !meta.contains("document_start_id") || !meta["document_start_id"].is_number_unsigned())
      return;
    const int v = meta["document_start_id"].get<int>();
    TR_CHECK(id < 0 || v == id, key, ": '", meta_path, "' records document_start_id ", v, " but '", from, "' ", id,
             "; the shards were prepared with different tokenizers: set data.document_separator explicitly");
    id = v;
    from = meta_path;
  });
  return id;
}

std::vector<PrepareJson> read_prepare_jsons(const std::string& pattern, const std::string& key) {
  std::vector<PrepareJson> out;
  if (pattern.empty()) return out;
  for_each_prepare_json(expand_pattern(pattern, key), key,
                        [&](const std::string& dir, const std::string& meta_path, const nlohmann::json& meta) {
                          out.push_back({dir, meta_path, meta});
                        });
  return out;
}

std::unique_ptr<TokenSource> open_token_files(const std::string& pattern, const std::string& format,
                                              int vocab_size, const std::string& key) {
  if (format != "llmc" && format != "raw_uint16" && format != "raw_uint32")
    TR_FAIL("data.format: '", format, "' is not a token file format (llmc | raw_uint16 | raw_uint32)");
  if (pattern.empty())
    TR_FAIL(key, ": no path given; set it to a token file or a glob such as data/train_*.bin");
  auto src = std::make_unique<TokenFileSource>(pattern, format, key);
  const std::vector<std::string> paths = expand_pattern(pattern, key);
  check_prepared_vocab(paths, vocab_size, key);
  const std::map<std::string, ShardRecord> records = prepared_shard_records(paths, key);
  for (const auto& path : paths) {
    auto rec = records.find(path.find('/') == std::string::npos ? "./" + path : path);
    src->add_file(path, vocab_size, rec == records.end() ? nullptr : &rec->second);
  }
  src->check_masks();
  TR_LOG_INFO(key, ": ", src->describe());
  return src;
}

}  // namespace trainrun
