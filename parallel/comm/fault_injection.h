// Tests: a communicator that fails one collective the way a stream-ordered
// NCCL collective fails, so the "noticed late" paths run on the CPU.
//
//   TRAINRUN_DEBUG_COMM_FAULT=<group>:<rank>:<step>
//
// On global rank <rank>, the communicator whose group name starts with
// <group> ("world", "dp_shard", "dp_replicate1", ...) fails its first collective
// issued during step <step>: the collective runs (its peers complete it, as
// they would on a GPU), but this rank's output is thrown away (a reduction
// gets its input back: a gradient that was never reduced) and the call
// returns as if all went well; the failure surfaces at the next call or at
// check_health(), with an Error naming the operation, the group, the rank
// and the step. Every later call repeats it, as NCCL's aborted communicator
// does. Host buffers only (the CPU backend). Unset: no wrapper.
#pragma once
#include <memory>

#include "parallel/comm/communicator.h"

namespace trainrun {

// `inner` unchanged when the environment asks for no fault on this rank and
// group (set the group with set_group before wrapping).
std::unique_ptr<Communicator> maybe_inject_faults(std::unique_ptr<Communicator> inner, int global_rank);

}  // namespace trainrun
