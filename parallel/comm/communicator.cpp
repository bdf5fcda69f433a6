// Helpers shared by every Communicator implementation.
#include <cstring>
#include <vector>

#include "parallel/comm/communicator.h"

namespace trainrun {

std::string first_error_of_ranks(Communicator& comm, const std::string& mine) {
  if (comm.world_size() == 1) return mine;
  // A fixed slot per rank: long messages are cut, never the collective.
  constexpr size_t kSlot = 1024;
  std::vector<char> in(kSlot, 0), all(kSlot * size_t(comm.world_size()), 0);
  std::memcpy(in.data(), mine.data(), std::min(mine.size(), kSlot - 1));
  comm.all_gather(all.data(), in.data(), kSlot);
  for (int r = 0; r < comm.world_size(); ++r) {
    const char* p = all.data() + size_t(r) * kSlot;
    if (*p) return std::string(p, strnlen(p, kSlot)) + " (rank " + std::to_string(r) + ")";
  }
  return "";
}

}  // namespace trainrun
