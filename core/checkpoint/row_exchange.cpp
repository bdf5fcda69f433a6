// Tensor-parallel checkpoint writes in whole rows; see row_exchange.h.
#include "core/checkpoint/row_exchange.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <exception>

#include "core/common/error.h"
#include "core/common/fileio.h"

namespace trainrun::ckpt {

using Range = ParamStore::Range;

RowExchangePlan plan_row_exchange(const std::vector<Range>& write_ranges, Communicator& tp) {
  RowExchangePlan plan;
  plan.position.assign(write_ranges.size(), -1);
  const int T = tp.world_size();
  if (T <= 1) return plan;
  // This rank's strided ranges in write order, as (global, count, stride, reps).
  std::vector<size_t> index;
  std::vector<int64_t> mine;
  for (size_t i = 0; i < write_ranges.size(); ++i) {
    const Range& r = write_ranges[i];
    if (r.reps <= 1) continue;
    index.push_back(i);
    mine.insert(mine.end(), {r.global, r.count, r.stride, r.reps});
  }
  // Every member's count first: the lists are then gathered at the longest.
  const int64_t n = int64_t(index.size());
  std::vector<int64_t> counts(static_cast<size_t>(T));
  tp.all_gather(counts.data(), &n, sizeof(int64_t));
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  if (most == 0) return plan;
  mine.resize(size_t(most) * 4, -1);
  std::vector<int64_t> all(size_t(T) * size_t(most) * 4);
  tp.all_gather(all.data(), mine.data(), size_t(most) * 4 * sizeof(int64_t));
  auto at = [&](int u, int64_t j, int f) { return all[(size_t(u) * size_t(most) + size_t(j)) * 4 + size_t(f)]; };
  // Matched by the rows they slice, not by position: rank 0 also writes
  // the replicated tensors, so its list can differ around them (a slice
  // next to one it owns merges into a contiguous range).
  std::vector<std::set<std::array<int64_t, 4>>> of_rank(static_cast<size_t>(T));
  for (int u = 0; u < T; ++u)
    for (int64_t j = 0; j < counts[size_t(u)]; ++j)
      of_rank[size_t(u)].insert({at(u, j, 0), at(u, j, 1), at(u, j, 2), at(u, j, 3)});
  const int t = tp.rank();
  // The qualified row blocks are the same on every member (the test is
  // symmetric); the group meets them in each member's write order, which
  // must then be one order: by their rows. A member that writes them in
  // another order turns the exchange off for the whole group.
  int64_t last_row0 = -1, out_of_order = 0;
  std::vector<size_t> chosen;
  for (size_t k = 0; k < index.size(); ++k) {
    const Range& r = write_ranges[index[k]];
    const int64_t c = r.count, g0 = r.global - int64_t(t) * c;
    bool ok = c > 0 && r.stride == int64_t(T) * c && r.reps > 1 && uint64_t(r.stride) * 4 <= kSegmentBytes;
    for (int u = 0; u < T && ok; ++u) ok = of_rank[size_t(u)].count({g0 + u * c, c, r.stride, r.reps}) > 0;
    if (!ok) continue;
    if (g0 <= last_row0) out_of_order = 1;
    last_row0 = g0;
    chosen.push_back(index[k]);
  }
  std::vector<int64_t> any_out(static_cast<size_t>(T));
  tp.all_gather(any_out.data(), &out_of_order, sizeof(int64_t));
  if (std::count(any_out.begin(), any_out.end(), 0) != T) return plan;
  for (size_t i : chosen) plan.position[i] = plan.ranges++;
  return plan;
}

void write_whole_rows(int fd, const std::string& path, uint64_t base, int kind, const Range& r, int64_t rotate,
                      ParamStore& ps, Communicator& tp, Hasher& h, RowExchangeBuffers& bufs,
                      std::vector<Segment>& segs, const std::function<void(bool failed)>& agree) {
  const int T = tp.world_size(), t = tp.rank();
  const int64_t c = r.count, S = r.stride, R = r.reps;
  TR_CHECK(S == int64_t(T) * c, "checkpoint: range at element ", r.global, " is not a tensor-parallel row slice (a bug)");
  const int64_t g0 = r.global - int64_t(t) * c;  // the rows' first element
  // Rows per group: a group's full rows fit one segment (at least one row).
  const int64_t G = std::max<int64_t>(1, int64_t(kSegmentBytes / 4) / S);
  const int64_t groups = (R + G - 1) / G;
  auto rows_of = [&](int64_t g) { return g < groups ? std::min(G, R - g * G) : int64_t(0); };
  const int64_t rot = rotate % T;
  std::exception_ptr err;  // this member's failure, raised at the next meeting
  auto meet = [&] {
    try {
      agree(bool(err));
    } catch (...) {
      if (err) std::rethrow_exception(err);
      throw;
    }
  };
  for (int64_t q = 0; q < groups; q += T) {
    meet();
    // The group of the round that rank u writes.
    auto group_of = [&](int u) { return q + (u - rot + T) % T; };
    // This rank's slices of the round's rows, back to back.
    const int64_t lo = q * G, hi = std::min(R, (q + T) * G);
    bufs.mine.resize(size_t((hi - lo) * c));
    try {
      ps.copy_state_range(kind, r.rows(lo, hi - lo), bufs.mine.data());
    } catch (...) {
      err = std::current_exception();
    }
    const int64_t own = group_of(t), n = rows_of(own);
    if (n > 0) {
      bufs.full.resize(size_t(n * S));
      const float* src = bufs.mine.data() + (own * G - lo) * c;
      for (int64_t i = 0; i < n; ++i) std::memcpy(bufs.full.data() + i * S + t * c, src + i * c, size_t(c) * 4);
      bufs.recv.resize(size_t(n * c));
    }
    for (int k = 1; k < T; ++k) {
      const int to = (t + k) % T, from = (t - k + T) % T;
      const int64_t send_rows = rows_of(group_of(to));
      const float* send = send_rows > 0 ? bufs.mine.data() + (group_of(to) * G - lo) * c : nullptr;
      tp.send_recv(send, size_t(send_rows * c) * 4, send_rows > 0 ? to : -1,
                   n > 0 ? bufs.recv.data() : nullptr, size_t(n * c) * 4, n > 0 ? from : -1);
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(bufs.full.data() + i * S + from * c, bufs.recv.data() + i * c, size_t(c) * 4);
    }
    if (n == 0 || err) continue;
    // One write for the group's rows; one strided segment per TP slice.
    const uint64_t off = base + uint64_t(g0 + own * G * S) * 4;
    try {
      pwrite_all(fd, bufs.full.data(), size_t(n * S) * 4, off_t(off), path);
    } catch (...) {
      err = std::current_exception();
      continue;
    }
    count_checkpoint_write();
    for (int u = 0; u < T; ++u) {
      h.reset();
      for (int64_t i = 0; i < n; ++i) h.update(bufs.full.data() + i * S + u * c, size_t(c) * 4);
      if (n == 1)
        segs.push_back({off + uint64_t(u * c) * 4, uint64_t(c) * 4, h.digest()});
      else
        segs.push_back({off + uint64_t(u * c) * 4, uint64_t(c) * 4, h.digest(), uint64_t(S) * 4, uint64_t(n)});
    }
  }
  meet();  // the last round's writes
}

}  // namespace trainrun::ckpt
