// The CUDA op tests' shared side-by-side harness (test_cuda_ops.cpp,
// test_cuda_moe.cpp): the skip rule without a GPU, the tolerances, the
// norm-wise error check, and tensors that hold the same values on the CPU
// and the CUDA backend (Twin). test_cuda_ops.cpp's header comment says why
// each tolerance is what it is.
#pragma once
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "tests/support/device_io.h"

namespace trainrun::cuda_cmp {

constexpr double kF32 = 1e-4;
constexpr double kBf16 = 1e-2;
constexpr double kAttnFwd = 2e-2;
constexpr double kAttnBwd = 3e-2;
constexpr double kLoss = 3e-2;

using Vec = std::vector<float>;

// The GPU count, or 0 with a reason for the skip message.
inline int gpus(std::string* reason) {
  static std::string why;
  static const int n = cuda_device_count(&why);
  *reason = why;
  return n;
}

// The "SKIPPED: " prefix is what CTest looks for (CMakeLists.txt, the test
// section): keep the two in step.
#define CUDA_TEST_OR_SKIP()                                          \
  std::string skip_reason_;                                          \
  if (gpus(&skip_reason_) == 0) {                                    \
    WARN("SKIPPED: no usable GPU: " << skip_reason_);                \
    return;                                                          \
  }

// Multi-GPU tests: skipped with the count where fewer GPUs are visible.
#define CUDA_TEST_OR_SKIP_BELOW(n_gpus)                                 \
  CUDA_TEST_OR_SKIP();                                                  \
  if (const int visible_ = gpus(&skip_reason_); visible_ < (n_gpus)) { \
    WARN("SKIPPED: needs " << (n_gpus) << " GPUs, " << visible_ << " visible"); \
    return;                                                             \
  }

inline Vec randn(size_t n, uint64_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(mean, stddev);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

inline std::vector<int32_t> rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

inline double rel_err(const Vec& got, const Vec& want) {
  REQUIRE(got.size() == want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;  // unwritten (poisoned) or overflowed
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline void check_close(const std::string& what, const Vec& got, const Vec& want, double tol) {
  const double e = rel_err(got, want);
  std::printf("  %-58s rel err %.3e (tol %.0e)\n", what.c_str(), e, tol);
  INFO(what << ": norm-wise relative error " << e << " exceeds " << tol << " (inf: an element is NaN/unwritten)");
  CHECK(e <= tol);
}

// The two backends side by side, and tensors that hold the same values on both.
struct Pair {
  std::unique_ptr<Backend> cpu = make_cpu_backend(2);
  std::unique_ptr<Backend> gpu;
  Pair() { gpu = make_backend("cuda", 0, nullptr); }
};

using test::cast_into;
using test::download_act;
using test::download_f32;
using test::upload_f32;

inline void poison(Backend* be, void* p, size_t bytes) {
  std::vector<unsigned char> nan(bytes, 0xFF);  // NaN in fp32 and bf16
  be->copy_to_device(p, nan.data(), bytes);
}

// A tensor with the same values on both backends. `act`: the activation
// dtype (bf16 on the GPU, rounded there; the CPU gets the rounded values).
// `offset` elements of slack in front test unaligned pointers.
struct Twin {
  DeviceBuffer cbuf, gbuf;
  Vec val;
  bool act;
  size_t n, offset;
  Twin(Pair& p, const Vec& v, bool act_dtype, size_t offset_elems = 0)
      : act(act_dtype), n(v.size()), offset(offset_elems) {
    const size_t ges = act ? dtype_size(p.gpu->act_dtype()) : 4;
    gbuf = DeviceBuffer(p.gpu.get(), (n + offset + 1) * ges);
    if (act) {
      cast_into(p.gpu.get(), g(), v);
      val = download_act(p.gpu.get(), g(), n);
    } else {
      p.gpu->copy_to_device(g(), v.data(), n * 4);
      val = v;
    }
    cbuf = upload_f32(p.cpu.get(), val);
  }
  void* g() const { return gbuf.as<char>() + offset * (act ? 2 : 4); }
  void* c() const { return cbuf.get(); }
  float* gf() const { return static_cast<float*>(g()); }
  float* cf() const { return cbuf.as<float>(); }
  Vec read_gpu(Pair& p) const { return act ? download_act(p.gpu.get(), g(), n) : download_f32(p.gpu.get(), g(), n); }
  Vec read_cpu(Pair& p) const { return download_f32(p.cpu.get(), c(), n); }
};

// An output: poisoned on the GPU.
inline Twin out_twin(Pair& p, size_t n, bool act, size_t offset = 0) {
  Twin t(p, Vec(n, 1.0f), act, offset);
  poison(p.gpu.get(), t.gbuf.get(), t.gbuf.bytes());
  return t;
}

struct Tok {
  DeviceBuffer c, g;
  Tok(Pair& p, const std::vector<int32_t>& t) : c(p.cpu.get(), t.size() * 4), g(p.gpu.get(), t.size() * 4) {
    p.cpu->copy_to_device(c.get(), t.data(), t.size() * 4);
    p.gpu->copy_to_device(g.get(), t.data(), t.size() * 4);
  }
  const int32_t* cp() const { return c.as<int32_t>(); }
  const int32_t* gp() const { return g.as<int32_t>(); }
};

inline std::string shape(std::initializer_list<std::pair<const char*, long>> dims) {
  std::string s;
  for (auto& d : dims) s += std::string(s.empty() ? "" : " ") + d.first + "=" + std::to_string(d.second);
  return s;
}


}  // namespace trainrun::cuda_cmp
