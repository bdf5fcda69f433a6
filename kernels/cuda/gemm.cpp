// cuBLASLt GEMM wrapper: plans cached per (descriptor, alignments); see gemm.h.
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "core/common/error.h"
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

namespace {

// `g` (may be null) is described only when the call failed: no string
// formatting on the per-call path.
void check_lt(cublasStatus_t s, const char* call, const GemmDesc* g) {
  if (s != CUBLAS_STATUS_SUCCESS)
    TR_FAIL("cublasLt: ", call, " failed: ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s), ")",
            g ? " for " + g->describe() : std::string());
}
#define TR_LT_CHECK(call, g) check_lt((call), #call, (g))

cudaDataType_t cuda_type(DType t) { return t == DType::F32 ? CUDA_R_32F : CUDA_R_16BF; }

cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::GeluAux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::GeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::DGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::BGradA: return CUBLASLT_EPILOGUE_BGRADA;
    case GemmEpilogue::BGradB: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool uses_bias(GemmEpilogue e) { return e == GemmEpilogue::Bias || e == GemmEpilogue::GeluAuxBias; }
bool uses_bias_grad(GemmEpilogue e) {
  return e == GemmEpilogue::DGeluBGrad || e == GemmEpilogue::BGradA || e == GemmEpilogue::BGradB;
}
bool uses_bias_vector(GemmEpilogue e) { return uses_bias(e) || uses_bias_grad(e); }
bool uses_aux(GemmEpilogue e) {
  return e == GemmEpilogue::GeluAux || e == GemmEpilogue::GeluAuxBias || e == GemmEpilogue::DGelu ||
         e == GemmEpilogue::DGeluBGrad;
}

// Largest power of two (<= 16) dividing the address: what the heuristic may
// assume. For strided batches every batch's start counts, so the stride (in
// bytes) must be divisible too.
uint32_t alignment_of(const void* p, int64_t stride_bytes = 0) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(stride_bytes);
  uint32_t al = 16;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

uint32_t align_a(const GemmDesc& g, const GemmPtrs& p) {
  return alignment_of(p.a, g.batch > 1 ? g.stride_a * int64_t(dtype_size(g.ab_type)) : 0);
}
uint32_t align_b(const GemmDesc& g, const GemmPtrs& p) {
  return alignment_of(p.b, g.batch > 1 ? g.stride_b * int64_t(dtype_size(g.ab_type)) : 0);
}
uint32_t align_d(const GemmDesc& g, const GemmPtrs& p) {
  return alignment_of(p.d, g.batch > 1 ? g.stride_d * int64_t(dtype_size(g.d_type)) : 0);
}

}  // namespace

const char* epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::None: return "none";
    case GemmEpilogue::Bias: return "bias";
    case GemmEpilogue::GeluAux: return "gelu+aux";
    case GemmEpilogue::GeluAuxBias: return "gelu+aux+bias";
    case GemmEpilogue::DGelu: return "dgelu";
    case GemmEpilogue::DGeluBGrad: return "dgelu+bgrad";
    case GemmEpilogue::BGradA: return "bgrad(A)";
    case GemmEpilogue::BGradB: return "bgrad(B)";
  }
  return "?";
}

