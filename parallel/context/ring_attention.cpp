#include "parallel/context/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "core/common/debug_hooks.h"
#include "core/common/error.h"

namespace trainrun {

namespace {
char* at(void* p, int64_t elems, DType t) { return static_cast<char*>(p) + elems * int64_t(dtype_size(t)); }
const char* at(const void* p, int64_t elems, DType t) {
  return static_cast<const char*>(p) + elems * int64_t(dtype_size(t));
}
}  // namespace

RingAttention::RingAttention(Backend& be, Communicator& comm, const CpAttentionShape& shape, const int32_t* doc_start)
    : be_(be), comm_(comm), shape_(shape), split_(shape.T, comm.world_size(), comm.rank()) {
  TR_CHECK(shape.B >= 1 && shape.NH > 0 && shape.NKV > 0 && shape.HS > 0 && shape.NH % shape.NKV == 0,
           "ring attention: B ", shape.B, ", NH ", shape.NH, ", NKV ", shape.NKV, ", HS ", shape.HS,
           " (NKV must divide NH)");
  const int Tc = split_.chunk(), Tl = split_.local_rows(), B = shape.B;
  doc_dev_ = static_cast<int32_t*>(be_.alloc(size_t(B) * Tl * sizeof(int32_t)));
  bytes_ += size_t(B) * Tl * sizeof(int32_t);
  set_documents(doc_start);
  const DType act = be_.act_dtype();
  const size_t kv_elems = size_t(B) * Tl * 2 * shape.NKV * shape.HS;
  auto alloc = [&](size_t bytes) {
    bytes_ += bytes;
    return be_.alloc(bytes);
  };
  for (int i = 0; i < 2; ++i) {
    kv_[i] = alloc(kv_elems * dtype_size(act));
    dkv_[i] = static_cast<float*>(alloc(kv_elems * sizeof(float)));
  }
  blk_out_ = alloc(size_t(B) * Tc * shape.NH * shape.HS * dtype_size(act));
  blk_lse_ = static_cast<float*>(alloc(size_t(B) * shape.NH * Tc * sizeof(float)));
  dq_ = static_cast<float*>(alloc(size_t(B) * Tl * (shape.NH + 2 * shape.NKV) * shape.HS * sizeof(float)));
}

void RingAttention::set_documents(const int32_t* doc_start) {
  const int B = shape_.B;
  if (doc_start)
    doc_host_.assign(doc_start, doc_start + int64_t(B) * shape_.T);
  else
    doc_host_.clear();
  first_key_.clear();
  const LocalDocumentMask local = split_document_mask(doc_start, B, split_);
  be_.copy_to_device(doc_dev_, local.doc_start.data(), local.doc_start.size() * sizeof(int32_t));
}

RingAttention::~RingAttention() {
  for (void* p : {static_cast<void*>(doc_dev_), kv_[0], kv_[1], static_cast<void*>(dkv_[0]),
                  static_cast<void*>(dkv_[1]), blk_out_, static_cast<void*>(blk_lse_), static_cast<void*>(dq_)})
    if (p) be_.free(p);
}

const std::vector<int32_t>& RingAttention::chunk_first_key(int window) {
  auto it = first_key_.find(window);
  if (it != first_key_.end()) return it->second;
  const int N = split_.cp(), Tc = split_.chunk(), T = shape_.T;
  std::vector<int32_t> first(size_t(2 * N));
  for (int c = 0; c < 2 * N; ++c) {
    int32_t m = c * Tc;  // a query always sees itself
    for (int b = 0; b < (doc_host_.empty() ? 1 : shape_.B); ++b)
      for (int t = c * Tc; t < (c + 1) * Tc; ++t) {
        int32_t f = doc_host_.empty() ? 0 : doc_host_[size_t(int64_t(b) * T + t)];
        if (window > 0) f = std::max(f, int32_t(t - window + 1));
        m = std::min(m, f);
      }
    first[size_t(c)] = m;
  }
  return first_key_.emplace(window, std::move(first)).first->second;
}

bool RingAttention::visible(int q_chunk, int k_chunk, int window) {
  const int Tc = split_.chunk();
  // Causal: some key not after the chunk's last query; documents and
  // window: some key at or after the earliest first visible key of the
  // chunk's queries. Exact: that query sees the chunk's keys from there up
  // to itself (or to the chunk's end when the chunk is earlier).
  return k_chunk <= q_chunk && (k_chunk + 1) * Tc - 1 >= chunk_first_key(window)[size_t(q_chunk)];
}

bool RingAttention::needs(int src, int dst, int window) {
  for (int qc = 0; qc < 2; ++qc)
    for (int kc = 0; kc < 2; ++kc)
      if (visible(split_.global_chunk_of(dst, qc), split_.global_chunk_of(src, kc), window)) return true;
  return false;
}

bool RingAttention::forwarded(int src, int step, int window) {
  const int N = split_.cp();
  for (int later = step + 1; later < N; ++later)
    if (needs(src, (src + later) % N, window)) return true;
  return false;
}

std::unique_ptr<PendingCollective> RingAttention::pass(const char* phase, int step, void* send, void* recv,
                                                       size_t bytes, bool send_it, bool recv_it, uint32_t tag,
                                                       bool deferred) {
  const int N = split_.cp(), r = split_.rank();
  std::unique_ptr<PendingCollective> pending;
  if (!send_it && !recv_it) return pending;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const void* sb = send_it ? send : nullptr;
    void* rb = recv_it ? recv : nullptr;
    const size_t sn = send_it ? bytes : 0, rn = recv_it ? bytes : 0;
    const int to = send_it ? (r + 1) % N : -1, from = recv_it ? (r + N - 1) % N : -1;
    if (deferred)
      pending = comm_.send_recv_deferred(sb, sn, to, rb, rn, from, tag);
    else
      comm_.send_recv(sb, sn, to, rb, rn, from, tag);
  } catch (const std::exception& e) {
    TR_FAIL("ring attention ", phase, " (cp group ", comm_.group().empty() ? std::string("unnamed") : comm_.group(),
            ", cp rank ", r, " of ", N, ", ring step ", step + 1, " of ", N, "): ", e.what());
  }
  // Blocking transfers (Gloo): the time the compute thread waited on K/V.
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return pending;
}

