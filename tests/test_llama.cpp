// The Llama network (core/model/llama/llama.h) end to end on the CPU backend:
//  - the loss and every parameter gradient of a tiny Llama (GQA, tied and
//    untied, llama3 rope scaling) against a double-precision reference
//    forward composed here from tests/support/reference_ops.h, and central
//    finite differences of its mean loss;
//  - activation checkpointing and padded logits rows change nothing;
//  - the logits, the loss and every parameter gradient against Hugging Face
//    transformers' LlamaForCausalLM in fp32 (scripts/reference/hf_llama.py),
//    the HF weights read into our flat layout by their names;
//  - the arch's activation estimate is the network's arena;
//  - the KV-cached decoder (llama_decoder.h) against the full forward;
//  - model.init_from of a LlamaForCausalLM directory (bit for bit, through a
//    2-rank full_shard job), its refusals, and `trainrun generate` greedy
//    against transformers' generate.
//
// Error metric: norm-wise relative error per tensor (ref::rel_err), as in
// tests/test_model_grad.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/io/safetensors.h"
#include "core/model/llama/llama.h"
#include "core/model/model.h"
#include "kernels/backend.h"
#include "kernels/rope_table.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/device_io.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using ref::Tokens;
using ref::Vec;
using Catch::Matchers::Contains;

