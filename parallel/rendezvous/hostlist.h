// Slurm host lists ("node[01-04,07]", "gpu-a[1-2],gpu-b3",
// "rack[1-2]-node[01-02]"): what SLURM_JOB_NODELIST holds, expanded the way
// `scontrol show hostnames` does, without needing Slurm installed.
//
// Grammar: a list is host expressions separated by commas (commas inside
// brackets separate ranges instead). A host expression is literal text with
// any number of bracket groups; a group is comma-separated numbers or
// lo-hi ranges. A range is printed with at least as many digits as its lower
// bound was written with, so "[08-11]" gives 08, 09, 10, 11 and "[8-11]"
// gives 8, 9, 10, 11. Several groups expand as a cartesian product, the
// leftmost group varying slowest (rack1-node01, rack1-node02, rack2-node01...).
// Order is kept and duplicates are kept: node 0 is the first host.
//
// Malformed lists throw trainrun::Error quoting the list and the column:
//   hostlist 'node[1-2': '[' at column 5 has no matching ']'
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace trainrun {

// Expands every host. Refuses lists that would expand to more than
// kMaxHostlistHosts names (a typo like [1-99999999] must not eat the memory).
std::vector<std::string> expand_hostlist(const std::string& list);

// The first host only (node 0 of a Slurm step), with the same validation.
std::string first_host(const std::string& list);

constexpr size_t kMaxHostlistHosts = 1 << 20;

}  // namespace trainrun
