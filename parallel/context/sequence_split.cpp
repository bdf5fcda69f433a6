#include "parallel/context/sequence_split.h"

#include <cstring>

#include "core/common/error.h"

namespace trainrun {

SequenceSplit::SequenceSplit(int T, int cp, int rank) : T_(T), cp_(cp), rank_(rank) {
  TR_CHECK(cp >= 1, "context parallelism: cp ", cp, " (must be at least 1)");
  TR_CHECK(rank >= 0 && rank < cp, "context parallelism: rank ", rank, " is outside a cp group of ", cp);
  TR_CHECK(T > 0 && T % (2 * cp) == 0, "context parallelism: the sequence length ", T,
           " is not a multiple of 2 x cp = ", 2 * cp,
           " (each rank holds two of 2 x cp equal chunks); change model.seq_len or parallel.context_parallel");
}

int SequenceSplit::global_pos(int local_row) const {
  TR_CHECK(local_row >= 0 && local_row < local_rows(), "context parallelism: local row ", local_row, " of ",
           local_rows());
  const int c = local_row / chunk();
  return global_chunk(c) * chunk() + local_row % chunk();
}

int SequenceSplit::local_row(int global_pos) const {
  const int c = global_pos / chunk();
  if (c == rank_) return global_pos % chunk();
  if (c == 2 * cp_ - 1 - rank_) return chunk() + global_pos % chunk();
  return -1;
}

int SequenceSplit::owner(int global_pos) const {
  TR_CHECK(global_pos >= 0 && global_pos < T_, "context parallelism: position ", global_pos, " outside T = ", T_);
  const int c = global_pos / chunk();
  return c < cp_ ? c : 2 * cp_ - 1 - c;
}

void split_rows(const void* global, void* local, int B, size_t row_bytes, const SequenceSplit& s) {
  const int Tc = s.chunk(), Tl = s.local_rows();
  const char* g = static_cast<const char*>(global);
  char* l = static_cast<char*>(local);
  const size_t chunk_bytes = size_t(Tc) * row_bytes;
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < 2; ++c)
      std::memcpy(l + (size_t(b) * Tl + size_t(c) * Tc) * row_bytes,
                  g + (size_t(b) * s.T() + size_t(s.global_chunk(c)) * Tc) * row_bytes, chunk_bytes);
}

void merge_rows(const std::vector<const void*>& locals, void* global, int B, size_t row_bytes, int T, int cp) {
  TR_CHECK(int(locals.size()) == cp, "context parallelism: merge_rows got ", locals.size(), " ranks' rows for cp ", cp);
  char* g = static_cast<char*>(global);
  for (int r = 0; r < cp; ++r) {
    const SequenceSplit s(T, cp, r);
    const char* l = static_cast<const char*>(locals[size_t(r)]);
    const size_t chunk_bytes = size_t(s.chunk()) * row_bytes;
    for (int b = 0; b < B; ++b)
      for (int c = 0; c < 2; ++c)
        std::memcpy(g + (size_t(b) * T + size_t(s.global_chunk(c)) * s.chunk()) * row_bytes,
                    l + (size_t(b) * s.local_rows() + size_t(c) * s.chunk()) * row_bytes, chunk_bytes);
  }
}

LocalDocumentMask split_document_mask(const int32_t* doc_start, int B, const SequenceSplit& s) {
  const int Tl = s.local_rows();
  LocalDocumentMask m;
  m.doc_start.resize(size_t(B) * Tl);
  m.pos.resize(size_t(B) * Tl);
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < Tl; ++l) {
      const int t = s.global_pos(l);
      const int32_t d = doc_start ? doc_start[size_t(b) * s.T() + t] : 0;
      TR_CHECK(d >= 0 && d <= t, "context parallelism: doc_start[", b, ", ", t, "] = ", d, " is not in [0, ", t,
               "] (a bug in the document mask)");
      m.doc_start[size_t(b) * Tl + l] = d;
      m.pos[size_t(b) * Tl + l] = t - d;
    }
  return m;
}

}  // namespace trainrun
