// GPT-2 end to end on the CPU backend against the double-precision reference
// model (tests/support/reference_ops.h):
//  - the forward loss and per-token losses match the reference;
//  - the gradient of EVERY parameter (the model is tiny) matches central
//    finite differences of the reference mean loss, tensor by tensor;
//  - activation checkpointing changes nothing, bit for bit;
//  - a second forward/backward accumulates into the same gradient buffer;
//  - the loss at the default init is ~ln(V) (uniform predictions);
//  - gpt2_init_params is deterministic and any slice equals that part of the
//    full init (what lets every shard initialise its own slice).
//
// Error metric: norm-wise relative error per parameter tensor,
// ||got - want||_2 / ||want||_2 (ref::rel_err): single gradient entries may
// be ~0 by cancellation (e.g. the k-part of the qkv bias, to which softmax is
// exactly invariant), so element-wise relative errors would be meaningless.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/model/gpt2/gpt2.h"
#include "kernels/backend.h"
#include "tests/support/device_io.h"
#include "tests/support/reference_ops.h"

using namespace trainrun;
using ref::Tokens;
using ref::Vec;

namespace {

std::unique_ptr<Backend> make_backend() { return make_cpu_backend(2); }

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

using test::download_act;
using test::download_f32;
using test::upload_act;
using test::upload_f32;
using test::upload_i32;

Vec to_double(const std::vector<float>& f) { return Vec(f.begin(), f.end()); }

// The tiny model of the gradient test.
// A model shape for a test, init_std 0.3 (see tiny_config).
GPT2Config config_of(int L, int NH, int C, int V, int T) { return GPT2Config::of(L, NH, C, V, T, 0.3); }

// init_std 0.3 instead of 0.02: with 0.02 the blocks are nearly the identity
// and most gradients are tiny, so a wrong term could hide below the tolerance.
GPT2Config tiny_config() { return config_of(2, 2, 8, 11, 6); }

// gpt2_init_params, then noise on the biases and LayerNorm parameters (which
// the init sets to exactly 0 / 1): with zero biases a forward that dropped a
// bias, or swapped LN weight and bias, would still produce the right loss.
std::vector<float> tiny_params(const GPT2Config& cfg, const ParamLayout& lay) {
  std::vector<float> p(lay.total);
  gpt2_init_params(cfg, lay, 1234, 0, lay.total, p.data());
  std::mt19937_64 gen(99);
  std::normal_distribution<double> d(0.0, 0.1);
  for (const auto& t : lay.tensors)
    if (t.shape.size() == 1)
      for (int64_t i = 0; i < t.numel; ++i) p[t.offset + i] += float(d(gen));
  return p;
}

// One forward (for_backward, dloss_scale 1/(B*T)) + backward of the model
// into a zeroed fp32 gradient buffer, as the trainer does for one micro-batch.
struct RunOut {
  std::vector<float> losses;  // (B*T)
  std::vector<float> grads;   // (total)
};
RunOut run_model(Backend* be, const GPT2Config& cfg, bool ckpt, const std::vector<float>& params,
                 const Tokens& inputs, const Tokens& targets, int B, int T, int passes = 1) {
  GPT2 model(cfg, be, B, ckpt);
  const ParamLayout& lay = model.layout();
  DeviceBuffer p = upload_act(be, params);
  DeviceBuffer g(be, size_t(lay.total) * 4);  // alloc() zero-initialises
  be->zero(g.get(), g.bytes());
  DeviceBuffer in = upload_i32(be, inputs), tg = upload_i32(be, targets);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  RunOut r;
  for (int i = 0; i < passes; ++i) {
    model.forward(units, in.as<int32_t>(), tg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
    model.backward(units);
  }
  r.losses = download_f32(be, model.losses(), size_t(B) * T);
  r.grads = download_f32(be, g.get(), lay.total);
  return r;
}

double mean(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += x;
  return s / double(v.size());
}

}  // namespace

TEST_CASE("model_grad: tiny GPT-2 loss and every parameter gradient match the double reference",
          "[model_grad]") {
  auto be = make_backend();
  const GPT2Config cfg = tiny_config();
  const int B = 2, T = cfg.T;
  const ParamLayout lay = make_gpt2_layout(cfg);
  const std::vector<float> params = tiny_params(cfg, lay);
  const Tokens inputs = rand_tokens(size_t(B) * T, cfg.V, 5);
  const Tokens targets = rand_tokens(size_t(B) * T, cfg.V, 6);

  // The reference sees exactly the values the backend holds (act dtype).
  Vec pref;
  {
    DeviceBuffer p = upload_act(be.get(), params);
    pref = to_double(download_act(be.get(), p.get(), params.size()));
  }

  // Forward-only pass: logits against the reference logits.
  {
    GPT2 model(cfg, be.get(), B, false);
    DeviceBuffer p = upload_act(be.get(), params);
    DeviceBuffer g(be.get(), size_t(lay.total) * 4);
    DeviceBuffer in = upload_i32(be.get(), inputs), tg = upload_i32(be.get(), targets);
    FlatUnitAccess units(model.layout(), p.get(), g.as<float>(), be->act_dtype());
    model.forward(units, in.as<int32_t>(), tg.as<int32_t>(), B, T, false, 1.0f);
    const Vec logits = to_double(download_act(be.get(), model.logits(), size_t(B) * T * cfg.V));
    const double e = ref::rel_err(logits, ref::gpt2_logits(cfg, pref, inputs, B, T));
    std::printf("  model logits rel err %.3e\n", e);
    CHECK(e <= 1e-5);
  }

  const RunOut run = run_model(be.get(), cfg, false, params, inputs, targets, B, T);

  // Loss: per token and the mean.
  const Vec ref_logits = ref::gpt2_logits(cfg, pref, inputs, B, T);
  const Vec ref_losses = ref::cross_entropy(ref_logits, targets, B * T, cfg.V);
  const double loss_err = ref::rel_err(to_double(run.losses), ref_losses);
  const double ref_loss = ref::gpt2_loss(cfg, pref, inputs, targets, B, T);
  const double mean_err = std::abs(mean(run.losses) - ref_loss) / ref_loss;
  std::printf("  model loss %.6f (ref %.6f): mean rel err %.3e, per-token rel err %.3e\n", mean(run.losses),
              ref_loss, mean_err, loss_err);
  CHECK(loss_err <= 1e-5);
  CHECK(mean_err <= 1e-5);

  // Gradients: central differences of the reference mean loss over every
  // parameter (~1900 of them, two reference forwards each).
  Vec x = pref;
  const Vec fd = ref::central_fd(x, [&] { return ref::gpt2_loss(cfg, x, inputs, targets, B, T); });

  double worst = 0.0;
  std::string worst_name;
  for (const auto& t : lay.tensors) {
    Vec got(run.grads.begin() + t.offset, run.grads.begin() + t.offset + t.numel);
    Vec want(fd.begin() + t.offset, fd.begin() + t.offset + t.numel);
    const double e = ref::rel_err(got, want);
    double norm = 0.0;
    for (double w : want) norm += w * w;
    std::printf("  %-40s |g| %.3e rel err %.3e\n", t.name.c_str(), std::sqrt(norm), e);
    if (!(e <= worst)) {  // also catches NaN
      worst = e;
      worst_name = t.name;
    }
  }
  INFO("worst parameter tensor: " << worst_name << " with norm-wise relative gradient error " << worst);
  CHECK(worst <= 1e-4);
}

TEST_CASE("model_grad: activation checkpointing gives identical losses and gradients", "[model_grad]") {
  auto be = make_backend();
  // Larger than the FD model (L=3, several heads) so that the single shared
  // activation set of checkpointing is reused across more than two layers.
  const GPT2Config cfg = config_of(3, 4, 32, 53, 16);
  const int B = 3, T = 13;  // T < cfg.T: a shorter batch than the buffers
  const ParamLayout lay = make_gpt2_layout(cfg);
  const std::vector<float> params = tiny_params(cfg, lay);
  const Tokens inputs = rand_tokens(size_t(B) * T, cfg.V, 7);
  const Tokens targets = rand_tokens(size_t(B) * T, cfg.V, 8);

  const RunOut off = run_model(be.get(), cfg, false, params, inputs, targets, B, T);
  const RunOut on = run_model(be.get(), cfg, true, params, inputs, targets, B, T);
  CHECK(std::memcmp(off.losses.data(), on.losses.data(), off.losses.size() * 4) == 0);
  CHECK(std::memcmp(off.grads.data(), on.grads.data(), off.grads.size() * 4) == 0);
  // Sanity: the gradients are not trivially equal because they are zero.
  double n2 = 0.0;
  for (float g : off.grads) n2 += double(g) * g;
  CHECK(n2 > 0.0);
  // Without checkpointing, a rerun is bit-identical too (same threads).
  const RunOut again = run_model(be.get(), cfg, false, params, inputs, targets, B, T);
  CHECK(std::memcmp(off.grads.data(), again.grads.data(), off.grads.size() * 4) == 0);
}

TEST_CASE("model_grad: padded logits rows (the GPU layout) give the same losses and gradients", "[model_grad]") {
  // The CUDA backend pads logits rows to a multiple of 64; a CPU backend
  // told to do the same runs that model path here, against the unpadded one.
  auto plain = make_backend();
  auto padded = make_cpu_backend(2, 64);
  const GPT2Config cfg = config_of(2, 2, 16, 37, 8);  // V 37 -> ldv 64: rows 27 elements longer than V
  REQUIRE(padded->logits_stride(cfg.V) == 64);
  const int B = 2, T = 8;
  const ParamLayout lay = make_gpt2_layout(cfg);
  const std::vector<float> params = tiny_params(cfg, lay);
  const Tokens inputs = rand_tokens(size_t(B) * T, cfg.V, 17);
  const Tokens targets = rand_tokens(size_t(B) * T, cfg.V, 18);
  const RunOut a = run_model(plain.get(), cfg, false, params, inputs, targets, B, T);
  const RunOut b = run_model(padded.get(), cfg, false, params, inputs, targets, B, T);
  const double le = ref::rel_err(to_double(b.losses), to_double(a.losses));
  const double ge = ref::rel_err(to_double(b.grads), to_double(a.grads));
  std::printf("  padded logits rows: losses rel err %.3e, grads rel err %.3e\n", le, ge);
  CHECK(le <= 1e-6);
  CHECK(ge <= 1e-6);
  // Forward-only logits read back through logits_stride().
  GPT2 model(cfg, padded.get(), B, false);
  REQUIRE(model.logits_stride() == 64);
  DeviceBuffer p = upload_act(padded.get(), params);
  DeviceBuffer g(padded.get(), size_t(lay.total) * 4);
  DeviceBuffer in = upload_i32(padded.get(), inputs);
  FlatUnitAccess units(model.layout(), p.get(), g.as<float>(), padded->act_dtype());
  model.forward(units, in.as<int32_t>(), nullptr, B, T, false, 1.0f);
  const Vec rows = to_double(download_act(padded.get(), model.logits(), size_t(B) * T * 64));
  const Vec want = ref::gpt2_logits(cfg, to_double(params), inputs, B, T);
  Vec got;
  for (int n = 0; n < B * T; ++n) got.insert(got.end(), rows.begin() + n * 64, rows.begin() + n * 64 + cfg.V);
  CHECK(ref::rel_err(got, want) <= 1e-5);
}

TEST_CASE("model_grad: parameter gradients accumulate over micro-batches", "[model_grad]") {
  auto be = make_backend();
  const GPT2Config cfg = tiny_config();
  const int B = 2, T = cfg.T;
  const ParamLayout lay = make_gpt2_layout(cfg);
  const std::vector<float> params = tiny_params(cfg, lay);
  const Tokens inputs = rand_tokens(size_t(B) * T, cfg.V, 9);
  const Tokens targets = rand_tokens(size_t(B) * T, cfg.V, 10);
  for (bool ckpt : {false, true}) {
    INFO("activation checkpointing " << ckpt);
    const RunOut one = run_model(be.get(), cfg, ckpt, params, inputs, targets, B, T, 1);
    const RunOut two = run_model(be.get(), cfg, ckpt, params, inputs, targets, B, T, 2);
    // Two identical micro-batches: 2x the gradient, up to fp32 rounding of the
    // different summation order (tied wte gets head + encoder terms).
    Vec want(one.grads.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = 2.0 * one.grads[i];
    const double e = ref::rel_err(to_double(two.grads), want);
    std::printf("  two micro-batches vs 2x one (ckpt %d): rel err %.3e\n", int(ckpt), e);
    CHECK(e <= 1e-6);
  }
}

TEST_CASE("model_grad: loss at the default init is ~ln(V)", "[model_grad]") {
  auto be = make_backend();
  GPT2Config cfg;  // default init_std 0.02
  cfg.L = 2;
  cfg.NH = 4;
  cfg.C = 64;
  cfg.V = 256;
  cfg.T = 32;
  REQUIRE(cfg.init_std == 0.02);
  const int B = 4, T = cfg.T;
  const ParamLayout lay = make_gpt2_layout(cfg);
  std::vector<float> params(lay.total);
  gpt2_init_params(cfg, lay, 42, 0, lay.total, params.data());
  const Tokens inputs = rand_tokens(size_t(B) * T, cfg.V, 11);
  const Tokens targets = rand_tokens(size_t(B) * T, cfg.V, 12);

  GPT2 model(cfg, be.get(), B, false);
  DeviceBuffer p = upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  DeviceBuffer in = upload_i32(be.get(), inputs), tg = upload_i32(be.get(), targets);
  FlatUnitAccess units(model.layout(), p.get(), g.as<float>(), be->act_dtype());
  model.forward(units, in.as<int32_t>(), tg.as<int32_t>(), B, T, false, 1.0f);
  const double loss = mean(download_f32(be.get(), model.losses(), size_t(B) * T));
  std::printf("  loss at init %.4f, ln(256) = %.4f\n", loss, std::log(256.0));
  CHECK(std::abs(loss - std::log(256.0)) < 0.1);
}

TEST_CASE("model_grad: gpt2_init_params is deterministic and slice-consistent", "[model_grad]") {
  GPT2Config cfg = tiny_config();
  cfg.init_std = 0.02;
  cfg.L = 3;
  cfg.C = 16;
  const ParamLayout lay = make_gpt2_layout(cfg);
  const int64_t n = lay.total;
  std::vector<float> full(n), again(n), other_seed(n);
  gpt2_init_params(cfg, lay, 7, 0, n, full.data());
  gpt2_init_params(cfg, lay, 7, 0, n, again.data());
  gpt2_init_params(cfg, lay, 8, 0, n, other_seed.data());
  CHECK(std::memcmp(full.data(), again.data(), n * 4) == 0);
  CHECK(std::memcmp(full.data(), other_seed.data(), n * 4) != 0);

  // Slices: unit boundaries, tensor-straddling ranges, single elements, the
  // ends, the empty slice, and a split of the whole vector into uneven shards.
  std::vector<std::pair<int64_t, int64_t>> ranges = {{0, 1}, {n - 1, n}, {5, 5}, {0, n}};
  for (const auto& u : lay.units) ranges.push_back({u.offset, u.offset + u.numel});
  std::mt19937_64 gen(3);
  for (int i = 0; i < 20; ++i) {
    int64_t a = int64_t(gen() % uint64_t(n)), b = int64_t(gen() % uint64_t(n + 1));
    if (a > b) std::swap(a, b);
    ranges.push_back({a, b});
  }
  for (int world : {3, 7}) {
    int64_t per = (n + world - 1) / world;
    for (int r = 0; r < world; ++r) ranges.push_back({std::min(n, r * per), std::min(n, (r + 1) * per)});
  }
  for (const auto& [a, b] : ranges) {
    std::vector<float> part(size_t(b - a) + 1, -12345.0f);  // one sentinel past the end
    gpt2_init_params(cfg, lay, 7, a, b, part.data());
    INFO("slice [" << a << ", " << b << ")");
    CHECK(std::memcmp(part.data(), full.data() + a, size_t(b - a) * 4) == 0);
    CHECK(part[size_t(b - a)] == -12345.0f);  // nothing written past end - begin
  }

  // The values follow the GPT-2 recipe: LN weight 1, biases 0, N(0, std)
  // matrices, std/sqrt(2L) for the residual projections.
  for (const auto& t : lay.tensors) {
    INFO(t.name);
    const bool ln = t.name.find("ln_") != std::string::npos;
    const bool is_bias = t.name.size() > 5 && t.name.compare(t.name.size() - 5, 5, ".bias") == 0;
    if (ln || is_bias) {
      const float want = (ln && !is_bias) ? 1.0f : 0.0f;
      for (int64_t i = 0; i < t.numel; ++i) REQUIRE(full[t.offset + i] == want);
      continue;
    }
    double s = 0.0, s2 = 0.0;
    for (int64_t i = 0; i < t.numel; ++i) {
      s += full[t.offset + i];
      s2 += double(full[t.offset + i]) * full[t.offset + i];
    }
    const double m = s / t.numel, sd = std::sqrt(s2 / t.numel - m * m);
    const bool resid = t.name.find("c_proj.weight") != std::string::npos;
    const double want_sd = resid ? cfg.init_std / std::sqrt(2.0 * cfg.L) : cfg.init_std;
    // Sample std of >= 96 normals: within ~25% with overwhelming probability,
    // and the draws are fixed by the seed anyway.
    CHECK(std::abs(sd - want_sd) < 0.25 * want_sd);
    CHECK(std::abs(m) < 0.5 * want_sd);
  }
}
