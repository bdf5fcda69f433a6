// Rotary position embedding, forward and backward: see rope.cuh.
#include "kernels/cuda/rope.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;

// (x1, x2) rotated by the angle whose cos/sin are (c, s); kSign = -1 is the
// transpose (the backward). The fused forms are spelled out so that every
// path and every call rounds alike.
template <int kSign>
__device__ __forceinline__ void rotate(float x1, float x2, float c, float s, float& y1, float& y2) {
  s = kSign > 0 ? s : -s;
  y1 = fmaf(x1, c, -(x2 * s));
  y2 = fmaf(x2, c, x1 * s);
}

// Work item `idx` -> (row bt, head h, first pair i) for `per_head` items of
// `width` pairs per head, NR = NH + NKV rotated heads per row.
struct Item {
  int64_t bt;
  int h, i;
};
__device__ __forceinline__ Item item_of(int64_t idx, int per_head, int width, int NR) {
  Item it;
  it.i = int(idx % per_head) * width;
  const int64_t rest = idx / per_head;
  it.h = int(rest % NR);
  it.bt = rest / NR;
  return it;
}

// VEC: one thread per 8 pairs: half % 8 == 0, qkv and cos_sin 16-byte
// aligned (then so is every pack: ld and HS are multiples of 16 elements).
template <int kSign, bool VEC>
__global__ void rope_kernel(bf16* qkv, const float* cos_sin, int T, int NH, int NKV, int HS, int pos0,
                            int64_t work, const int32_t* pos) {
  const int half = HS / 2, NR = NH + NKV;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS;
  constexpr int kW = VEC ? 8 : 1;
  const int per_head = half / kW;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < work; idx += stride) {
    const Item it = item_of(idx, per_head, kW, NR);
    const int p = pos0 + (pos ? pos[it.bt] : int(it.bt % T));  // pos: document masking
    bf16* x1 = qkv + it.bt * ld + int64_t(it.h) * HS + it.i;
    bf16* x2 = x1 + half;
    const float* cs = cos_sin + (int64_t(p) * half + it.i) * 2;
    if (VEC) {
      auto a = Pack16<bf16>::load_rw(x1), b = Pack16<bf16>::load_rw(x2);  // written below: coherent loads
      const float4* cs4 = reinterpret_cast<const float4*>(cs);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 t = __ldg(cs4 + q);  // (cos, sin) of pairs i + 2q and i + 2q + 1
        float y1, y2;
        rotate<kSign>(to_float(a.v[2 * q]), to_float(b.v[2 * q]), t.x, t.y, y1, y2);
        a.v[2 * q] = from_float<bf16>(y1);
        b.v[2 * q] = from_float<bf16>(y2);
        rotate<kSign>(to_float(a.v[2 * q + 1]), to_float(b.v[2 * q + 1]), t.z, t.w, y1, y2);
        a.v[2 * q + 1] = from_float<bf16>(y1);
        b.v[2 * q + 1] = from_float<bf16>(y2);
      }
      a.store(x1);
      b.store(x2);
    } else {
      float y1, y2;
      rotate<kSign>(to_float(*x1), to_float(*x2), __ldg(cs), __ldg(cs + 1), y1, y2);
      *x1 = from_float<bf16>(y1);
      *x2 = from_float<bf16>(y2);
    }
  }
}

// Checks the arguments and launches; false when there is nothing to do.
template <int kSign>
bool rope_launch(bf16* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                 const int32_t* pos, cudaStream_t stream, const char* op) {
  TR_CHECK(HS > 0 && HS % 2 == 0, op, ": head size ", HS, " must be even (RoPE rotates pairs i, i+HS/2)");
  TR_CHECK(NH > 0 && NKV > 0, op, ": NH ", NH, " and NKV ", NKV, " must be positive");
  TR_CHECK(pos0 >= 0, op, ": pos0 ", pos0, " must be >= 0");
  if (B <= 0 || T <= 0) return false;
  const int half = HS / 2;
  const bool vec = half % 8 == 0 && aligned16(qkv) && aligned16(cos_sin);
  const int64_t pairs = int64_t(B) * T * (NH + NKV) * half;
  const int64_t work = vec ? pairs / 8 : pairs;
  if (vec) {
    rope_kernel<kSign, true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(qkv, cos_sin, T, NH, NKV, HS, pos0,
                                                                                work, pos);
  } else {
    rope_kernel<kSign, false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(qkv, cos_sin, T, NH, NKV, HS, pos0,
                                                                                 work, pos);
  }
  return true;
}

}  // namespace

void rope_forward(bf16* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                  cudaStream_t stream, const int32_t* pos) {
  if (rope_launch<+1>(qkv, cos_sin, B, T, NH, NKV, HS, pos0, pos, stream, "rope_forward"))
    TR_CUDA_LAUNCH_CHECK("rope_forward");
}

void rope_backward(bf16* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                   cudaStream_t stream, const int32_t* pos) {
  if (rope_launch<-1>(dqkv, cos_sin, B, T, NH, NKV, HS, pos0, pos, stream, "rope_backward"))
    TR_CUDA_LAUNCH_CHECK("rope_backward");
}

}  // namespace trainrun::cuda
