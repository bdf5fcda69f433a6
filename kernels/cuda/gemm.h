// The one cuBLASLt entry point: every matrix product of the CUDA backend goes
// through Gemm::run with a named descriptor.
//
// Convention: cuBLAS's column-major one,
//     D(m,n) = alpha * op(A)(m,k) @ op(B)(k,n) + beta * D,   beta = accumulate ? 1 : 0
// with op(X) = X^T when trans is set; A is stored (m,k) col-major with lda
// (or (k,m) when transa), likewise B. A row-major (R,S) matrix is a
// col-major (S,R) one with the same leading dimension, which is how the
// backend maps torch.nn.Linear (see matmul.cuh for the three products).
// Batched products use batch/stride_* (strided batches).
//
// Types: A and B in ab_type (bf16 on this backend), D in d_type (bf16 for
// activations, fp32 for accumulated weight gradients); compute and scale
// type are always fp32 (CUBLAS_COMPUTE_32F: fp32 accumulation). The bias
// and bias-gradient vectors are in bias_type, which must equal d_type:
// cuBLASLt's rule outside its FP8 and integer kernels (the bias, and the
// bias gradient its BGRAD epilogues write, have the output's element type).
// The caller states it and the wrapper passes it to cuBLASLt
// (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE) for every epilogue with a bias or
// bias-gradient pointer, so the buffer's type is never left to a default.
//
// Epilogues (fused by cuBLASLt after the product, before the store):
//   None         D = AB (+D)
//   Bias         D = AB + bias(m)                         bias: bias_type, m values
//   GeluAux      D = gelu(AB); aux = AB                   aux: (m,n) ab_type, ld_aux
//   GeluAuxBias  D = gelu(AB + bias); aux = AB + bias
//   DGelu        D = (AB) * gelu'(aux)                    aux from a GeluAux forward
//   DGeluBGrad   D = (AB) * gelu'(aux); bias_grad = rowsum(D) (over n)
//   BGradA       bias_grad(m) = sum over k of op(A)
//   BGradB       bias_grad(n) = sum over k of op(B)       bias_grad: bias_type (the backend: fp32, with an fp32 D)
// The GELU is the tanh approximation, as GPT-2. bias_grad is overwritten
// (cuBLASLt never accumulates it); the backend adds it where += is needed.
//
// Alignment: every pointer must be aligned to its element size (else an
// Error naming the operand); the actual alignment of each pointer (up to
// 16 bytes) is passed to the heuristic, so an odd leading dimension or
// offset gets a slower but correct kernel, never a fault. Aux needs ld_aux a
// multiple of 8 (cuBLASLt's rule) and is checked.
//
// Caching: the descriptor, the four layouts, the preference and the
// heuristic's chosen algorithm are built once per distinct (descriptor,
// alignments) and reused: per call only the pointer attributes are set.
// One workspace (32 MiB, the size NVIDIA recommends for Hopper) serves every
// call on the compute stream. When the heuristic returns no algorithm the
// Error names the whole descriptor; `supported()` asks without running.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace trainrun::cuda {

enum class GemmEpilogue { None, Bias, GeluAux, GeluAuxBias, DGelu, DGeluBGrad, BGradA, BGradB };
const char* epilogue_name(GemmEpilogue e);

struct GemmDesc {
  bool transa = false, transb = false;
  int m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int batch = 1;                                // strided batch count
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;
  DType ab_type = DType::BF16;
  DType d_type = DType::BF16;
  bool accumulate = false;                      // beta = 1: D += alpha*AB
  GemmEpilogue epilogue = GemmEpilogue::None;
  DType bias_type = DType::BF16;                // bias / bias_grad elements (epilogues with one); == d_type
  int64_t ld_aux = 0;                           // GELU epilogues
  std::string describe() const;                 // for error messages
};

struct GemmPtrs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;   // Bias, GeluAuxBias (bias_type)
  void* bias_grad = nullptr;    // DGeluBGrad, BGradA, BGradB (bias_type)
  void* aux = nullptr;          // GELU epilogues
  float alpha = 1.0f;
};

class Gemm {
 public:
  explicit Gemm(int device, size_t workspace_bytes = size_t(32) << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void run(const GemmDesc& desc, const GemmPtrs& ptrs, cudaStream_t stream);
  // Whether cuBLASLt has an algorithm for this descriptor at these pointers'
  // alignments (the answer is cached like the plan itself).
  bool supported(const GemmDesc& desc, const GemmPtrs& ptrs);
  // cuBLASLt's version number (e.g. 130100).
  static size_t library_version();
  // Benchmark helper: the median milliseconds of each of the heuristic's
  // first `max_algos` algorithms for this descriptor ([0] is the one run()
  // uses), over `repeats` timed calls after a warm-up. Overwrites D.
  std::vector<float> time_algorithms(const GemmDesc& desc, const GemmPtrs& ptrs, cudaStream_t stream, int max_algos,
                                     int repeats);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainrun::cuda