namespace {

ModelConfig llama_cfg(int L, int NH, int NKV, int C, int F, int V, int T, bool tied, bool scaled) {
  ModelConfig c;
  c.arch = "llama";
  c.L = L, c.NH = NH, c.NKV = NKV, c.C = C, c.F = F, c.V = V, c.T = T;
  c.tied = tied;
  c.init_std = 0.3;  // not the near-identity blocks of 0.02: every term matters
  c.rope_theta = 500000;
  if (scaled) {
    // theta 10000 and an original context of 64 put a head of 8's four
    // frequencies (wavelengths 6.3, 63, 628, 6283) in all three bands of
    // llama3 scaling: kept (< 16), blended (16..64) and stretched (> 64).
    c.rope_theta = 10000;
    c.rope_scaling_type = "llama3";
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.original_max_position_embeddings = 64;
  }
  return c;
}

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

// init_params, then noise on the RMSNorm gains (which start at exactly 1).
std::vector<float> tiny_params(const ModelArch& arch) {
  const ParamLayout& lay = arch.layout();
  std::vector<float> p(size_t(lay.total));
  arch.init_params(1234, 0, lay.total, p.data());
  std::mt19937_64 gen(99);
  std::normal_distribution<double> d(0.0, 0.1);
  for (const auto& t : lay.tensors)
    if (t.shape.size() == 1)
      for (int64_t i = 0; i < t.numel; ++i) p[size_t(t.offset + i)] += float(d(gen));
  return p;
}

// The Llama forward in double from the flat parameters, tensors found by
// name (a disagreement with LlamaBlockOffsets shows up as a failure).
Vec ref_logits(const ModelArch& arch, const Vec& p, const Tokens& tokens, int B, int T) {
  const ModelConfig& c = arch.config();
  const ParamLayout& lay = arch.layout();
  const int N = B * T, C = c.C, F = c.F, HS = c.head_size(), KV = c.NKV * HS;
  auto W = [&](const std::string& n) {
    const ParamTensor& t = lay.get(n);
    return Vec(p.begin() + t.offset, p.begin() + t.offset + t.numel);
  };
  const RopeScaling* scaling = c.rope_scaling_type.empty() ? nullptr : &c.rope_scaling;
  const std::vector<double> inv = rope_inv_freq(HS, c.rope_theta, scaling);
  const Vec inv_freq(inv.begin(), inv.end());
  const Vec wte = W("model.embed_tokens.weight");
  Vec x = ref::encoder(tokens, wte, Vec(size_t(T) * C, 0.0), B, T, C);
  for (int l = 0; l < c.L; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    Vec h = ref::rmsnorm(x, W(pre + "input_layernorm.weight"), N, C, c.norm_eps);
    const Vec q = ref::linear(h, W(pre + "self_attn.q_proj.weight"), {}, N, C, C);
    const Vec k = ref::linear(h, W(pre + "self_attn.k_proj.weight"), {}, N, C, KV);
    const Vec v = ref::linear(h, W(pre + "self_attn.v_proj.weight"), {}, N, C, KV);
    Vec qkv;
    for (int n = 0; n < N; ++n) {
      qkv.insert(qkv.end(), q.begin() + size_t(n) * C, q.begin() + size_t(n + 1) * C);
      qkv.insert(qkv.end(), k.begin() + size_t(n) * KV, k.begin() + size_t(n + 1) * KV);
      qkv.insert(qkv.end(), v.begin() + size_t(n) * KV, v.begin() + size_t(n + 1) * KV);
    }
    qkv = ref::rope(qkv, inv_freq, B, T, c.NH, c.NKV, HS, 0);
    const Vec att = ref::attention_gqa(qkv, B, T, c.NH, c.NKV, HS);
    x = ref::residual(x, ref::linear(att, W(pre + "self_attn.o_proj.weight"), {}, N, C, C));
    h = ref::rmsnorm(x, W(pre + "post_attention_layernorm.weight"), N, C, c.norm_eps);
    const Vec g = ref::linear(h, W(pre + "mlp.gate_proj.weight"), {}, N, C, F);
    const Vec u = ref::linear(h, W(pre + "mlp.up_proj.weight"), {}, N, C, F);
    Vec gu;
    for (int n = 0; n < N; ++n) {
      gu.insert(gu.end(), g.begin() + size_t(n) * F, g.begin() + size_t(n + 1) * F);
      gu.insert(gu.end(), u.begin() + size_t(n) * F, u.begin() + size_t(n + 1) * F);
    }
    x = ref::residual(x, ref::linear(ref::swiglu(gu, N, F), W(pre + "mlp.down_proj.weight"), {}, N, F, C));
  }
  const Vec hf = ref::rmsnorm(x, W("model.norm.weight"), N, C, c.norm_eps);
  return ref::linear(hf, c.tied ? wte : W("lm_head.weight"), {}, N, C, c.V);
}

double ref_loss(const ModelArch& arch, const Vec& p, const Tokens& in, const Tokens& tg, int B, int T) {
  const Vec l = ref::cross_entropy(ref_logits(arch, p, in, B, T), tg, B * T, arch.config().V);
  double s = 0;
  for (double x : l) s += x;
  return s / double(B * T);
}

struct RunOut {
  std::vector<float> losses;  // (B*T)
  std::vector<float> logits;  // (B*T*V), from a forward without backward
  std::vector<float> grads;   // (total)
};

// A forward-only pass (logits) and one forward + backward (dloss_scale
// 1/(B*T)) into a zeroed gradient, as the trainer runs a micro-batch.
RunOut run_model(Backend* be, const ModelArch& arch, bool ckpt, const std::vector<float>& params, const Tokens& in,
                 const Tokens& tg, int B, int T, int passes = 1) {
  const ParamLayout& lay = arch.layout();
  const int V = arch.config().V;
  auto net = arch.make_network(be, B, ckpt);
  DeviceBuffer p = test::upload_act(be, params);
  DeviceBuffer g(be, size_t(lay.total) * 4);
  DeviceBuffer din = test::upload_i32(be, in), dtg = test::upload_i32(be, tg);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  RunOut r;
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
  const int ldv = net->logits_stride();
  const std::vector<float> padded = test::download_act(be, net->logits(), size_t(B) * T * ldv);
  for (int n = 0; n < B * T; ++n)
    r.logits.insert(r.logits.end(), padded.begin() + size_t(n) * ldv, padded.begin() + size_t(n) * ldv + V);
  for (int i = 0; i < passes; ++i) {
    net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
    net->backward(units);
  }
  r.losses = test::download_f32(be, net->losses(), size_t(B) * T);
  r.grads = test::download_f32(be, g.get(), size_t(lay.total));
  return r;
}

double mean(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += x;
  return s / double(v.size());
}

// Worst norm-wise relative error over the layout's tensors; prints each.
double worst_tensor_err(const ParamLayout& lay, const std::vector<float>& got, const Vec& want,
                        std::string* worst_name) {
  double worst = 0;
  for (const auto& t : lay.tensors) {
    const Vec a(got.begin() + t.offset, got.begin() + t.offset + t.numel);
    const Vec b(want.begin() + t.offset, want.begin() + t.offset + t.numel);
    const double e = ref::rel_err(a, b);
    std::printf("  %-44s rel err %.3e\n", t.name.c_str(), e);
    if (!(e <= worst)) {  // NaN too
      worst = e;
      *worst_name = t.name;
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("llama: tiny model loss and every gradient match the double reference and finite differences",
          "[llama]") {
  auto be = make_cpu_backend(2);
  struct Case { int NKV; bool tied, scaled; };
  for (const Case k : {Case{2, true, false}, Case{1, false, true}}) {
    const auto arch = make_model_arch(llama_cfg(2, 4, k.NKV, 16, 24, 19, 7, k.tied, k.scaled));
    INFO(arch->describe() << (k.scaled ? " llama3 rope scaling" : ""));
    std::printf("%s\n", arch->describe().c_str());
    const int B = 2, T = 7;
    const std::vector<float> params = tiny_params(*arch);
    const Tokens in = rand_tokens(size_t(B) * T, 19, 5), tg = rand_tokens(size_t(B) * T, 19, 6);
    Vec x(params.begin(), params.end());
    const RunOut run = run_model(be.get(), *arch, false, params, in, tg, B, T);

    const Vec logits = ref_logits(*arch, x, in, B, T);
    const double logit_err = ref::rel_err(Vec(run.logits.begin(), run.logits.end()), logits);
    const double want = ref_loss(*arch, x, in, tg, B, T);
    const double loss_err = std::abs(mean(run.losses) - want) / want;
    std::printf("  logits rel err %.3e, loss %.6f (ref %.6f) rel err %.3e\n", logit_err, mean(run.losses), want,
                loss_err);
    CHECK(logit_err <= 1e-5);
    CHECK(loss_err <= 1e-5);

    const Vec fd = ref::central_fd(x, [&] { return ref_loss(*arch, x, in, tg, B, T); });
    std::string name;
    const double worst = worst_tensor_err(arch->layout(), run.grads, fd, &name);
    INFO("worst tensor " << name << ": " << worst);
    CHECK(worst <= 1e-4);
  }
}

TEST_CASE("llama: checkpointing, padded logits rows and a second pass", "[llama]") {
  const auto arch = make_model_arch(llama_cfg(3, 4, 2, 16, 24, 19, 9, false, false));
  const int B = 3, T = 7;  // T < model T: shorter than the buffers
  const std::vector<float> params = tiny_params(*arch);
  const Tokens in = rand_tokens(size_t(B) * T, 19, 7), tg = rand_tokens(size_t(B) * T, 19, 8);
  auto be = make_cpu_backend(2);
  const RunOut off = run_model(be.get(), *arch, false, params, in, tg, B, T);
  const RunOut on = run_model(be.get(), *arch, true, params, in, tg, B, T);
  CHECK(std::memcmp(off.losses.data(), on.losses.data(), off.losses.size() * 4) == 0);
  CHECK(std::memcmp(off.grads.data(), on.grads.data(), off.grads.size() * 4) == 0);
  double n2 = 0;
  for (float g : off.grads) n2 += double(g) * g;
  CHECK(n2 > 0);
  // Rows padded as on the GPU (64): the same numbers.
  auto padded_be = make_cpu_backend(2, 64);
  const RunOut pad = run_model(padded_be.get(), *arch, false, params, in, tg, B, T);
  CHECK(std::memcmp(off.logits.data(), pad.logits.data(), off.logits.size() * 4) == 0);
  CHECK(std::memcmp(off.grads.data(), pad.grads.data(), off.grads.size() * 4) == 0);
  // Gradients accumulate: two passes give twice one.
  const RunOut twice = run_model(be.get(), *arch, false, params, in, tg, B, T, 2);
  double e = 0, r = 0;
  for (size_t i = 0; i < off.grads.size(); ++i) {
    e += std::pow(double(twice.grads[i]) - 2.0 * off.grads[i], 2);
    r += std::pow(2.0 * off.grads[i], 2);
  }
  CHECK(std::sqrt(e / r) <= 1e-6);
}

namespace {
// One rank that counts the all-gathers the sharded store issues.
class GatherCounter final : public Communicator {
 public:
  int gathers = 0;
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "gather-counter"; }
  void all_reduce(float*, int64_t, ReduceOp) override {}
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp) override {
    if (out != in) std::memcpy(out, in, size_t(n) * 4);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    ++gathers;
    if (out != in) std::memcpy(out, in, bytes);
  }
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
};
}  // namespace

TEST_CASE("llama: full_shard gathers the embeddings a second time only for a tied head", "[llama][sharding]") {
  for (const bool tied : {false, true}) {
    INFO("tied " << tied);
    const auto arch = make_model_arch(llama_cfg(2, 4, 2, 16, 24, 19, 9, tied, false));
    const int B = 2, T = 9;
    auto be = make_cpu_backend(1);
    GatherCounter comm;
    auto store = make_param_store("full_shard", arch->layout(), be.get(), &comm, 0, nullptr);
    store->init_params(*arch, 7);
    auto net = arch->make_network(be.get(), B, false);
    const Tokens in = rand_tokens(size_t(B) * T, 19, 7), tg = rand_tokens(size_t(B) * T, 19, 8);
    DeviceBuffer din = test::upload_i32(be.get(), in), dtg = test::upload_i32(be.get(), tg);
    const int units = int(arch->layout().units.size());
    // An evaluation forward: every unit once, the embeddings again for a tied
    // head, and no prefetch of a unit the pass does not use.
    comm.gathers = 0;
    net->forward(*store, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 0.0f);
    CHECK(comm.gathers == units + (tied ? 1 : 0));
    // A training step: the forward as above; the backward gathers the head
    // and the blocks again, not the embeddings (a tied head keeps them from
    // the end of the forward; an untied one needs only their gradient).
    comm.gathers = 0;
    store->zero_grads();
    net->forward(*store, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
    net->backward(*store);
    store->finish_grads();
    CHECK(comm.gathers == units + (tied ? 1 : 0) + (units - 1));
  }
}

TEST_CASE("llama: the arch's activation estimate is the network's arena", "[llama]") {
  auto be = make_cpu_backend(1);
  for (bool ckpt : {false, true})
    for (bool tied : {false, true}) {
      const auto arch = make_model_arch(llama_cfg(3, 4, 2, 16, 24, 19, 9, tied, false));
      for (int B : {1, 3}) {
        auto net = arch->make_network(be.get(), B, ckpt);
        CHECK(arch->activation_bytes(B, ckpt, ActivationDevice{4, true, 1}) == double(net->activation_bytes()));
      }
    }
}

// ---- the KV-cached decoder -------------------------------------------------------------

TEST_CASE("llama: the decoder's logits equal the full forward's last row at every step", "[llama][decoder]") {
  struct Case { int NH, NKV; bool tied, scaled; int T, prefill, align; };
  // GQA 2:1 and 4:1, tied and untied, llama3 scaling; a prefill of two
  // chunks (> LlamaDecoder::kChunk rows); padded (GPU-like) logits rows.
  for (const Case k : {Case{4, 2, true, true, 16, 4, 1}, Case{4, 1, false, true, 16, 3, 1},
                       Case{4, 2, false, false, 16, 5, 64}, Case{8, 2, true, true, 280, 270, 1}}) {
    const ModelConfig cfg = llama_cfg(2, k.NH, k.NKV, 32, 40, 37, k.T, k.tied, k.scaled);
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe() << " prefill " << k.prefill << " align " << k.align);
    REQUIRE(arch->has_decoder());
    auto be = make_cpu_backend(2, k.align);
    const std::vector<float> params = tiny_params(*arch);
    DeviceBuffer p = test::upload_act(be.get(), params);
    const ParamLayout& lay = arch->layout();
    FlatUnitAccess units(lay, p.get(), nullptr, be->act_dtype());
    const int steps = 5, cap = k.prefill + steps;
    auto dec = arch->make_decoder(be.get(), cap);
    CHECK(dec->bytes() == arch->decoder_bytes_needed(*be, cap));
    CHECK(dec->capacity() == cap);
    auto net = arch->make_network(be.get(), 1, false);
    const Tokens seq = rand_tokens(size_t(cap), cfg.V, 21);
    const int V = cfg.V;
    double worst = 0;
    std::vector<float> got;
    for (int pass = 0; pass < 2; ++pass) {  // the second after reset(): the cache is reused
      dec->reset();
      REQUIRE(dec->position() == 0);
      for (int n = k.prefill; n <= cap; ++n) {
        if (n == k.prefill)
          dec->feed(units, seq.data(), n, got);
        else
          dec->feed(units, seq.data() + n - 1, 1, got);
        REQUIRE(dec->position() == n);
        DeviceBuffer din = test::upload_i32(be.get(), Tokens(seq.begin(), seq.begin() + n));
        net->forward(units, din.as<int32_t>(), nullptr, 1, n, false, 0.0f);
        const int ldv = net->logits_stride();
        const std::vector<float> all = test::download_act(be.get(), net->logits(), size_t(n) * ldv);
        const Vec want(all.begin() + size_t(n - 1) * ldv, all.begin() + size_t(n - 1) * ldv + V);
        REQUIRE(got.size() == size_t(V));
        const double e = ref::rel_err(Vec(got.begin(), got.end()), want);
        INFO("position " << n << " rel err " << e);
        CHECK(e <= 1e-5);
        worst = std::max(worst, e);
      }
    }
    std::printf("decoder %s prefill %d: worst rel err %.3e\n", arch->describe().c_str(), k.prefill, worst);
    // Past the capacity is an error, not a write outside the cache.
    CHECK_THROWS_WITH(dec->feed(units, seq.data(), 1, got), Contains("capacity"));
  }
}

// ---- against Hugging Face transformers ------------------------------------------------

namespace {

using test::hf_python;

std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

}  // namespace

TEST_CASE("llama: logits, loss and every gradient match transformers' LlamaForCausalLM", "[llama][hf]") {
  struct Case { int NH, NKV; bool tied, scaled; };
  // GQA 2:1 and 4:1 (and 1:1), tied and untied, llama3 rope scaling.
  for (const Case k : {Case{4, 2, true, false}, Case{4, 1, false, true}, Case{4, 4, false, false},
                       Case{8, 2, true, true}}) {
    const int L = 2, C = 32, F = 40, V = 37, T = 9, B = 2;
    ModelConfig cfg = llama_cfg(L, k.NH, k.NKV, C, F, V, T, k.tied, k.scaled);
    cfg.norm_eps = 1e-5;
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe() << (k.scaled ? " llama3 rope scaling" : ""));
    std::printf("%s%s\n", arch->describe().c_str(), k.scaled ? " llama3" : "");
    test::TempDir dir("llama_hf");
    const Tokens in = rand_tokens(size_t(B) * T, V, 11), tg = rand_tokens(size_t(B) * T, V, 12);
    {
      SafeTensorFile batch;
      batch.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
      batch.tensors.push_back(make_tensor("targets", "I32", {B, T}, tg.data()));
      write_safetensors(dir / "batch.safetensors", batch);
    }
    char args[512];
    std::snprintf(args, sizeof args,
                  " random --out '%s' --layers %d --hidden %d --heads %d --kv-heads %d --intermediate %d --vocab %d "
                  "--max-positions %d --rope-theta %g --eps %g%s%s --batch '%s' --out-ref '%s'",
                  (dir / "model").c_str(), L, C, k.NH, k.NKV, F, V, T, cfg.rope_theta, cfg.norm_eps,
                  k.tied ? " --tie" : "",
                  k.scaled ? " --rope-scaling-factor 8 --low-freq-factor 1 --high-freq-factor 4"
                             " --original-max-positions 64"
                           : "",
                  (dir / "batch.safetensors").c_str(), (dir / "ref.safetensors").c_str());
    const test::RunResult r = test::run_command("OMP_NUM_THREADS=2 '" + hf_python() + "' '" + test::source_dir() +
                                                "/scripts/reference/hf_llama.py'" + args);
    INFO(r.err);
    REQUIRE(r.exit_code == 0);

    // HF's weights into our flat layout, by name (nn.Linear layout: no transpose).
    const std::string wpath = dir / "model/model.safetensors";
    const SafeTensorFile w = read_safetensors(wpath);
    const ParamLayout& lay = arch->layout();
    std::vector<float> params(size_t(lay.total));
    for (const auto& t : lay.tensors) {
      const SafeTensor* s = w.find(arch->hf_tensor(t).name);
      if (!s) FAIL(wpath << " has no tensor '" << t.name << "'");
      REQUIRE(s->shape == t.shape);
      const std::vector<float> v = s->as_f32();
      std::copy(v.begin(), v.end(), params.begin() + t.offset);
    }
    const std::string rpath = dir / "ref.safetensors";
    const SafeTensorFile ref = read_safetensors(rpath);

    auto be = make_cpu_backend(2);
    const RunOut run = run_model(be.get(), *arch, false, params, in, tg, B, T);
    const std::vector<float> hl = f32_of(ref, "logits", rpath);
    const double logit_err = ref::rel_err(Vec(run.logits.begin(), run.logits.end()), Vec(hl.begin(), hl.end()));
    const double hf_loss = f32_of(ref, "loss", rpath)[0];
    const double loss_err = std::abs(mean(run.losses) - hf_loss) / hf_loss;
    std::printf("  logits rel err %.3e, loss %.6f (HF %.6f) rel err %.3e\n", logit_err, mean(run.losses), hf_loss,
                loss_err);
    CHECK(logit_err <= 1e-5);
    CHECK(loss_err <= 1e-5);

    Vec want(size_t(lay.total));
    for (const auto& t : lay.tensors) {
      const std::vector<float> g = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
      REQUIRE(int64_t(g.size()) == t.numel);
      std::copy(g.begin(), g.end(), want.begin() + t.offset);
    }
    std::string name;
    const double worst = worst_tensor_err(lay, run.grads, want, &name);
    INFO("worst tensor " << name << ": " << worst);
    CHECK(worst <= 1e-4);
  }
}

// ---- training through the job spec ----------------------------------------------------

#include "core/config/job_spec.h"
#include "core/model/model_io.h"
#include "core/train/trainer.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/inprocess.h"

namespace {

// GQA 2:1, llama3 rope scaling, units that do not divide evenly by 2 or 3
// ranks; gradient clipping and accumulation on.
std::string llama_job(const std::string& dir, const std::string& strategy, int group, const std::string& tie,
                      const std::string& ckpt) {
  return "model: {arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 22, vocab_size: 23,\n"
         "        seq_len: 12, rope_theta: 10000, tie_embeddings: " + tie + ",\n"
         "        rope_scaling: {type: llama3, factor: 4, original_max_position_embeddings: 8}}\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 12, micro_batch_size: 2, max_steps: 8, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, eval_interval: 4, eval_steps: 1, log_interval: 1, grad_clip: 0.5,\n"
         "        activation_checkpointing: " + ckpt + "}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) + ", timeout_s: 60}\n";
}

struct LlamaRun {
  std::vector<double> losses;
  std::vector<float> weights;
};

// The micro-batch that divides the 12 sequences of a step at `world` ranks.
std::string llama_micro(int world) { return "train.micro_batch_size=" + std::to_string(world == 4 ? 3 : 2); }

LlamaRun run_llama(int world, const std::string& strategy, int group, const std::string& tie,
                   const std::string& ckpt = "none") {
  test::TempDir dir("llama");
  const JobSpec job =
      parse_job_spec(llama_job(dir.path(), strategy, group, tie, ckpt), "job.yaml", {llama_micro(world)});
  LlamaRun out;
  out.losses = test::run_ranks_inprocess(job, world)[0].losses;
  const ModelConfig c = load_model_safetensors(dir / "model.safetensors", out.weights);
  CHECK(c.arch == "llama");
  return out;
}

}  // namespace