std::string GemmDesc::describe() const {
  return detail::cat("gemm m=", m, " n=", n, " k=", k, " op(A)=", transa ? "T" : "N", " op(B)=", transb ? "T" : "N",
                     " lda=", lda, " ldb=", ldb, " ldd=", ldd, batch > 1 ? detail::cat(" batch=", batch) : "",
                     " A/B ", dtype_name(ab_type), " D ", dtype_name(d_type), accumulate ? " D+=" : "",
                     " epilogue ", epilogue_name(epilogue),
                     uses_bias_vector(epilogue) ? detail::cat(" bias ", dtype_name(bias_type)) : "");
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t heur{};
  bool ok = false;  // the heuristic found an algorithm
  ~Plan() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct Gemm::Impl {
  int device = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::mutex mu;  // the plan cache and the per-call pointer attributes
  std::unordered_map<std::string, std::unique_ptr<Plan>> plans;

  static std::string key(const GemmDesc& g, const GemmPtrs& p) {
    char buf[320];
    std::snprintf(buf, sizeof buf, "%d%d|%d,%d,%d|%lld,%lld,%lld|%d,%lld,%lld,%lld|%d%d%d%d%d|%lld|%u,%u,%u,%u,%u",
                  g.transa, g.transb, g.m, g.n, g.k, (long long)g.lda, (long long)g.ldb, (long long)g.ldd, g.batch,
                  (long long)g.stride_a, (long long)g.stride_b, (long long)g.stride_d, int(g.ab_type),
                  int(g.d_type), int(g.accumulate), int(g.epilogue), int(g.bias_type), (long long)g.ld_aux,
                  align_a(g, p), align_b(g, p), align_d(g, p),
                  alignment_of(uses_bias(g.epilogue) ? p.bias : p.bias_grad), alignment_of(p.aux));
    return buf;
  }

  void validate(const GemmDesc& g, const GemmPtrs& p) const {
    TR_CHECK(g.m >= 1 && g.n >= 1 && g.k >= 1 && g.batch >= 1, "cublasLt: empty or negative shape in ", g.describe());
    TR_CHECK(g.lda >= (g.transa ? g.k : g.m) && g.ldb >= (g.transb ? g.n : g.k) && g.ldd >= g.m,
             "cublasLt: leading dimension smaller than the matrix in ", g.describe());
    const size_t ab = dtype_size(g.ab_type), ds = dtype_size(g.d_type);
    TR_CHECK(p.a && p.b && p.d, "cublasLt: null A, B or D pointer in ", g.describe());
    TR_CHECK(reinterpret_cast<uintptr_t>(p.a) % ab == 0 && reinterpret_cast<uintptr_t>(p.b) % ab == 0,
             "cublasLt: A or B is not aligned to its element size in ", g.describe());
    TR_CHECK(reinterpret_cast<uintptr_t>(p.d) % ds == 0, "cublasLt: D is not aligned to its element size in ", g.describe());
    if (uses_bias(g.epilogue)) TR_CHECK(p.bias, "cublasLt: epilogue needs a bias pointer in ", g.describe());
    if (uses_bias_grad(g.epilogue)) TR_CHECK(p.bias_grad, "cublasLt: epilogue needs a bias_grad pointer in ", g.describe());
    if (uses_bias_vector(g.epilogue)) {
      TR_CHECK(g.bias_type == g.d_type, "cublasLt: the bias / bias-gradient vector must have D's type (",
               dtype_name(g.d_type), "; cuBLASLt's rule outside FP8/integer kernels), not ", dtype_name(g.bias_type),
               ", in ", g.describe());
      const void* bp = uses_bias(g.epilogue) ? p.bias : p.bias_grad;
      TR_CHECK(reinterpret_cast<uintptr_t>(bp) % dtype_size(g.bias_type) == 0,
               "cublasLt: the bias / bias-gradient vector is not aligned to its element size in ", g.describe());
    }
    if (uses_aux(g.epilogue)) {
      TR_CHECK(p.aux, "cublasLt: epilogue needs an aux pointer in ", g.describe());
      TR_CHECK(g.ld_aux >= g.m && g.ld_aux % 8 == 0,
               "cublasLt: ld_aux must be >= m and a multiple of 8 (cuBLASLt's rule) in ", g.describe());
      TR_CHECK(g.batch == 1, "cublasLt: GELU epilogues are not wired for batched products in ", g.describe());
    }
  }

  void set_pointers(Plan& pl, const GemmDesc& g, const GemmPtrs& p) {
    const GemmDesc* ctx = &g;
    if (uses_bias(g.epilogue)) {
      const void* bias = p.bias;
      TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), ctx);
    } else if (uses_bias_grad(g.epilogue)) {
      void* bg = p.bias_grad;
      TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bg, sizeof bg), ctx);
    }
    if (uses_aux(g.epilogue)) {
      void* aux = p.aux;
      TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
                  ctx);
    }
  }

  Plan& plan(const GemmDesc& g, const GemmPtrs& p) {
    const std::string k = key(g, p);
    auto it = plans.find(k);
    if (it != plans.end()) return *it->second;
    auto pl = std::make_unique<Plan>();
    const GemmDesc* ctx = &g;
    TR_LT_CHECK(cublasLtMatmulDescCreate(&pl->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), ctx);
    const cublasOperation_t ta = g.transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), ctx);
    TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), ctx);
    const cublasLtEpilogue_t ep = lt_epilogue(g.epilogue);
    TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep), ctx);
    if (uses_bias_vector(g.epilogue)) {
      // Stated, not left to cuBLASLt's default (D's type): the bias read by
      // BIAS / GELU_AUX_BIAS and the bias gradient written by the BGRAD epilogues.
      const int32_t bt = static_cast<int32_t>(cuda_type(g.bias_type));
      TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt), ctx);
    }
    if (uses_aux(g.epilogue)) {
      const int64_t ld = g.ld_aux;
      TR_LT_CHECK(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld), ctx);
    }
    // Layouts: A is (m,k) or, transposed, stored (k,m); B is (k,n) or (n,k).
    const cudaDataType_t abt = cuda_type(g.ab_type), dt = cuda_type(g.d_type);
    TR_LT_CHECK(cublasLtMatrixLayoutCreate(&pl->a, abt, g.transa ? g.k : g.m, g.transa ? g.m : g.k, g.lda), ctx);
    TR_LT_CHECK(cublasLtMatrixLayoutCreate(&pl->b, abt, g.transb ? g.n : g.k, g.transb ? g.k : g.n, g.ldb), ctx);
    TR_LT_CHECK(cublasLtMatrixLayoutCreate(&pl->d, dt, g.m, g.n, g.ldd), ctx);
    if (g.batch > 1) {
      const int32_t bc = g.batch;
      struct L { cublasLtMatrixLayout_t l; int64_t stride; } ls[] = {{pl->a, g.stride_a}, {pl->b, g.stride_b}, {pl->d, g.stride_d}};
      for (auto& l : ls) {
        TR_LT_CHECK(cublasLtMatrixLayoutSetAttribute(l.l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc), ctx);
        TR_LT_CHECK(cublasLtMatrixLayoutSetAttribute(l.l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &l.stride,
                                                     sizeof l.stride), ctx);
      }
    }
    TR_LT_CHECK(cublasLtMatmulPreferenceCreate(&pl->pref), ctx);
    const uint64_t ws = workspace_bytes;
    TR_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pl->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                ctx);
    const uint32_t al_a = align_a(g, p), al_b = align_b(g, p), al_d = align_d(g, p);
    TR_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pl->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                                     sizeof al_a), ctx);
    TR_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pl->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                                     sizeof al_b), ctx);
    TR_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pl->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d,
                                                     sizeof al_d), ctx);
    TR_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pl->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d,
                                                     sizeof al_d), ctx);
    // The heuristic reads the epilogue pointers' values for their alignment.
    set_pointers(*pl, g, p);
    int returned = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, pl->desc, pl->a, pl->b, pl->d, pl->d, pl->pref, 1,
                                                      &pl->heur, &returned);
    pl->ok = s == CUBLAS_STATUS_SUCCESS && returned > 0;
    Plan& ref = *pl;
    plans.emplace(k, std::move(pl));
    return ref;
  }
};