AttentionBlock RingAttention::block(const void* qkv, const void* kv, int qc, int src, int kc,
                                    const AttentionOptions& opt) const {
  const DType act = be_.act_dtype();
  const int Tc = split_.chunk(), Tl = split_.local_rows();
  const int NH = shape_.NH, NKV = shape_.NKV, HS = shape_.HS;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, kv_ld = int64_t(2) * NKV * HS, C = int64_t(NH) * HS;
  AttentionBlock a;
  a.B = shape_.B, a.Tq = Tc, a.Tk = Tc, a.NH = NH, a.NKV = NKV, a.HS = HS;
  a.q_pos0 = split_.global_chunk(qc) * Tc;
  a.k_pos0 = split_.global_chunk_of(src, kc) * Tc;
  a.q = at(qkv, int64_t(qc) * Tc * ld, act);
  a.q_ld = ld, a.q_bs = Tl * ld;
  a.k = at(kv, int64_t(kc) * Tc * kv_ld, act);
  a.v = at(kv, int64_t(kc) * Tc * kv_ld + int64_t(NKV) * HS, act);
  a.kv_ld = kv_ld, a.kv_bs = Tl * kv_ld;
  // The final out / lse rows of query chunk qc (callers override for a partial).
  a.o_ld = C, a.o_bs = Tl * C;
  a.lse_bs = int64_t(NH) * Tl, a.lse_hs = Tl;
  a.q_doc = doc_dev_ + int64_t(qc) * Tc;
  a.doc_bs = Tl;
  a.window = opt.window, a.softcap = opt.softcap, a.scale = opt.scale;
  return a;
}

