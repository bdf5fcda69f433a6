// Pieces of `trainrun prepare` shared by the byte-level path (prepare.cpp)
// and the tokenizer path (prepare_bpe.cpp). Private to core/data.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace trainrun::prep {

// Header + tokens to `path` through a temp name and a rename (version 1 =
// uint16, 7 = uint32), so no truncated shard ever sits under a final name.
void write_shard_file(const std::string& path, const void* tokens, int64_t ntok, int version);
// `bytes` to `path`, fsync'd. With commit, through a temp name and a rename;
// without, straight to `path` (the caller's own temp name, renamed later).
void write_file_atomic(const std::string& path, const void* data, size_t bytes, bool commit);
// "train_000003.bin"
std::string shard_name(const std::string& prefix, int index);
// "2 shards (train_000000.bin .. train_000001.bin)"
std::string shard_range(const std::vector<std::string>& names);
// Removes (train|val)_NNNNNN.(bin|mask) files in `dir` not in `keep`; returns how many.
int remove_stale_shards(const std::string& dir, const std::set<std::string>& keep);
// Creates `dir` and proves it writable (errors name --output).
void prepare_output_dir(const std::string& dir);

// The text files among --input (directories walked, sorted), less binary
// files, empty files and duplicate paths (logged). Fails when none is left.
struct InputSet {
  std::vector<std::string> texts;
  std::vector<std::string> binary;
  int duplicates = 0;
};
InputSet select_text_files(const std::vector<std::string>& inputs);

}  // namespace trainrun::prep
