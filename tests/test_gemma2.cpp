// Gemma 2 (core/model/gemma2/) on the shared Llama network, CPU backend:
//  - logits, loss and every parameter gradient against transformers 4.44.2's
//    Gemma2ForCausalLM (eager attention: the soft-capping is only there),
//    through scripts/reference/hf_gemma2.py, with caps small enough to bite
//    (attention 1.5, final 3; the test checks the final one does), heads 16
//    wide on n_embd 32 (head_dim != C/NH), GQA 2:1, query_pre_attn_scalar 12;
//    the config comes from the directory's config.json (gemma2_config_from_hf);
//    input tokens avoid HF's pad id 0 (see the case);
//  - activation checkpointing gives the same gradients (the recompute runs
//    the post norms again);
//  - the CPU ops alone against their definitions in double: soft-capped,
//    rescaled GQA attention at T = 70 (two of causal_head.h's blocks) forward
//    and backward (finite differences), the final cap and its cross-entropy
//    (an ignored target included);
//  - the arch's activation estimate is the network's arena;
//  - the KV-cached decoder (generate) equals the full forward's logits;
//  - what is not implemented yet is refused by name: a sequence or decoder
//    capacity longer than the sliding window, an untied head, another MLP
//    activation.
// The job spec, presets, export / init_from / generate and the meshes:
// tests/test_gemma2_jobs.cpp.
// Error metric: norm-wise relative error per tensor (ref::rel_err).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/io/safetensors.h"
#include "core/model/gemma2/gemma2_arch.h"
#include "core/model/model.h"
#include "core/model/model_spec.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using ref::Vec;
using Tokens = std::vector<int32_t>;
using json = nlohmann::ordered_json;

namespace {

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return json::parse(f);
}

// A tiny Gemma 2 with every feature on and caps that bite.
struct Shape {
  int L = 2, C = 32, NH = 4, NKV = 2, HD = 16, F = 48, V = 96, T = 16;
  double attn_cap = 1.5, final_cap = 3, query_scalar = 12;
  int window = 16;  // = T: no layer's window excludes a key; 5: the even layers' does (local, global, ...)
};

ModelConfig config_of(const Shape& s) {
  ModelConfig c;
  c.arch = "gemma2";
  c.L = s.L, c.C = s.C, c.NH = s.NH, c.NKV = s.NKV, c.head_dim = s.HD, c.F = s.F, c.V = s.V, c.T = s.T;
  c.tied = true;
  c.norm_eps = 1e-6;
  c.attn_softcap = float(s.attn_cap);
  c.final_softcap = float(s.final_cap);
  c.query_scale = s.query_scalar;
  c.sliding_window = s.window;
  return c;
}

// A random HF model of the shape in DIR/model with the batch's reference in DIR/ref.safetensors.
std::string hf_random(const Shape& s, const test::TempDir& dir, const Tokens& in, const Tokens& tg, int B) {
  SafeTensorFile batch;
  batch.tensors.push_back(make_tensor("inputs", "I32", {B, s.T}, in.data()));
  batch.tensors.push_back(make_tensor("targets", "I32", {B, s.T}, tg.data()));
  write_safetensors(dir / "batch.safetensors", batch);
  std::ostringstream a;
  a << "random --out '" << (dir / "model") << "' --layers " << s.L << " --hidden " << s.C << " --heads " << s.NH
    << " --kv-heads " << s.NKV << " --head-dim " << s.HD << " --intermediate " << s.F << " --vocab " << s.V
    << " --max-positions " << s.T << " --attn-softcap " << s.attn_cap << " --final-softcap " << s.final_cap
    << " --query-scalar " << s.query_scalar << " --window " << s.window << " --batch '" << (dir / "batch.safetensors")
    << "' --out-ref '" << (dir / "ref.safetensors") << "'";
  const test::RunResult r = test::run_reference_script("hf_gemma2.py", a.str());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return dir / "model";
}

struct RunOut {
  std::vector<float> losses, logits, grads;
};

