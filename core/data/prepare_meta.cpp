// prepare.json's tokenizer and text-byte records (core/data/prepare_meta.h).
#include "core/data/prepare_meta.h"

#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/common/error.h"

namespace fs = std::filesystem;

namespace trainrun {

std::string file_xxh64(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TR_CHECK(in, "cannot open '", path, "' to hash it: ", detail::errno_string());
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    XXH64_update(st, buf.data(), size_t(in.gcount()));
  }
  const bool bad = in.bad();
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  TR_CHECK(!bad, "cannot read '", path, "' to hash it: ", detail::errno_string());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

namespace {

std::string string_field(const nlohmann::json& m, const char* name) {
  auto it = m.find(name);
  return it != m.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

PreparedTokenizer prepared_tokenizer(const std::string& pattern, const std::string& key, bool check_file) {
  PreparedTokenizer out;
  std::string hash;          // the first record's
  bool have_record = false;  // a prepare.json that says bytes or names a tokenizer
  for (const PrepareJson& pj : read_prepare_jsons(pattern, key)) {
    if (!pj.meta.is_object() || !pj.meta.contains("tokenizer")) continue;
    // tokenizer_path (absolute) since 2026-12; before, the argument as given, relative to prepare's directory.
    std::string path = string_field(pj.meta, "tokenizer_path");
    if (path.empty()) path = string_field(pj.meta, "tokenizer");
    const std::string h = string_field(pj.meta, "tokenizer_xxh64");
    if (have_record) {
      // Shards of two tokenizers in one split: their ids mean different text.
      const bool same = path.empty() == out.path.empty() && (h.empty() || hash.empty() ? path == out.path : h == hash);
      TR_CHECK(same, key, ": '", pj.meta_path, "' records the tokenizer '", path.empty() ? "bytes" : path, "' but '",
               out.meta_path, "' '", out.path.empty() ? "bytes" : out.path,
               "': these shards were prepared with different tokenizers; prepare them all with one");
      continue;
    }
    have_record = true;
    out.path = path;
    out.meta_path = pj.meta_path;
    hash = h;
    if (pj.meta.contains("vocab_size") && pj.meta["vocab_size"].is_number_integer())
      out.vocab_size = pj.meta["vocab_size"].get<int64_t>();
  }
  if (!check_file || out.path.empty()) return out;
  TR_CHECK(fs::is_regular_file(out.path), key, ": '", out.meta_path, "' records that these shards were made with the "
           "tokenizer '", out.path, "', which is not there; put it back (the ids are its tokens, nothing else turns "
           "them into text), or re-run `trainrun prepare --tokenizer` with the tokenizer you have");
  if (!hash.empty()) {
    const std::string now = file_xxh64(out.path);
    TR_CHECK(now == hash, key, ": the tokenizer '", out.path, "' has changed since `trainrun prepare` made these "
             "shards ('", out.meta_path, "' records xxhash64 ", hash, ", the file now hashes to ", now,
             "), so its ids are not the data's; restore the file the data was made with, or re-run `trainrun "
             "prepare --tokenizer ", out.path, "`");
  }
  return out;
}

double prepared_val_tokens_per_byte(const std::string& pattern, const std::string& key) {
  int64_t tokens = 0, bytes = 0;
  const auto metas = read_prepare_jsons(pattern, key);
  if (metas.empty()) return -1;
  for (const PrepareJson& pj : metas) {
    const auto& m = pj.meta;
    if (!m.is_object() || !m.contains("val_tokens") || !m.contains("val_bytes") ||
        !m["val_tokens"].is_number_unsigned() || !m["val_bytes"].is_number_unsigned())
      return -1;
    tokens += m["val_tokens"].get<int64_t>();
    bytes += m["val_bytes"].get<int64_t>();
  }
  return tokens > 0 && bytes > 0 ? double(tokens) / double(bytes) : -1;
}

}  // namespace trainrun