TEST_CASE("llama: every sharding strategy at 2, 3 and 4 ranks trains as one rank does", "[llama][sharding]") {
  for (const char* tie : {"false", "true"}) {
    const LlamaRun ref = run_llama(1, "no_shard", 0, tie);
    REQUIRE(ref.losses.size() == 8);
    CHECK(ref.losses.back() < ref.losses.front());
    for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
      for (int world : {2, 3, 4}) {
        INFO(strategy << " x" << world << ", tie_embeddings " << tie);
        // hybrid_shard: groups of 1 (pure replication) at 2 ranks, 2 x 2 at 4.
        const bool hybrid = std::string(strategy) == "hybrid_shard";
        const int group = hybrid && world == 2 ? 1 : hybrid && world == 4 ? 2 : 0;
        const LlamaRun got = run_llama(world, strategy, group, tie, world == 3 ? "blocks" : "none");
        REQUIRE(got.losses.size() == ref.losses.size());
        for (size_t i = 0; i < ref.losses.size(); ++i) {
          INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << ref.losses[i]);
          CHECK(std::fabs(got.losses[i] - ref.losses[i]) <= 1e-5 * std::fabs(ref.losses[i]));
        }
        REQUIRE(got.weights.size() == ref.weights.size());
        double num = 0, den = 0;
        for (size_t i = 0; i < ref.weights.size(); ++i) {
          num += (double(got.weights[i]) - ref.weights[i]) * (double(got.weights[i]) - ref.weights[i]);
          den += double(ref.weights[i]) * ref.weights[i];
        }
        CHECK(std::sqrt(num / den) <= 1e-5);
      }
    }
  }
}

