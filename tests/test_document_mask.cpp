// data.document_mask: block-causal attention and positions restarting per
// document (core/data/document_mask.h, the doc_start/pos arguments of
// kernels/backend.h, DocumentMask in core/model/model.h).
//
// The references, strongest first:
//  - a document run on its own: the masked ops on a packed sequence equal,
//    document by document, the plain causal ops run on that document alone
//    (attention fwd + bwd, MHA and GQA; RoPE; the wpe lookup and its
//    gradient), and the whole model's per-token losses and gradients equal
//    the sum over its documents run separately (packing equivalence);
//  - a double-precision textbook loop of masked attention, and central
//    finite differences of it for the backward;
//  - one rank: dp2 (full_shard) and tp2 + sequence parallelism train as one
//    rank does with the mask on (and differently from the mask off), and so
//    do pipelines (1f1b, zero_bubble, interleaved, pp2 x tp2), whose every
//    stage gets the offsets (parallel/pipeline/executor.h).
// Layouts cover documents of length 1, one document spanning the sequence,
// boundaries at positions 0 and T-1 and on the CPU kernels' 64-row blocks.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/data/dataset.h"
#include "core/data/document_mask.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "kernels/rope_table.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/op_test_util.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Contains;
using ref::Vec;

namespace {

constexpr int32_t kSep = 99;  // the separator id of the kernel tests

// Tokens of one sequence of length T whose documents start at `starts`
// (position 0 always starts one; it carries the separator only when listed).
std::vector<int32_t> doc_tokens(int T, const std::vector<int>& starts, uint64_t seed) {
  std::vector<int32_t> tok(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) tok[size_t(t)] = int32_t((seed * 31 + uint64_t(t) * 7) % 50);
  for (int s : starts) tok[size_t(s)] = kSep;
  return tok;
}

struct Layout {
  int B = 0, T = 0;
  std::vector<int32_t> tokens, doc_start, pos;
  std::vector<std::pair<int, int>> docs;  // (b*T + s, length) of every document
};

Layout make_layout(int T, const std::vector<std::vector<int>>& starts) {
  Layout L;
  L.B = int(starts.size());
  L.T = T;
  for (size_t b = 0; b < starts.size(); ++b) {
    const auto tok = doc_tokens(T, starts[b], b + 1);
    L.tokens.insert(L.tokens.end(), tok.begin(), tok.end());
  }
  L.doc_start.resize(L.tokens.size());
  L.pos.resize(L.tokens.size());
  document_offsets(L.tokens.data(), L.B, T, kSep, L.doc_start.data(), L.pos.data());
  for (int b = 0; b < L.B; ++b)
    for (int t = 0; t < T; ++t)
      if (t == 0 || L.doc_start[size_t(b * T + t)] != L.doc_start[size_t(b * T + t - 1)]) {
        int e = t + 1;
        while (e < T && L.doc_start[size_t(b * T + e)] == t) ++e;
        L.docs.push_back({b * T + t, e - t});
      }
  return L;
}

// T = 150: three of the CPU kernel's 64-row blocks. Sequence 0: documents of
// length 1 at 0, 1, 2, a boundary inside a block (70) and a length-1
// document at T-1; sequence 1: one document over the whole sequence (no
// separator at all); sequence 2: boundaries on block edges (64, 128) and a
// length-1 document at 64.
Layout big_layout() { return make_layout(150, {{0, 1, 2, 3, 70, 149}, {}, {64, 65, 128}}); }

Vec rows(const Vec& x, int64_t row0, int n, int W) {
  return Vec(x.begin() + row0 * W, x.begin() + (row0 + n) * W);
}

// Textbook document-masked GQA attention in double: query t of sequence b
// sees keys [doc_start, t] (qkv laid out as kernels/backend.h's GQA ops).
Vec ref_attention_doc(const Vec& qkv, int B, int T, int NH, int NKV, int HS, const std::vector<int32_t>& ds) {
  const int W = (NH + 2 * NKV) * HS, C = NH * HS, R = NH / NKV;
  Vec out(size_t(B) * T * C, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const double* q = &qkv[(size_t(b) * T + t) * W + h * HS];
        const int s0 = ds[size_t(b * T + t)];
        std::vector<double> w;
        double mx = -1e300;
        for (int s = s0; s <= t; ++s) {
          const double* k = &qkv[(size_t(b) * T + s) * W + (NH + h / R) * HS];
          double d = 0;
          for (int i = 0; i < HS; ++i) d += q[i] * k[i];
          w.push_back(d / std::sqrt(double(HS)));
          mx = std::max(mx, w.back());
        }
        double sum = 0;
        for (double& x : w) sum += x = std::exp(x - mx);
        for (int s = s0; s <= t; ++s) {
          const double* v = &qkv[(size_t(b) * T + s) * W + (NH + NKV + h / R) * HS];
          for (int i = 0; i < HS; ++i) out[(size_t(b) * T + t) * C + h * HS + i] += w[size_t(s - s0)] / sum * v[i];
        }
      }
  return out;
}

struct Heads {
  int NH, NKV, HS;
  bool mha;  // through attention_forward/backward (NKV == NH) instead of the GQA ops
};

void attn_fwd(Backend* be, const Heads& h, void* out, float* saved, const void* qkv, int B, int T,
              const int32_t* ds) {
  if (h.mha) be->attention_forward(out, saved, qkv, B, T, h.NH * h.HS, h.NH, ds);
  else be->attention_gqa_forward(out, saved, qkv, B, T, h.NH, h.NKV, h.HS, ds);
}
void attn_bwd(Backend* be, const Heads& h, void* dqkv, const void* dout, const void* qkv, const void* out,
              const float* saved, int B, int T, const int32_t* ds) {
  if (h.mha) be->attention_backward(dqkv, dout, qkv, out, saved, B, T, h.NH * h.HS, h.NH, ds);
  else be->attention_gqa_backward(dqkv, dout, qkv, out, saved, B, T, h.NH, h.NKV, h.HS, ds);
}
size_t saved_floats(Backend* be, const Heads& h, int B, int T) {
  return h.mha ? be->attention_saved_floats(B, T, h.NH) : be->attention_gqa_saved_floats(B, T, h.NH);
}

// Masked attention over the packed layout: out and dqkv.
std::pair<Vec, Vec> masked_attention(Backend* be, const Heads& h, const Layout& L, const Vec& qkv, const Vec& dout,
                                     bool masked = true) {
  const int W = (h.NH + 2 * h.NKV) * h.HS, C = h.NH * h.HS, N = L.B * L.T;
  ActTensor q(be, qkv), d(be, dout);
  DeviceBuffer ds = upload_i32(be, L.doc_start);
  DeviceBuffer out(be, size_t(N) * C * 4), dq(be, size_t(N) * W * 4);
  DeviceBuffer saved(be, saved_floats(be, h, L.B, L.T) * 4);
  const int32_t* dsp = masked ? ds.as<int32_t>() : nullptr;
  attn_fwd(be, h, out.get(), saved.as<float>(), q.get(), L.B, L.T, dsp);
  attn_bwd(be, h, dq.get(), d.get(), q.get(), out.get(), saved.as<float>(), L.B, L.T, dsp);
  return {download_act_vec(be, out.get(), size_t(N) * C), download_act_vec(be, dq.get(), size_t(N) * W)};
}

void check_attention_per_document(const Heads& h) {
  auto be = make_cpu_backend(2);
  const Layout L = big_layout();
  const int W = (h.NH + 2 * h.NKV) * h.HS, C = h.NH * h.HS, N = L.B * L.T;
  const Vec qkv = randn(size_t(N) * W, 11), dout = randn(size_t(N) * C, 12);
  const auto [out, dqkv] = masked_attention(be.get(), h, L, qkv, dout);
  Vec want_out(out.size()), want_dqkv(dqkv.size());
  for (const auto& [row0, n] : L.docs) {
    // The document alone: one sequence of n tokens, plain causal attention.
    ActTensor q(be.get(), rows(qkv, row0, n, W)), d(be.get(), rows(dout, row0, n, C));
    DeviceBuffer o(be.get(), size_t(n) * C * 4), dq(be.get(), size_t(n) * W * 4);
    DeviceBuffer saved(be.get(), saved_floats(be.get(), h, 1, n) * 4);
    attn_fwd(be.get(), h, o.get(), saved.as<float>(), q.get(), 1, n, nullptr);
    attn_bwd(be.get(), h, dq.get(), d.get(), q.get(), o.get(), saved.as<float>(), 1, n, nullptr);
    const Vec oo = download_act_vec(be.get(), o.get(), size_t(n) * C);
    const Vec gg = download_act_vec(be.get(), dq.get(), size_t(n) * W);
    std::copy(oo.begin(), oo.end(), want_out.begin() + row0 * C);
    std::copy(gg.begin(), gg.end(), want_dqkv.begin() + row0 * W);
  }
  check_close("doc-masked attention out == per-document causal", out, want_out, 1e-6);
  check_close("doc-masked attention dqkv == per-document causal", dqkv, want_dqkv, 1e-6);
  // Sequence 1 is one document: exactly the unmasked op, bit for bit (the
  // block skip changes nothing when a block's document starts at 0).
  const auto [out0, dqkv0] = masked_attention(be.get(), h, L, qkv, dout, false);
  for (int64_t i = int64_t(L.T) * C; i < int64_t(2) * L.T * C; ++i) REQUIRE(out[size_t(i)] == out0[size_t(i)]);
  for (int64_t i = int64_t(L.T) * W; i < int64_t(2) * L.T * W; ++i) REQUIRE(dqkv[size_t(i)] == dqkv0[size_t(i)]);
  // And the mask does something: sequence 0 differs from plain causal.
  CHECK(ref::rel_err(rows(out, 0, L.T, C), rows(out0, 0, L.T, C)) > 1e-2);
}

}  // namespace

