// SwiGLU forward and backward: see swiglu.cuh.
#include "kernels/cuda/swiglu.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + __expf(-x)); }

// VEC: kW = 8 columns per work item (F % 8 == 0, pointers 16-byte aligned).
template <bool VEC>
__global__ void swiglu_forward_kernel(bf16* out, const bf16* inp, int F, int64_t work) {
  constexpr int kW = VEC ? 8 : 1;
  const int per_row = F / kW;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < work; idx += stride) {
    const int64_t n = idx / per_row;
    const int f = int(idx % per_row) * kW;
    const bf16* g = inp + n * 2 * F + f;
    const bf16* u = g + F;
    bf16* o = out + n * F + f;
    if (VEC) {
      const auto gp = Pack16<bf16>::load(g), up = Pack16<bf16>::load(u);
      Pack16<bf16> op;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float gv = to_float(gp.v[k]);
        op.v[k] = from_float<bf16>(gv * sigmoid_f(gv) * to_float(up.v[k]));
      }
      op.store(o);
    } else {
      const float gv = to_float(*g);
      *o = from_float<bf16>(gv * sigmoid_f(gv) * to_float(*u));
    }
  }
}

// dinp may alias inp: g and u are read (plain, coherent loads) before the
// same thread writes dg and du over them.
template <bool VEC>
__global__ void swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int F, int64_t work) {
  constexpr int kW = VEC ? 8 : 1;
  const int per_row = F / kW;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < work; idx += stride) {
    const int64_t n = idx / per_row;
    const int f = int(idx % per_row) * kW;
    const bf16* g = inp + n * 2 * F + f;
    const bf16* u = g + F;
    const bf16* dy = dout + n * F + f;
    bf16* dg = dinp + n * 2 * F + f;
    bf16* du = dg + F;
    if (VEC) {
      const auto gp = Pack16<bf16>::load_rw(g), up = Pack16<bf16>::load_rw(u);
      const auto yp = Pack16<bf16>::load(dy);
      Pack16<bf16> dgp, dup;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float gv = to_float(gp.v[k]), uv = to_float(up.v[k]), d = to_float(yp.v[k]);
        const float sg = sigmoid_f(gv);
        dgp.v[k] = from_float<bf16>(d * uv * sg * (1.0f + gv * (1.0f - sg)));
        dup.v[k] = from_float<bf16>(d * gv * sg);
      }
      dgp.store(dg);
      dup.store(du);
    } else {
      const float gv = to_float(*g), uv = to_float(*u), d = to_float(*dy);
      const float sg = sigmoid_f(gv);
      *dg = from_float<bf16>(d * uv * sg * (1.0f + gv * (1.0f - sg)));
      *du = from_float<bf16>(d * gv * sg);
    }
  }
}

}  // namespace

void swiglu_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream) {
  TR_CHECK(N >= 0 && F >= 0, "swiglu_forward: N ", N, " and F ", F, " must be >= 0");
  if (N == 0 || F == 0) return;
  const bool vec = F % 8 == 0 && aligned16(out) && aligned16(inp);
  const int64_t work = int64_t(N) * F / (vec ? 8 : 1);
  if (vec) {
    swiglu_forward_kernel<true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(out, inp, F, work);
  } else {
    swiglu_forward_kernel<false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(out, inp, F, work);
  }
  TR_CUDA_LAUNCH_CHECK("swiglu_forward");
}

void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream) {
  TR_CHECK(N >= 0 && F >= 0, "swiglu_backward: N ", N, " and F ", F, " must be >= 0");
  if (N == 0 || F == 0) return;
  const bool vec = F % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp);
  const int64_t work = int64_t(N) * F / (vec ? 8 : 1);
  if (vec) {
    swiglu_backward_kernel<true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(dinp, dout, inp, F, work);
  } else {
    swiglu_backward_kernel<false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(dinp, dout, inp, F, work);
  }
  TR_CUDA_LAUNCH_CHECK("swiglu_backward");
}

}  // namespace trainrun::cuda