void RingAttention::forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt) {
  const int W = opt.window;
  const DType act = be_.act_dtype();
  const int N = split_.cp(), r = split_.rank(), Tc = split_.chunk(), Tl = split_.local_rows();
  const int NH = shape_.NH, NKV = shape_.NKV, HS = shape_.HS;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, kv_ld = int64_t(2) * NKV * HS, C = int64_t(NH) * HS;
  const size_t kv_bytes = size_t(shape_.B) * Tl * kv_ld * dtype_size(act);
  const double waited = stats_.wait_seconds;  // cumulative; the counts are per pass
  stats_ = RingStats{};
  stats_.wait_seconds = waited;
  // This rank's K|V, packed, is the first block.
  be_.copy_rows(kv_[0], act, kv_ld, at(qkv, int64_t(NH) * HS, act), act, ld, int64_t(shape_.B) * Tl, kv_ld);
  int cur = 0;
  bool held = true, started[2] = {false, false};
  for (int s = 0; s < N; ++s) {
    const int src = (r + N - s) % N;
    // Double buffering: the block the next step needs is in flight (into
    // kv_[1 - cur]) while this step's attention reads kv_[cur]; on NCCL the
    // two overlap, on Gloo the transfer completes first.
    std::unique_ptr<PendingCollective> next;
    bool recv_it = false;
    if (s < N - 1) {
      if (s == 0) debug_cp_kill_hook();  // tests: TRAINRUN_DEBUG_CP_KILL (core/common/debug_hooks.h)
      const bool send_it = held && forwarded(src, s, W);
      recv_it = forwarded((r + N - 1 - s) % N, s, W);  // what rank r-1 holds at step s
      if (send_it) ++stats_.sends;
      else if (held) ++stats_.sends_skipped;
      next = pass("forward", s, kv_[cur], kv_[1 - cur], kv_bytes, send_it, recv_it, 1, /*deferred=*/true);
    }
    for (int qc = 0; qc < 2 && held; ++qc)
      for (int kc = 0; kc < 2; ++kc) {
        if (!visible(split_.global_chunk(qc), split_.global_chunk_of(src, kc), W)) {
          ++stats_.blocks_skipped;
          continue;
        }
        ++stats_.blocks_computed;
        AttentionBlock a = block(qkv, kv_[cur], qc, src, kc, opt);
        void* o = at(out, int64_t(qc) * Tc * C, act);
        float* l = lse + int64_t(qc) * Tc;
        if (!started[qc]) {  // the chunk's first partial goes straight to the result
          be_.attention_block_forward(o, l, a);
          started[qc] = true;
          continue;
        }
        AttentionBlock p = a;  // the partial, dense
        p.o_ld = C, p.o_bs = int64_t(Tc) * C, p.lse_bs = int64_t(NH) * Tc, p.lse_hs = Tc;
        be_.attention_block_forward(blk_out_, blk_lse_, p);
        be_.attention_block_merge(o, l, blk_out_, blk_lse_, a);
      }
    if (s == N - 1) break;
    if (next) next->order_compute_after();  // the next block has landed before anything reads it
    cur = 1 - cur;
    held = recv_it;
  }
  TR_CHECK(started[0] && started[1], "ring attention: a query chunk saw no key (a bug: it always sees itself)");
}

void RingAttention::backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                             const AttentionOptions& opt) {
  const int W = opt.window;
  const DType act = be_.act_dtype();
  const int N = split_.cp(), r = split_.rank(), Tc = split_.chunk(), Tl = split_.local_rows();
  const int NH = shape_.NH, NKV = shape_.NKV, HS = shape_.HS;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, kv_ld = int64_t(2) * NKV * HS, C = int64_t(NH) * HS;
  const int64_t rows = int64_t(shape_.B) * Tl;
  const size_t kv_bytes = size_t(rows * kv_ld) * dtype_size(act), dkv_bytes = size_t(rows * kv_ld) * sizeof(float);
  be_.zero(dq_, size_t(rows * ld) * sizeof(float));
  be_.zero(dkv_[0], dkv_bytes);
  be_.copy_rows(kv_[0], act, kv_ld, at(qkv, int64_t(NH) * HS, act), act, ld, rows, kv_ld);
  int cur = 0;
  bool held = true;
  for (int s = 0; s < N; ++s) {
    const int src = (r + N - s) % N;
    // K/V go on while a later rank needs them, in flight during this step's
    // backward (double-buffered as in forward); the dK|dV accumulator, which
    // this step adds to, goes on after it, always, so that after N passes
    // each rank holds its own block's.
    const bool send_it = s < N - 1 && held && forwarded(src, s, W);
    const bool recv_it = s < N - 1 && forwarded((r + N - 1 - s) % N, s, W);
    std::unique_ptr<PendingCollective> next =
        pass("backward (K/V)", s, kv_[cur], kv_[1 - cur], kv_bytes, send_it, recv_it, 2, /*deferred=*/true);
    for (int qc = 0; qc < 2 && held; ++qc)
      for (int kc = 0; kc < 2; ++kc) {
        if (!visible(split_.global_chunk(qc), split_.global_chunk_of(src, kc), W)) continue;
        const AttentionBlock a = block(qkv, kv_[cur], qc, src, kc, opt);
        float* dk = dkv_[cur] + int64_t(kc) * Tc * kv_ld;
        be_.attention_block_backward(dq_ + int64_t(qc) * Tc * ld, dk, dk + int64_t(NKV) * HS,
                                     at(dout, int64_t(qc) * Tc * C, act), at(out, int64_t(qc) * Tc * C, act),
                                     lse + int64_t(qc) * Tc, a);
      }
    if (next) next->order_compute_after();
    pass("backward (dK/dV)", s, dkv_[cur], dkv_[1 - cur], dkv_bytes, true, true, 3);
    cur = 1 - cur;
    held = recv_it;
  }
  // dqkv = dq | dK dV of this rank's own block, in the act dtype.
  be_.copy_rows(dqkv, act, ld, dq_, DType::F32, ld, rows, C);
  be_.copy_rows(at(dqkv, C, act), act, ld, dkv_[cur], DType::F32, kv_ld, rows, kv_ld);
}

}  // namespace trainrun