// ---- the offsets ---------------------------------------------------------------------------

TEST_CASE("docmask: document_offsets: the separator starts the document it belongs to", "[docmask]") {
  const int32_t in[] = {5, 7, 9, 7, 7, 1,   // seq 0: separator 7 at 1, 3, 4
                        7, 2, 3, 4, 5, 6};  // seq 1: at 0 only: one document
  int32_t ds[12], pos[12];
  document_offsets(in, 2, 6, 7, ds, pos);
  const std::vector<int32_t> want_ds = {0, 1, 1, 3, 4, 4, 0, 0, 0, 0, 0, 0};
  const std::vector<int32_t> want_pos = {0, 0, 1, 0, 0, 1, 0, 1, 2, 3, 4, 5};
  CHECK(std::vector<int32_t>(ds, ds + 12) == want_ds);
  CHECK(std::vector<int32_t>(pos, pos + 12) == want_pos);
}

// ---- kernels against a document run on its own ------------------------------------------------

TEST_CASE("docmask: MHA attention fwd+bwd equals causal attention on each document alone", "[docmask][cpu_ops]") {
  check_attention_per_document({3, 3, 8, true});
}

TEST_CASE("docmask: GQA attention fwd+bwd equals causal attention on each document alone", "[docmask][cpu_ops]") {
  check_attention_per_document({4, 2, 8, false});
  check_attention_per_document({4, 1, 6, false});
}

