// The CUDA backend's mixture-of-experts ops (backend.h's "mixture of
// experts" section; the CPU reference is kernels/cpu/cpu_moe.cpp): the
// router (moe_route.cu), permute / unpermute and the shared expert's gate
// (moe_permute.cu), and the experts' grouped GEMM (moe_grouped_gemm.cpp).
// Routing state (probs, lse, idx, w, stats, dw) is fp32 / int32 as the
// interface says; activations, logits and their gradients are bf16.
// Not yet run on a GPU (docs/gpu-results.md).
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/moe_grouped_gemm.h"
#include "kernels/cuda/moe_permute.cuh"
#include "kernels/cuda/moe_route.cuh"

namespace trainrun::cuda {

namespace {
inline bf16* H(void* p) { return static_cast<bf16*>(p); }
inline const bf16* H(const void* p) { return static_cast<const bf16*>(p); }
}  // namespace

void CudaBackend::moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const void* logits, int N, int E,
                                    int K, bool renorm) {
  make_current();
  cuda::moe_route_forward(probs, lse, idx, w, H(logits), N, E, K, renorm, compute_);
}

void CudaBackend::moe_route_backward(void* dlogits, const float* dw, const float* probs, const float* lse,
                                     const int32_t* idx, const float* aux_grad, float z_scale, int N, int E, int K,
                                     bool renorm) {
  make_current();
  cuda::moe_route_backward(H(dlogits), dw, probs, lse, idx, aux_grad, z_scale, N, E, K, renorm, compute_);
}

void CudaBackend::moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N,
                                   int E, int K) {
  make_current();
  cuda::moe_router_stats(stats, probs, lse, idx, N, E, K, compute_);
}

void CudaBackend::moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens,
                               int E, float aux_coef, float z_coef, float grad_scale) {
  make_current();
  cuda::moe_aux_loss(out, aux_grad, losses, n, stats, tokens, E, aux_coef, z_coef, grad_scale, compute_);
}

void CudaBackend::moe_permute(int32_t* pos, int32_t* offsets, void* xp, const int32_t* idx, const void* x, int N,
                              int K, int E, int C) {
  make_current();
  const size_t bytes = N > 0 && K > 0 && E > 0 ? cuda::moe_permute_scratch_bytes(N, K, E) : 0;
  Scratch s(*alloc_, bytes);
  cuda::moe_permute(pos, offsets, H(xp), idx, H(x), N, K, E, C, s.as<void>(), s.bytes(), compute_);
}

void CudaBackend::moe_permute_backward(void* dx, const void* dxp, const int32_t* pos, int N, int K, int C) {
  make_current();
  cuda::moe_permute_backward(H(dx), H(dxp), pos, N, K, C, compute_);
}

void CudaBackend::moe_expert_matmul_forward(void* out, const void* in, const void* w, const int32_t* offsets, int E,
                                            int IC, int OC) {
  make_current();
  moe_gemm().forward(H(out), H(in), H(w), offsets, E, IC, OC, compute_);
}

void CudaBackend::moe_expert_matmul_backward(void* din, float* dw, const void* dout, const void* in, const void* w,
                                             const int32_t* offsets, int E, int IC, int OC) {
  make_current();
  moe_gemm().backward(H(din), dw, H(dout), H(in), H(w), offsets, E, IC, OC, compute_);
}

void CudaBackend::moe_unpermute_forward(void* out, const void* yp, const int32_t* pos, const float* w, int N, int K,
                                        int C) {
  make_current();
  cuda::moe_unpermute_forward(H(out), H(yp), pos, w, N, K, C, compute_);
}

void CudaBackend::moe_unpermute_backward(void* dyp, float* dw, const void* dout, const void* yp, const int32_t* pos,
                                         const float* w, int N, int K, int C) {
  make_current();
  cuda::moe_unpermute_backward(H(dyp), dw, H(dout), H(yp), pos, w, N, K, C, compute_);
}

void CudaBackend::moe_sigmoid_gate_forward(void* out, const void* y, const void* g, int N, int C) {
  make_current();
  cuda::moe_sigmoid_gate_forward(H(out), H(y), H(g), N, C, compute_);
}

void CudaBackend::moe_sigmoid_gate_backward(void* dy, void* dg, const void* dout, const void* y, const void* g, int N,
                                            int C) {
  make_current();
  cuda::moe_sigmoid_gate_backward(H(dy), H(dg), H(dout), H(y), H(g), N, C, compute_);
}

MoeGroupedGemm& CudaBackend::moe_gemm() {
  std::lock_guard<std::mutex> lk(moe_mu_);
  if (!moe_gemm_) moe_gemm_ = std::make_unique<MoeGroupedGemm>(device_, *gemm_, *alloc_);  // its cuBLAS handle: on first use
  return *moe_gemm_;
}

bool CudaBackend::moe_gemm_fallback_used() const {
  std::lock_guard<std::mutex> lk(moe_mu_);
  return moe_gemm_ && moe_gemm_->fallback_used();
}

}  // namespace trainrun::cuda
