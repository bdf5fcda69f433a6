// The CUDA backend's nf4_dequantize (kernels/cuda/nf4.cu) against the CPU's
// (the host loop that tests/test_nf4.cpp checks against the bitsandbytes
// reference): the same bits, fp32 and bf16, at odd sizes (1, 19, 111, 500,
// one element past a 64-block, past an absmax run, n % 16 tails) and with
// unaligned pointers (the one-element-per-thread path). Outputs are
// poisoned with NaN first, so an element the kernel skips fails.
// Without a usable GPU every case prints "SKIPPED: no usable GPU: <reason>".
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/model/adapter/nf4.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "tests/support/cuda_skip.h"

using namespace trainrun;

namespace {

std::vector<float> randn(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  if (n > 200) std::fill(v.begin() + 64, v.begin() + 128, 0.0f);  // an all-zero block
  return v;
}

// Copies `bytes` to device memory `skew` bytes past a fresh allocation's start.
struct Placed {
  DeviceBuffer buf;
  void* p = nullptr;
  Placed(Backend* be, const void* host, size_t bytes, size_t skew) : buf(be, bytes + skew + 16) {
    p = static_cast<char*>(buf.get()) + skew;
    if (host) be->copy_to_device(p, host, bytes);
  }
};

size_t first_diff(const void* a, const void* b, size_t n, size_t elem) {
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(static_cast<const char*>(a) + i * elem, static_cast<const char*>(b) + i * elem, elem) != 0)
      return i;
  return n;
}

}  // namespace

TEST_CASE("cuda nf4_dequantize equals the CPU backend's, fp32 and bf16", "[cuda][nf4]") {
  TR_CUDA_TEST_OR_SKIP();
  auto gpu = make_backend("cuda", 0, nullptr);
  const auto& map = nf4::dynamic_map();
  for (int64_t n : {int64_t(1), int64_t(19), int64_t(111), int64_t(500), int64_t(65), int64_t(16384 * 64 + 1),
                    int64_t(70001), int64_t(64 * 1000)}) {
    const auto x = randn(size_t(n), uint64_t(n));
    const auto t = nf4::quantize(x.data(), n, "x");
    std::vector<float> want(x.size());
    std::vector<uint16_t> want16(x.size());
    nf4::dequantize(t, want.data());
    nf4::dequantize_bf16(t, want16.data());
    for (size_t skew : {size_t(0), size_t(1)}) {  // 1: packed 1 byte and out 4 bytes off alignment
      INFO("n = " << n << ", skew " << skew);
      Placed packed(gpu.get(), t.packed.data(), t.packed.size(), skew);
      Placed qabsmax(gpu.get(), t.qabsmax.data(), t.qabsmax.size(), 0);
      Placed absmax2(gpu.get(), t.absmax2.data(), 4 * t.absmax2.size(), 0);
      Placed dmap(gpu.get(), map.data(), 4 * map.size(), 0);
      const std::vector<float> poison(x.size(), std::numeric_limits<float>::quiet_NaN());
      Placed out(gpu.get(), poison.data(), 4 * x.size(), 4 * skew);
      Placed out16(gpu.get(), poison.data(), 2 * x.size(), 4 * skew);
      gpu->nf4_dequantize(out.p, DType::F32, static_cast<uint8_t*>(packed.p), static_cast<uint8_t*>(qabsmax.p),
                          static_cast<float*>(absmax2.p), static_cast<float*>(dmap.p), t.offset, n);
      gpu->nf4_dequantize(out16.p, DType::BF16, static_cast<uint8_t*>(packed.p), static_cast<uint8_t*>(qabsmax.p),
                          static_cast<float*>(absmax2.p), static_cast<float*>(dmap.p), t.offset, n);
      std::vector<float> got(x.size());
      std::vector<uint16_t> got16(x.size());
      gpu->copy_to_host(got.data(), out.p, 4 * x.size());
      gpu->copy_to_host(got16.data(), out16.p, 2 * x.size());
      gpu->synchronize();
      const size_t d32 = first_diff(got.data(), want.data(), x.size(), 4);
      const size_t d16 = first_diff(got16.data(), want16.data(), x.size(), 2);
      INFO("fp32: first difference at " << d32 << (d32 < x.size() ? "" : " (none)"));
      INFO("bf16: first difference at " << d16 << (d16 < x.size() ? "" : " (none)"));
      CHECK(d32 == x.size());
      CHECK(d16 == x.size());
    }
  }
}