TEST_CASE("docmask: masked attention forward against a double reference, backward against finite differences",
          "[docmask][cpu_ops]") {
  auto be = make_cpu_backend(2);
  // T = 9: documents [0,3) [3,4) [4,8) [8,9) in sequence 0, one in sequence 1.
  const Layout L = make_layout(9, {{0, 3, 4, 8}, {}});
  for (const Heads h : {Heads{2, 2, 4, true}, Heads{4, 2, 4, false}}) {
    INFO("NH " << h.NH << " NKV " << h.NKV);
    const int W = (h.NH + 2 * h.NKV) * h.HS, C = h.NH * h.HS, N = L.B * L.T;
    Vec qkv = randn(size_t(N) * W, 21);
    const Vec R = randn(size_t(N) * C, 22);
    const auto [out, dqkv] = masked_attention(be.get(), h, L, qkv, R);
    Vec qv = ActTensor(be.get(), qkv).val;  // the rounded values the backend saw
    check_close("masked attention out vs double", out, ref_attention_doc(qv, L.B, L.T, h.NH, h.NKV, h.HS, L.doc_start),
                1e-5);
    const Vec g = ref::central_fd(qv, [&] {
      return ref::dot(ref_attention_doc(qv, L.B, L.T, h.NH, h.NKV, h.HS, L.doc_start), R);
    });
    check_close("masked attention dqkv vs finite differences", dqkv, g, 1e-4);
  }
}

TEST_CASE("docmask: RoPE with positions equals RoPE on each document alone (pos0 0 and 3)", "[docmask][cpu_ops]") {
  auto be = make_cpu_backend(2);
  const Layout L = big_layout();
  const int NH = 4, NKV = 2, HS = 6, W = (NH + 2 * NKV) * HS, N = L.B * L.T;
  for (int pos0 : {0, 3}) {
    INFO("pos0 " << pos0);
    const std::vector<float> table = rope_table(L.T + pos0, HS, 10000.0, nullptr);
    DeviceBuffer cs = upload_f32(be.get(), table);
    DeviceBuffer pos = upload_i32(be.get(), L.pos);
    const Vec x = randn(size_t(N) * W, 31);
    for (bool backward : {false, true}) {
      ActTensor a(be.get(), x);
      if (backward) be->rope_backward(a.get(), cs.as<float>(), L.B, L.T, NH, NKV, HS, pos0, pos.as<int32_t>());
      else be->rope_forward(a.get(), cs.as<float>(), L.B, L.T, NH, NKV, HS, pos0, pos.as<int32_t>());
      const Vec got = download_act_vec(be.get(), a.get(), size_t(N) * W);
      Vec want(got.size());
      for (const auto& [row0, n] : L.docs) {
        ActTensor d(be.get(), rows(x, row0, n, W));
        if (backward) be->rope_backward(d.get(), cs.as<float>(), 1, n, NH, NKV, HS, pos0);
        else be->rope_forward(d.get(), cs.as<float>(), 1, n, NH, NKV, HS, pos0);
        const Vec r = download_act_vec(be.get(), d.get(), size_t(n) * W);
        std::copy(r.begin(), r.end(), want.begin() + row0 * W);
      }
      REQUIRE(got == want);  // the same rotation of the same numbers: bit for bit
    }
  }
}

