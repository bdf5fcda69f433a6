// The load-balanced split of a sequence over the cp ranks of a context-
// parallel group (issue 27). The T tokens are cut into 2N equal chunks of
// Tc = T / (2N); rank i holds chunk i and chunk 2N-1-i, in that order, as
// its 2 Tc local rows. Under a causal mask chunk c does work proportional to
// c + 1, so every rank does (i + 1) + (2N - i) = 2N + 1 units: even.
// Every op outside attention is row-local and runs on the local rows; the
// attention (ring_attention.h, all_to_all_attention.h) uses the rows' global
// positions.
//
// T must be a multiple of 2N: the job spec refuses other lengths
// (parallel.context_parallel) rather than padding.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace trainrun {

class SequenceSplit {
 public:
  SequenceSplit(int T, int cp, int rank);
  int T() const { return T_; }
  int cp() const { return cp_; }
  int rank() const { return rank_; }
  int chunk() const { return T_ / (2 * cp_); }   // Tc
  int local_rows() const { return 2 * chunk(); }  // Tl = 2 Tc
  // The global chunk index of local chunk 0 or 1: rank, 2 cp - 1 - rank.
  int global_chunk(int local_chunk) const { return local_chunk == 0 ? rank_ : 2 * cp_ - 1 - rank_; }
  // The same for another rank of the group.
  int global_chunk_of(int rank, int local_chunk) const { return local_chunk == 0 ? rank : 2 * cp_ - 1 - rank; }
  // Local row -> global position, and back (-1: another rank holds it).
  int global_pos(int local_row) const;
  int local_row(int global_pos) const;
  // The rank that holds global position p.
  int owner(int global_pos) const;

 private:
  int T_, cp_, rank_;
};

// Host rows: `global` holds B sequences of T rows of `row_bytes` each;
// `local` gets this rank's B x Tl rows (split_rows), or the reverse: the
// group's local rows (rank r's at local[r]) put back into global order
// (merge_rows; a test and checkpoint helper, not a step's path).
void split_rows(const void* global, void* local, int B, size_t row_bytes, const SequenceSplit& s);
void merge_rows(const std::vector<const void*>& locals, void* global, int B, size_t row_bytes, int T, int cp);

// A batch's document mask (core/data/document_mask.h's doc_start, (B,T)
// host int32; kernels/backend.h) for this rank's rows:
//   doc_start[b*Tl + l] = the GLOBAL index where row l's document starts
//                         (the attention compares it with global key positions);
//   pos[b*Tl + l]       = global_pos(l) - that start: RoPE's / wpe's
//                         position, which restarts at 0 at each document's
//                         start even when the document began in a chunk
//                         another rank holds.
struct LocalDocumentMask {
  std::vector<int32_t> doc_start;  // (B, Tl) global indices
  std::vector<int32_t> pos;        // (B, Tl) position inside the document
};
LocalDocumentMask split_document_mask(const int32_t* doc_start, int B, const SequenceSplit& s);

}  // namespace trainrun
