// CPU backend: rotary position embedding (HF Llama's rotate_half form),
// forward and backward, in place on the fused qkv (B,T,(NH+2*NKV)*HS).
//
// Per row (b,t) at position p = pos0 + t (document masking: pos0 + pos[b,t]), for each of the NH q heads and the
// NKV k heads (contiguous at the start of the row), with c_i = cos(p f_i),
// s_i = sin(p f_i) read from cos_sin (maxT, HS/2, 2) and i < HS/2:
//   forward  (rotate by +p f_i):  y1 = x1 c - x2 s,   y2 = x2 c + x1 s
//   backward (the transpose):     dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s
// where x1 = x[i], x2 = x[i + HS/2]. That is HF's q*cos + rotate_half(q)*sin
// with cos/sin repeated over both halves. The v heads are not touched; their
// gradient passes through.
#include <cstdint>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

namespace {
// kSign = +1: forward rotation, -1: its transpose (the backward).
template <int kSign>
void rope_apply(float* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0, const int32_t* pos,
                const char* op) {
  TR_CHECK(HS > 0 && HS % 2 == 0, op, ": head size ", HS, " must be even (RoPE rotates pairs i, i+HS/2)");
  TR_CHECK(pos0 >= 0, op, ": pos0 ", pos0, " must be >= 0");
  const int half = HS / 2;
  const int ld = (NH + 2 * NKV) * HS;  // row stride of qkv
  const int rotated = NH + NKV;        // q heads then k heads
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < int64_t(B) * T; ++bt) {
    const int t = pos ? pos[bt] : int(bt % T);
    const float* cs = cos_sin + int64_t(pos0 + t) * HS;  // HS/2 (cos, sin) pairs
    float* row = qkv + bt * ld;
    for (int h = 0; h < rotated; ++h) {
      float* x1 = row + h * HS;
      float* x2 = x1 + half;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = kSign * cs[2 * i + 1];
        const float a = x1[i], b = x2[i];
        x1[i] = a * c - b * s;
        x2[i] = b * c + a * s;
      }
    }
  }
}
}  // namespace

void CpuBackend::rope_forward(void* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                              const int32_t* pos) {
  rope_apply<+1>(static_cast<float*>(qkv), cos_sin, B, T, NH, NKV, HS, pos0, pos, "rope_forward");
}

void CpuBackend::rope_backward(void* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                               const int32_t* pos) {
  rope_apply<-1>(static_cast<float*>(dqkv), cos_sin, B, T, NH, NKV, HS, pos0, pos, "rope_backward");
}

}  // namespace trainrun
