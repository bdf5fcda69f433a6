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

// Early receives (stream-ordered links, NCCL): where each receive of the
// list is posted, so that the transfer runs while the compute stream works
// on other slots instead of starting when the stream reaches it. post[i]
// for a receive i is the index of the action after which it is issued (-1:
// at the step's start; i: at its own place, as without early receives);
// other actions get their own index. A receive writes its slot's buffer,
// so it is posted right after the last earlier action on the same slot
// (that buffer's last reader: the previous microbatch's backward or send,
// or this one's forward), and never before an earlier receive from the
// same peer (a link matches messages in order). The receive that takes a
// slot over (its microbatch's first action there) is posted early only
// when `takeover_early`: the executor has checked that no send reads the
// buffer it writes (the previous microbatch's sends may still be out);
// else at its own place, after the waits for those sends.
std::vector<int> plan_receive_posts(const PipelineSchedule& s, int rank, const PipelineSlotPlan& slots,
                                    bool takeover_early);

}  // namespace trainrun
