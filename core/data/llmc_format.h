// The llm.c token shard format, shared by the reader (token_files.cpp) and
// the writer (prepare.cpp) so the two cannot drift apart.
#pragma once
#include <cstdint>

namespace trainrun::llmc {

constexpr int kHeaderInts = 256;
constexpr int64_t kHeaderBytes = kHeaderInts * 4;  // 1024
// llm.c's GPT-2 shards: uint16 tokens.
constexpr int32_t kMagicU16 = 20240520;
constexpr int32_t kVersionU16 = 1;
// llm.c's Llama-3 shards: uint32 tokens.
constexpr int32_t kMagicU32 = 20240801;
constexpr int32_t kVersionU32 = 7;

}  // namespace trainrun::llmc