namespace {

// A run of llama_job in `dir` at `world` ranks with --set overrides; the
// losses of metrics.jsonl (this and earlier invocations, in order).
std::vector<double> llama_run_in(const std::string& dir, int world, const std::string& strategy,
                                 const std::string& tie, std::vector<std::string> sets = {}) {
  sets.push_back(llama_micro(world));
  const JobSpec job = parse_job_spec(llama_job(dir, strategy, 0, tie, "none"), "job.yaml", sets);
  test::run_ranks_inprocess(job, world);
  return test::losses_of(dir);
}

}  // namespace

TEST_CASE("llama: 4 steps + resume + 4 steps is bit-identical to 8 steps, every strategy", "[llama][checkpoint]") {
  for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    for (int world : {1, 2}) {
      // The untied head is its own sharding unit (its optimizer state too).
      const char* tie = world == 1 ? "true" : "false";
      INFO(strategy << " x" << world << ", tie_embeddings " << tie);
      test::TempDir dir("llama_resume");
      const auto straight = llama_run_in(dir / "straight", world, strategy, tie);
      const auto first = llama_run_in(dir / "resumed", world, strategy, tie, {"train.exit_interval=4"});
      REQUIRE(test::latest_of(dir / "resumed") == "step_00000004");
      REQUIRE(first.size() == 4);
      const auto resumed = llama_run_in(dir / "resumed", world, strategy, tie);
      REQUIRE(straight.size() == 8);
      CHECK(resumed == straight);  // same world size, same arithmetic: bit-identical
      CHECK(test::weights_of(dir / "straight") == test::weights_of(dir / "resumed"));
    }
  }
}

