// Ring attention (parallel.cp_mode: ring): causal, document-masked,
// grouped-query attention over a sequence split across the N ranks of a
// context-parallel group by SequenceSplit (sequence_split.h).
//
// Each rank keeps its query rows; the K/V of every rank travels around the
// ring (rank r sends to r+1 and receives from r-1), so at step s rank r
// holds the K/V block of rank r - s. Per step, each pair (local query
// chunk, block key chunk) that some query may see is one
// Backend::attention_block_forward (kernels/attention_block.h), whose
// partial (output and per-row log-sum-exp) is merged into the running
// result in a fixed order (step, then key chunk), so the result is
// deterministic and equal to the one-rank attention to float tolerance.
//
// Skipping, decided on the host from the batch's document starts (every
// rank holds the same (B,T) array, made from the global batch) and the
// layer's sliding window: a (query chunk, key chunk) pair is computed only
// when some query may see some key of it (causal, and not wholly before
// the queries' documents or windows); a block is forwarded along the ring
// only while a later rank needs it. The window, soft-cap and scale
// (AttentionOptions, per layer: Gemma 2 alternates) go into every block op.
// With a window shorter than a chunk a rank needs only its ring
// neighbours' blocks, but a block bound for rank r-1 still travels the
// whole ring to get there: the ring skips the compute of the blocks in
// between, and a transfer only when no rank further on needs the block.
//
// Backward: the flash recompute against the final (global) log-sum-exp.
// K/V travel the ring again, and with them their fp32 dK/dV accumulator,
// which each rank adds its part to; after N passes it is home. Sums run in
// ring order from the owner on: deterministic.
//
// Communication: K/V are double-buffered. At step s the block step s+1
// needs is posted (Communicator::send_recv_deferred, into the other
// buffer) before step s's attention, which reads only the current one; the
// compute is ordered after the transfer only before the next step. On NCCL
// (stream-ordered, grouped send/recv on the communicator's own stream) the
// transfer overlaps the block's attention; Gloo blocks, so on the CPU it
// completes first. The dK/dV accumulator goes after the step that adds to
// it. A failure or timeout is rethrown with the phase, the ring step and
// the cp group.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/context/sequence_split.h"

namespace trainrun {

struct CpAttentionShape {
  int B = 1;    // sequences
  int T = 0;    // GLOBAL sequence length (each rank holds 2 T / (2 cp) rows)
  int NH = 0, NKV = 0, HS = 0;
};

// What the last forward pass did (wait_seconds: every pass), for tests and the bench.
struct RingStats {
  int blocks_computed = 0;   // (query chunk, key chunk) pairs this rank computed
  int blocks_skipped = 0;    // pairs it held but no query could see
  int sends = 0;             // K/V blocks it sent (dK/dV not counted)
  int sends_skipped = 0;     // ring steps where no later rank needed the block
  double wait_seconds = 0;   // in send_recv (K/V, and dK/dV in backward), over the object's life
};

class RingAttention {
 public:
  // comm: the cp group (its rank is this rank's cp index). doc_start: the
  // batch's (B,T) host document starts over the GLOBAL sequence (the same
  // on every cp rank), null = one document per sequence. Copied.
  RingAttention(Backend& be, Communicator& comm, const CpAttentionShape& shape, const int32_t* doc_start);
  ~RingAttention();
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;

  const SequenceSplit& split() const { return split_; }
  // The next micro-batch's documents (as the constructor's doc_start; null = none).
  void set_documents(const int32_t* doc_start);
  // Bytes it allocated on the backend (the workspace a network adds to its activations).
  size_t bytes() const { return bytes_; }
  // qkv (B, Tl, (NH+2 NKV) HS) act dtype, this rank's rows (split order);
  // out (B, Tl, NH HS) act dtype; lse (B, NH, Tl) fp32, kept for backward.
  // opt: the layer's window, soft-cap and scale (kernels/backend.h).
  void forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt = {});
  // dqkv (B, Tl, (NH+2 NKV) HS) act dtype, overwritten; out and lse: forward's (and its opt).
  void backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                const AttentionOptions& opt = {});
  const RingStats& stats() const { return stats_; }

 private:
  // Per global chunk: the smallest first visible key of its queries over
  // the batch, max(doc start, pos - window + 1), for this window (cached).
  const std::vector<int32_t>& chunk_first_key(int window);
  bool visible(int q_chunk, int k_chunk, int window);  // global chunk indices
  bool needs(int src, int dst, int window);            // does rank dst see any of rank src's keys?
  bool forwarded(int src, int step, int window);       // does src's block leave the rank holding it at `step`?
  // One ring step's transfer (send to r+1, receive from r-1); deferred:
  // Communicator::send_recv_deferred, whose handle the caller orders the
  // compute after once it reads the received block (null: completed).
  std::unique_ptr<PendingCollective> pass(const char* phase, int step, void* send, void* recv, size_t bytes,
                                          bool send_it, bool recv_it, uint32_t tag, bool deferred = false);
  AttentionBlock block(const void* qkv, const void* kv, int qc, int src, int kc, const AttentionOptions& opt) const;

  Backend& be_;
  Communicator& comm_;
  CpAttentionShape shape_;
  SequenceSplit split_;
  std::vector<int32_t> doc_host_;  // (B, T) the batch's global doc starts; empty = none
  std::map<int, std::vector<int32_t>> first_key_;  // window -> chunk_first_key (cleared per batch)
  int32_t* doc_dev_ = nullptr;    // (B, Tl) device: the local rows' global doc starts
  void* kv_[2] = {nullptr, nullptr};    // (B, Tl, 2 NKV HS) act: the block held and the one arriving
  float* dkv_[2] = {nullptr, nullptr};  // (B, Tl, 2 NKV HS) fp32: its dK|dV accumulator, and the arriving one
  void* blk_out_ = nullptr;             // (B, Tc, NH HS) act: one block's partial
  float* blk_lse_ = nullptr;            // (B, NH, Tc)
  float* dq_ = nullptr;                 // (B, Tl, (NH+2 NKV) HS) fp32, laid out like qkv
  RingStats stats_;
  size_t bytes_ = 0;
};

}  // namespace trainrun
