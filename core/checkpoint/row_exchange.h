// Tensor-parallel checkpoint writes in whole rows. A TP rank holds a
// row-parallel weight's slice of the inner dim: one run of `count` elements
// per row, `stride` = tp x count apart in the file. Written as is, that is
// one pwrite per row (about 3.9M per rank and checkpoint at 70B tp8). The
// TP group instead trades slices so that each rank writes whole rows:
//
//   rows are cut in groups whose full rows fit one segment (kSegmentBytes);
//   in a round of tp groups, each rank owns one (rotating from range to
//   range): every rank sends each owner its slice of the owner's rows
//   (pairwise send_recv, tp - 1 exchanges per round), and the owner writes
//   the group's full rows with one pwrite.
//
// The file stays logical (nothing in it depends on tp) and the manifest
// keeps one strided segment per TP slice of each group, hashed by the
// writer from the full rows: a rank loading on the same mesh reads and
// verifies exactly its own slice, as before.
//
// The exchange runs over its own host communicator of the TP group (Gloo:
// the pieces are host memory on every backend), used only by the
// checkpoint (one save at a time: the training thread or the async save's
// thread, never both). Host memory: one group's full rows and this rank's
// slices of a round (two segments), whatever the model.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/checkpoint/format.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"

namespace trainrun::ckpt {

// Which of this rank's write ranges the TP group writes in whole rows.
// Collective over `tp`: built from every member's ranges, so it is the same
// decision on every member. A strided range qualifies when every member has
// one at the same position among its strided ranges with the same count,
// stride and reps, starting at the same row, slice u at column u x count,
// the slices tiling the row (stride = tp x count), a full row no larger
// than a segment (a longer row is few runs of more than a segment each:
// nothing to gain).
struct RowExchangePlan {
  std::vector<int64_t> position;  // per write range: its index among the qualified ones, or -1
  int64_t ranges = 0;             // how many qualified
};
RowExchangePlan plan_row_exchange(const std::vector<ParamStore::Range>& write_ranges, Communicator& tp);

// Buffers reused across a save's ranges.
struct RowExchangeBuffers {
  std::vector<float> mine, full, recv;
  size_t bytes() const { return (mine.capacity() + full.capacity() + recv.capacity()) * sizeof(float); }
};

// Collective over `tp`: writes range `r` (one that plan_row_exchange
// qualified) of state `kind`, read from `ps`, to `fd` whose element 0 of the
// kind sits at byte `base`, as whole rows; appends the segments hashed to
// `segs`. Every member calls it for the same range at the same time.
// `rotate` (the same on every member) moves which rank writes a range's
// first group, so small tensors (one group) spread over the group.
// `agree(failed)` is the group's meeting (collective; it throws on every
// member when any failed): called before each round and at the end, so an
// error on one member (a write that failed) stops all of them together
// instead of leaving its peers in an exchange; this member's own error is
// the one it then rethrows.
void write_whole_rows(int fd, const std::string& path, uint64_t base, int kind, const ParamStore::Range& r,
                      int64_t rotate, ParamStore& ps, Communicator& tp, Hasher& h, RowExchangeBuffers& bufs,
                      std::vector<Segment>& segs, const std::function<void(bool failed)>& agree);

}  // namespace trainrun::ckpt