TEST_CASE("llama: a checkpoint from 2 ranks (full_shard) resumes on 3 (shard_grad_op) and 4 (hybrid)",
          "[llama][checkpoint]") {
  test::TempDir dir("llama_reshard");
  const auto straight = llama_run_in(dir / "straight", 1, "no_shard", "false");
  REQUIRE(straight.size() == 8);
  for (const auto& [world, strategy] : {std::pair<int, const char*>{3, "shard_grad_op"}, {4, "hybrid_shard"}}) {
    INFO("resumed at " << world << " ranks, " << strategy);
    const std::string run = dir / ("r" + std::to_string(world));
    llama_run_in(run, 2, "full_shard", "false", {"train.exit_interval=4"});
    REQUIRE(test::latest_of(run) == "step_00000004");
    const auto got = llama_run_in(run, world, strategy, "false");
    REQUIRE(got.size() == straight.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("step " << i + 1 << ": " << got[i] << " vs " << straight[i]);
      CHECK(std::fabs(got[i] - straight[i]) <= 1e-5 * std::fabs(straight[i]));
    }
  }
}

// ---- model.init_from: a Hugging Face LlamaForCausalLM directory -------------------------

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/checkpoint/hf_interop.h"

namespace {

// `hf_llama.py random` into dir/name: GQA 2:1, L=2, C=16, F=24, V=29, 12 positions.
std::string hf_random_llama(const test::TempDir& dir, const std::string& name, bool tied, bool scaled) {
  const std::string out = dir / name;
  const std::string args =
      " random --out '" + out + "' --layers 2 --hidden 16 --heads 4 --kv-heads 2 --intermediate 24 --vocab 29"
      " --max-positions 12 --rope-theta 10000 --eps 1e-5 --seed 3" + std::string(tied ? " --tie" : "") +
      (scaled ? " --rope-scaling-factor 4 --low-freq-factor 1 --high-freq-factor 4 --original-max-positions 8" : "");
  const test::RunResult r = test::run_command("OMP_NUM_THREADS=1 '" + hf_python() + "' '" + test::source_dir() +
                                              "/scripts/reference/hf_llama.py'" + args);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return out;
}

// The job's model.* for that directory.
std::string hf_llama_model_yaml(const std::string& init_from, bool tied, bool scaled, const std::string& arch) {
  return "model: {arch: " + arch + ", n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 29,\n"
         "        seq_len: 12, rope_theta: 10000, norm_eps: 1.0e-5, tie_embeddings: " + (tied ? "true" : "false") +
         (scaled ? ",\n        rope_scaling: {type: llama3, factor: 4, low_freq_factor: 1, high_freq_factor: 4,"
                   " original_max_position_embeddings: 8}"
                 : "") +
         ",\n        init_from: '" + init_from + "'}\n";
}

// HF's tensors in our flat layout, by name (nn.Linear layout: no transpose).
std::vector<float> hf_flat(const ModelArch& arch, const std::string& dir) {
  const SafeTensorFile w = read_safetensors(dir + "/model.safetensors");
  std::vector<float> flat(size_t(arch.layout().total));
  for (const auto& t : arch.layout().tensors) {
    const SafeTensor* s = w.find(t.name);
    if (!s) FAIL(dir << " has no tensor '" << t.name << "'");
    REQUIRE(s->shape == t.shape);
    REQUIRE(s->dtype == "F32");
    const std::vector<float> v = s->as_f32();
    std::copy(v.begin(), v.end(), flat.begin() + t.offset);
  }
  return flat;
}

std::string init_from_error(const ModelSpec& m) {
  try {
    load_init_from(m);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("llama: model.init_from loads a LlamaForCausalLM directory bit for bit", "[llama][hf][init_from]") {
  test::TempDir dir("llama_init");
  for (const bool tied : {true, false}) {
    const bool scaled = true;
    INFO("tie_embeddings " << tied);
    const std::string hf = hf_random_llama(dir, tied ? "tied" : "untied", tied, scaled);
    const std::string run = dir / (tied ? "run_tied" : "run_untied");
    // model.arch auto follows config.json's model_type (tied); explicit llama (untied).
    const std::string yaml =
        hf_llama_model_yaml(hf, tied, scaled, tied ? "auto" : "llama") +
        "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
        // lr 1e-30: one real optimizer step that cannot move a weight of ~0.1.
        "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0, warmup_steps: 0,\n"
        "        schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1, log_interval: 1}\n"
        "output: {dir: '" + run + "', sample_tokens: 0}\n"
        "parallel: {sharding: full_shard, timeout_s: 60}\n";
    const JobSpec job = parse_job_spec(yaml, "job.yaml", {});
    const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
    REQUIRE(arch->name() == "llama");
    CHECK(arch->config().tied == tied);
    const std::vector<float> want = hf_flat(*arch, hf);
    // The loader alone, then a 2-rank full_shard job (each rank reads its ranges).
    const std::vector<float> loaded = load_init_from(job.model);
    REQUIRE(loaded.size() == want.size());
    CHECK(std::memcmp(loaded.data(), want.data(), want.size() * 4) == 0);
    const auto sums = test::run_ranks_inprocess(job, 2);
    REQUIRE(sums[0].losses.size() == 1);
    std::vector<float> trained;
    const ModelConfig c = load_model_safetensors(run + "/model.safetensors", trained);
    CHECK(c.arch == "llama");
    REQUIRE(trained.size() == want.size());
    CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

    // `trainrun generate` (KV cache, greedy) on the written weights continues a
    // prompt as transformers' greedy generate does, up to the 12 positions.
    const std::string prompt = "5 17 2 28 0";
    const test::RunResult theirs =
        test::run_command("OMP_NUM_THREADS=1 '" + hf_python() + "' '" + test::source_dir() +
                          "/scripts/reference/hf_llama.py' generate --model '" + hf + "' --prompt '" + prompt +
                          "' --max-new-tokens 7");
    INFO(theirs.err);
    REQUIRE(theirs.exit_code == 0);
    const test::RunResult ours = test::run_trainrun("generate --checkpoint '" + run + "/model.safetensors' --prompt '" +
                                                    prompt + "' --max-tokens 7 --top-k 1");
    INFO(ours.err);
    REQUIRE(ours.exit_code == 0);
    std::printf("generate (tied %d): ours '%s' transformers '%s'\n", int(tied), ours.out.c_str(), theirs.out.c_str());
    CHECK(ours.out == theirs.out);
    std::istringstream is(ours.out);
    int n = 0;
    for (std::string t; is >> t;) ++n;
    CHECK(n == 12);
  }
}

TEST_CASE("llama: bad init_from directories and configs are refused, naming the problem", "[llama][hf][init_from]") {
  namespace fs = std::filesystem;
  using nlohmann::ordered_json;
  test::TempDir dir("llama_init_bad");
  const std::string good = hf_random_llama(dir, "good", false, false);
  ordered_json base;
  {
    std::ifstream f(good + "/config.json");
    base = ordered_json::parse(f);
  }
  // A copy of the good directory with config.json edited.
  auto with_config = [&](const std::string& name, const std::function<void(ordered_json&)>& edit) {
    const std::string d = dir / name;
    fs::create_directories(d);
    fs::copy_file(good + "/model.safetensors", d + "/model.safetensors", fs::copy_options::overwrite_existing);
    ordered_json c = base;
    edit(c);
    test::write_file(d + "/config.json", c.dump(2));
    return d;
  };
  auto spec = [&](const std::string& d, const std::vector<std::string>& sets = {}) {
    return parse_job_spec(hf_llama_model_yaml(d, false, false, "auto") + "data: {format: synthetic}\n", "job.yaml",
                          sets)
        .model;
  };
  REQUIRE(init_from_error(spec(good)).empty());

  // A missing tensor.
  const std::string missing = dir / "missing";
  fs::create_directories(missing);
  fs::copy_file(good + "/config.json", missing + "/config.json");
  {
    SafeTensorFile f = read_safetensors(good + "/model.safetensors");
    f.tensors.erase(std::remove_if(f.tensors.begin(), f.tensors.end(),
                                   [](const SafeTensor& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; }),
                    f.tensors.end());
    write_safetensors(missing + "/model.safetensors", f);
  }
  struct Case {
    const char* what;
    ModelSpec m;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"unknown rope type",
       spec(with_config("yarn", [](ordered_json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; })),
       {"rope_scaling.rope_type = \"yarn\"", "llama3"}},
      {"old-style type key", spec(with_config("dyn", [](ordered_json& c) {
         c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
       })),
       {"rope_scaling.type = \"dynamic\""}},
      {"missing tensor", spec(missing), {"has no tensor 'model.layers.1.mlp.up_proj.weight'"}},
      {"attention bias", spec(with_config("abias", [](ordered_json& c) { c["attention_bias"] = true; })),
       {"attention_bias = true"}},
      {"mlp bias", spec(with_config("mbias", [](ordered_json& c) { c["mlp_bias"] = true; })), {"mlp_bias = true"}},
      {"gelu", spec(with_config("gelu", [](ordered_json& c) { c["hidden_act"] = "gelu"; })),
       {"hidden_act = \"gelu\"", "silu"}},
      {"width", spec(good, {"model.ffn_dim=32"}),
       {"intermediate_size = 24 (config.json) but model.ffn_dim is 32", "set model.ffn_dim: 24"}},
      {"kv heads", spec(good, {"model.n_kv_head=4"}), {"num_key_value_heads = 2 (config.json) but model.n_kv_head is 4"}},
      {"theta", spec(good, {"model.rope_theta=500000"}), {"rope_theta = 10000 (config.json) but model.rope_theta is 500000"}},
      {"tied", spec(good, {"model.tie_embeddings=true"}),
       {"tie_word_embeddings = false (config.json) but model.tie_embeddings is true"}},
      {"scaling", spec(good, {"model.rope_scaling.type=llama3"}),
       {"rope_scaling.rope_type = none (config.json) but model.rope_scaling.type is llama3"}},
      {"context", spec(good, {"model.seq_len=16"}), {"max_position_embeddings = 12", "model.seq_len is 16"}},
  };
  for (const auto& k : cases) {
    INFO(k.what);
    const std::string err = init_from_error(k.m);
    INFO(err);
    CHECK_THAT(err, Contains("model.init_from"));
    for (const auto& e : k.expect) CHECK_THAT(err, Contains(e));
  }
}

// ---- model.init_from alone: config.json gives the shape --------------------------------

#include "core/model/model_spec.h"

namespace {
std::string resolve_error(const std::string& yaml) {
  try {
    JobSpec job = parse_job_spec(yaml, "job.yaml", {});
    resolve_model_shape(job);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("llama: a job with only model.init_from trains the directory's Llama", "[llama][hf][init_from][spec]") {
  test::TempDir dir("llama_init_only");
  const std::string hf = hf_random_llama(dir, "hf", /*tied=*/false, /*scaled=*/true);
  const std::string run = dir / "run";
  // No shape at all: seq_len is the directory's 12 positions.
  test::write_file(dir / "job.yaml",
                   "model: {init_from: '" + hf + "'}\n"
                   "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
                   "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0,\n"
                   "        warmup_steps: 0, schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n"
                   "parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 60}\n");
  const test::RunResult r =
      test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("model.seq_len: 12 (not set: " + hf + "/config.json's max_position_embeddings is 12)"));
  CHECK_THAT(r.err, Contains("model.init_from: initial weights from"));
  // job.resolved.yaml holds config.json's shape (hf_llama.py random's arguments).
  const std::string resolved = test::read_file(run + "/job.resolved.yaml");
  for (const char* line : {"\n  arch: llama ", "\n  n_layer: 2 ", "\n  n_head: 4 ", "\n  n_kv_head: 2 ",
                           "\n  n_embd: 16 ", "\n  ffn_dim: 24 ", "\n  vocab_size: 29 ", "\n  seq_len: 12 ",
                           "\n  rope_theta: 10000 ", "\n  tie_embeddings: false ", "\n    type: llama3 ",
                           "\n    factor: 4 ", "\n    original_max_position_embeddings: 8 "}) {
    INFO(line);
    CHECK(resolved.find(line) != std::string::npos);
  }
  // The weights that trained (one step that cannot move them) are the directory's, bit for bit.
  std::vector<float> trained;
  const ModelConfig c = load_model_safetensors(run + "/model.safetensors", trained);
  CHECK(c.arch == "llama");
  CHECK(c.L == 2);
  CHECK(c.NKV == 2);
  const std::vector<float> want = hf_flat(*make_model_arch(c), hf);
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // The directory goes away (a purged scratch disk); the job, preempted,
  // resumes from its checkpoint, which holds the shape and the weights.
  std::filesystem::remove_all(hf);
  const test::RunResult resumed = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                                    dir / "job.yaml" + "' --set train.max_steps=2");
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK_THAT(resumed.err, Contains("is gone; the shape comes from " + run + "/checkpoints/step_00000001"));
  CHECK(test::read_file(run + "/metrics.jsonl").find("\"step\":2,") != std::string::npos);
  // A fresh start (no checkpoint to resume) still needs the directory, and says so.
  const test::RunResult fresh = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                                  dir / "job.yaml" + "' --set output.dir='" + dir / "run2" + "'");
  CHECK(fresh.exit_code != 0);
  CHECK_THAT(fresh.err, Contains("model.init_from: '" + hf + "' does not exist"));
}

// Rank 1 reads its part of model.init_from 8 s late (a slow shared
// filesystem: TRAINRUN_DEBUG_INIT_FROM_DELAY_MS), with a 3 s collective
// timeout. Before, the ranks agreed on the load in an all-gather, which
// timed out on rank 0 after 3 s; now they agree through the rendezvous
// store with the disk timeout (10 x parallel.timeout_s, at least 10 min).
TEST_CASE("llama: rank skew in reading init_from longer than the collective timeout does not fail the job",
          "[llama][hf][init_from]") {
  test::TempDir dir("llama_init_skew");
  const std::string hf = hf_random_llama(dir, "hf", /*tied=*/false, /*scaled=*/false);
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml",
                   "model: {init_from: '" + hf + "'}\n"
                   "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
                   "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0,\n"
                   "        warmup_steps: 0, schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n"
                   "parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 3}\n");
  const test::RunResult r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_INIT_FROM_DELAY_MS=1:8000 '" +
                                              test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(test::read_file(run + "/logs/rank1.log"), Contains("debug: rank 1 waits 8000 ms before reading model.init_from"));
  CHECK_THAT(r.err, Contains("model.init_from: initial weights from"));
  CHECK(test::file_exists(run + "/model.safetensors"));
}

TEST_CASE("llama: a shape field that disagrees with init_from's config.json names both values", "[llama][hf][init_from][spec]") {
  test::TempDir dir("llama_init_disagree");
  const std::string hf = hf_random_llama(dir, "hf", /*tied=*/true, /*scaled=*/false);
  const std::string cfg = hf + "/config.json";
  const std::string data = "data: {format: synthetic}\n";
  // Agreeing fields are fine, and an explicit shorter seq_len is the training context.
  CHECK(resolve_error("model: {init_from: '" + hf + "', n_layer: 2, tie_embeddings: true, seq_len: 8}\n" + data) ==
        "");
  // "The model's own" sentinels written out are filled, not compared.
  CHECK(resolve_error("model: {init_from: '" + hf + "', tie_embeddings: auto, n_kv_head: 0, ffn_dim: 0}\n" + data) ==
        "");
  CHECK(resolve_error("model: {init_from: '" + hf + "', n_layer: 3}\n" + data) ==
        "model.init_from: '" + cfg + "' has num_hidden_layers = 2 but model.n_layer is 3 (job.yaml:1:" +
            std::to_string(33 + hf.size()) +
            "); remove model.n_layer to take the directory's value, or set it to 2 (the job's model.* must describe "
            "the weights it starts from)");
  CHECK_THAT(resolve_error("model: {init_from: '" + hf + "', tie_embeddings: false}\n" + data),
             Contains("has tie_word_embeddings = true but model.tie_embeddings is false"));
  CHECK_THAT(resolve_error("model: {init_from: '" + hf + "', rope_scaling: {type: llama3}}\n" + data),
             Contains("has rope_scaling.rope_type = none but model.rope_scaling.type is llama3"));
  CHECK_THAT(resolve_error("model: {init_from: '" + hf + "', n_kv_head: 4}\n" + data),
             Contains("has num_key_value_heads = 2 but model.n_kv_head is 4"));
  // seq_len past the model's positions.
  CHECK(resolve_error("model: {init_from: '" + hf + "', seq_len: 13}\n" + data) ==
        "model.init_from: '" + cfg + "' has max_position_embeddings = 12 but model.seq_len is 13 (job.yaml:1:" +
            std::to_string(33 + hf.size()) + "); set model.seq_len to at most 12 (the model has no positions beyond "
            "that)");
  // A preset and a directory that are different models: both named.
  CHECK(resolve_error("model: {init_from: '" + hf + "', preset: llama3.2-1b}\n" + data) ==
        "model.init_from: '" + cfg + "' has num_hidden_layers = 2 but model.n_layer is 16 (model.preset "
        "llama3.2-1b); remove model.n_layer to take the directory's value, or set it to 2 (the job's model.* must "
        "describe the weights it starts from)");
  // A missing directory is named at job load.
  CHECK_THAT(resolve_error("model: {init_from: '" + dir / "nope" + "'}\n" + data),
             Contains("model.init_from: '" + dir / "nope" + "' does not exist"));
}
