// The host AdamW of parallel.offload (kernels/cpu/host_adamw.h) against the
// CPU backend's adamw_update, bit for bit: every kernel this CPU runs
// (scalar, AVX2, AVX-512), odd sizes (lane tails), weight decay on and off,
// a clipping scale, several steps (bias correction), 1 and 2 threads.
// Bit-identical is the contract, not a tolerance: it is what makes losses
// with offload on equal those with it off.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/host_adamw.h"

using namespace trainrun;

namespace {

struct State {
  std::vector<float> w, g, m, v;
};

State random_state(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  State s;
  for (int64_t i = 0; i < n; ++i) {
    s.w.push_back(d(rng));
    s.g.push_back(d(rng) * 0.1f);
    s.m.push_back(d(rng) * 0.01f);
    s.v.push_back(std::abs(d(rng)) * 1e-4f);
  }
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("host AdamW is bit-identical to the CPU backend's adamw_update", "[host_adamw]") {
  auto be = make_cpu_backend(2);
  for (HostIsa isa : {HostIsa::Scalar, HostIsa::Avx2, HostIsa::Avx512}) {
    if (!host_isa_supported(isa)) {
      WARN("skipping the " << host_isa_name(isa) << " kernel: this CPU does not support it");
      continue;
    }
    for (int64_t n : {1, 7, 19, 111, 500, 4097, 100003}) {
      for (float wd : {0.0f, 0.1f}) {
        for (float gs : {1.0f, 0.37f}) {
          for (int threads : {1, 2}) {
            CAPTURE(host_isa_name(isa), n, wd, gs, threads);
            State ref = random_state(n, uint32_t(n * 31 + threads));
            State got = ref;
            HostAdamWArgs a;
            a.lr = 3e-3f;
            a.beta1 = 0.9f;
            a.beta2 = 0.95f;
            a.eps = 1e-8f;
            a.weight_decay = wd;
            a.grad_scale = gs;
            for (int step = 1; step <= 3; ++step) {
              a.step = step;
              be->adamw_update(ref.w.data(), ref.w.data(), ref.g.data(), ref.m.data(), ref.v.data(), n, a.lr,
                               a.beta1, a.beta2, a.eps, wd, step, gs);
              host_adamw_update(got.w.data(), got.g.data(), got.m.data(), got.v.data(), n, a, threads, isa);
            }
            REQUIRE(same_bits(got.m, ref.m));
            REQUIRE(same_bits(got.v, ref.v));
            REQUIRE(same_bits(got.w, ref.w));
          }
        }
      }
    }
  }
}

TEST_CASE("host AdamW moves the weights (the comparison above is not vacuous)", "[host_adamw]") {
  State s = random_state(1000, 5);
  const std::vector<float> before = s.w;
  HostAdamWArgs a;
  a.weight_decay = 0.1f;
  host_adamw_update(s.w.data(), s.g.data(), s.m.data(), s.v.data(), 1000, a, 2);
  int changed = 0;
  for (size_t i = 0; i < before.size(); ++i) changed += s.w[i] != before[i];
  REQUIRE(changed > 990);
}

TEST_CASE("host_accumulate adds like the backend's accumulate", "[host_adamw]") {
  auto be = make_cpu_backend(2);
  State s = random_state(10007, 9);
  std::vector<float> ref = s.w, got = s.w;
  be->accumulate(ref.data(), s.g.data(), 10007);
  host_accumulate(got.data(), s.g.data(), 10007, 2);
  REQUIRE(same_bits(got, ref));
}
