// Host AdamW: the optimizer of parallel.offload (the fp32 master weights,
// both moments and the gradient shard live in host memory and the update
// runs on host threads, ZeRO-Offload style).
//
// Math (per element, exactly the CPU backend's adamw_update, including
// which products GCC fuses into FMAs there under -march=x86-64-v3, so the
// two are bit-identical and offload on/off gives the same losses):
//   g    = grad * grad_scale                    (clipping)
//   m    = fma(beta1, m, (1-beta1) * g)
//   v    = fma(beta2, v, ((1-beta2) * g) * g)
//   u    = fma(wd, w, (m / bc1) / (sqrt(v / bc2) + eps))
//   w    = fma(-lr, u, w)                       (w - lr * u, one rounding)
// bc1 = 1 - beta1^step and bc2 = 1 - beta2^step are computed in double and
// rounded to float once, as the backend does.
//
// Three kernels, picked once at run time (cpuid via __builtin_cpu_supports):
// AVX-512F (16 lanes), AVX2+FMA (8 lanes), and a scalar loop with std::fma.
// Each element is independent, so the split over threads and lanes never
// changes a bit. TRAINRUN_HOST_ADAMW_ISA=scalar|avx2|avx512 forces one (for
// tests and the benchmark; a request the CPU cannot run is an error).
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

enum class HostIsa { Scalar, Avx2, Avx512 };
const char* host_isa_name(HostIsa isa);
// The widest kernel this CPU runs (or the one TRAINRUN_HOST_ADAMW_ISA names).
HostIsa host_adamw_best_isa();
bool host_isa_supported(HostIsa isa);

struct HostAdamWArgs {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
  int step = 1;  // 1-based, for bias correction
  float grad_scale = 1.0f;
};

// master/m/v updated in place from grad over n elements (host memory).
// threads <= 1: on the calling thread; else split over that many OpenMP
// threads in 64-byte-aligned chunks.
void host_adamw_update(float* master, const float* grad, float* m, float* v, int64_t n, const HostAdamWArgs& a,
                       int threads = 1, HostIsa isa = host_adamw_best_isa());

// dst += src on the host (fp32): accumulating gradient shards across
// micro-batches the way the backend's accumulate() does (one add, no FMA).
void host_accumulate(float* dst, const float* src, int64_t n, int threads = 1);

}  // namespace trainrun
