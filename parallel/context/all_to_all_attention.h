// All-to-all attention (parallel.cp_mode: all_to_all; DeepSpeed-Ulysses):
// heads are exchanged for sequence. Each of the N ranks of a cp group holds
// its SequenceSplit rows of every head; one all_to_all gives each rank
// every row (T, in global order) of NH/N query heads and the key/value
// heads they read, attention runs there on the whole sequence (causal and
// document masks on global positions: Backend::attention_block_forward with
// one block), and a second all_to_all returns the output rows to their
// owners. Needs NH % N == 0 (the job spec checks n_head % (cp x tp));
// key/value heads are split when NKV % N == 0 and replicated otherwise
// (N % NKV == 0: each rank gets the one KV head its query heads read, and
// the gradients of a KV head are summed over the ranks that read it, in
// rank order). Other (NH, NKV, N) are refused with what would work.
//
// Backward: q, k, v, the output and its gradient are exchanged again (one
// all_to_all), the block backward recomputes against the saved log-sum-exp,
// and dq | dk | dv (fp32) go back in one all_to_all. The lse buffer
// (B*NH*Tl floats, the same size as ring attention's) holds this mode's own
// layout, (B, NH/N, T): pass the forward's to the backward untouched.
#pragma once
#include <cstdint>

#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/context/ring_attention.h"
#include "parallel/context/sequence_split.h"

namespace trainrun {

class AllToAllAttention {
 public:
  // comm: the cp group; doc_start: the (B,T) host document starts of the
  // GLOBAL sequence (the same on every cp rank), null = none. Copied.
  AllToAllAttention(Backend& be, Communicator& comm, const CpAttentionShape& shape, const int32_t* doc_start);
  ~AllToAllAttention();
  AllToAllAttention(const AllToAllAttention&) = delete;
  AllToAllAttention& operator=(const AllToAllAttention&) = delete;

  const SequenceSplit& split() const { return split_; }
  // The next micro-batch's documents (as the constructor's doc_start; null = none).
  void set_documents(const int32_t* doc_start);
  size_t bytes() const { return bytes_; }                  // what it allocated on the backend
  double wait_seconds() const { return wait_seconds_; }    // in all_to_all, over its life
  // As RingAttention: qkv (B,Tl,(NH+2NKV)HS), out (B,Tl,NH HS), lse B*NH*Tl floats.
  // opt: the layer's window, soft-cap and scale, applied on the whole sequence's global positions.
  void forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt = {});
  void backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                const AttentionOptions& opt = {});

 private:
  int kv_first(int rank) const;  // the first KV head rank `rank` works with
  void exchange(const char* phase, void* out, const void* in, size_t bytes_per_rank);
  AttentionBlock whole(int width, const AttentionOptions& opt) const;  // one block: every row of the local heads, in `full_`

  Backend& be_;
  Communicator& comm_;
  CpAttentionShape shape_;
  SequenceSplit split_;
  int nh_ = 0, nkv_ = 0;            // heads per rank after the exchange
  int32_t* doc_buf_ = nullptr;      // (B,T) global doc starts
  int32_t* doc_dev_ = nullptr;      // doc_buf_ when the batch has documents, else null
  void* send_ = nullptr;            // (N, B, Tl, W2) act / fp32: what goes to each rank
  void* recv_ = nullptr;            // (N, B, Tl, W2) act / fp32: what came from each rank
  void* full_ = nullptr;            // (B, T, W2) act: q | k | v | out | dout of the local heads, global order
  float* grad_ = nullptr;           // (B, T, W2) fp32: dq | dk | dv of the local heads (laid out like full_)
  float* dkv_ = nullptr;            // (B, Tl, 2 NKV HS) fp32: this rank's dK|dV, summed over the ranks
  size_t bytes_ = 0;
  double wait_seconds_ = 0;
};

}  // namespace trainrun
