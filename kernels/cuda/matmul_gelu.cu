// GEMM + GELU epilogues: see matmul_gelu.cuh.
#include "kernels/cuda/matmul_gelu.cuh"

#include "kernels/cuda/matmul.cuh"

namespace trainrun::cuda {

bool matmul_gelu_forward(Gemm& gemm, bf16* out, bf16* pre, const bf16* inp, const bf16* weight, const bf16* bias,
                         int N, int C, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return true;
  if (OC % 8 != 0) return false;  // cuBLASLt: ld_aux a multiple of 8
  GemmDesc g = linear_forward_desc(N, C, OC, bias != nullptr);
  g.epilogue = bias ? GemmEpilogue::GeluAuxBias : GemmEpilogue::GeluAux;
  g.ld_aux = OC;
  GemmPtrs p;
  p.a = weight;
  p.b = inp;
  p.d = out;
  p.bias = bias;
  p.aux = pre;
  if (!gemm.supported(g, p)) return false;
  gemm.run(g, p, stream);
  return true;
}

bool matmul_dinp_dgelu(Gemm& gemm, bf16* dinp, const bf16* dout, const bf16* weight, const bf16* pre, int N, int C,
                       int OC, cudaStream_t stream) {
  if (N <= 0) return true;
  if (OC <= 0) return false;  // matmul_backward zeroes dinp (a k = 0 GEMM is no cuBLASLt problem)
  if (C % 8 != 0) return false;
  GemmDesc g = linear_dinp_desc(N, C, OC);
  g.epilogue = GemmEpilogue::DGelu;
  g.ld_aux = C;
  GemmPtrs p;
  p.a = weight;
  p.b = dout;
  p.d = dinp;
  p.aux = const_cast<bf16*>(pre);  // read-only for DGELU; the wrapper's field is shared with GELU_AUX
  if (!gemm.supported(g, p)) return false;
  gemm.run(g, p, stream);
  return true;
}

}  // namespace trainrun::cuda
