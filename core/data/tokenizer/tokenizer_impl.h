// The loaded form of a tokenizer.json, shared by the loader
// (tokenizer_load.cpp) and the encoder (tokenizer_encode.cpp). Private to
// core/data/tokenizer.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/data/tokenizer/tokenizer.h"

namespace trainrun {

// A compiled PCRE2 pattern (UTF + UCP, JIT-compiled when the platform has a JIT).
struct CompiledRegex {
  pcre2_code* code = nullptr;
  bool jit = false;
  std::string pattern;
  CompiledRegex() = default;
  CompiledRegex(const CompiledRegex&) = delete;
  CompiledRegex& operator=(const CompiledRegex&) = delete;
  CompiledRegex(CompiledRegex&& o) noexcept : code(o.code), jit(o.jit), pattern(std::move(o.pattern)) { o.code = nullptr; }
  ~CompiledRegex() { if (code) pcre2_code_free(code); }
};

// One splitting pre-tokenizer step; every step splits with behavior
// Isolated (matches and the gaps between them are all pieces).
struct SplitStep {
  CompiledRegex re;
};

// Open-addressing map (pair of ids) -> (rank, merged id). The hot loop of BPE
// is this lookup; std::unordered_map's node chasing costs ~2x here.
class MergeTable {
 public:
  void build(const std::vector<std::array<uint32_t, 4>>& merges);  // {left, right, rank, merged}
  // True and fills rank/merged when (left, right) is a merge.
  bool find(uint32_t left, uint32_t right, uint32_t& rank, uint32_t& merged) const {
    if (slots_.empty()) return false;
    const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == kEmpty) return false;
      if (s.key == key) {
        rank = s.rank;
        merged = s.merged;
        return true;
      }
    }
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> 17); }
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0, merged = 0;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
};

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false;
};

struct Tokenizer::Impl {
  std::string name;                                   // the file, for messages
  std::vector<std::string> id_to_bytes;               // (V) decoded bytes of each id
  std::vector<uint8_t> id_known;                      // (V) 1 where the id exists
  std::unordered_map<std::string, uint32_t> vocab;     // byte-level spelling -> id
  std::unordered_map<std::string, uint32_t> raw_vocab; // the same tokens keyed by their bytes (ignore_merges)
  std::array<uint32_t, 256> byte_id{};                 // id of each single byte's symbol
  MergeTable merges;
  bool ignore_merges = false;
  std::vector<SplitStep> splits;  // Split steps, then ByteLevel's own regex when use_regex
  size_t byte_level_step = 0;     // index in `splits` where ByteLevel acts (after the Split steps)
  bool add_prefix_space = false;  // ByteLevel's, applied to each piece it receives
  std::vector<AddedToken> added;
  // Added tokens by first byte, longest first (leftmost-longest matching).
  std::array<std::vector<uint32_t>, 256> added_by_first;  // indices into `added`
  bool any_plain_added = false;  // a non-special added token exists (always matched)
  bool any_special = false;
  std::unordered_map<std::string, uint32_t> added_by_content;
  int64_t bos = -1;
  uint32_t vocab_size = 0;
};

// GPT-2's pre-tokenizer regex, which ByteLevel(use_regex: true) applies.
extern const char* const kGpt2Pattern;

// The 256 code points ByteLevel maps bytes to (GPT-2's bytes_to_unicode).
const std::array<uint32_t, 256>& byte_to_codepoint();
void append_utf8(uint32_t cp, std::string& out);

}  // namespace trainrun
