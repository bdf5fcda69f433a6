// Which activation set (slot) each action of a rank's list uses, and which
// of its own earlier sends it must wait for first: the executor's buffer
// policy, as a function of the schedule alone, so that the executor runs
// it and check_pipeline_schedule proves it cannot hang.
//
// Per chunk a rank keeps as many slots as its list has microbatches open
// at once (received or forwarded, not yet backwarded). A microbatch takes
// the first free slot at its first action on the chunk and gives it back
// after its backward (B on the first stage, SendGrad elsewhere; BW under
// zero_bubble, whose weight step still needs the activations). A send
// reads its slot's buffers after the call returns, so two actions wait for
// an earlier send to have been received: the one that takes a slot over
// (its last send must be done before the buffers are overwritten), and a
// send from a slot whose previous send is still out (one message in
// flight per slot). At the end of the step the executor waits for every
// send, which a schedule whose messages are all received satisfies.
#pragma once
#include <vector>

#include "parallel/pipeline/schedule.h"

namespace trainrun {

struct PipelineSlotPlan {
  std::vector<int> slots_per_chunk;    // activation sets per chunk (index c: virtual stage rank + c P)
  std::vector<int> slot;               // per action: the slot of its (chunk, microbatch)
  std::vector<std::vector<int>> waits;  // per action: indices of this rank's send actions to wait for first
};

// Errors: a list that holds more microbatches on a chunk than it opens
// (a schedule that frees late), naming the stage.
PipelineSlotPlan plan_pipeline_slots(const PipelineSchedule& s, int rank);

}  // namespace trainrun
