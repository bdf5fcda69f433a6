// CPU backend: memory, casts, elementwise ops and the optimizer.
// The neural-net ops are in cpu_nn.cpp and cpu_attention.cpp.
#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/common/error.h"
#include "kernels/cpu/fastmath.h"

extern "C" void openblas_set_num_threads(int);

namespace trainrun {

namespace {
// Allocation header: the size lives just before the returned pointer so
// free() can keep the byte counters exact without a map.
constexpr size_t kAlign = 64;
}  // namespace

CpuBackend::CpuBackend(int threads, int logits_align) : logits_align_(logits_align > 1 ? logits_align : 1) {
  threads_ = threads > 0 ? threads : omp_get_max_threads();
  omp_set_num_threads(threads_);
  openblas_set_num_threads(threads_);
}

std::unique_ptr<Backend> make_cpu_backend(int threads, int logits_align) {
  return std::make_unique<CpuBackend>(threads, logits_align);
}

void* CpuBackend::alloc(size_t bytes) {
  size_t total = bytes + kAlign;
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, total) != 0 || raw == nullptr)
    TR_FAIL("cpu backend: out of host memory allocating ", bytes, " bytes (", bytes_in_use(),
            " already in use); reduce train.micro_batch_size or the model size");
  std::memset(raw, 0, total);
  *static_cast<size_t*>(raw) = bytes;
  size_t now = (in_use_ += bytes);
  size_t prev = peak_.load();
  while (now > prev && !peak_.compare_exchange_weak(prev, now)) {
  }
  return static_cast<char*>(raw) + kAlign;
}

void CpuBackend::free(void* p) {
  if (!p) return;
  void* raw = static_cast<char*>(p) - kAlign;
  in_use_ -= *static_cast<size_t*>(raw);
  std::free(raw);
}

void CpuBackend::copy_to_device(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
void CpuBackend::copy_to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

void CpuBackend::copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                                     const HostChunkSink& consume) {
  (void)ready;  // every op ran on the calling thread already
  if (bytes) consume(src, 0, bytes);
}
void CpuBackend::copy_device(void* dst, const void* src, size_t bytes) {
  if (dst != src) std::memmove(dst, src, bytes);
}
void CpuBackend::zero(void* p, size_t bytes) { std::memset(p, 0, bytes); }

void CpuBackend::cast_from_f32(void* dst, const float* src, int64_t n) {
  if (dst != src) std::memcpy(dst, src, n * sizeof(float));
}
void CpuBackend::cast_to_f32(float* dst, const void* src, int64_t n) {
  if (dst != src) std::memcpy(dst, src, n * sizeof(float));
}

void CpuBackend::residual_forward(void* out_, const void* a_, const void* b_, int64_t n) {
  float* out = static_cast<float*>(out_);
  const float* a = static_cast<const float*>(a_);
  const float* b = static_cast<const float*>(b_);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// GELU, tanh approximation (as GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
}

void CpuBackend::gelu_forward(void* out_, const void* inp_, int64_t n) {
  float* out = static_cast<float*>(out_);
  const float* x = static_cast<const float*>(inp_);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float u = kGeluScale * (v + 0.044715f * v * v * v);
    out[i] = 0.5f * v * (1.0f + fastmath::tanh(u));
  }
}

void CpuBackend::gelu_backward(void* dinp_, const void* inp_, const void* dout_, int64_t n) {
  float* dinp = static_cast<float*>(dinp_);
  const float* x = static_cast<const float*>(inp_);
  const float* dout = static_cast<const float*>(dout_);
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i];
    float u = kGeluScale * (v + 0.044715f * v * v * v);
    float th = fastmath::tanh(u);
    float sech2 = 1.0f - th * th;
    float grad = 0.5f * (1.0f + th) + 0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * v * v);
    dinp[i] = grad * dout[i];
  }
}

// Per-thread partial sums in double, combined in thread order: deterministic
// for a fixed thread count and far more accurate than a float running sum.
template <bool kSquare>
static void reduce_into(float* out, const float* x, int64_t n, int threads) {
  std::vector<double> partial(threads, 0.0);
#pragma omp parallel num_threads(threads)
  {
    int tid = omp_get_thread_num();
    double acc = 0.0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) acc += kSquare ? double(x[i]) * double(x[i]) : double(x[i]);
    partial[tid] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  out[0] += static_cast<float>(total);
}

void CpuBackend::sum_squares(float* out, const float* x, int64_t n) { reduce_into<true>(out, x, n, threads_); }
void CpuBackend::sum(float* out, const float* x, int64_t n) { reduce_into<false>(out, x, n, threads_); }

void CpuBackend::scale(float* x, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void CpuBackend::accumulate(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void CpuBackend::adamw_update(float* master, void* param_, const float* grad, float* m, float* v, int64_t n,
                              float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                              float grad_scale) {
  float* param = static_cast<float*>(param_);
  // Bias corrections computed once in double: at step 1 with beta2=0.999 the
  // float expression 1-beta2^t loses digits.
  const float bc1 = static_cast<float>(1.0 - std::pow(double(beta1), step));
  const float bc2 = static_cast<float>(1.0 - std::pow(double(beta2), step));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] * grad_scale;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float mhat = mi / bc1;
    float vhat = vi / bc2;
    float w = master[i];
    w -= lr * (mhat / (std::sqrt(vhat) + eps) + weight_decay * w);
    master[i] = w;
    param[i] = w;
  }
}

}  // namespace trainrun