TEST_CASE("docmask: the wpe lookup and its gradient use the positions (encoder and vocab-parallel embedding)",
          "[docmask][cpu_ops]") {
  auto be = make_cpu_backend(2);
  const Layout L = big_layout();
  const int V = 100, C = 5, N = L.B * L.T;
  ActTensor wte(be.get(), randn(size_t(V) * C, 41)), wpe(be.get(), randn(size_t(L.T) * C, 42));
  DeviceBuffer tok = upload_i32(be.get(), L.tokens), pos = upload_i32(be.get(), L.pos);
  const Vec dout = randn(size_t(N) * C, 43);
  ActTensor d(be.get(), dout);
  // The references: document by document, the unmasked ops on it alone.
  Vec want_out(size_t(N) * C), want_dwpe(size_t(L.T) * C, 0.0), want_dwte(size_t(V) * C, 0.0);
  for (const auto& [row0, n] : L.docs) {
    std::vector<int32_t> t(L.tokens.begin() + row0, L.tokens.begin() + row0 + n);
    DeviceBuffer dt = upload_i32(be.get(), t), o(be.get(), size_t(n) * C * 4);
    be->encoder_forward(o.get(), dt.as<int32_t>(), wte.get(), wpe.get(), 1, n, C);
    const Vec oo = download_act_vec(be.get(), o.get(), size_t(n) * C);
    std::copy(oo.begin(), oo.end(), want_out.begin() + row0 * C);
    F32Tensor gw(be.get(), Vec(size_t(V) * C, 0.0)), gp(be.get(), Vec(size_t(L.T) * C, 0.0));
    ActTensor dd(be.get(), rows(dout, row0, n, C));
    be->encoder_backward(gw.get(), gp.get(), dd.get(), dt.as<int32_t>(), 1, n, C);
    const Vec a = download_f32_vec(be.get(), gw.get(), size_t(V) * C);
    const Vec b = download_f32_vec(be.get(), gp.get(), size_t(L.T) * C);
    for (size_t i = 0; i < a.size(); ++i) want_dwte[i] += a[i];
    for (size_t i = 0; i < b.size(); ++i) want_dwpe[i] += b[i];
  }
  SECTION("encoder") {
    DeviceBuffer o(be.get(), size_t(N) * C * 4);
    be->encoder_forward(o.get(), tok.as<int32_t>(), wte.get(), wpe.get(), L.B, L.T, C, pos.as<int32_t>());
    REQUIRE(download_act_vec(be.get(), o.get(), size_t(N) * C) == want_out);
    F32Tensor gw(be.get(), Vec(size_t(V) * C, 0.0)), gp(be.get(), Vec(size_t(L.T) * C, 0.0));
    be->encoder_backward(gw.get(), gp.get(), d.get(), tok.as<int32_t>(), L.B, L.T, C, pos.as<int32_t>());
    check_close("encoder dwpe (by position) == per-document sum", download_f32_vec(be.get(), gp.get(), size_t(L.T) * C),
                want_dwpe, 1e-6);
    check_close("encoder dwte == per-document sum", download_f32_vec(be.get(), gw.get(), size_t(V) * C), want_dwte,
                1e-6);
  }
  SECTION("vocab-parallel embedding, summed over two vocabulary halves") {
    Vec out(size_t(N) * C, 0.0), dwte(size_t(V) * C, 0.0), dwpe(size_t(L.T) * C, 0.0);
    for (int r = 0; r < 2; ++r) {
      const int v0 = r * V / 2, nv = V / 2;
      ActTensor part(be.get(), rows(wte.val, v0, nv, C));
      DeviceBuffer o(be.get(), size_t(N) * C * 4);
      be->vocab_embedding_forward(o.get(), tok.as<int32_t>(), part.get(), r == 0 ? wpe.get() : nullptr, v0, nv, L.B, L.T,
                                  C, pos.as<int32_t>());
      const Vec oo = download_act_vec(be.get(), o.get(), size_t(N) * C);
      for (size_t i = 0; i < oo.size(); ++i) out[i] += oo[i];
      F32Tensor gw(be.get(), Vec(size_t(nv) * C, 0.0)), gp(be.get(), Vec(size_t(L.T) * C, 0.0));
      be->vocab_embedding_backward(gw.get(), r == 0 ? gp.get() : nullptr, d.get(), tok.as<int32_t>(), v0, nv, L.B, L.T,
                                   C, pos.as<int32_t>());
      const Vec a = download_f32_vec(be.get(), gw.get(), size_t(nv) * C);
      const Vec b = download_f32_vec(be.get(), gp.get(), size_t(L.T) * C);
      for (size_t i = 0; i < a.size(); ++i) dwte[size_t(v0) * C + i] += a[i];
      for (size_t i = 0; i < b.size(); ++i) dwpe[i] += b[i];
    }
    check_close("vocab embedding out == per-document", out, want_out, 1e-7);
    check_close("vocab embedding dwpe == per-document sum", dwpe, want_dwpe, 1e-6);
    check_close("vocab embedding dwte == per-document sum", dwte, want_dwte, 1e-6);
  }
}