// A forward-only pass (logits) and one forward + backward (dloss_scale 1/(B*T)) into a zeroed gradient.
RunOut run_model(const ModelArch& arch, const std::vector<float>& params, const Tokens& in, const Tokens& tg, int B,
                 int T, bool ckpt = false) {
  auto be = make_cpu_backend(2);
  const ParamLayout& lay = arch.layout();
  const int V = arch.config().V;
  auto net = arch.make_network(be.get(), B, ckpt);
  DeviceBuffer p = test::upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  be->zero(g.get(), size_t(lay.total) * 4);
  DeviceBuffer din = test::upload_i32(be.get(), in), dtg = test::upload_i32(be.get(), tg);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  RunOut r;
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
  const int ldv = net->logits_stride();
  const std::vector<float> padded = test::download_act(be.get(), net->logits(), size_t(B) * T * ldv);
  for (int n = 0; n < B * T; ++n)
    r.logits.insert(r.logits.end(), padded.begin() + size_t(n) * ldv, padded.begin() + size_t(n) * ldv + V);
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
  net->backward(units);
  r.losses = test::download_f32(be.get(), net->losses(), size_t(B) * T);
  r.grads = test::download_f32(be.get(), g.get(), size_t(lay.total));
  return r;
}

// The HF model's weights into our flat layout, by name.
std::vector<float> flat_from_hf(const ModelArch& arch, const std::string& wpath) {
  const SafeTensorFile w = read_safetensors(wpath);
  const ParamLayout& lay = arch.layout();
  std::vector<float> params(size_t(lay.total));
  for (const auto& t : lay.tensors) {
    const SafeTensor* s = w.find(arch.hf_tensor(t).name);
    if (!s) FAIL(wpath << " has no tensor '" << t.name << "'");
    REQUIRE(s->shape == t.shape);
    const std::vector<float> v = s->as_f32();
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  return params;
}

}  // namespace

TEST_CASE("gemma2: logits, loss and every gradient equal transformers' Gemma2ForCausalLM", "[gemma2][hf]") {
  // Window 5 < T 16: layer 0 attends locally, layer 1 globally (HF's eager
  // mask: query i sees keys i-5 < j <= i on even layers).
  for (const int window : {16, 5}) {
  INFO("sliding_window " << window);
  Shape s;
  s.window = window;
  const int B = 2, T = s.T;
  test::TempDir dir("gemma2_hf");
  // Inputs avoid token 0: Gemma2Config's pad_token_id is 0 and HF's
  // nn.Embedding(padding_idx=0) gives that row no gradient from the input
  // side, a padding rule trainrun does not copy (padding is the loss mask's
  // business, not a token id's); the targets may be 0.
  Tokens in = rand_tokens(size_t(B) * T, s.V - 1, 11);
  for (auto& t : in) t += 1;
  const Tokens tg = rand_tokens(size_t(B) * T, s.V, 12);
  const std::string model = hf_random(s, dir, in, tg, B);
  // The config as config.json gives it: every Gemma 2 value comes through.
  const ModelConfig cfg = gemma2_config_from_hf(read_json(model + "/config.json"), model, "test");
  CHECK(cfg.arch == "gemma2");
  CHECK(cfg.head_size() == s.HD);
  CHECK(cfg.attn_softcap == float(s.attn_cap));
  CHECK(cfg.final_softcap == float(s.final_cap));
  CHECK(cfg.query_scale == s.query_scalar);
  CHECK(cfg.sliding_window == s.window);
  CHECK(cfg.tied);
  const auto arch = make_model_arch(cfg);
  CHECK(arch->config().norm_offset);
  CHECK(arch->config().post_norms);
  CHECK(arch->config().mlp_act == "gelu_tanh");
  CHECK(arch->config().embed_scale);
  std::printf("%s\n", arch->describe().c_str());
  const std::vector<float> params = flat_from_hf(*arch, model + "/model.safetensors");
  const std::string rpath = dir / "ref.safetensors";
  const SafeTensorFile ref = read_safetensors(rpath);
  // The final cap bites: the logits before it exceed it.
  const double uncapped = f32_of(ref, "uncapped_absmax", rpath)[0];
  std::printf("  max |logit| before the final cap %.3f (cap %.1f)\n", uncapped, s.final_cap);
  CHECK(uncapped > 1.5 * s.final_cap);

  const RunOut run = run_model(*arch, params, in, tg, B, T);
  const std::vector<float> hl = f32_of(ref, "logits", rpath);
  const double logit_err = ref::rel_err(Vec(run.logits.begin(), run.logits.end()), Vec(hl.begin(), hl.end()));
  double loss = 0;
  for (float x : run.losses) loss += x;
  loss /= double(run.losses.size());
  const double hf_loss = f32_of(ref, "loss", rpath)[0];
  const double loss_err = std::abs(loss - hf_loss) / hf_loss;
  std::printf("  logits rel err %.3e, loss %.6f (HF %.6f) rel err %.3e\n", logit_err, loss, hf_loss, loss_err);
  CHECK(logit_err <= 1e-5);
  CHECK(loss_err <= 1e-5);
  double worst = 0;
  std::string worst_name;
  for (const auto& t : arch->layout().tensors) {
    const std::vector<float> g = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
    REQUIRE(int64_t(g.size()) == t.numel);
    const double e = ref::rel_err(Vec(run.grads.begin() + t.offset, run.grads.begin() + t.offset + t.numel),
                                  Vec(g.begin(), g.end()));
    std::printf("  %-52s rel err %.3e\n", t.name.c_str(), e);
    if (!(e <= worst)) worst = e, worst_name = t.name;
  }
  INFO("worst gradient " << worst_name << ": " << worst);
  CHECK(worst <= 1e-5);

  // Activation checkpointing recomputes each block (post norms included) before its backward.
  const RunOut ck = run_model(*arch, params, in, tg, B, T, true);
  const double ck_err = ref::rel_err(Vec(ck.grads.begin(), ck.grads.end()), Vec(run.grads.begin(), run.grads.end()));
  std::printf("  checkpointed gradients vs plain: rel err %.3e\n", ck_err);
  CHECK(ck_err <= 1e-6);
  }
}

