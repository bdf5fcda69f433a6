// Fused AdamW: see adamw.cuh.
#include "kernels/cuda/adamw.cuh"

namespace trainrun::cuda {

namespace {

__device__ __forceinline__ float adamw_one(float w, float g, float& m, float& v, const AdamWArgs& a) {
  g *= a.grad_scale;
  m = a.beta1 * m + (1.0f - a.beta1) * g;
  v = a.beta2 * v + (1.0f - a.beta2) * g * g;
  const float mhat = m / a.bc1, vhat = v / a.bc2;
  return w - a.lr * (mhat / (sqrtf(vhat) + a.eps) + a.weight_decay * w);
}

// VEC: every pointer 16-byte aligned; 8 parameters per iteration.
template <bool VEC>
__global__ void adamw_kernel(float* master, bf16* param, const float* grad, float* m, float* v, int64_t n,
                             AdamWArgs a) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      alignas(16) float w[8];
      alignas(16) float g[8];
      alignas(16) float mm[8];
      alignas(16) float vv[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t o = 8 * i + 4 * h;
        *reinterpret_cast<float4*>(w + 4 * h) = *reinterpret_cast<const float4*>(master + o);
        *reinterpret_cast<float4*>(g + 4 * h) = __ldg(reinterpret_cast<const float4*>(grad + o));
        *reinterpret_cast<float4*>(mm + 4 * h) = *reinterpret_cast<const float4*>(m + o);
        *reinterpret_cast<float4*>(vv + 4 * h) = *reinterpret_cast<const float4*>(v + o);
      }
      Pack16<bf16> p;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        w[k] = adamw_one(w[k], g[k], mm[k], vv[k], a);
        p.v[k] = from_float<bf16>(w[k]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t o = 8 * i + 4 * h;
        *reinterpret_cast<float4*>(master + o) = *reinterpret_cast<const float4*>(w + 4 * h);
        *reinterpret_cast<float4*>(m + o) = *reinterpret_cast<const float4*>(mm + 4 * h);
        *reinterpret_cast<float4*>(v + o) = *reinterpret_cast<const float4*>(vv + 4 * h);
      }
      p.store(param + 8 * i);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride) {
    float mi = m[i], vi = v[i];
    const float w = adamw_one(master[i], grad[i], mi, vi, a);
    m[i] = mi;
    v[i] = vi;
    master[i] = w;
    param[i] = from_float<bf16>(w);
  }
}

}  // namespace

void adamw_update(float* master, bf16* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a,
                  cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(adamw_kernel<true>, adamw_kernel<false>,
                   aligned16(master) && aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v), n, stream,
                   master, param, grad, m, v, n, a);
  TR_CUDA_LAUNCH_CHECK("adamw_update");
}

}  // namespace trainrun::cuda