// ---- the whole model --------------------------------------------------------------------------

namespace {

ModelConfig small_model(const std::string& arch) {
  ModelConfig c = ModelConfig::of(2, 4, 16, 23, 16);
  c.arch = arch;
  if (arch != "gpt2") {  // llama, qwen2 (whose q/k/v biases get init()'s noise)
    c.NKV = 2;
    c.F = 24;
    c.tied = false;
  }
  return c;
}

struct ModelRun {
  std::vector<float> losses, grads;
};

// One forward + backward over (B, T) tokens with dloss_scale 1, the grads
// accumulated into `grads` (so several calls sum).
ModelRun run_model(Backend* be, const ModelArch& arch, const std::vector<float>& params, std::vector<float>& grads,
                   const std::vector<int32_t>& in, const std::vector<int32_t>& tg, int B, int T, int32_t sep) {
  const ParamLayout& lay = arch.layout();
  auto net = arch.make_network(be, B, false);
  DeviceBuffer p = upload_act(be, params), g = upload_f32(be, grads);
  DeviceBuffer din = upload_i32(be, in), dtg = upload_i32(be, tg);
  std::vector<int32_t> ds(in.size()), pos(in.size());
  DocumentMask docs;
  DeviceBuffer dds, dpos;
  if (sep >= 0) {
    document_offsets(in.data(), B, T, sep, ds.data(), pos.data());
    dds = upload_i32(be, ds);
    dpos = upload_i32(be, pos);
    docs = {dds.as<int32_t>(), dpos.as<int32_t>()};
  }
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f, docs);
  net->backward(units);
  ModelRun r;
  r.losses = download_f32(be, net->losses(), size_t(B) * T);
  grads = download_f32(be, g.get(), size_t(lay.total));
  r.grads = grads;
  return r;
}

std::vector<float> init(const ModelArch& arch) {
  std::vector<float> p(size_t(arch.layout().total));
  arch.init_params(5, 0, arch.layout().total, p.data());
  for (size_t i = 0; i < p.size(); ++i) p[i] += 0.01f * float(std::sin(double(i)));  // break the unit norm gains
  return p;
}

}  // namespace

TEST_CASE("docmask: a document's losses do not see the document before it (and do without the mask)",
          "[docmask][model]") {
  auto be = make_cpu_backend(2);
  const int32_t sep = 0;
  for (const char* a : {"gpt2", "llama", "qwen2"}) {
    INFO(a);
    auto arch = make_model_arch(small_model(a));
    const std::vector<float> params = init(*arch);
    // Two documents: [0, 7) and [7, 16); targets are the next tokens.
    std::vector<int32_t> in = {0, 3, 5, 7, 9, 11, 13, 0, 2, 4, 6, 8, 10, 12, 14, 16};
    std::vector<int32_t> tg(in.begin() + 1, in.end());
    tg.push_back(1);
    std::vector<int32_t> in2 = in;
    for (int t = 1; t < 7; ++t) in2[size_t(t)] = int32_t((in[size_t(t)] * 5 + 1) % 23);  // change document 1
    if (in2[3] == sep) in2[3] = 21;
    for (bool on : {true, false}) {
      INFO("document_mask " << on);
      std::vector<float> g1(size_t(arch->layout().total), 0.0f), g2 = g1;
      const auto r1 = run_model(be.get(), *arch, params, g1, in, tg, 1, 16, on ? sep : -1);
      const auto r2 = run_model(be.get(), *arch, params, g2, in2, tg, 1, 16, on ? sep : -1);
      double worst = 0;
      for (int t = 7; t < 16; ++t)
        worst = std::max(worst, double(std::fabs(r1.losses[size_t(t)] - r2.losses[size_t(t)])));
      std::printf("  %-6s mask %-3s: max |loss change| on document 2 = %.3e\n", a, on ? "on" : "off", worst);
      if (on) CHECK(worst <= 1e-6);
      else CHECK(worst > 1e-4);
    }
  }
}

