// Llama's description (llama_arch.h): layout, init, cost model, metadata.
#include "core/model/llama/llama_arch.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/init_rng.h"
#include "core/model/llama/llama.h"
#include "core/model/llama/llama_decoder.h"
#include "core/model/moe/moe_layout.h"
#include "core/model/moe/moe_mlp.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

ModelConfig resolved(ModelConfig c, const char* arch) {
  check_model_config_common(c);
  TR_CHECK(c.arch == arch, "model.arch: '", c.arch, "' given to the ", arch, " architecture (a bug)");
  // LlamaConfig's attention_bias would add o_proj's bias too: refused when read (llama_hf.cpp).
  TR_CHECK(!c.qkv_bias || c.arch != "llama",
           "model: llama has no q/k/v biases (qkv_bias); use model.arch: qwen2 for a model with them");
  TR_CHECK(c.F > 0, "model.ffn_dim: ", arch, " needs its MLP width (config.json's intermediate_size); set it");
  TR_CHECK(c.head_size() % 2 == 0, c.head_dim > 0 ? "model.head_dim: the head size " : "model.n_embd: the head size model.n_embd / model.n_head = ",
           c.head_size(), " must be even for rotary embeddings");
  c.NKV = c.kv_heads();
  // One spelling per model: head_dim = C/NH is the default, so it is 0
  // (metadata, manifests and config comparisons then match older files).
  if (c.head_dim * c.NH == c.C) c.head_dim = 0;
  return c;
}

ParamLayout llama_layout(const ModelConfig& c) {
  using S = ParamTensor::Split;
  const int64_t C = c.C, V = c.V, F = c.F, Q = c.q_dim(), KV = int64_t(c.kv_heads()) * c.head_size();
  LayoutBuilder b;
  b.begin_unit("embeddings");
  b.add("model.embed_tokens.weight", {V, C}, true, S::Vocab);
  b.end_unit();
  for (int l = 0; l < c.L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    b.begin_unit("block " + std::to_string(l));
    b.add(p + "input_layernorm.weight", {C}, false, S::Replicated);
    b.add(p + "self_attn.q_proj.weight", {Q, C}, true, S::Column, 1, c.NH);  // split by heads
    b.add(p + "self_attn.k_proj.weight", {KV, C}, true, S::Column, 1, c.kv_heads());
    b.add(p + "self_attn.v_proj.weight", {KV, C}, true, S::Column, 1, c.kv_heads());
    if (c.qkv_bias) {  // adjacent: one bias for the fused q|k|v GEMM; split by heads like the weights
      b.add(p + "self_attn.q_proj.bias", {Q}, false, S::Column, 1, c.NH);
      b.add(p + "self_attn.k_proj.bias", {KV}, false, S::Column, 1, c.kv_heads());
      b.add(p + "self_attn.v_proj.bias", {KV}, false, S::Column, 1, c.kv_heads());
    }
    b.add(p + "self_attn.o_proj.weight", {C, Q}, true, S::Row, 1, c.NH);
    b.add(p + "post_attention_layernorm.weight", {C}, false, S::Replicated);
    // Gemma 2 (post_norms): the norm above is on the attention output; the MLP's input norm is this one.
    if (c.post_norms) b.add(p + "pre_feedforward_layernorm.weight", {C}, false, S::Replicated);
    if (c.moe.on()) {
      add_moe_tensors(b, p, C, c.moe);  // the MLP's place (core/model/moe/moe_layout.h)
    } else {
      b.add(p + "mlp.gate_proj.weight", {F, C}, true, S::Column);
      b.add(p + "mlp.up_proj.weight", {F, C}, true, S::Column);
      b.add(p + "mlp.down_proj.weight", {C, F}, true, S::Row);
    }
    if (c.qk_norm) {  // after the rest, so the other offsets stay (LlamaBlockOffsets)
      b.add(p + "self_attn.q_norm.weight", {c.head_size()}, false, S::Replicated);
      b.add(p + "self_attn.k_norm.weight", {c.head_size()}, false, S::Replicated);
    }
    if (c.post_norms) b.add(p + "post_feedforward_layernorm.weight", {C}, false, S::Replicated);
    b.end_unit();
  }
  b.begin_unit("head");
  b.add("model.norm.weight", {C}, false, S::Replicated);
  if (!c.tied) b.add("lm_head.weight", {V, C}, true, S::Vocab);
  b.end_unit();
  if (c.tied) b.tie("lm_head.weight", "model.embed_tokens.weight");
  return b.finish();
}

