// A network's attention under context parallelism (issue 27): what
// core/model's networks call instead of the one-rank attention op when
// parallel.context_parallel > 1, so that the networks stay sequence-local
// and the cp logic lives here.
//
// The network runs every other op on this rank's rows (SequenceSplit: chunk
// i and chunk 2N-1-i of each sequence, Tl = T / N rows per sequence). Per
// micro-batch it calls begin_batch, which hands the ring / all_to_all
// attention the batch's GLOBAL document starts (the host array every cp rank
// made from the same sequences) and returns the positions the row-local
// ops use (RoPE, GPT-2's position table): the rows' global positions, or,
// with document masks, the position inside the document, which restarts at
// 0 even when the document began in a chunk another rank holds.
//
// One CpAttention serves every layer of a network (the attention classes
// keep no per-layer state: each layer keeps its own output and log-sum-exp,
// B*NH*Tl floats, in its activations).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/model/model.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

class RingAttention;
class AllToAllAttention;

// What a network needs to know about the cp group (make_network's cp).
struct ContextParallel {
  Communicator* comm = nullptr;  // the cp group; its rank is this rank's cp index
  std::string mode = "ring";     // parallel.cp_mode: ring | all_to_all
  int size() const { return comm ? comm->world_size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
};

class CpAttention {
 public:
  // T: the GLOBAL sequence length (a multiple of 2 x cp); NH, NKV, HS: the
  // heads this rank computes (its tensor-parallel share).
  CpAttention(Backend& be, const ContextParallel& cp, int maxB, int T, int NH, int NKV, int HS);
  ~CpAttention();
  CpAttention(const CpAttention&) = delete;
  CpAttention& operator=(const CpAttention&) = delete;

  int local_rows() const { return T_ / cp_.size(); }  // Tl
  // The floats one layer keeps for the backward (its log-sum-exp), per micro-batch of B.
  static int64_t saved_floats(int B, int T, int cp, int NH) { return int64_t(B) * NH * (T / cp); }
  // One micro-batch of B sequences: `docs` holds this rank's rows
  // (doc_start, pos; split_document_mask) and host_doc_start the whole
  // sequences' starts, or is empty (one document per sequence). Returns the
  // mask the row-local ops read: pos = the global positions without documents.
  DocumentMask begin_batch(int B, const DocumentMask& docs);
  // As RingAttention / AllToAllAttention (qkv (B,Tl,(NH+2NKV)HS), out (B,Tl,NH HS), lse saved_floats).
  // opt: the layer's window, soft-cap and scale (LlamaNetwork::attn_opt).
  void forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt = {});
  void backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                const AttentionOptions& opt = {});
  // What it allocated on the backend: the activation workspace of the cp attention.
  size_t workspace_bytes() const;
  // The same from the shapes (the planner's; act_bytes: the activation
  // dtype's size): the positions, and the ring's two K/V blocks, their two
  // fp32 dK/dV accumulators, one chunk's partial and an fp32 dq|dk|dv; or
  // all_to_all's whole-sequence buffers of the rank's heads.
  static size_t workspace_bytes_for(const std::string& mode, int B, int T, int cp, int NH, int NKV, int HS,
                                    int act_bytes);
  // Seconds the compute thread spent waiting on K/V transfers (ring) or the
  // exchanges (all_to_all), over the object's life.
  double wait_seconds() const;

 private:
  void rebuild(int B);

  Backend& be_;
  ContextParallel cp_;
  int maxB_, T_, NH_, NKV_, HS_;
  int B_ = 0;                               // the micro-batch the attention is built for
  int32_t* pos_ = nullptr;                  // (maxB, Tl) device: the rows' global positions
  std::unique_ptr<RingAttention> ring_;
  std::unique_ptr<AllToAllAttention> a2a_;
  double waited_before_ = 0;                // wait of attentions rebuilt for another B
};

// The refusals of a model that context parallelism cannot compute yet,
// naming the key (called by the networks when built with a cp group).
void check_context_parallel_model(const ModelConfig& cfg, const ContextParallel& cp);

}  // namespace trainrun