TEST_CASE("docmask: packing equivalence: losses and gradients equal the documents run separately",
          "[docmask][model]") {
  auto be = make_cpu_backend(2);
  const int32_t sep = 1;
  for (const char* a : {"gpt2", "llama", "qwen2"}) {
    INFO(a);
    auto arch = make_model_arch(small_model(a));
    const std::vector<float> params = init(*arch);
    // B = 2 of T = 16: documents [0,1) [1,6) [6,15) [15,16) (length 1 at
    // both ends) and one spanning sequence 1 with no separator at all.
    std::vector<int32_t> in = {1, 1, 4, 9, 3, 7, 1, 2, 8, 22, 5, 6, 11, 13, 17, 1,
                               3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 2, 4, 6, 8, 10, 12};
    std::vector<int32_t> tg(in.size());
    for (size_t i = 0; i < tg.size(); ++i) tg[i] = int32_t((in[i] * 3 + 2) % 23);
    std::vector<float> packed_g(size_t(arch->layout().total), 0.0f), sep_g = packed_g;
    const auto packed = run_model(be.get(), *arch, params, packed_g, in, tg, 2, 16, sep);
    std::vector<float> want_losses(in.size());
    const std::vector<std::pair<int, int>> docs = {{0, 1}, {1, 5}, {6, 9}, {15, 1}, {16, 16}};
    for (const auto& [s, n] : docs) {
      std::vector<int32_t> di(in.begin() + s, in.begin() + s + n), dt(tg.begin() + s, tg.begin() + s + n);
      const auto r = run_model(be.get(), *arch, params, sep_g, di, dt, 1, n, -1);
      std::copy(r.losses.begin(), r.losses.end(), want_losses.begin() + s);
    }
    check_close(std::string(a) + " packed per-token losses == per document",
                Vec(packed.losses.begin(), packed.losses.end()), Vec(want_losses.begin(), want_losses.end()), 1e-6);
    check_close(std::string(a) + " packed gradients == sum over documents", Vec(packed_g.begin(), packed_g.end()),
                Vec(sep_g.begin(), sep_g.end()), 1e-5);
  }
}

TEST_CASE("docmask: one document per sequence is the model without the mask, bit for bit", "[docmask][model]") {
  auto be = make_cpu_backend(2);
  for (const char* a : {"gpt2", "llama", "qwen2"}) {
    INFO(a);
    auto arch = make_model_arch(small_model(a));
    const std::vector<float> params = init(*arch);
    std::vector<int32_t> in(32), tg(32);
    for (int i = 0; i < 32; ++i) {
      in[size_t(i)] = int32_t(2 + (i * 7) % 21);
      tg[size_t(i)] = int32_t((i * 5) % 23);
    }
    in[16] = 1;  // the separator at the start of sequence 1 only
    std::vector<float> g1(size_t(arch->layout().total), 0.0f), g2 = g1;
    const auto on = run_model(be.get(), *arch, params, g1, in, tg, 2, 16, 1);
    const auto off = run_model(be.get(), *arch, params, g2, in, tg, 2, 16, -1);
    CHECK(on.losses == off.losses);
    CHECK(on.grads == off.grads);
  }
}

// ---- training runs: multi-rank against one rank -------------------------------------------------

namespace {

std::string dm_job(const std::string& dir, const std::string& model, const std::string& strategy, int tp) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}, document_mask: true, document_separator: 3}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: 5, lr: 3.0e-3,\n"
         "        min_lr: 3.0e-4, warmup_steps: 2, eval_interval: 0, eval_steps: 1, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", tensor_parallel: " + std::to_string(tp) + ", timeout_s: 60}\n";
}

const char* kGpt2 = "{arch: gpt2, n_layer: 2, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16}";
const char* kLlama = "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
                     "seq_len: 16, tie_embeddings: false}";

std::vector<double> train_losses(const std::string& model, int world, int tp, const std::string& strategy,
                                 const std::vector<std::string>& sets = {}) {
  TempDir dir("docmask");
  const JobSpec job = parse_job_spec(dm_job(dir.path(), model, strategy, tp), "job.yaml", sets);
  return run_ranks_inprocess(job, world)[0].losses;
}

void check_same(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i] << " vs " << want[i]);
    CHECK(std::fabs(got[i] - want[i]) <= 1e-5 * std::fabs(want[i]));
  }
}

}  // namespace

TEST_CASE("docmask: dp2 (full_shard, and with activation checkpointing) and tp2 + SP train as one rank does",
          "[docmask][multirank]") {
  for (const char* model : {kGpt2, kLlama}) {
    INFO(model);
    const auto ref = train_losses(model, 1, 1, "no_shard");
    REQUIRE(ref.size() == 5);
    // The mask is in effect: the same job without it trains otherwise.
    const auto off = train_losses(model, 1, 1, "no_shard", {"data.document_mask=false"});
    CHECK(std::fabs(off[0] - ref[0]) > 1e-4);
    {
      INFO("dp2 full_shard");
      check_same(train_losses(model, 2, 1, "full_shard"), ref);
    }
    {
      INFO("tp2 + sequence parallelism");
      check_same(train_losses(model, 2, 2, "no_shard", {"parallel.sequence_parallel=true"}), ref);
    }
    {
      INFO("dp2 shard_grad_op + activation checkpointing (the recompute sees the same documents)");
      check_same(train_losses(model, 2, 1, "shard_grad_op", {"train.activation_checkpointing=blocks"}), ref);
    }
  }
}

// ---- training runs under pipeline parallelism: every stage masks ---------------------------------