double r64(double bytes) { return std::ceil(bytes / 64.0) * 64.0; }

bool ends_with(const std::string& n, const char* suf) {
  const size_t k = std::char_traits<char>::length(suf);
  return n.size() >= k && n.compare(n.size() - k, k, suf) == 0;
}

// Doubles in metadata: every digit, so they read back exactly.
std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

LlamaArch::LlamaArch(const ModelConfig& cfg) : LlamaArch(cfg, "llama") {}
LlamaArch::LlamaArch(const ModelConfig& cfg, const char* arch)
    : ModelArch(resolved(cfg, arch), llama_layout(resolved(cfg, arch))) {}

std::unique_ptr<ModelArch> make_llama_arch(const ModelConfig& cfg) { return std::make_unique<LlamaArch>(cfg); }

// The block's GEMMs as LlamaNetwork numbers them: 0 q|k|v, 1 o_proj,
// 2 gate|up, 3 down_proj (llama.cpp's block_forward).
std::vector<BlockLinear> LlamaArch::block_linears() const {
  const ModelConfig& c = cfg_;
  const int64_t C = c.C, F = c.F, Q = c.q_dim(), KV = int64_t(c.kv_heads()) * c.head_size();
  if (c.moe.on())  // the experts are no adapter target yet: attention's linears only
    return {{"self_attn.q_proj", 0, C, Q, 0}, {"self_attn.k_proj", 0, C, KV, Q},
            {"self_attn.v_proj", 0, C, KV, Q + KV}, {"self_attn.o_proj", 1, Q, C, 0}};
  return {{"self_attn.q_proj", 0, C, Q, 0},         {"self_attn.k_proj", 0, C, KV, Q},
          {"self_attn.v_proj", 0, C, KV, Q + KV},   {"self_attn.o_proj", 1, Q, C, 0},
          {"mlp.gate_proj", 2, C, F, 0},            {"mlp.up_proj", 2, C, F, F},
          {"mlp.down_proj", 3, F, C, 0}};
}
std::string LlamaArch::hf_block_prefix(int layer) const { return "model.layers." + std::to_string(layer) + "."; }

std::string LlamaArch::describe() const {
  const ModelConfig& c = cfg_;
  std::string s = name() + " L=" + std::to_string(c.L) + " C=" + std::to_string(c.C) + " heads=" + std::to_string(c.NH) +
                  " kv_heads=" + std::to_string(c.NKV) + " ffn=" + std::to_string(c.F) + " V=" + std::to_string(c.V) +
                  " T=" + std::to_string(c.T);
  if (c.head_dim > 0) s += " head_dim=" + std::to_string(c.head_dim);
  if (c.tied) s += " tied=1";
  return s;
}

void LlamaArch::init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const {
  // N(0, std) for matrices and the embedding, std/sqrt(2L) for the two
  // residual projections (o_proj, down_proj), RMSNorm weights 1, biases 0
  // (as transformers' _init_weights zeroes a Linear's bias).
  const double resid_std = cfg_.init_std / std::sqrt(2.0 * cfg_.L);
  const uint64_t s = splitmix64(seed);
  for (const auto& t : layout_.tensors) {
    const int64_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo >= hi) continue;
    const bool norm = ends_with(t.name, "norm.weight"), bias = ends_with(t.name, ".bias");
    const double std = ends_with(t.name, "o_proj.weight") || moe_is_residual_projection(t.name) ? resid_std
                                                                                                 : cfg_.init_std;
    // (norm_offset, Gemma 2: the norms compute x * (1 + w), so w = 0 is the identity gain.)
    const float norm_init = cfg_.norm_offset ? 0.0f : 1.0f;
    for (int64_t i = lo; i < hi; ++i)
      out[i - begin] = norm ? norm_init : bias ? 0.0f : float(std * normal_at(s, uint64_t(i)));
  }
}

int64_t LlamaArch::matmul_parameters() const {
  // RoPE has no table; an untied input embedding is a lookup. A mixture of
  // experts multiplies each token by its top_k experts only (the active
  // parameters: MFU counts the FLOPs the tokens take).
  const MoeConfig& m = cfg_.moe;
  const int64_t idle = m.on() ? int64_t(cfg_.L) * (m.n_experts - m.top_k) * 3 * int64_t(m.ffn) * cfg_.C : 0;
  return num_parameters() - (cfg_.tied ? 0 : int64_t(cfg_.V) * cfg_.C) - idle;
}

