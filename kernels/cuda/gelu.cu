// GELU (tanh approximation), forward and backward: see gelu.cuh.
#include "kernels/cuda/gelu.cuh"

#include "kernels/cuda/activations.cuh"

namespace trainrun::cuda {

namespace {

template <bool VEC>
__global__ void gelu_forward_kernel(bf16* out, const bf16* inp, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      const auto x = Pack16<bf16>::load(inp + 8 * i);
      Pack16<bf16> y;
#pragma unroll
      for (int k = 0; k < 8; ++k) y.v[k] = from_float<bf16>(gelu_tanh_f(to_float(x.v[k])));
      y.store(out + 8 * i);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride) out[i] = from_float<bf16>(gelu_tanh_f(to_float(inp[i])));
}

// dinp may alias dout: each element is read, then written, by one thread,
// so plain (coherent) loads are used for dout.
template <bool VEC>
__global__ void gelu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      const auto x = Pack16<bf16>::load(inp + 8 * i);
      const auto g = Pack16<bf16>::load_rw(dout + 8 * i);
      Pack16<bf16> d;
#pragma unroll
      for (int k = 0; k < 8; ++k) d.v[k] = from_float<bf16>(gelu_tanh_grad_f(to_float(x.v[k])) * to_float(g.v[k]));
      d.store(dinp + 8 * i);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride)
    dinp[i] = from_float<bf16>(gelu_tanh_grad_f(to_float(inp[i])) * to_float(dout[i]));
}

}  // namespace

void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(gelu_forward_kernel<true>, gelu_forward_kernel<false>, aligned16(out) && aligned16(inp), n, stream,
                   out, inp, n);
  TR_CUDA_LAUNCH_CHECK("gelu_forward");
}

void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(gelu_backward_kernel<true>, gelu_backward_kernel<false>,
                   aligned16(dinp) && aligned16(inp) && aligned16(dout), n, stream, dinp, inp, dout, n);
  TR_CUDA_LAUNCH_CHECK("gelu_backward");
}

}  // namespace trainrun::cuda