TEST_CASE("gemma2: the arch's activation estimate is the network's arena", "[gemma2]") {
  auto be = make_cpu_backend(1);
  for (bool ckpt : {false, true}) {
    const auto arch = make_model_arch(config_of(Shape{}));
    for (int B : {1, 3}) {
      auto net = arch->make_network(be.get(), B, ckpt);
      CHECK(arch->activation_bytes(B, ckpt, ActivationDevice{4, true, 1}) == double(net->activation_bytes()));
    }
  }
}

TEST_CASE("gemma2: what is not implemented yet is refused by name", "[gemma2]") {
  auto be = make_cpu_backend(1);
  // (A sequence or a KV cache longer than the sliding window is no longer
  // refused: the attention ops have the window, tests/test_sliding_window.cpp.)
  // An untied head.
  ModelConfig untied = config_of(Shape{});
  untied.tied = false;
  CHECK_THROWS_WITH(make_model_arch(untied), Contains("model.tie_embeddings: false; Gemma 2's LM head"));
  // config.json: another activation, an untied head.
  json c = {{"model_type", "gemma2"},   {"vocab_size", 96},       {"hidden_size", 32},
            {"intermediate_size", 48},  {"num_hidden_layers", 2}, {"num_attention_heads", 4},
            {"num_key_value_heads", 2}, {"head_dim", 16},         {"max_position_embeddings", 16}};
  const ModelConfig d = gemma2_config_from_hf(c, "dir", "model.init_from");
  CHECK(d.attn_softcap == 50.f);  // Gemma2Config's defaults
  CHECK(d.final_softcap == 30.f);
  CHECK(d.query_scale == 224);
  CHECK(d.sliding_window == 4096);
  c["hidden_activation"] = "gelu";
  CHECK_THROWS_WITH(gemma2_config_from_hf(c, "dir", "model.init_from"),
                    Contains("'dir' has hidden_activation = \"gelu\"; trainrun's Gemma 2 needs \"gelu_pytorch_tanh\""));
  c.erase("hidden_activation");
  c["tie_word_embeddings"] = false;
  CHECK_THROWS_WITH(gemma2_config_from_hf(c, "dir", "model.init_from"), Contains("tie_word_embeddings = false"));
}

namespace {
// Soft-capped, rescaled causal GQA attention in double, straight from the
// definition (transformers' eager Gemma2Attention without RoPE): qkv (B,T,
// (NH+2NKV)*HS), out (B,T,NH*HS).
Vec capped_attention(const Vec& qkv, int B, int T, int NH, int NKV, int HS, double scale, double cap) {
  const int ld = (NH + 2 * NKV) * HS, R = NH / NKV;
  Vec out(size_t(B) * T * NH * HS, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const double* q = &qkv[(size_t(b) * T + t) * ld + h * HS];
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          const double* k = &qkv[(size_t(b) * T + j) * ld + (NH + h / R) * HS];
          double d = 0;
          for (int i = 0; i < HS; ++i) d += q[i] * k[i];
          s[j] = cap * std::tanh(d * scale / cap);
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int j = 0; j <= t; ++j) {
          const double* v = &qkv[(size_t(b) * T + j) * ld + (NH + NKV + h / R) * HS];
          for (int i = 0; i < HS; ++i) out[(size_t(b) * T + t) * NH * HS + h * HS + i] += s[j] / sum * v[i];
        }
      }
  return out;
}
}  // namespace