double LlamaArch::activation_bytes(int B, bool ckpt, const ActivationDevice& d) const {
  // LlamaNetwork's arena (llama.cpp), buffer by buffer: GPT-2's plan with
  // RMSNorm (no mean), grouped q|k|v, a gated MLP (gate|up, silu(gate)*up),
  // and the RoPE table (no position table: the embedding reads none).
  const ModelConfig& m = cfg_;
  const double es = d.act_bytes;
  const double N = double(B) * double(m.T), C = double(m.C), F = double(m.F);
  const double attn_saved = d.attention_probs ? double(B) * m.NH * double(m.T) * double(m.T)
                                              : double(B) * m.NH * double(m.T);
  const double HS = m.head_size(), Q = double(m.q_dim());
  const double qkv = Q + 2.0 * m.NKV * HS;
  double per_layer = 0;
  per_layer += r64(N * C * es);                       // attention norm
  per_layer += r64(N * 4);                            // its rstd
  per_layer += r64(N * qkv * es);                     // q|k|v
  if (m.qk_norm) {
    per_layer += r64(N * (Q + m.NKV * HS) * es);      // q|k before qk-norm
    per_layer += r64(N * (m.NH + m.NKV) * 4);         // its per-head rstd
  }
  per_layer += r64(N * Q * es);                       // attention output
  per_layer += r64(attn_saved * 4);                   // attention's saved state (fp32)
  per_layer += r64(N * C * es);                       // residual after attention
  per_layer += r64(N * C * es);                       // MLP norm
  per_layer += r64(N * 4);                            // its rstd
  if (!m.moe.on()) {
    per_layer += r64(N * 2 * F * es);                 // gate|up (dgate|dup in place in backward)
    per_layer += r64(N * F * es);                     // silu(gate)*up
  }
  if (m.post_norms) per_layer += 2 * (r64(N * C * es) + r64(N * 4));  // attention / MLP outputs before their norms, rstd
  double total = 0;
  total += r64(double(m.T) * HS * 4);                 // RoPE cos/sin table (T, HS/2, 2) fp32
  total += r64(N * C * es);                           // embeddings output
  total += double(m.L) * r64(N * C * es);             // block outputs (the checkpoints)
  total += double(ckpt ? 1 : m.L) * per_layer;        // per-layer sets, or one shared when recomputing
  total += r64(N * C * es);                           // final norm
  total += r64(N * 4);                                // its rstd
  const double Vp = std::ceil(double(m.V) / d.logits_align) * d.logits_align;
  total += r64(N * Vp * es);                          // logits, rows padded (then dlogits in place)
  total += r64(N * 4);                                // per-token losses
  total += r64(N * C * es);                           // backward: dres
  total += r64(N * std::max(C, Q) * es);              // backward: dbuf_c (also d attention output)
  total += r64(N * qkv * es);                         // backward: dqkv
  if (m.moe.on())                                     // the MoE MLP's own (core/model/moe/moe_mlp.h)
    total += double(MoeMlp::bytes(m.moe, m.C, size_t(es), int64_t(N), ckpt ? 1 : m.L, m.L, true));
  else
    total += r64(N * F * es);                         // backward: d(silu(gate)*up)
  if (m.post_norms) total += r64(N * C * es);         // backward: the gradient through a post norm
  return total;
}

std::map<std::string, std::string> LlamaArch::file_metadata() const {
  const ModelConfig& c = cfg_;
  std::map<std::string, std::string> m = {{"format", "pt"},
                                          {"arch", name()},
                                          {"n_layer", std::to_string(c.L)},
                                          {"n_head", std::to_string(c.NH)},
                                          {"n_kv_head", std::to_string(c.NKV)},
                                          {"n_embd", std::to_string(c.C)},
                                          {"ffn_dim", std::to_string(c.F)},
                                          {"vocab_size", std::to_string(c.V)},
                                          {"seq_len", std::to_string(c.T)},
                                          {"init_std", exact(c.init_std)},
                                          {"norm_eps", exact(c.norm_eps)},
                                          {"rope_theta", exact(c.rope_theta)},
                                          {"tie_embeddings", c.tied ? "true" : "false"}};
  if (c.head_dim > 0) m["head_dim"] = std::to_string(c.head_dim);  // only when set: older files stay as they were
  if (c.sliding_window > 0) m["sliding_window"] = std::to_string(c.sliding_window);  // likewise
  if (!c.rope_scaling_type.empty()) {
    m["rope_scaling.type"] = c.rope_scaling_type;
    m["rope_scaling.factor"] = exact(c.rope_scaling.factor);
    m["rope_scaling.low_freq_factor"] = exact(c.rope_scaling.low_freq_factor);
    m["rope_scaling.high_freq_factor"] = exact(c.rope_scaling.high_freq_factor);
    m["rope_scaling.original_max_position_embeddings"] = std::to_string(c.rope_scaling.original_max_position_embeddings);
  }
  return m;
}

