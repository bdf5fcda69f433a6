// The experts' grouped GEMM: see moe_grouped_gemm.h for the design.
#include "kernels/cuda/moe_grouped_gemm.h"

#include <cublas_v2.h>

#include <mutex>
#include <vector>

#include "kernels/cuda/matmul.cuh"

namespace trainrun::cuda {

namespace {

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cublasStatus_t (unknown)";
  }
}

#define TR_CUBLAS_CHECK(call)                                                                       \
  do {                                                                                              \
    const cublasStatus_t tr_st_ = (call);                                                           \
    TR_CHECK(tr_st_ == CUBLAS_STATUS_SUCCESS, "cublas: ", #call, " failed: ", cublas_status_name(tr_st_), " at ", \
             __FILE__, ":", __LINE__);                                                              \
  } while (0)

// One product over the non-empty experts: per group g, D_g(m,n) = alpha op(A_g) op(B_g) + beta D_g
// (column-major, cuBLAS's convention), with the shared transposes and leading dimensions.
struct Groups {
  bool transa = false, transb = false;
  int lda = 0, ldb = 0, ldc = 0;
  bool c_f32 = false, accumulate = false;
  std::vector<int> m, n, k;
  std::vector<const void*> a, b;
  std::vector<void*> c;
  std::vector<int> expert;  // for the fallback and messages
  std::vector<int> rows;    // the expert's row count
  void add(int e, int rows_e, int mm, int nn, int kk, const void* pa, const void* pb, void* pc) {
    expert.push_back(e), rows.push_back(rows_e);
    m.push_back(mm), n.push_back(nn), k.push_back(kk);
    a.push_back(pa), b.push_back(pb), c.push_back(pc);
  }
  int count() const { return int(m.size()); }
};

}  // namespace

struct MoeGroupedGemm::Impl {
  int device = 0;
  Gemm& gemm;
  DeviceAllocator& alloc;
  cublasHandle_t handle = nullptr;
  // Pinned host memory: the offsets read back, and the pointer arrays of up
  // to two products per call (backward: din and dw) before their upload.
  int32_t* host_offsets = nullptr;
  size_t offsets_cap = 0;
  const void** host_ptrs = nullptr;
  size_t ptrs_cap = 0;
  bool fallback[2] = {false, false};  // per C type: bf16, fp32
  std::mutex mu;                      // one caller at a time (the pinned buffers)

  Impl(int dev, Gemm& g, DeviceAllocator& a) : device(dev), gemm(g), alloc(a) {
    TR_CUBLAS_CHECK(cublasCreate(&handle));
  }
  ~Impl() {
    if (handle) cublasDestroy(handle);
    if (host_offsets) cudaFreeHost(host_offsets);
    if (host_ptrs) cudaFreeHost(host_ptrs);
  }

  // The offsets on the host: one copy and one wait on the stream (the header says why).
  const int32_t* read_offsets(const int32_t* offsets, int E, cudaStream_t stream, const char* op) {
    if (offsets_cap < size_t(E) + 1) {
      if (host_offsets) TR_CUDA_CHECK(cudaFreeHost(host_offsets));
      host_offsets = nullptr;
      TR_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_offsets), (size_t(E) + 1) * 4));
      offsets_cap = size_t(E) + 1;
    }
    TR_CUDA_CHECK(cudaMemcpyAsync(host_offsets, offsets, (size_t(E) + 1) * 4, cudaMemcpyDeviceToHost, stream));
    TR_CUDA_CHECK(cudaStreamSynchronize(stream));
    TR_CHECK(host_offsets[0] == 0, op, ": offsets[0] is ", host_offsets[0], ", not 0 (a bug: offsets come from moe_permute)");
    for (int e = 0; e < E; ++e)
      TR_CHECK(host_offsets[e + 1] >= host_offsets[e], op, ": offsets of expert ", e, " run backwards (",
               host_offsets[e], " then ", host_offsets[e + 1], "; a bug: offsets come from moe_permute)");
    return host_offsets;
  }

  void ensure_ptrs(size_t n) {
    if (ptrs_cap >= n) return;
    if (host_ptrs) TR_CUDA_CHECK(cudaFreeHost(host_ptrs));
    host_ptrs = nullptr;
    TR_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_ptrs), n * sizeof(void*)));
    ptrs_cap = n;
  }

  // slot: which half of the pinned pointer area (0 or 1: the two products of a backward).
  void run(const Groups& g, int slot, cudaStream_t stream, const char* op) {
    const int G = g.count();
    if (G == 0) return;
    const int ti = g.c_f32 ? 1 : 0;
    if (!fallback[ti]) {
      const void** hp = host_ptrs + size_t(slot) * (ptrs_cap / 2);  // ensure_ptrs: 3 arrays of E, twice
      for (int i = 0; i < G; ++i) hp[i] = g.a[size_t(i)], hp[G + i] = g.b[size_t(i)], hp[2 * G + i] = g.c[size_t(i)];
      void* dev = alloc.allocate(size_t(3) * G * sizeof(void*));
      // Released at once: the next user of the block is ordered after this call on the same stream.
      struct Release {
        DeviceAllocator& a;
        void* p;
        ~Release() { a.release(p); }
      } release{alloc, dev};
      TR_CUDA_CHECK(cudaMemcpyAsync(dev, hp, size_t(3) * G * sizeof(void*), cudaMemcpyHostToDevice, stream));
      const void* const* da = static_cast<const void* const*>(dev);
      const void* const* db = da + G;
      void* const* dc = static_cast<void* const*>(dev) + 2 * G;
      const std::vector<cublasOperation_t> ta(size_t(G), g.transa ? CUBLAS_OP_T : CUBLAS_OP_N);
      const std::vector<cublasOperation_t> tb(size_t(G), g.transb ? CUBLAS_OP_T : CUBLAS_OP_N);
      const std::vector<int> lda(size_t(G), g.lda), ldb(size_t(G), g.ldb), ldc(size_t(G), g.ldc), ones(size_t(G), 1);
      const std::vector<float> alpha(size_t(G), 1.f), beta(size_t(G), g.accumulate ? 1.f : 0.f);
      TR_CUBLAS_CHECK(cublasSetStream(handle, stream));
      const cublasStatus_t st = cublasGemmGroupedBatchedEx(
          handle, ta.data(), tb.data(), g.m.data(), g.n.data(), g.k.data(), alpha.data(), da, CUDA_R_16BF,
          lda.data(), db, CUDA_R_16BF, ldb.data(), beta.data(), dc, g.c_f32 ? CUDA_R_32F : CUDA_R_16BF, ldc.data(), G,
          ones.data(), CUBLAS_COMPUTE_32F);
      if (st == CUBLAS_STATUS_SUCCESS) return;
      TR_CHECK(st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE, op,
               ": cublasGemmGroupedBatchedEx failed: ", cublas_status_name(st), " (", G, " experts, C ",
               g.c_f32 ? "fp32" : "bf16", ")");
      fallback[ti] = true;  // from now on per expert, below
    }
    // Per expert through the cuBLASLt wrapper (matmul.cuh's descriptors have the same mapping).
    for (int i = 0; i < G; ++i) {
      GemmDesc d;
      d.transa = g.transa, d.transb = g.transb;
      d.m = g.m[size_t(i)], d.n = g.n[size_t(i)], d.k = g.k[size_t(i)];
      d.lda = g.lda, d.ldb = g.ldb, d.ldd = g.ldc;
      d.ab_type = DType::BF16;
      d.d_type = g.c_f32 ? DType::F32 : DType::BF16;
      d.accumulate = g.accumulate;
      GemmPtrs p;
      p.a = g.a[size_t(i)], p.b = g.b[size_t(i)], p.d = g.c[size_t(i)];
      gemm.run(d, p, stream);
    }
  }
};

