// What `trainrun prepare` records in prepare.json beside its shards, beyond
// the per-shard counts that token_files.cpp checks: which tokenizer made
// the ids (so a run can turn its sample back into text, and
// `trainrun generate` can find it) and how many bytes of text the val split
// holds (so a run reports val loss in bits per byte, a figure that compares
// a byte-level run with a BPE run).
//
// The fields (docs/data-format.md):
//   "tokenizer"        the --tokenizer argument as given ("" = byte-level)
//   "tokenizer_path"   the same, absolute: a job may start in another directory
//   "tokenizer_xxh64"  xxhash64 of that tokenizer.json's bytes (16 hex
//                      digits): a file retrained or edited after prepare is
//                      refused instead of decoding the data's ids wrongly
//   "val_tokens", "val_bytes"  the val split's tokens and the bytes of text
//                      they encode (document-start tokens included in the
//                      former; no val_bytes for the chat formats, whose
//                      tokens are a template's rendering, not the text)
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace trainrun {

// The prepare.json files in the directories of `pattern`'s files (token_files.cpp),
// parsed, in directory order; one that is not JSON is an error naming `key` and it.
struct PrepareJson {
  std::string dir, meta_path;
  nlohmann::json meta;
};
std::vector<PrepareJson> read_prepare_jsons(const std::string& pattern, const std::string& key);

// xxhash64 of a file's bytes as 16 hex digits; throws naming the file.
std::string file_xxh64(const std::string& path);

// The tokenizer the shards of `pattern` (a path or glob, as data.train)
// were prepared with, from the prepare.json files beside them.
struct PreparedTokenizer {
  std::string path;       // "" = byte-level shards, or no prepare.json names one
  std::string meta_path;  // the prepare.json that names it
  int64_t vocab_size = -1;
};
// Every prepare.json must name the same tokenizer. With `check_file`, the
// file must exist and hash as recorded; errors name `key`, the prepare.json,
// the tokenizer file and what to do.
PreparedTokenizer prepared_tokenizer(const std::string& pattern, const std::string& key, bool check_file);

// The val split's tokens per byte of text (summed over the prepare.json
// files beside `pattern`'s shards): 1 for byte-level shards, ~0.37 for a
// 2K BPE on English. < 0 when any of them lacks the record (older prepare,
// chat formats, files not made by prepare).
double prepared_val_tokens_per_byte(const std::string& pattern, const std::string& key);

}  // namespace trainrun