namespace {

// 4 layers (interleaved v=2 over pp2 needs 4 virtual stages), micro-batch 1:
// 8 microbatches per step at pp2; eval on, so the pipeline's forward_only
// masks too; clipping on, so the global norm must agree as well.
std::string dm_pp_job(const std::string& dir, const std::string& model, int pp, int tp, const std::string& schedule,
                      int v) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}, document_mask: true, document_separator: 3}\n"
         "train: {global_batch_size: 8, micro_batch_size: 1, max_steps: 4, lr: 3.0e-3,\n"
         "        min_lr: 3.0e-4, warmup_steps: 2, eval_interval: 2, eval_steps: 1, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: no_shard, tensor_parallel: " + std::to_string(tp) +
         ", pipeline_parallel: " + std::to_string(pp) + ", pipeline_schedule: " + schedule +
         ", pipeline_virtual_stages: " + std::to_string(v) + ", timeout_s: 60}\n";
}

const char* kGpt2Pp = "{arch: gpt2, n_layer: 4, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16}";
const char* kLlamaPp = "{arch: llama, n_layer: 4, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
                       "seq_len: 16, tie_embeddings: false}";

struct PpRun {
  std::vector<double> losses;
  double val = -1;
  std::vector<float> weights;  // the final model.safetensors, flat
};

PpRun run_pp(const std::string& model, int world, int pp, int tp, const std::string& schedule = "1f1b", int v = 1,
             const std::vector<std::string>& sets = {}) {
  TempDir dir("docmask_pp");
  const JobSpec job = parse_job_spec(dm_pp_job(dir.path(), model, pp, tp, schedule, v), "job.yaml", sets);
  const auto sums = run_ranks_inprocess(job, world);
  PpRun out;
  out.losses = sums[0].losses;
  out.val = sums[0].best_val_loss;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / den);
}

void check_same_run(const PpRun& got, const PpRun& want) {
  check_same(got.losses, want.losses);
  INFO("val loss " << got.val << " vs " << want.val);
  CHECK(want.val > 0);
  CHECK(std::fabs(got.val - want.val) <= 1e-5 * std::fabs(want.val));
  REQUIRE(got.weights.size() == want.weights.size());
  INFO("final weights rel err " << rel_err(got.weights, want.weights));
  CHECK(rel_err(got.weights, want.weights) <= 1e-5);
}

// The mask is in effect under the pipeline: the same pp2 job without it
// trains otherwise, so the equalities below cannot hold with it dropped.
void check_pp_masked_like_one_rank(const char* model) {
  const PpRun ref = run_pp(model, 1, 1, 1);
  REQUIRE(ref.losses.size() == 4);
  {
    INFO("pp2 1f1b without the mask trains otherwise");
    const PpRun off = run_pp(model, 2, 2, 1, "1f1b", 1, {"data.document_mask=false"});
    // (the last step's: at init llama's step-1 losses differ by only ~5e-5)
    CHECK(std::fabs(off.losses.back() - ref.losses.back()) > 1e-4);
    CHECK(std::fabs(off.val - ref.val) > 1e-4);
    CHECK(rel_err(off.weights, ref.weights) > 1e-4);
  }
  {
    INFO("pp2 1f1b");
    check_same_run(run_pp(model, 2, 2, 1, "1f1b"), ref);
  }
  {
    INFO("pp2 1f1b + activation checkpointing (the stages' recompute sees the same documents)");
    check_same_run(run_pp(model, 2, 2, 1, "1f1b", 1, {"train.activation_checkpointing=blocks"}), ref);
  }
  {
    INFO("pp2 zero_bubble (the deferred weight step sees the same documents)");
    check_same_run(run_pp(model, 2, 2, 1, "zero_bubble"), ref);
  }
  {
    INFO("pp2 interleaved_1f1b v=2 (middle virtual stages on both ranks)");
    check_same_run(run_pp(model, 2, 2, 1, "interleaved_1f1b", 2), ref);
  }
  {
    INFO("pp2 x tp2 1f1b");
    check_same_run(run_pp(model, 4, 2, 2, "1f1b"), ref);
  }
}

}  // namespace

TEST_CASE("docmask: gpt2 under pipelines (1f1b, checkpointing, zero_bubble, interleaved v=2, pp2 x tp2) trains as "
          "one rank does", "[docmask][pp][multirank]") {
  check_pp_masked_like_one_rank(kGpt2Pp);
}

TEST_CASE("docmask: llama under pipelines (1f1b, checkpointing, zero_bubble, interleaved v=2, pp2 x tp2) trains as "
          "one rank does", "[docmask][pp][multirank]") {
  check_pp_masked_like_one_rank(kLlamaPp);
}

// ---- bad input ----------------------------------------------------------------------------------

