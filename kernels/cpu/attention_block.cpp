// CPU backend: attention by blocks (kernels/attention_block.h has the math,
// the masks and the layouts), the context-parallel attention's compute.
//
// Each (b, h) runs alone (OpenMP over B*NH in the forward and the merge;
// over B*NKV in the backward, so a KV head's dk/dv sum over its query heads
// runs in head order in one thread: deterministic). The products are
// sgemms over the whole block, as the one-rank op's (cpu_attention_gqa.cpp):
// scores S = scale Q K^T (Tq x Tk), then per query row the visible keys,
// one contiguous range [lo, hi] of the block (global positions are
// consecutive inside a block), are softmaxed and the rest zeroed, so a
// masked score costs its share of the GEMM but nothing after; O = P V.
// The backward recomputes P from the saved log-sum-exp and takes dV += P^T
// dO, dS = P (dO V^T - rowsum(dO O)) scale, dQ += dS K, dK += dS^T Q.
// Options (Gemma 2, Mistral): the window narrows [lo, hi] from the left;
// the soft-cap replaces a visible score s by cap tanh(s / cap) before the
// softmax, and the backward multiplies dS by 1 - tanh^2 (recomputed: the
// block keeps no scores); scale replaces 1/sqrt(HS). std::tanh, not the
// one-rank op's fastmath::tanh (~1e-7 apart): this op is the reference the
// CUDA block op is checked against.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