Gemm::Gemm(int device, size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  impl_->workspace_bytes = workspace_bytes;
  TR_LT_CHECK(cublasLtCreate(&impl_->handle), nullptr);
  TR_CUDA_CHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
}

Gemm::~Gemm() {
  impl_->plans.clear();
  if (impl_->workspace) cudaFree(impl_->workspace);
  if (impl_->handle) cublasLtDestroy(impl_->handle);
}

size_t Gemm::library_version() { return cublasLtGetVersion(); }

std::vector<float> Gemm::time_algorithms(const GemmDesc& g, const GemmPtrs& p, cudaStream_t stream, int max_algos,
                                         int repeats) {
  impl_->validate(g, p);
  std::lock_guard<std::mutex> lk(impl_->mu);
  Plan& pl = impl_->plan(g, p);
  TR_CHECK(pl.ok, "cublasLt: no algorithm for ", g.describe());
  impl_->set_pointers(pl, g, p);
  std::vector<cublasLtMatmulHeuristicResult_t> heur(std::max(1, max_algos));
  int returned = 0;
  TR_LT_CHECK(cublasLtMatmulAlgoGetHeuristic(impl_->handle, pl.desc, pl.a, pl.b, pl.d, pl.d, pl.pref, int(heur.size()),
                                             heur.data(), &returned), &g);
  heur.resize(returned);
  heur.insert(heur.begin(), pl.heur);  // [0]: the cached choice (the heuristic's first)
  heur.erase(heur.begin() + 1);
  cudaEvent_t e0, e1;
  TR_CUDA_CHECK(cudaEventCreate(&e0));
  TR_CUDA_CHECK(cudaEventCreate(&e1));
  const float alpha = p.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  std::vector<float> out;
  for (const auto& h : heur) {
    std::vector<float> times;
    bool failed = false;
    for (int r = -2; r < repeats && !failed; ++r) {  // two warm-up calls
      TR_CUDA_CHECK(cudaEventRecord(e0, stream));
      failed = cublasLtMatmul(impl_->handle, pl.desc, &alpha, p.a, pl.a, p.b, pl.b, &beta, p.d, pl.d, p.d, pl.d,
                              &h.algo, impl_->workspace, impl_->workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS;
      TR_CUDA_CHECK(cudaEventRecord(e1, stream));
      TR_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      TR_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 0) times.push_back(ms);
    }
    if (failed || times.empty()) {
      out.push_back(-1.0f);
      continue;
    }
    std::sort(times.begin(), times.end());
    out.push_back(times[times.size() / 2]);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return out;
}

bool Gemm::supported(const GemmDesc& desc, const GemmPtrs& ptrs) {
  impl_->validate(desc, ptrs);
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->plan(desc, ptrs).ok;
}

void Gemm::run(const GemmDesc& g, const GemmPtrs& p, cudaStream_t stream) {
  impl_->validate(g, p);
  std::lock_guard<std::mutex> lk(impl_->mu);
  Plan& pl = impl_->plan(g, p);
  if (!pl.ok)
    TR_FAIL("cublasLt: no algorithm for ", g.describe(), " (alignments A ", align_a(g, p), ", B ",
            align_b(g, p), ", D ", align_d(g, p),
            " bytes); this shape/epilogue combination is not supported by this cuBLASLt (version ",
            cublasLtGetVersion(), ")");
  impl_->set_pointers(pl, g, p);
  const float alpha = p.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  TR_LT_CHECK(cublasLtMatmul(impl_->handle, pl.desc, &alpha, p.a, pl.a, p.b, pl.b, &beta, p.d, pl.d, p.d, pl.d,
                             &pl.heur.algo, impl_->workspace, impl_->workspace_bytes, stream),
              &g);
}

}  // namespace trainrun::cuda
