// Double-precision reference ops: see reference_ops.h. Written for reading,
// not for speed: one loop nest per formula, indices spelled out.
#include "tests/support/reference_ops.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace trainrun::ref {

Vec encoder(const Tokens& tokens, const Vec& wte, const Vec& wpe, int B, int T, int C) {
  Vec out(size_t(B) * T * C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const int tok = tokens[size_t(b) * T + t];
      for (int c = 0; c < C; ++c)
        out[(size_t(b) * T + t) * C + c] = wte[size_t(tok) * C + c] + wpe[size_t(t) * C + c];
    }
  return out;
}

Vec layernorm(const Vec& x, const Vec& w, const Vec& b, int N, int C, Vec* mean, Vec* rstd) {
  Vec out(size_t(N) * C);
  if (mean) mean->assign(N, 0.0);
  if (rstd) rstd->assign(N, 0.0);
  for (int n = 0; n < N; ++n) {
    const double* row = x.data() + size_t(n) * C;
    double m = 0.0;
    for (int c = 0; c < C; ++c) m += row[c];
    m /= C;
    double var = 0.0;
    for (int c = 0; c < C; ++c) var += (row[c] - m) * (row[c] - m);
    var /= C;  // biased, as torch.nn.LayerNorm
    const double s = 1.0 / std::sqrt(var + 1e-5);
    for (int c = 0; c < C; ++c) out[size_t(n) * C + c] = (row[c] - m) * s * w[c] + b[c];
    if (mean) (*mean)[n] = m;
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

Vec linear(const Vec& x, const Vec& W, const Vec& bias, int N, int C, int OC) {
  Vec out(size_t(N) * OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double acc = bias.empty() ? 0.0 : bias[o];
      for (int c = 0; c < C; ++c) acc += x[size_t(n) * C + c] * W[size_t(o) * C + c];
      out[size_t(n) * OC + o] = acc;
    }
  return out;
}

Vec attention(const Vec& qkv, int B, int T, int C, int NH) {
  const int HS = C / NH;
  const size_t C3 = size_t(3) * C;
  const double scale = 1.0 / std::sqrt(double(HS));
  Vec out(size_t(B) * T * C, 0.0);
  Vec p(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        const double* q = qkv.data() + (size_t(b) * T + t) * C3 + size_t(h) * HS;
        // scores against keys 0..t (causal), then a stable softmax
        double mx = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const double* k = qkv.data() + (size_t(b) * T + j) * C3 + C + size_t(h) * HS;
          double s = 0.0;
          for (int d = 0; d < HS; ++d) s += q[d] * k[d];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0.0;
        for (int j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        double* o = out.data() + (size_t(b) * T + t) * C + size_t(h) * HS;
        for (int j = 0; j <= t; ++j) {
          const double* v = qkv.data() + (size_t(b) * T + j) * C3 + 2 * size_t(C) + size_t(h) * HS;
          for (int d = 0; d < HS; ++d) o[d] += p[j] / sum * v[d];
        }
      }
  return out;
}

Vec gelu(const Vec& x) {
  const double k = std::sqrt(2.0 / std::acos(-1.0));  // sqrt(2/pi)
  Vec out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    out[i] = 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
  }
  return out;
}

Vec residual(const Vec& a, const Vec& b) {
  Vec out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

Vec cross_entropy(const Vec& logits, const Tokens& targets, int N, int V) {
  Vec loss(N, 0.0);
  for (int n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    const double* z = logits.data() + size_t(n) * V;
    double mx = -INFINITY;
    for (int v = 0; v < V; ++v) mx = std::max(mx, z[v]);
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
    loss[n] = mx + std::log(sum) - z[targets[n]];
  }
  return loss;
}

// ---- Llama ops -------------------------------------------------------------------

Vec rmsnorm(const Vec& x, const Vec& w, int N, int C, double eps, Vec* rstd) {
  Vec out(size_t(N) * C);
  if (rstd) rstd->assign(N, 0.0);
  for (int n = 0; n < N; ++n) {
    const double* row = x.data() + size_t(n) * C;
    double ms = 0.0;
    for (int c = 0; c < C; ++c) ms += row[c] * row[c];
    ms /= C;
    const double s = 1.0 / std::sqrt(ms + eps);
    for (int c = 0; c < C; ++c) out[size_t(n) * C + c] = row[c] * s * w[c];
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

Vec rope(const Vec& qkv, const Vec& inv_freq, int B, int T, int NH, int NKV, int HS, int pos0) {
  const int half = HS / 2;
  if (HS % 2 != 0 || int(inv_freq.size()) != half) throw std::runtime_error("ref::rope: need HS even, HS/2 freqs");
  const size_t ld = size_t(NH + 2 * NKV) * HS;
  Vec out = qkv;  // v heads pass through
  Vec cosv(HS), sinv(HS), rot(HS);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      for (int d = 0; d < HS; ++d) {
        const double angle = double(pos0 + t) * inv_freq[d % half];  // cat(freqs, freqs)
        cosv[d] = std::cos(angle);
        sinv[d] = std::sin(angle);
      }
      for (int h = 0; h < NH + NKV; ++h) {  // q heads, then k heads
        const double* x = qkv.data() + (size_t(b) * T + t) * ld + size_t(h) * HS;
        for (int d = 0; d < HS; ++d) rot[d] = d < half ? -x[d + half] : x[d - half];  // rotate_half
        double* y = out.data() + (size_t(b) * T + t) * ld + size_t(h) * HS;
        for (int d = 0; d < HS; ++d) y[d] = x[d] * cosv[d] + rot[d] * sinv[d];
      }
    }
  return out;
}

Vec swiglu(const Vec& inp, int N, int F) {
  Vec out(size_t(N) * F);
  for (int n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) {
      const double g = inp[size_t(n) * 2 * F + f], u = inp[size_t(n) * 2 * F + F + f];
      out[size_t(n) * F + f] = g / (1.0 + std::exp(-g)) * u;
    }
  return out;
}

Vec attention_gqa(const Vec& qkv, int B, int T, int NH, int NKV, int HS) {
  if (NH % NKV != 0) throw std::runtime_error("ref::attention_gqa: NKV must divide NH");
  const int R = NH / NKV, C = NH * HS;
  const size_t ld = size_t(NH + 2 * NKV) * HS;
  // repeat_kv: an MHA qkv(B,T,3C) whose k/v head h is the KV head h / R.
  Vec mha(size_t(B) * T * 3 * C);
  for (size_t bt = 0; bt < size_t(B) * T; ++bt)
    for (int h = 0; h < NH; ++h)
      for (int d = 0; d < HS; ++d) {
        const double* row = qkv.data() + bt * ld;
        double* m = mha.data() + bt * 3 * C;
        m[size_t(h) * HS + d] = row[size_t(h) * HS + d];
        m[C + size_t(h) * HS + d] = row[size_t(NH + h / R) * HS + d];
        m[2 * size_t(C) + size_t(h) * HS + d] = row[size_t(NH + NKV + h / R) * HS + d];
      }
  return attention(mha, B, T, C, NH);
}

Vec attention_gqa_masked(const Vec& qkv, int B, int T, int NH, int NKV, int HS, const int32_t* doc_start, int window,
                         double scale, double softcap) {
  if (NH % NKV != 0) throw std::runtime_error("ref::attention_gqa_masked: NKV must divide NH");
  const int R = NH / NKV, C = NH * HS;
  const size_t ld = size_t(NH + 2 * NKV) * HS;
  const double sc = scale > 0 ? scale : 1.0 / std::sqrt(double(HS));
  Vec out(size_t(B) * T * C, 0.0), p(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        int first = doc_start ? doc_start[size_t(b) * T + t] : 0;
        if (window > 0) first = std::max(first, t - window + 1);
        const double* q = qkv.data() + (size_t(b) * T + t) * ld + size_t(h) * HS;
        double mx = -INFINITY;
        for (int j = first; j <= t; ++j) {
          const double* k = qkv.data() + (size_t(b) * T + j) * ld + size_t(NH + h / R) * HS;
          double s = 0.0;
          for (int d = 0; d < HS; ++d) s += q[d] * k[d];
          s *= sc;
          if (softcap > 0) s = softcap * std::tanh(s / softcap);
          p[j] = s;
          mx = std::max(mx, s);
        }
        double sum = 0.0;
        for (int j = first; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double* o = out.data() + (size_t(b) * T + t) * C + size_t(h) * HS;
        for (int j = first; j <= t; ++j) {
          const double* v = qkv.data() + (size_t(b) * T + j) * ld + size_t(NH + NKV + h / R) * HS;
          for (int d = 0; d < HS; ++d) o[d] += p[j] / sum * v[d];
        }
      }
  return out;
}

namespace {
// The entries of one named tensor of the flat parameter vector.
Vec tensor(const ParamLayout& lay, const Vec& params, const std::string& name) {
  const ParamTensor& t = lay.get(name);
  return Vec(params.begin() + t.offset, params.begin() + t.offset + t.numel);
}
}  // namespace

Vec gpt2_logits(const GPT2Config& cfg, const Vec& params, const Tokens& tokens, int B, int T) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  if (int64_t(params.size()) != lay.total) throw std::runtime_error("ref::gpt2_logits: wrong parameter count");
  if (T > cfg.T) throw std::runtime_error("ref::gpt2_logits: T exceeds the position table");
  const int C = cfg.C, N = B * T;
  auto P = [&](const std::string& name) { return tensor(lay, params, name); };

  Vec x = encoder(tokens, P("transformer.wte.weight"), P("transformer.wpe.weight"), B, T, C);
  for (int l = 0; l < cfg.L; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    // attention sub-block (pre-LayerNorm)
    Vec ln1 = layernorm(x, P(p + "ln_1.weight"), P(p + "ln_1.bias"), N, C);
    Vec qkv = linear(ln1, P(p + "attn.c_attn.weight"), P(p + "attn.c_attn.bias"), N, C, 3 * C);
    Vec att = attention(qkv, B, T, C, cfg.NH);
    Vec proj = linear(att, P(p + "attn.c_proj.weight"), P(p + "attn.c_proj.bias"), N, C, C);
    Vec res2 = residual(x, proj);
    // MLP sub-block
    Vec ln2 = layernorm(res2, P(p + "ln_2.weight"), P(p + "ln_2.bias"), N, C);
    Vec fc = linear(ln2, P(p + "mlp.c_fc.weight"), P(p + "mlp.c_fc.bias"), N, C, 4 * C);
    Vec act = gelu(fc);
    Vec mlp = linear(act, P(p + "mlp.c_proj.weight"), P(p + "mlp.c_proj.bias"), N, 4 * C, C);
    x = residual(res2, mlp);
  }
  Vec lnf = layernorm(x, P("transformer.ln_f.weight"), P("transformer.ln_f.bias"), N, C);
  return linear(lnf, P("transformer.wte.weight"), Vec(), N, C, cfg.V);  // tied LM head
}

double gpt2_loss(const GPT2Config& cfg, const Vec& params, const Tokens& tokens, const Tokens& targets,
                 int B, int T) {
  Vec losses = cross_entropy(gpt2_logits(cfg, params, tokens, B, T), targets, B * T, cfg.V);
  double sum = 0.0;
  for (double l : losses) sum += l;
  return sum / (double(B) * T);
}

// ---- test helpers ----------------------------------------------------------------

double dot(const Vec& a, const Vec& b) {
  if (a.size() != b.size()) throw std::runtime_error("ref::dot: size mismatch");
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double rel_err(const Vec& a, const Vec& ref) {
  if (a.size() != ref.size()) throw std::runtime_error("ref::rel_err: size mismatch");
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

Vec central_fd(Vec& x, const std::function<double()>& f, double h) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    g[i] = (fp - fm) / (2.0 * h);
  }
  return g;
}

}  // namespace trainrun::ref