namespace {

void check_block(const char* op, const AttentionBlock& a) {
  TR_CHECK(a.B >= 1 && a.Tq >= 0 && a.Tk >= 0 && a.NH > 0 && a.NKV > 0 && a.HS > 0, op, ": B ", a.B, ", Tq ", a.Tq,
           ", Tk ", a.Tk, ", NH ", a.NH, ", NKV ", a.NKV, ", HS ", a.HS, " (sizes must be positive)");
  TR_CHECK(a.NH % a.NKV == 0, op, ": NKV ", a.NKV, " must divide NH ", a.NH);
  TR_CHECK(a.window >= 0 && a.softcap >= 0.f && a.scale >= 0.f, op, ": window ", a.window, ", softcap ", a.softcap,
           " and scale ", a.scale, " must be >= 0 (0: none / none / 1/sqrt(HS))");
}

float block_scale(const AttentionBlock& a) { return a.scale > 0.f ? a.scale : 1.0f / std::sqrt(float(a.HS)); }

// The keys query row i of batch b sees: [lo, hi] in block rows (empty when lo > hi).
inline void visible_range(const AttentionBlock& a, int b, int i, int* lo, int* hi) {
  const int qpos = a.q_pos0 + i;
  int first = a.q_doc ? a.q_doc[int64_t(b) * a.doc_bs + i] : 0;
  if (a.window > 0) first = std::max(first, qpos - a.window + 1);
  *lo = std::max(0, first - a.k_pos0);
  *hi = std::min(a.Tk - 1, qpos - a.k_pos0);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

void CpuBackend::attention_block_forward(void* out_, float* lse, const AttentionBlock& a) {
  check_block("attention_block_forward", a);
  float* out = static_cast<float*>(out_);
  const float* q = static_cast<const float*>(a.q);
  const float* k = static_cast<const float*>(a.k);
  const float* v = static_cast<const float*>(a.v);
  const int R = a.NH / a.NKV, HS = a.HS, Tq = a.Tq, Tk = a.Tk;
  const float sc = block_scale(a), cap = a.softcap;
  if (Tq == 0) return;
#pragma omp parallel num_threads(threads())
  {
    std::vector<float> S(size_t(Tq) * std::max(1, Tk));  // scores, then probabilities
#pragma omp for schedule(static)
    for (int bh = 0; bh < a.B * a.NH; ++bh) {
      const int b = bh / a.NH, h = bh % a.NH, g = h / R;
      const float* Q = q + b * a.q_bs + h * HS;
      const float* K = k + b * a.kv_bs + g * HS;
      const float* V = v + b * a.kv_bs + g * HS;
      float* O = out + b * a.o_bs + h * HS;
      if (Tk > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, sc, Q, int(a.q_ld), K, int(a.kv_ld), 0.0f,
                    S.data(), Tk);
      for (int i = 0; i < Tq; ++i) {
        float* si = S.data() + int64_t(i) * Tk;
        float& li = lse[b * a.lse_bs + h * a.lse_hs + i];
        int lo, hi;
        visible_range(a, b, i, &lo, &hi);
        if (lo > hi) {
          std::fill(si, si + Tk, 0.0f);
          li = kNegInf;
          continue;
        }
        if (cap > 0.f)
          for (int j = lo; j <= hi; ++j) si[j] = cap * std::tanh(si[j] / cap);
        const float m = *std::max_element(si + lo, si + hi + 1);
        float sum = 0;
        for (int j = lo; j <= hi; ++j) sum += (si[j] = std::exp(si[j] - m));
        const float inv = 1.0f / sum;
        for (int j = lo; j <= hi; ++j) si[j] *= inv;
        std::fill(si, si + lo, 0.0f);
        std::fill(si + hi + 1, si + Tk, 0.0f);
        li = m + std::log(sum);
      }
      if (Tk > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, HS, Tk, 1.0f, S.data(), Tk, V, int(a.kv_ld), 0.0f,
                    O, int(a.o_ld));
      else
        for (int i = 0; i < Tq; ++i) std::fill(O + int64_t(i) * a.o_ld, O + int64_t(i) * a.o_ld + HS, 0.0f);
    }
  }
}

void CpuBackend::attention_block_merge(void* out_, float* lse, const void* block_out_, const float* block_lse,
                                       const AttentionBlock& a) {
  check_block("attention_block_merge", a);
  float* out = static_cast<float*>(out_);
  const float* bo = static_cast<const float*>(block_out_);
  const int HS = a.HS, C = a.NH * a.HS;
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int bh = 0; bh < a.B * a.NH; ++bh) {
    const int b = bh / a.NH, h = bh % a.NH;
    for (int i = 0; i < a.Tq; ++i) {
      float& l = lse[b * a.lse_bs + h * a.lse_hs + i];
      const float lb = block_lse[(int64_t(b) * a.NH + h) * a.Tq + i];
      if (lb == kNegInf) continue;  // the block saw nothing of this row
      float* oi = out + b * a.o_bs + i * a.o_ld + h * HS;
      const float* bi = bo + (int64_t(b) * a.Tq + i) * C + h * HS;
      if (l == kNegInf) {
        std::copy(bi, bi + HS, oi);
        l = lb;
        continue;
      }
      const double mx = std::max(l, lb);
      const double ea = std::exp(double(l) - mx), eb = std::exp(double(lb) - mx), tot = ea + eb;
      for (int c = 0; c < HS; ++c) oi[c] = float((ea * oi[c] + eb * bi[c]) / tot);
      l = float(mx + std::log(tot));
    }
  }
}

void CpuBackend::attention_block_backward(float* dq, float* dk, float* dv, const void* dout_, const void* out_,
                                          const float* lse, const AttentionBlock& a) {
  check_block("attention_block_backward", a);
  const float* q = static_cast<const float*>(a.q);
  const float* k = static_cast<const float*>(a.k);
  const float* v = static_cast<const float*>(a.v);
  const float* dout = static_cast<const float*>(dout_);
  const float* out = static_cast<const float*>(out_);
  const int R = a.NH / a.NKV, HS = a.HS, Tq = a.Tq, Tk = a.Tk;
  const float sc = block_scale(a), cap = a.softcap;
  if (Tq == 0 || Tk == 0) return;
  // One thread per (b, g): it owns dk/dv of KV head g and dq of the group's
  // query heads, visited in head order.
#pragma omp parallel num_threads(threads())
  {
    std::vector<float> P(size_t(Tq) * Tk), dS(size_t(Tq) * Tk);
#pragma omp for schedule(static)
    for (int bg = 0; bg < a.B * a.NKV; ++bg) {
      const int b = bg / a.NKV, g = bg % a.NKV;
      const float* K = k + b * a.kv_bs + g * HS;
      const float* V = v + b * a.kv_bs + g * HS;
      float* dK = dk + b * a.kv_bs + g * HS;
      float* dV = dv + b * a.kv_bs + g * HS;
      for (int h = g * R; h < (g + 1) * R; ++h) {
        const float* Q = q + b * a.q_bs + h * HS;
        const float* dO = dout + b * a.o_bs + h * HS;
        const float* O = out + b * a.o_bs + h * HS;
        float* dQ = dq + b * a.q_bs + h * HS;
        // P = exp(scale Q K^T - lse) on the visible keys, 0 elsewhere; dP = dO V^T.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, sc, Q, int(a.q_ld), K, int(a.kv_ld), 0.0f,
                    P.data(), Tk);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, 1.0f, dO, int(a.o_ld), V, int(a.kv_ld), 0.0f,
                    dS.data(), Tk);
        for (int i = 0; i < Tq; ++i) {
          float* pi = P.data() + int64_t(i) * Tk;
          float* di = dS.data() + int64_t(i) * Tk;
          int lo, hi;
          visible_range(a, b, i, &lo, &hi);
          const float l = lse[b * a.lse_bs + h * a.lse_hs + i];
          if (lo > hi || l == kNegInf) lo = Tk, hi = Tk - 1;  // sees nothing: a zero row
          const float* doi = dO + int64_t(i) * a.o_ld;
          const float* oi = O + int64_t(i) * a.o_ld;
          float D = 0;
          for (int c = 0; c < HS; ++c) D += doi[c] * oi[c];
          if (cap > 0.f)
            for (int j = lo; j <= hi; ++j) {
              const float t = std::tanh(pi[j] / cap);  // the capped score is cap t; d(cap t)/ds = 1 - t^2
              pi[j] = std::exp(cap * t - l);
              di[j] = pi[j] * (di[j] - D) * (1.0f - t * t) * sc;
            }
          else
            for (int j = lo; j <= hi; ++j) {
              pi[j] = std::exp(pi[j] - l);
              di[j] = pi[j] * (di[j] - D) * sc;
            }
          std::fill(pi, pi + std::min(lo, Tk), 0.0f);
          std::fill(di, di + std::min(lo, Tk), 0.0f);
          std::fill(pi + hi + 1, pi + Tk, 0.0f);
          std::fill(di + hi + 1, di + Tk, 0.0f);
        }
        // dV += P^T dO, dQ += dS K, dK += dS^T Q (in head order: deterministic).
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Tk, HS, Tq, 1.0f, P.data(), Tk, dO, int(a.o_ld), 1.0f, dV,
                    int(a.kv_ld));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, HS, Tk, 1.0f, dS.data(), Tk, K, int(a.kv_ld), 1.0f,
                    dQ, int(a.q_ld));
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Tk, HS, Tq, 1.0f, dS.data(), Tk, Q, int(a.q_ld), 1.0f, dK,
                    int(a.kv_ld));
      }
    }
  }
}

void CpuBackend::copy_rows(void* dst_, DType dst_type, int64_t dst_ld, const void* src_, DType src_type,
                           int64_t src_ld, int64_t rows, int64_t cols) {
  // The CPU's act dtype is fp32: both sides are floats.
  TR_CHECK(dst_type == DType::F32 && src_type == DType::F32, "copy_rows: the CPU backend holds fp32 only (got ",
           dtype_name(src_type), " -> ", dtype_name(dst_type), ")");
  float* dst = static_cast<float*>(dst_);
  const float* src = static_cast<const float*>(src_);
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * src_ld, src + r * src_ld + cols, dst + r * dst_ld);
}

void CpuBackend::add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows,
                              int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * dst_ld + c] += src[r * src_ld + c];
}

}  // namespace trainrun
