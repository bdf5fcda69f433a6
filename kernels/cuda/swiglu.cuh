// The gated MLP activations, forward and backward: SwiGLU (Llama's MLP) and
// GeGLU (Gemma 2's: gelu with the tanh approximation in silu's place,
// HF's gelu_pytorch_tanh; act and act' in activations.cuh). For GeGLU read
// gelu_tanh for silu below.
//
// inp (N, 2F) bf16 is the fused gate|up GEMM's output: per row, gate g =
// inp[:F], up u = inp[F:]. With sigma(x) = 1/(1+e^-x), silu(x) = x sigma(x):
//   forward   out (N, F) = silu(g) * u
//   backward  dg = dout * u * sigma(g) (1 + g (1 - sigma(g)))   (= dout * u * silu'(g))
//             du = dout * silu(g)
//             dinp (N, 2F) = dg | du, overwritten; dinp may alias inp.
// fp32 math, one bf16 rounding per output. sigma uses __expf: for large |g|
// e^-g overflows to inf or underflows to 0, so sigma saturates to 0 or 1
// (never inf/inf), and dg, du stay finite.
//
// One thread per 8 columns (16-byte packs of g, u, dout and the outputs)
// when F % 8 == 0 and every pointer is 16-byte aligned, else one per column;
// grid-stride loops, 256 threads per block. In place: each thread reads g
// and u of its columns (coherent loads) before it writes the same two
// places, and no two threads share a column.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void swiglu_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream);
void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream);
void geglu_forward(bf16* out, const bf16* inp, int N, int F, cudaStream_t stream);
void geglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int N, int F, cudaStream_t stream);

}  // namespace trainrun::cuda
