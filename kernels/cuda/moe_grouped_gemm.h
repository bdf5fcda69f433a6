// The experts' grouped GEMM (backend.h's moe_expert_matmul_forward /
// _backward): rows [offsets[e], offsets[e+1]) of the expert-ordered
// activations times expert e's nn.Linear weight, for every expert at once.
//
//   forward   out(R,OC) rows of e = in(R,IC) rows of e @ w[e]^T        w (E,OC,IC) bf16, out bf16
//   backward  din rows of e = dout rows of e @ w[e]                    (bf16, overwritten)
//             dw[e] += dout rows of e ^T @ in rows of e                (fp32, +=)
// Per expert these are matmul.cuh's three products with N = its row count.
//
// Why cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx, CUDA >= 12.5) and
// not cuBLASLt per expert on streams:
//  - one call covers every expert, so a layer with 128 experts (Qwen3-MoE)
//    costs one launch and one host call, not 128 GEMM launches plus event
//    fences across streams, and cuBLAS schedules the groups' tiles together
//    (small experts fill the GPU alongside large ones);
//  - the row counts change every step. cuBLASLt plans per shape: our Gemm
//    wrapper (gemm.h) caches one plan per distinct descriptor, so per-expert
//    calls would add a heuristic query and a cache entry for every new row
//    count; the grouped call takes the shapes as arrays and plans per call.
// The per-expert cuBLASLt path is kept as the fallback: when cuBLAS says the
// grouped call does not support a type combination (bf16 A/B with an fp32
// C for the weight gradient is the one in doubt; NOT_SUPPORTED or
// INVALID_VALUE), that product runs per expert through the Gemm wrapper from
// then on, and CudaBackend::moe_gemm_fallback_used() says so.
//
// The row counts: cuBLAS takes m/n/k as host arrays, and offsets live on the
// device (moe_permute writes them). Each call copies the E+1 offsets to
// pinned host memory on the compute stream and waits for that copy: one
// stream synchronisation per grouped GEMM (not one per expert), so 2 per MoE
// layer in the forward and 2 in the backward. Its cost is the wait for the
// work enqueued before it (the router and the permute of this layer: the
// host stops running ahead) plus ~10 us of round trip; at a few hundred
// microseconds of GEMM per layer that is a few percent of a small model's
// step, less for a large one. The per-expert pointer arrays are then built
// on the host and uploaded with one asynchronous copy per product.
// Empty experts are left out of the groups (their dw stays as it was).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/device_allocator.h"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

class MoeGroupedGemm {
 public:
  // gemm: the per-expert fallback; alloc: device scratch for the pointer arrays.
  MoeGroupedGemm(int device, Gemm& gemm, DeviceAllocator& alloc);
  ~MoeGroupedGemm();
  MoeGroupedGemm(const MoeGroupedGemm&) = delete;
  MoeGroupedGemm& operator=(const MoeGroupedGemm&) = delete;

  void forward(bf16* out, const bf16* in, const bf16* w, const int32_t* offsets, int E, int IC, int OC,
               cudaStream_t stream);
  void backward(bf16* din, float* dw, const bf16* dout, const bf16* in, const bf16* w, const int32_t* offsets, int E,
                int IC, int OC, cudaStream_t stream);
  // Whether a product has fallen back to per-expert cuBLASLt calls.
  bool fallback_used() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainrun::cuda
