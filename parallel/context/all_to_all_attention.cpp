#include "parallel/context/all_to_all_attention.h"

#include <chrono>
#include <string>

#include "core/common/error.h"

namespace trainrun {

namespace {
char* at(void* p, int64_t elems, DType t) { return static_cast<char*>(p) + elems * int64_t(dtype_size(t)); }
const char* at(const void* p, int64_t elems, DType t) {
  return static_cast<const char*>(p) + elems * int64_t(dtype_size(t));
}
}  // namespace

AllToAllAttention::AllToAllAttention(Backend& be, Communicator& comm, const CpAttentionShape& shape,
                                     const int32_t* doc_start)
    : be_(be), comm_(comm), shape_(shape), split_(shape.T, comm.world_size(), comm.rank()) {
  const int N = split_.cp(), NH = shape.NH, NKV = shape.NKV;
  TR_CHECK(shape.B >= 1 && NH > 0 && NKV > 0 && shape.HS > 0 && NH % NKV == 0, "all_to_all attention: B ", shape.B,
           ", NH ", NH, ", NKV ", NKV, ", HS ", shape.HS, " (NKV must divide NH)");
  TR_CHECK(NH % N == 0, "all_to_all attention: ", NH, " attention heads do not split over cp ", N,
           " ranks; use parallel.cp_mode: ring or a context_parallel that divides model.n_head");
  TR_CHECK(NKV % N == 0 || N % NKV == 0, "all_to_all attention: ", NKV, " key/value heads over cp ", N,
           " ranks: neither splits them (NKV % cp) nor replicates whole heads (cp % NKV); use "
           "parallel.cp_mode: ring");
  nh_ = NH / N;
  nkv_ = NKV % N == 0 ? NKV / N : 1;
  const int64_t B = shape.B, T = shape.T, HS = shape.HS;
  const int64_t W2 = int64_t(nh_ + 2 * nkv_) * HS + 2 * int64_t(nh_) * HS;
  const size_t big = size_t(B * T * W2) * 4;  // fp32 is the widest element either way
  auto alloc = [&](size_t bytes) {
    bytes_ += bytes;
    return be_.alloc(bytes);
  };
  send_ = alloc(big);
  recv_ = alloc(big);
  full_ = alloc(size_t(B * T * W2) * dtype_size(be_.act_dtype()));
  grad_ = static_cast<float*>(alloc(big));
  dkv_ = static_cast<float*>(alloc(size_t(B * split_.local_rows() * 2 * NKV * HS) * 4));
  doc_buf_ = static_cast<int32_t*>(alloc(size_t(B * T) * 4));
  set_documents(doc_start);
}

void AllToAllAttention::set_documents(const int32_t* doc_start) {
  doc_dev_ = doc_start ? doc_buf_ : nullptr;
  if (doc_start) be_.copy_to_device(doc_buf_, doc_start, size_t(shape_.B) * shape_.T * 4);
}

AllToAllAttention::~AllToAllAttention() {
  for (void* p : {send_, recv_, full_, static_cast<void*>(grad_), static_cast<void*>(dkv_),
                  static_cast<void*>(doc_buf_)})
    if (p) be_.free(p);
}

int AllToAllAttention::kv_first(int rank) const {
  const int R = shape_.NH / shape_.NKV;
  return rank * nh_ / R;  // the KV head of the rank's first query head (and, split, its whole share)
}

void AllToAllAttention::exchange(const char* phase, void* out, const void* in, size_t bytes_per_rank) {
  const auto t0 = std::chrono::steady_clock::now();
  struct Timed {  // the wait counts on the error path too
    std::chrono::steady_clock::time_point t0;
    double& sum;
    ~Timed() { sum += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  } timed{t0, wait_seconds_};
  try {
    comm_.all_to_all(out, in, bytes_per_rank);
  } catch (const std::exception& e) {
    TR_FAIL("all_to_all attention ", phase, " (cp group ",
            comm_.group().empty() ? std::string("unnamed") : comm_.group(), ", cp rank ", split_.rank(), " of ",
            split_.cp(), "): ", e.what());
  }
}

AttentionBlock AllToAllAttention::whole(int width, const AttentionOptions& opt) const {
  const DType act = be_.act_dtype();
  const int64_t T = shape_.T, HS = shape_.HS;
  AttentionBlock a;
  a.B = shape_.B, a.Tq = shape_.T, a.Tk = shape_.T, a.NH = nh_, a.NKV = nkv_, a.HS = shape_.HS;
  a.q = full_;
  a.q_ld = width, a.q_bs = T * width;
  a.k = at(full_, nh_ * HS, act);
  a.v = at(full_, (nh_ + nkv_) * HS, act);
  a.kv_ld = width, a.kv_bs = T * width;
  a.o_ld = width, a.o_bs = T * width;
  a.lse_bs = int64_t(nh_) * T, a.lse_hs = T;
  a.q_doc = doc_dev_;
  a.doc_bs = T;
  a.window = opt.window, a.softcap = opt.softcap, a.scale = opt.scale;
  return a;
}

void AllToAllAttention::forward(void* out, float* lse, const void* qkv, const AttentionOptions& opt) {
  const DType act = be_.act_dtype();
  const int N = split_.cp(), NH = shape_.NH, NKV = shape_.NKV;
  const int64_t B = shape_.B, T = shape_.T, HS = shape_.HS, Tl = split_.local_rows(), Tc = split_.chunk();
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, C = int64_t(NH) * HS, hq = int64_t(nh_) * HS, hk = int64_t(nkv_) * HS;
  const int64_t w = hq + 2 * hk, W2 = w + 2 * hq, rows = B * Tl;
  // 1. To rank j: its query heads and their KV heads, for this rank's rows.
  for (int j = 0; j < N; ++j) {
    char* base = at(send_, j * rows * w, act);
    be_.copy_rows(base, act, w, at(qkv, j * hq, act), act, ld, rows, hq);
    be_.copy_rows(base + hq * int64_t(dtype_size(act)), act, w, at(qkv, C + kv_first(j) * HS, act), act, ld, rows, hk);
    be_.copy_rows(base + (hq + hk) * int64_t(dtype_size(act)), act, w,
                  at(qkv, C + int64_t(NKV) * HS + kv_first(j) * HS, act), act, ld, rows, hk);
  }
  exchange("forward (q, k, v)", recv_, send_, size_t(rows * w) * dtype_size(act));
  // 2. Every rank's rows into global order, then attention over the whole sequence.
  for (int i = 0; i < N; ++i)
    for (int64_t b = 0; b < B; ++b)
      for (int c = 0; c < 2; ++c)
        be_.copy_rows(at(full_, (b * T + split_.global_chunk_of(i, c) * Tc) * W2, act), act, W2,
                      at(recv_, ((i * B + b) * Tl + c * Tc) * w, act), act, w, Tc, w);
  const AttentionBlock a = whole(int(W2), opt);
  be_.attention_block_forward(at(full_, w, act), lse, a);
  // 3. The output rows back to their owners, then heads side by side.
  for (int i = 0; i < N; ++i)
    for (int64_t b = 0; b < B; ++b)
      for (int c = 0; c < 2; ++c)
        be_.copy_rows(at(send_, ((i * B + b) * Tl + c * Tc) * hq, act), act, hq,
                      at(full_, (b * T + split_.global_chunk_of(i, c) * Tc) * W2 + w, act), act, W2, Tc, hq);
  exchange("forward (output)", recv_, send_, size_t(rows * hq) * dtype_size(act));
  for (int j = 0; j < N; ++j) be_.copy_rows(at(out, j * hq, act), act, C, at(recv_, j * rows * hq, act), act, hq, rows, hq);
}

void AllToAllAttention::backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                                 const AttentionOptions& opt) {
  const DType act = be_.act_dtype(), f32 = DType::F32;
  const int N = split_.cp(), NH = shape_.NH, NKV = shape_.NKV;
  const int64_t B = shape_.B, T = shape_.T, HS = shape_.HS, Tl = split_.local_rows(), Tc = split_.chunk();
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, C = int64_t(NH) * HS, hq = int64_t(nh_) * HS, hk = int64_t(nkv_) * HS;
  const int64_t w = hq + 2 * hk, W2 = w + 2 * hq, rows = B * Tl, KV2 = 2 * int64_t(NKV) * HS;
  const int64_t es = int64_t(dtype_size(act));
  // 1. q | k | v | out | dout of rank j's heads, for this rank's rows.
  for (int j = 0; j < N; ++j) {
    char* base = at(send_, j * rows * W2, act);
    be_.copy_rows(base, act, W2, at(qkv, j * hq, act), act, ld, rows, hq);
    be_.copy_rows(base + hq * es, act, W2, at(qkv, C + kv_first(j) * HS, act), act, ld, rows, hk);
    be_.copy_rows(base + (hq + hk) * es, act, W2, at(qkv, C + int64_t(NKV) * HS + kv_first(j) * HS, act), act, ld,
                  rows, hk);
    be_.copy_rows(base + w * es, act, W2, at(out, j * hq, act), act, C, rows, hq);
    be_.copy_rows(base + (w + hq) * es, act, W2, at(dout, j * hq, act), act, C, rows, hq);
  }
  exchange("backward (q, k, v, out, dout)", recv_, send_, size_t(rows * W2) * dtype_size(act));
  for (int i = 0; i < N; ++i)
    for (int64_t b = 0; b < B; ++b)
      for (int c = 0; c < 2; ++c)
        be_.copy_rows(at(full_, (b * T + split_.global_chunk_of(i, c) * Tc) * W2, act), act, W2,
                      at(recv_, ((i * B + b) * Tl + c * Tc) * W2, act), act, W2, Tc, W2);
  // 2. The flash recompute over the whole sequence of the local heads.
  be_.zero(grad_, size_t(B * T * W2) * 4);
  const AttentionBlock a = whole(int(W2), opt);
  be_.attention_block_backward(grad_, grad_ + hq, grad_ + hq + hk, at(full_, w + hq, act), at(full_, w, act), lse, a);
  // 3. dq | dk | dv rows back to their owners (fp32).
  for (int i = 0; i < N; ++i)
    for (int64_t b = 0; b < B; ++b)
      for (int c = 0; c < 2; ++c)
        be_.copy_rows(static_cast<float*>(send_) + ((i * B + b) * Tl + c * Tc) * w, f32, w,
                      grad_ + (b * T + split_.global_chunk_of(i, c) * Tc) * W2, f32, W2, Tc, w);
  exchange("backward (dq, dk, dv)", recv_, send_, size_t(rows * w) * 4);
  // 4. dq heads side by side; a KV head's gradient summed over the ranks that read it, in rank order.
  be_.zero(dkv_, size_t(rows * KV2) * 4);
  for (int j = 0; j < N; ++j) {
    const float* from = static_cast<const float*>(recv_) + j * rows * w;
    be_.copy_rows(at(dqkv, j * hq, act), act, ld, from, f32, w, rows, hq);
    be_.add_rows_f32(dkv_ + kv_first(j) * HS, KV2, from + hq, w, rows, hk);
    be_.add_rows_f32(dkv_ + int64_t(NKV) * HS + kv_first(j) * HS, KV2, from + hq + hk, w, rows, hk);
  }
  be_.copy_rows(at(dqkv, C, act), act, ld, dkv_, f32, KV2, rows, KV2);
}

}  // namespace trainrun
