// Document masking (data.document_mask): several documents packed into one
// sequence of model.seq_len tokens attend only within their own document
// (block-causal attention), and their positions (GPT-2's wpe, Llama's
// RoPE) restart at 0 at each document start, as Megatron's
// reset_attention_mask + reset_position_ids do.
//
// The rule (docs/data-format.md): a token equal to the separator starts a
// new document and belongs to it (prepare puts the tokenizer's BOS, or
// <|endoftext|>, at the start of every document); the first token of every
// sequence also starts a document, so the tail of a document cut by the
// sequence boundary is a document of its own.
#pragma once
#include <cstdint>
#include <string>

#include "core/config/job_spec.h"

namespace trainrun {

// Per sequence b of inputs (B,T): doc_start[b*T+t] = the index of the first
// token of t's document, pos[b*T+t] = t - doc_start[b*T+t]. O(B*T), host.
void document_offsets(const int32_t* inputs, int B, int T, int32_t separator, int32_t* doc_start, int32_t* pos);

// The separator id of a job with data.document_mask on (-1 when it is off):
// data.document_separator when set (>= 0), else the "document_start_id" that
// `trainrun prepare` recorded in prepare.json beside the data.train shards.
// Throws naming data.document_mask and data.document_separator when there is
// no way to know it (synthetic data, raw files, shards without prepare.json,
// or prepare.json files that disagree), and when the id is not below
// model.vocab_size.
int resolve_document_separator(const JobSpec& job);

// The "document_start_id" of the prepare.json files beside the files that
// `pattern` matches: -1 when none has one; throws (naming `key`) when two
// disagree or one is not valid JSON. (core/data/token_files.cpp)
int prepared_document_start(const std::string& pattern, const std::string& key);

}  // namespace trainrun
