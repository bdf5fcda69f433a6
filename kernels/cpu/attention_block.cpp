// CPU backend: attention by blocks (kernels/attention_block.h has the math,
// the masks and the layouts), the context-parallel attention's compute.
//
// Each (b, h) runs alone (OpenMP over B*NH in the forward and the merge;
// over B*NKV in the backward, so a KV head's dk/dv sum over its query heads
// runs in head order in one thread: deterministic). Per query row, the
// visible keys are one contiguous range [lo, hi] of the block (global
// positions are consecutive inside a block), so masking is a loop bound and
// a row that sees nothing costs nothing. Scores are accumulated in double
// inside a row (dot products of HS terms) and stored as float.
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
  TR_CHECK(a.window == 0, op, ": a sliding window (", a.window,
           ") is not implemented for context parallelism yet; use parallel.context_parallel: 1 for this model");
}

// The keys query row i of batch b sees: [lo, hi] in block rows (empty when lo > hi).
inline void visible_range(const AttentionBlock& a, int b, int i, int* lo, int* hi) {
  const int qpos = a.q_pos0 + i;
  const int doc = a.q_doc ? a.q_doc[int64_t(b) * a.doc_bs + i] : 0;
  *lo = std::max(0, doc - a.k_pos0);
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
  const int R = a.NH / a.NKV, HS = a.HS;
  const float sc = 1.0f / std::sqrt(float(HS));
#pragma omp parallel num_threads(threads())
  {
    std::vector<float> s(static_cast<size_t>(std::max(1, a.Tk)));
    std::vector<double> acc(static_cast<size_t>(HS));
#pragma omp for schedule(static)
    for (int bh = 0; bh < a.B * a.NH; ++bh) {
      const int b = bh / a.NH, h = bh % a.NH, g = h / R;
      for (int i = 0; i < a.Tq; ++i) {
        const float* qi = q + b * a.q_bs + i * a.q_ld + h * HS;
        float* oi = out + b * a.o_bs + i * a.o_ld + h * HS;
        float& li = lse[b * a.lse_bs + h * a.lse_hs + i];
        int lo, hi;
        visible_range(a, b, i, &lo, &hi);
        if (lo > hi) {
          std::fill(oi, oi + HS, 0.0f);
          li = kNegInf;
          continue;
        }
        float m = kNegInf;
        for (int j = lo; j <= hi; ++j) {
          const float* kj = k + b * a.kv_bs + j * a.kv_ld + g * HS;
          double d = 0;
          for (int c = 0; c < HS; ++c) d += double(qi[c]) * kj[c];
          s[size_t(j)] = float(d) * sc;
          m = std::max(m, s[size_t(j)]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = lo; j <= hi; ++j) {
          const double p = std::exp(double(s[size_t(j)]) - m);
          sum += p;
          const float* vj = v + b * a.kv_bs + j * a.kv_ld + g * HS;
          for (int c = 0; c < HS; ++c) acc[size_t(c)] += p * vj[c];
        }
        for (int c = 0; c < HS; ++c) oi[c] = float(acc[size_t(c)] / sum);
        li = float(double(m) + std::log(sum));
      }
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
  const int R = a.NH / a.NKV, HS = a.HS;
  const float sc = 1.0f / std::sqrt(float(HS));
  // One thread per (b, g): it owns dk/dv of KV head g and dq of the group's
  // query heads, visited in head order.
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int bg = 0; bg < a.B * a.NKV; ++bg) {
    const int b = bg / a.NKV, g = bg % a.NKV;
    for (int h = g * R; h < (g + 1) * R; ++h) {
      for (int i = 0; i < a.Tq; ++i) {
        int lo, hi;
        visible_range(a, b, i, &lo, &hi);
        if (lo > hi) continue;
        const float* qi = q + b * a.q_bs + i * a.q_ld + h * HS;
        const float* doi = dout + b * a.o_bs + i * a.o_ld + h * HS;
        const float* oi = out + b * a.o_bs + i * a.o_ld + h * HS;
        float* dqi = dq + b * a.q_bs + i * a.q_ld + h * HS;
        const double l = lse[b * a.lse_bs + h * a.lse_hs + i];
        double D = 0;
        for (int c = 0; c < HS; ++c) D += double(doi[c]) * oi[c];
        for (int j = lo; j <= hi; ++j) {
          const int64_t kvo = b * a.kv_bs + j * a.kv_ld + g * HS;
          const float* kj = k + kvo;
          const float* vj = v + kvo;
          double s = 0, dp = 0;
          for (int c = 0; c < HS; ++c) {
            s += double(qi[c]) * kj[c];
            dp += double(doi[c]) * vj[c];
          }
          const double p = std::exp(double(float(s) * sc) - l);
          const double ds = p * (dp - D) * sc;
          float* dkj = dk + kvo;
          float* dvj = dv + kvo;
          for (int c = 0; c < HS; ++c) {
            dqi[c] += float(ds * kj[c]);
            dkj[c] += float(ds * qi[c]);
            dvj[c] += float(p * doi[c]);
          }
        }
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
