// The gated MLP activations, SwiGLU and GeGLU, forward and backward: see
// swiglu.cuh. One pair of kernels templated on the gate's activation
// (activations.cuh), so the two differ only in act and act'.
#include "kernels/cuda/swiglu.cuh"

#include "kernels/cuda/activations.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;

// VEC: kW = 8 columns per work item (F % 8 == 0, pointers 16-byte aligned).
template <class Act, bool VEC>
__global__ void gated_forward_kernel(bf16* out, const bf16* inp, int F, int64_t work) {
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
      for (int k = 0; k < 8; ++k) op.v[k] = from_float<bf16>(Act::value(to_float(gp.v[k])) * to_float(up.v[k]));
      op.store(o);
    } else {
      *o = from_float<bf16>(Act::value(to_float(*g)) * to_float(*u));
    }
  }
}

// dinp may alias inp: g and u are read (plain, coherent loads) before the
// same thread writes dg and du over them.
template <class Act, bool VEC>
__global__ void gated_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int F, int64_t work) {
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
        const float uv = to_float(up.v[k]), d = to_float(yp.v[k]);
        float a, da;
        Act::both(to_float(gp.v[k]), a, da);
        dgp.v[k] = from_float<bf16>(d * uv * da);
        dup.v[k] = from_float<bf16>(d * a);
      }
      dgp.store(dg);
      dup.store(du);
    } else {
      const float uv = to_float(*u), d = to_float(*dy);
      float a, da;
      Act::both(to_float(*g), a, da);
      *dg = from_float<bf16>(d * uv * da);
      *du = from_float<bf16>(d * a);
    }
  }
}

template <class Act>
void gated_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream, const char* op) {
  TR_CHECK(N >= 0 && F >= 0, op, ": N ", N, " and F ", F, " must be >= 0");
  if (N == 0 || F == 0) return;
  const bool vec = F % 8 == 0 && aligned16(out) && aligned16(inp);
  const int64_t work = int64_t(N) * F / (vec ? 8 : 1);
  if (vec) {
    gated_forward_kernel<Act, true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(out, inp, F, work);
  } else {
    gated_forward_kernel<Act, false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(out, inp, F, work);
  }
}

template <class Act>
void gated_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream,
                    const char* op) {
  TR_CHECK(N >= 0 && F >= 0, op, ": N ", N, " and F ", F, " must be >= 0");
  if (N == 0 || F == 0) return;
  const bool vec = F % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp);
  const int64_t work = int64_t(N) * F / (vec ? 8 : 1);
  if (vec) {
    gated_backward_kernel<Act, true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(dinp, dout, inp, F, work);
  } else {
    gated_backward_kernel<Act, false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(dinp, dout, inp, F, work);
  }
}

}  // namespace

// (The launch checks are here: TR_CUDA_LAUNCH_CHECK takes a literal.)
void swiglu_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream) {
  gated_forward<SiluAct>(out, inp, N, F, stream, "swiglu_forward");
  TR_CUDA_LAUNCH_CHECK("swiglu_forward");
}
void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream) {
  gated_backward<SiluAct>(dinp, dout, inp, N, F, stream, "swiglu_backward");
  TR_CUDA_LAUNCH_CHECK("swiglu_backward");
}
void geglu_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream) {
  gated_forward<GeluTanhAct>(out, inp, N, F, stream, "geglu_forward");
  TR_CUDA_LAUNCH_CHECK("geglu_forward");
}
void geglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream) {
  gated_backward<GeluTanhAct>(dinp, dout, inp, N, F, stream, "geglu_backward");
  TR_CUDA_LAUNCH_CHECK("geglu_backward");
}

}  // namespace trainrun::cuda
