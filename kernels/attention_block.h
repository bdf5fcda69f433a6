// One block of attention between a query block and a key/value block of a
// longer sequence: the piece context parallelism (parallel/context/) builds
// causal, document-masked attention from when the sequence is split over
// ranks. Backend ops (kernels/backend.h): attention_block_forward /
// _backward / _merge and copy_rows; CPU in kernels/cpu/attention_block.cpp,
// CUDA in kernels/cuda/attention_block.cu.
//
// Positions are global (indices in the whole sequence): query row i of the
// block is at q_pos0 + i, key row j at k_pos0 + j. Query i may see key j iff
//     max(doc(i), q_pos0 + i - window + 1) <= k_pos0 + j <= q_pos0 + i,
// (the window term only with window > 0),
// doc(i) = q_doc[b*doc_bs + i] (the global index where i's document starts,
// kernels/backend.h's doc_start) or 0 without document masks. So a block
// whose keys all lie after its queries, or before their documents, is all
// masked (or, with a window, all before the queries' windows): the caller
// skips it rather than calling the op.
//
// GQA: query head h reads key/value head h / (NH/NKV). Every operand is a
// strided view, so the q heads of a (B,T,(NH+2*NKV)*HS) qkv, a packed K/V
// buffer and sub-blocks of either are passed without copies:
//   q[b*q_bs + i*q_ld + h*HS + c]                     (B,Tq,NH,HS)
//   k[b*kv_bs + j*kv_ld + g*HS + c], v likewise          (B,Tk,NKV,HS)
//   out[b*o_bs + i*o_ld + h*HS + c] (act dtype)          (B,Tq,NH,HS)
//   lse[b*lse_bs + h*lse_hs + i]    (fp32)               (B,NH,Tq)
// Forward: out = softmax_visible(q k^T / sqrt(HS)) v and lse = the row's
// log-sum-exp of the scaled scores over its visible keys; a row that sees
// no key of the block gets out = 0 and lse = -inf.
// Merge: the online-softmax combination of two partials of the same rows,
//   lse' = log(e^lse + e^lse_b), out' = e^(lse-lse') out + e^(lse_b-lse') out_b,
// with the block partial dense ((B,Tq,NH*HS) and (B,NH,Tq)); applied in a
// fixed order it makes the result deterministic.
// Backward (the flash recompute): with the FINAL out and lse of the rows
// (over every block) and D_i = rowsum(dout_i * out_i),
//   P = exp(q k^T / sqrt(HS) - lse) on visible pairs, dS = P (dout v^T - D),
//   dq += dS k / sqrt(HS), dk += dS^T q / sqrt(HS), dv += P^T dout,
// (with a soft-cap, dS also takes the cap's derivative 1 - tanh^2),
// accumulated (+=) into fp32 buffers laid out like q (dq) and k/v (dk, dv);
// a KV head's sum over its query heads runs in head order (deterministic).
#pragma once
#include <cstdint>

namespace trainrun {

struct AttentionBlock {
  int B = 1, Tq = 0, Tk = 0, NH = 0, NKV = 0, HS = 0;
  int q_pos0 = 0, k_pos0 = 0;          // global positions of query row 0 / key row 0
  const void* q = nullptr;             // act dtype, see above
  int64_t q_ld = 0, q_bs = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kv_ld = 0, kv_bs = 0;
  int64_t o_ld = 0, o_bs = 0;          // out (forward's output; backward's out and dout)
  int64_t lse_bs = 0, lse_hs = 0;      // lse (forward's output; backward's input)
  const int32_t* q_doc = nullptr;      // (B, ...) device int32: global doc start of each query row; null = 0
  int64_t doc_bs = 0;
  // The layer's AttentionOptions (kernels/backend.h), on global positions:
  // window > 0 narrows query i to keys k_pos0 + j >= q_pos0 + i - window + 1
  // (and doc(i)); softcap > 0 caps the scaled scores, s -> softcap *
  // tanh(s / softcap), before the mask; scale > 0 replaces 1 / sqrt(HS) (in
  // the backward too). The lse is over the capped scores, so the merge is
  // unchanged. A backend that does not implement a field refuses a nonzero
  // one by name, so a model is never silently computed without it.
  int window = 0;
  float softcap = 0.f;
  float scale = 0.f;
};

}  // namespace trainrun
