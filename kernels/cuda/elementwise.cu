// residual_forward, scale_f32, scale_bf16, accumulate_f32: see elementwise.cuh.
#include "kernels/cuda/elementwise.cuh"

namespace trainrun::cuda {

namespace {

// ---- kernels ---------------------------------------------------------------------

// VEC: every pointer 16-byte aligned; pack i covers elements [8i, 8i+8) and
// the tail (n % 8) is done by scalar code in the same grid-stride loop.
template <bool VEC>
__global__ void residual_forward_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      auto pa = Pack16<bf16>::load(a + 8 * i), pb = Pack16<bf16>::load(b + 8 * i);
      Pack16<bf16> po;
#pragma unroll
      for (int k = 0; k < 8; ++k) po.v[k] = from_float<bf16>(to_float(pa.v[k]) + to_float(pb.v[k]));
      po.store(out + 8 * i);
    }
    for (int64_t i = packs * 8 + start; i < n; i += stride) out[i] = from_float<bf16>(to_float(a[i]) + to_float(b[i]));
  } else {
    for (int64_t i = start; i < n; i += stride) out[i] = from_float<bf16>(to_float(a[i]) + to_float(b[i]));
  }
}

template <bool VEC>
__global__ void scale_f32_kernel(float* x, float s, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (VEC) {
    const int64_t packs = n / 4;
    for (int64_t i = start; i < packs; i += stride) {
      float4 v = reinterpret_cast<float4*>(x)[i];
      v.x *= s; v.y *= s; v.z *= s; v.w *= s;
      reinterpret_cast<float4*>(x)[i] = v;
    }
    for (int64_t i = packs * 4 + start; i < n; i += stride) x[i] *= s;
  } else {
    for (int64_t i = start; i < n; i += stride) x[i] *= s;
  }
}

// s is already rounded to bf16 (the launcher), as torch's bf16 scalar tensor.
template <bool VEC>
__global__ void scale_bf16_kernel(bf16* x, float s, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      auto p = Pack16<bf16>::load_rw(x + 8 * i);
#pragma unroll
      for (int k = 0; k < 8; ++k) p.v[k] = from_float<bf16>(to_float(p.v[k]) * s);
      p.store(x + 8 * i);
    }
    for (int64_t i = packs * 8 + start; i < n; i += stride) x[i] = from_float<bf16>(to_float(x[i]) * s);
  } else {
    for (int64_t i = start; i < n; i += stride) x[i] = from_float<bf16>(to_float(x[i]) * s);
  }
}

template <bool VEC>
__global__ void accumulate_f32_kernel(float* dst, const float* src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (VEC) {
    const int64_t packs = n / 4;
    for (int64_t i = start; i < packs; i += stride) {
      float4 d = reinterpret_cast<float4*>(dst)[i];
      const float4 s = __ldg(reinterpret_cast<const float4*>(src) + i);
      d.x += s.x; d.y += s.y; d.z += s.z; d.w += s.w;
      reinterpret_cast<float4*>(dst)[i] = d;
    }
    for (int64_t i = packs * 4 + start; i < n; i += stride) dst[i] += src[i];
  } else {
    for (int64_t i = start; i < n; i += stride) dst[i] += src[i];
  }
}

}  // namespace

// ---- launchers -------------------------------------------------------------------

void residual_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(residual_forward_kernel<true>, residual_forward_kernel<false>,
                   aligned16(out) && aligned16(a) && aligned16(b), n, stream, out, a, b, n);
  TR_CUDA_LAUNCH_CHECK("residual_forward");
}

void scale_f32(float* x, float s, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<4>(scale_f32_kernel<true>, scale_f32_kernel<false>, aligned16(x), n, stream, x, s, n);
  TR_CUDA_LAUNCH_CHECK("scale_f32");
}

void scale_bf16(bf16* x, float s, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const float sb = __bfloat162float(__float2bfloat16(s));  // round to nearest even, on the host
  launch_packed<8>(scale_bf16_kernel<true>, scale_bf16_kernel<false>, aligned16(x), n, stream, x, sb, n);
  TR_CUDA_LAUNCH_CHECK("scale_bf16");
}

void accumulate_f32(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<4>(accumulate_f32_kernel<true>, accumulate_f32_kernel<false>, aligned16(dst) && aligned16(src), n,
                   stream, dst, src, n);
  TR_CUDA_LAUNCH_CHECK("accumulate_f32");
}

}  // namespace trainrun::cuda