TEST_CASE("docmask: configs that cannot know the separator, or name a bad one, are refused", "[docmask][config]") {
  const std::string base = "model: {n_layer: 1, n_head: 2, n_embd: 8, vocab_size: 64, seq_len: 8}\n";
  SECTION("synthetic data without data.document_separator") {
    REQUIRE_THROWS_WITH(parse_job_spec(base + "data: {format: synthetic, document_mask: true}\n", "job.yaml"),
                        Contains("data.document_mask") && Contains("data.document_separator") &&
                            Contains("synthetic"));
  }
  SECTION("a separator that is not a token id of the model") {
    REQUIRE_THROWS_WITH(parse_job_spec(base + "data: {format: synthetic, document_mask: true, document_separator: 64}\n",
                                       "job.yaml"),
                        Contains("data.document_separator") && Contains("64") && Contains("model.vocab_size"));
  }
  SECTION("under a pipeline: accepted with a separator, refused as at pp1 without one") {
    const std::string pp = "model: {n_layer: 2, n_head: 2, n_embd: 8, vocab_size: 64, seq_len: 8}\n"
                           "parallel: {pipeline_parallel: 2}\n";
    CHECK(parse_job_spec(pp + "data: {format: synthetic, document_mask: true, document_separator: 3}\n", "job.yaml")
              .data.document_mask_on());
    REQUIRE_THROWS_WITH(parse_job_spec(pp + "data: {format: synthetic, document_mask: true}\n", "job.yaml"),
                        Contains("data.document_mask") && Contains("data.document_separator") &&
                            Contains("synthetic"));
  }
  SECTION("a separator below -1, and a document_mask that is not a boolean") {
    REQUIRE_THROWS_WITH(parse_job_spec(base + "data: {format: synthetic, document_separator: -2}\n", "job.yaml"),
                        Contains("data.document_separator"));
    REQUIRE_THROWS_WITH(parse_job_spec(base + "data: {format: synthetic, document_mask: yes}\n", "job.yaml"),
                        Contains("data.document_mask"));
  }
  TempDir d("docmask_cfg");
  std::vector<uint32_t> toks(64);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint32_t(i % 50);
  write_llmc_shard(d / "train_000000.bin", toks, 1);
  const std::string files = base + "data: {train: '" + d.path() + "/train_*.bin', document_mask: true}\n";
  SECTION("shards without prepare.json and no data.document_separator") {
    const JobSpec job = parse_job_spec(files, "job.yaml");
    REQUIRE_THROWS_WITH(resolve_document_separator(job), Contains("data.document_mask") &&
                                                             Contains("data.document_separator") &&
                                                             Contains("prepare.json") && Contains(d.path()));
  }
  SECTION("prepare.json's document_start_id is the default; an explicit separator wins") {
    write_file(d / "prepare.json", "{\"vocab_size\": 50, \"document_start\": \"<s>\", \"document_start_id\": 49}\n");
    CHECK(resolve_document_separator(parse_job_spec(files, "job.yaml")) == 49);
    CHECK(resolve_document_separator(parse_job_spec(files, "job.yaml", {"data.document_separator=7"})) == 7);
    CHECK(resolve_document_separator(parse_job_spec(files, "job.yaml", {"data.document_mask=false"})) == -1);
  }
  SECTION("prepare.json's id must be a token of the model") {
    write_file(d / "prepare.json", "{\"document_start_id\": 50257}\n");
    REQUIRE_THROWS_WITH(resolve_document_separator(parse_job_spec(files, "job.yaml")),
                        Contains("data.document_separator") && Contains("50257") && Contains("prepare.json") &&
                            Contains("model.vocab_size"));
  }
  SECTION("two prepare.json files that disagree") {
    const std::string a = d / "a", b = d / "b";
    REQUIRE(run_command("mkdir -p '" + a + "' '" + b + "'").exit_code == 0);
    write_llmc_shard(a + "/train_000000.bin", toks, 1);
    write_llmc_shard(b + "/train_000000.bin", toks, 1);
    write_file(a + "/prepare.json", "{\"document_start_id\": 49}\n");
    write_file(b + "/prepare.json", "{\"document_start_id\": 48}\n");
    const std::string two = base + "data: {train: '" + d.path() + "/*/train_*.bin', document_mask: true}\n";
    REQUIRE_THROWS_WITH(resolve_document_separator(parse_job_spec(two, "job.yaml")),
                        Contains("document_start_id") && Contains("48") && Contains("49") &&
                            Contains("data.document_separator"));
  }
}

TEST_CASE("docmask: a training job that cannot know the separator exits non-zero naming the keys",
          "[docmask][cli]") {
  TempDir d("docmask_cli");
  std::vector<uint32_t> toks(200);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint32_t(i % 50);
  write_llmc_shard(d / "train_000000.bin", toks, 1);
  write_file(d / "job.yaml", "model: {n_layer: 1, n_head: 2, n_embd: 8, vocab_size: 64, seq_len: 8}\n"
                             "data: {train: '" + d.path() + "/train_*.bin', document_mask: true}\n"
                             "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 1}\n"
                             "output: {dir: '" + d.path() + "/out'}\n");
  const RunResult r = run_trainrun("--config " + d.path() + "/job.yaml --set backend=cpu");
  INFO(r.out << r.err);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.out + r.err, Contains("data.document_mask") && Contains("data.document_separator"));
}