// The HF case has T = 16: one of causal_head.h's 64-row blocks. Here T = 70
// (two blocks: the backward's recomputed scores must line up across them),
// GQA 2:1, scores large enough that the cap saturates.
TEST_CASE("gemma2: the cpu attention's softcap and scale against the definition and finite differences",
          "[gemma2][cpu_ops]") {
  const int B = 1, T = 70, NH = 2, NKV = 1, HS = 4, ld = (NH + 2 * NKV) * HS;
  const double scale = 0.3, cap = 1.5;
  auto be = make_cpu_backend(2);
  std::mt19937_64 gen(5);
  std::normal_distribution<double> nd(0.0, 2.0);
  Vec qkv(size_t(B) * T * ld);
  for (auto& x : qkv) x = double(float(nd(gen)));
  Vec R(size_t(B) * T * NH * HS);
  for (auto& x : R) x = double(float(nd(gen)));
  auto up = [&](const Vec& v) { return test::upload_f32(be.get(), std::vector<float>(v.begin(), v.end())); };
  DeviceBuffer dq = up(qkv), dR = up(R), out(be.get(), R.size() * 4), dqkv(be.get(), qkv.size() * 4);
  DeviceBuffer saved(be.get(), be->attention_gqa_saved_floats(B, T, NH) * 4);
  AttentionOptions opt;
  opt.softcap = float(cap);
  opt.scale = float(scale);
  be->attention_gqa_forward(out.get(), saved.as<float>(), dq.get(), B, T, NH, NKV, HS, nullptr, opt);
  be->attention_gqa_backward(dqkv.get(), dR.get(), dq.get(), out.get(), saved.as<float>(), B, T, NH, NKV, HS, nullptr,
                             opt);
  const std::vector<float> got = test::download_f32(be.get(), out.get(), R.size());
  const std::vector<float> gotd = test::download_f32(be.get(), dqkv.get(), qkv.size());
  const Vec want = capped_attention(qkv, B, T, NH, NKV, HS, scale, cap);
  const double fe = ref::rel_err(Vec(got.begin(), got.end()), want);
  Vec x = qkv;
  const Vec fd = ref::central_fd(x, [&] { return ref::dot(capped_attention(x, B, T, NH, NKV, HS, scale, cap), R); });
  const double be_err = ref::rel_err(Vec(gotd.begin(), gotd.end()), fd);
  // The cap bites: without it the output differs.
  const double uncapped = ref::rel_err(want, capped_attention(qkv, B, T, NH, NKV, HS, scale, 1e9));
  std::printf("  softcap attention: forward %.3e, backward vs FD %.3e (uncapped differs by %.3f)\n", fe, be_err,
              uncapped);
  CHECK(fe <= 1e-5);
  CHECK(be_err <= 1e-4);
  CHECK(uncapped > 0.1);
}