MoeGroupedGemm::MoeGroupedGemm(int device, Gemm& gemm, DeviceAllocator& alloc)
    : impl_(std::make_unique<Impl>(device, gemm, alloc)) {}
MoeGroupedGemm::~MoeGroupedGemm() = default;

bool MoeGroupedGemm::fallback_used() const { return impl_->fallback[0] || impl_->fallback[1]; }

namespace {
void check_dims(const char* op, int E, int IC, int OC) {
  TR_CHECK(E >= 1 && IC >= 1 && OC >= 1, op, ": E ", E, ", IC ", IC, ", OC ", OC, " (each must be >= 1)");
}
}  // namespace

void MoeGroupedGemm::forward(bf16* out, const bf16* in, const bf16* w, const int32_t* offsets, int E, int IC, int OC,
                             cudaStream_t stream) {
  const char* op = "moe_expert_matmul_forward";
  check_dims(op, E, IC, OC);
  std::lock_guard<std::mutex> lk(impl_->mu);
  const int32_t* off = impl_->read_offsets(offsets, E, stream, op);
  impl_->ensure_ptrs(size_t(6) * E);
  // out^T(OC,rows) = w_e^T (col-major (IC,OC), transposed) @ in^T (IC,rows)
  Groups g;
  g.transa = true, g.lda = IC, g.ldb = IC, g.ldc = OC;
  for (int e = 0; e < E; ++e) {
    const int r0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    g.add(e, rows, OC, rows, IC, w + int64_t(e) * OC * IC, in + int64_t(r0) * IC, out + int64_t(r0) * OC);
  }
  impl_->run(g, 0, stream, op);
}

void MoeGroupedGemm::backward(bf16* din, float* dw, const bf16* dout, const bf16* in, const bf16* w,
                              const int32_t* offsets, int E, int IC, int OC, cudaStream_t stream) {
  const char* op = "moe_expert_matmul_backward";
  check_dims(op, E, IC, OC);
  if (!din && !dw) return;
  TR_CHECK(!din || w, op, ": the input gradient needs the weights (w is null)");
  std::lock_guard<std::mutex> lk(impl_->mu);
  const int32_t* off = impl_->read_offsets(offsets, E, stream, op);
  impl_->ensure_ptrs(size_t(6) * E);
  if (din) {
    // din^T(IC,rows) = w_e (col-major (IC,OC)) @ dout^T (OC,rows)
    Groups g;
    g.lda = IC, g.ldb = OC, g.ldc = IC;
    for (int e = 0; e < E; ++e) {
      const int r0 = off[e], rows = off[e + 1] - off[e];
      if (rows == 0) continue;
      g.add(e, rows, IC, rows, OC, w + int64_t(e) * OC * IC, dout + int64_t(r0) * OC, din + int64_t(r0) * IC);
    }
    impl_->run(g, 0, stream, op);
  }
  if (dw) {
    // dw_e^T(IC,OC) += in^T (IC,rows) @ dout (rows,OC): B = dout^T stored (OC,rows), transposed
    Groups g;
    g.transb = true, g.lda = IC, g.ldb = OC, g.ldc = IC, g.c_f32 = true, g.accumulate = true;
    for (int e = 0; e < E; ++e) {
      const int r0 = off[e], rows = off[e + 1] - off[e];
      if (rows == 0) continue;
      g.add(e, rows, IC, OC, rows, in + int64_t(r0) * IC, dout + int64_t(r0) * OC, dw + int64_t(e) * OC * IC);
    }
    impl_->run(g, 1, stream, op);
  }
}

}  // namespace trainrun::cuda