ModelConfig llama_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  auto text = [&](const char* key) -> const std::string& {
    auto it = meta.find(key);
    TR_CHECK(it != meta.end(), path, ": missing __metadata__ key '", key,
             "'; this file was not written by trainrun (or an older version)");
    return it->second;
  };
  auto num = [&](const char* key) {
    const std::string& v = text(key);
    try {
      size_t used = 0;
      const double d = std::stod(v, &used);
      if (used == v.size()) return d;
    } catch (...) {
    }
    TR_FAIL(path, ": __metadata__ key '", key, "' is not a number: '", v, "'");
  };
  auto integer = [&](const char* key) {
    const double d = num(key);
    TR_CHECK(d == std::floor(d) && std::fabs(d) < 2e9, path, ": __metadata__ key '", key, "' is not an integer: '",
             text(key), "'");
    return int(d);
  };
  ModelConfig c;
  c.arch = "llama";
  c.L = integer("n_layer");
  c.NH = integer("n_head");
  c.NKV = integer("n_kv_head");
  c.C = integer("n_embd");
  c.F = integer("ffn_dim");
  c.V = integer("vocab_size");
  c.T = integer("seq_len");
  c.init_std = num("init_std");
  c.norm_eps = num("norm_eps");
  c.rope_theta = num("rope_theta");
  const std::string& tied = text("tie_embeddings");
  TR_CHECK(tied == "true" || tied == "false", path, ": __metadata__ key 'tie_embeddings' is not true/false: '", tied,
           "'");
  c.tied = tied == "true";
  if (meta.count("head_dim")) c.head_dim = integer("head_dim");
  if (meta.count("sliding_window")) {
    c.sliding_window = integer("sliding_window");
    TR_CHECK(c.sliding_window >= 0, path, ": __metadata__ key 'sliding_window' is negative: ", c.sliding_window);
  }
  if (meta.count("rope_scaling.type")) {
    c.rope_scaling_type = text("rope_scaling.type");
    c.rope_scaling.factor = num("rope_scaling.factor");
    c.rope_scaling.low_freq_factor = num("rope_scaling.low_freq_factor");
    c.rope_scaling.high_freq_factor = num("rope_scaling.high_freq_factor");
    c.rope_scaling.original_max_position_embeddings = integer("rope_scaling.original_max_position_embeddings");
  }
  return c;
}

json LlamaArch::manifest_model() const {
  const ModelConfig& c = cfg_;
  json m = {{"arch", name()},       {"n_layer", c.L},    {"n_head", c.NH},         {"n_kv_head", c.NKV},
            {"n_embd", c.C},         {"ffn_dim", c.F},    {"vocab_size", c.V},      {"seq_len", c.T},
            {"norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta}, {"tie_embeddings", c.tied},
            {"rope_scaling", json::object()}};
  if (c.head_dim > 0) m["head_dim"] = c.head_dim;  // only when set: older manifests stay equal
  if (!c.rope_scaling_type.empty())
    m["rope_scaling"] = {{"type", c.rope_scaling_type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  return m;
}

std::unique_ptr<Network> LlamaArch::make_network(Backend* be, int maxB, bool activation_checkpointing,
                                                 const TensorParallel* tp, const PipelineStage* stage,
                                                 const ContextParallel* cp, const ExpertParallel* ep) const {
  return std::make_unique<LlamaNetwork>(cfg_, layout_, be, maxB, activation_checkpointing, tp, stage, cp, ep);
}
std::unique_ptr<Decoder> LlamaArch::make_decoder(Backend* be, int capacity) const {
  return std::make_unique<LlamaDecoder>(cfg_, layout_, be, capacity);
}
size_t LlamaArch::decoder_bytes_needed(const Backend& be, int capacity) const {
  return LlamaDecoder::bytes_needed(cfg_, be, capacity);
}

}  // namespace trainrun