// The final cap's two ops against the definition: loss = CE(cap * tanh(z / cap)),
// its gradient w.r.t. the uncapped z by finite differences; an ignored
// target (-1) gives loss 0 and gradient 0; rows ldv apart.
TEST_CASE("gemma2: logit_softcap_forward + softmax_cross_entropy's cap against the definition", "[gemma2][cpu_ops]") {
  const int N = 3, V = 7, ldv = 9;
  const double cap = 2.0, scale = 0.5;
  const std::vector<int32_t> tg = {4, -1, 0};
  auto be = make_cpu_backend(2);
  std::mt19937_64 gen(7);
  std::normal_distribution<double> nd(0.0, 4.0);  // |z| well above the cap
  Vec z(size_t(N) * ldv, 0.0);
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) z[size_t(n) * ldv + v] = double(float(nd(gen)));
  auto loss_of = [&](const Vec& zz) {
    double total = 0;
    for (int n = 0; n < N; ++n) {
      if (tg[n] < 0) continue;
      double mx = -1e300, sum = 0;
      std::vector<double> y(V);
      for (int v = 0; v < V; ++v) mx = std::max(mx, y[v] = cap * std::tanh(zz[size_t(n) * ldv + v] / cap));
      for (int v = 0; v < V; ++v) sum += std::exp(y[v] - mx);
      total += scale * (mx + std::log(sum) - y[tg[n]]);
    }
    return total;
  };
  DeviceBuffer dz = test::upload_f32(be.get(), std::vector<float>(z.begin(), z.end()));
  DeviceBuffer dt = test::upload_i32(be.get(), tg), losses(be.get(), N * 4);
  be->logit_softcap_forward(dz.get(), N, V, ldv, float(cap));
  const std::vector<float> y = test::download_f32(be.get(), dz.get(), z.size());
  double yerr = 0;
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v)
      yerr = std::max(yerr, std::abs(y[size_t(n) * ldv + v] - cap * std::tanh(z[size_t(n) * ldv + v] / cap)));
  be->softmax_cross_entropy(losses.as<float>(), dz.get(), dz.get(), dt.as<int32_t>(), N, V, ldv, float(scale),
                            float(cap));
  const std::vector<float> l = test::download_f32(be.get(), losses.get(), N);
  const std::vector<float> d = test::download_f32(be.get(), dz.get(), z.size());
  Vec zz = z;
  const Vec fd = ref::central_fd(zz, [&] { return loss_of(zz); });
  Vec got, want;
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) got.push_back(d[size_t(n) * ldv + v]), want.push_back(fd[size_t(n) * ldv + v]);
  const double gerr = ref::rel_err(got, want);
  const double lsum = scale * (double(l[0]) + l[2]);
  std::printf("  final cap: capped logits max abs err %.2e, loss %.6f (want %.6f), gradient vs FD %.3e\n", yerr, lsum,
              loss_of(z), gerr);
  CHECK(yerr <= 1e-6);
  CHECK(l[1] == 0.0f);
  CHECK(std::abs(lsum - loss_of(z)) <= 1e-5 * loss_of(z));
  CHECK(gerr <= 1e-5);
  for (int v = 0; v < V; ++v) CHECK(d[size_t(ldv) + v] == 0.0f);  // the ignored row
}

// The KV-cached decoder's logits against the full forward's last row, a
// prefill then one token at a time, with weights large enough that both caps bite.
TEST_CASE("gemma2: the decoder equals the full forward", "[gemma2]") {
  const ModelConfig cfg = config_of(Shape{});
  const auto arch = make_model_arch(cfg);
  auto be = make_cpu_backend(2);
  const ParamLayout& lay = arch->layout();
  std::vector<float> params(size_t(lay.total));
  std::mt19937_64 gen(3);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& x : params) x = nd(gen);
  DeviceBuffer p = test::upload_act(be.get(), params);
  FlatUnitAccess units(lay, p.get(), nullptr, be->act_dtype());
  const int prefill = 4, cap = cfg.T;
  auto dec = arch->make_decoder(be.get(), cap);
  CHECK(dec->bytes() == arch->decoder_bytes_needed(*be, cap));
  auto net = arch->make_network(be.get(), 1, false);
  const Tokens seq = rand_tokens(size_t(cap), cfg.V, 21);
  std::vector<float> got;
  double worst = 0, absmax = 0;
  for (int n = prefill; n <= cap; ++n) {
    if (n == prefill)
      dec->feed(units, seq.data(), n, got);
    else
      dec->feed(units, seq.data() + n - 1, 1, got);
    DeviceBuffer din = test::upload_i32(be.get(), Tokens(seq.begin(), seq.begin() + n));
    net->forward(units, din.as<int32_t>(), nullptr, 1, n, false, 0.0f);
    const int ldv = net->logits_stride();
    const std::vector<float> all = test::download_act(be.get(), net->logits(), size_t(n) * ldv);
    const Vec want(all.begin() + size_t(n - 1) * ldv, all.begin() + size_t(n - 1) * ldv + cfg.V);
    worst = std::max(worst, ref::rel_err(Vec(got.begin(), got.end()), want));
    for (float x : got) absmax = std::max(absmax, double(std::abs(x)));
  }
  std::printf("  decoder vs full forward: worst rel err %.3e (max |logit| %.3f, cap %.1f)\n", worst, absmax,
              double(cfg.final_softcap));
  CHECK(worst <= 1e-5);
  CHECK(absmax <= cfg.final_softcap);  // the decoder's logits are capped too
  CHECK(absmax > 0.5 * cfg.final_softcap);
}
