#include "parallel/context/cp_attention.h"

#include <vector>

#include "core/common/error.h"
#include "parallel/context/all_to_all_attention.h"
#include "parallel/context/ring_attention.h"
#include "parallel/context/sequence_split.h"

namespace trainrun {

void check_context_parallel_model(const ModelConfig& cfg, const ContextParallel& cp) {
  const int N = cp.size();
  TR_CHECK(cp.mode == "ring" || cp.mode == "all_to_all", "parallel.cp_mode: '", cp.mode,
           "' is not one of ring, all_to_all");
  TR_CHECK(cfg.T % (2 * N) == 0, "model.seq_len ", cfg.T, " is not a multiple of 2 x parallel.context_parallel (",
           2 * N, "); use a multiple of ", 2 * N);
  // The sliding window, Gemma 2's soft-cap and query scale go into the
  // block ops per layer (CpAttention::forward's opt); a backend whose block
  // op lacks one refuses it there, by name.
}

CpAttention::CpAttention(Backend& be, const ContextParallel& cp, int maxB, int T, int NH, int NKV, int HS)
    : be_(be), cp_(cp), maxB_(maxB), T_(T), NH_(NH), NKV_(NKV), HS_(HS) {
  TR_CHECK(cp.comm && cp.size() > 1, "CpAttention needs a cp group of 2 or more ranks (a bug)");
  TR_CHECK(T % (2 * cp.size()) == 0, "model.seq_len ", T, " is not a multiple of 2 x parallel.context_parallel (",
           2 * cp.size(), ")");
  // The rows' global positions, for every sequence of a micro-batch.
  const SequenceSplit split(T, cp.size(), cp.rank());
  const LocalDocumentMask global = split_document_mask(nullptr, maxB, split);
  pos_ = static_cast<int32_t*>(be_.alloc(global.pos.size() * 4));
  be_.copy_to_device(pos_, global.pos.data(), global.pos.size() * 4);
  rebuild(maxB);  // built once up front: its workspace counts in the arena from the start
}

CpAttention::~CpAttention() {
  ring_.reset();
  a2a_.reset();
  if (pos_) be_.free(pos_);
}

void CpAttention::rebuild(int B) {
  waited_before_ = wait_seconds();
  ring_.reset();
  a2a_.reset();
  const CpAttentionShape shape{B, T_, NH_, NKV_, HS_};
  if (cp_.mode == "all_to_all")
    a2a_ = std::make_unique<AllToAllAttention>(be_, *cp_.comm, shape, nullptr);
  else
    ring_ = std::make_unique<RingAttention>(be_, *cp_.comm, shape, nullptr);
  B_ = B;
}

DocumentMask CpAttention::begin_batch(int B, const DocumentMask& docs) {
  TR_CHECK(B >= 1 && B <= maxB_, "context parallelism: micro-batch ", B, " exceeds the buffers (", maxB_, ")");
  TR_CHECK(!docs.on() || docs.host_doc_start, "context parallelism: a document mask without the global host "
                                              "doc starts (DocumentMask::host_doc_start; a bug)");
  if (B != B_) rebuild(B);
  const int32_t* host = docs.on() ? docs.host_doc_start : nullptr;
  if (ring_) ring_->set_documents(host);
  if (a2a_) a2a_->set_documents(host);
  if (docs.on()) return docs;
  DocumentMask m;
  m.pos = pos_;  // sequence b's rows start at b*Tl, as the backend's (B,T) arrays do
  return m;
}

void CpAttention::forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt) {
  if (ring_)
    ring_->forward(out, lse, qkv, opt);
  else
    a2a_->forward(out, lse, qkv, opt);
}

void CpAttention::backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                           const AttentionOptions& opt) {
  if (ring_)
    ring_->backward(dqkv, dout, qkv, out, lse, opt);
  else
    a2a_->backward(dqkv, dout, qkv, out, lse, opt);
}

size_t CpAttention::workspace_bytes() const {
  const size_t pos = size_t(maxB_) * local_rows() * 4;
  return pos + (ring_ ? ring_->bytes() : 0) + (a2a_ ? a2a_->bytes() : 0);
}

size_t CpAttention::workspace_bytes_for(const std::string& mode, int B, int T, int cp, int NH, int NKV, int HS,
                                        int act_bytes) {
  const size_t b = size_t(B), Tl = size_t(T / cp), Tc = size_t(T / (2 * cp)), hs = size_t(HS);
  const size_t es = size_t(act_bytes);
  size_t bytes = b * Tl * 4;  // positions
  if (mode == "all_to_all") {
    const size_t nh = size_t(NH / cp), nkv = size_t(NKV % cp == 0 ? NKV / cp : 1);
    const size_t W2 = (nh + 2 * nkv) * hs + 2 * nh * hs, big = b * size_t(T) * W2;
    bytes += 3 * big * 4 + big * es + b * Tl * 2 * size_t(NKV) * hs * 4 + b * size_t(T) * 4;
  } else {
    const size_t kv = b * Tl * 2 * size_t(NKV) * hs;
    bytes += b * Tl * 4 + 2 * kv * es + 2 * kv * 4 + b * Tc * size_t(NH) * hs * es + b * size_t(NH) * Tc * 4 +
             b * Tl * size_t(NH + 2 * NKV) * hs * 4;
  }
  return bytes;
}

double CpAttention::wait_seconds() const {
  return waited_before_ + (ring_ ? ring_->stats().wait_seconds : 0) + (a2a_ ? a2a_->wait_seconds() : 0);
}

}  // namespace trainrun
