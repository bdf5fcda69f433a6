// Helpers shared by the backend op tests (test_cpu_ops, test_cpu_llama_ops):
// double-precision host vectors on one side, backend buffers (act dtype or
// fp32) on the other, and the norm-wise relative-error check they all use.
#pragma once
#include <catch2/catch.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/support/device_io.h"
#include "tests/support/reference_ops.h"

namespace trainrun::test {

using ref::Vec;

inline Vec randn(size_t n, uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> d(mean, stddev);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

// The float helpers of device_io.h with doubles on the host side.
inline DeviceBuffer upload_f32(Backend* be, const Vec& v) { return upload_f32(be, std::vector<float>(v.begin(), v.end())); }
inline Vec download_f32_vec(Backend* be, const void* p, size_t n) {
  const std::vector<float> f = download_f32(be, p, n);
  return Vec(f.begin(), f.end());
}
inline DeviceBuffer upload_act(Backend* be, const Vec& v) { return upload_act(be, std::vector<float>(v.begin(), v.end())); }
inline Vec download_act_vec(Backend* be, const void* p, size_t n) {
  const std::vector<float> f = download_act(be, p, n);
  return Vec(f.begin(), f.end());
}

// A tensor as the backend holds it: uploading rounds to the act dtype, and the
// reference must see exactly those rounded values, not the doubles we drew.
struct ActTensor {
  DeviceBuffer buf;
  Vec val;
  ActTensor(Backend* be, const Vec& v) : buf(upload_act(be, v)), val(download_act_vec(be, buf.get(), v.size())) {}
  void* get() const { return buf.get(); }
};
struct F32Tensor {
  DeviceBuffer buf;
  Vec val;
  F32Tensor(Backend* be, const Vec& v) : buf(upload_f32(be, v)), val(download_f32_vec(be, buf.get(), v.size())) {}
  float* get() const { return buf.as<float>(); }
};

inline Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

// Norm-wise relative error of got against want, printed and checked.
inline double check_close(const std::string& what, const Vec& got, const Vec& want, double tol) {
  REQUIRE(got.size() == want.size());
  const double e = ref::rel_err(got, want);
  std::printf("  %-52s rel err %.3e (tol %.0e)\n", what.c_str(), e, tol);
  INFO(what << ": norm-wise relative error " << e << " exceeds " << tol);
  CHECK(e <= tol);
  return e;
}

}  // namespace trainrun::test
