// GPT-2's ModelArch: rules, cost model, file metadata, factories. The
// Hugging Face half is gpt2_hf.cpp.
#include "core/model/gpt2/gpt2_arch.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/gpt2/gpt2.h"
#include "core/model/gpt2/gpt2_decoder.h"

namespace trainrun {

namespace {
// The rules every config obeys, then what GPT-2 cannot be; NKV and F resolved.
ModelConfig resolved(ModelConfig c) {
  check_model_config_common(c);
  TR_CHECK(c.arch == "gpt2", "model.arch: '", c.arch, "' given to the gpt2 architecture (a bug)");
  TR_CHECK(c.NKV == 0 || c.NKV == c.NH, "model.n_kv_head: gpt2 has no grouped-query attention; it must equal ",
           "model.n_head (", c.NH, ") or be left unset (got ", c.NKV, ")");
  TR_CHECK(c.F == 0 || c.F == 4 * c.C, "model.ffn_dim: gpt2's MLP is 4 * model.n_embd = ", 4 * int64_t(c.C),
           " wide; leave it unset (got ", c.F, ")");
  TR_CHECK(c.tied, "model.tie_embeddings: gpt2 ties the LM head to the token embedding; it cannot be false");
  TR_CHECK(std::fabs(c.norm_eps - 1e-5) <= 1e-11, "model.norm_eps: gpt2's LayerNorm uses 1e-05 (the backend's); got ",
           c.norm_eps);
  TR_CHECK(c.rope_scaling_type.empty(), "model.rope_scaling.type: gpt2 has learned positions, no rotary embedding; ",
           "leave it unset (got '", c.rope_scaling_type, "')");
  TR_CHECK(c.head_dim == 0 || int64_t(c.head_dim) * c.NH == c.C, "model.head_dim: gpt2's heads are model.n_embd / ",
           "model.n_head wide; leave it unset (got ", c.head_dim, ")");
  c.NKV = c.NH;
  c.F = 4 * c.C;
  c.head_dim = 0;
  return c;
}

// Bytes of one buffer in the arena: every buffer starts on 64 bytes.
double r64(double bytes) { return std::ceil(bytes / 64.0) * 64.0; }
}  // namespace

GPT2Arch::GPT2Arch(const ModelConfig& cfg) : ModelArch(resolved(cfg), make_gpt2_layout(cfg)) {}

std::unique_ptr<ModelArch> make_gpt2_arch(const ModelConfig& cfg) { return std::make_unique<GPT2Arch>(cfg); }

std::string GPT2Arch::describe() const {
  const ModelConfig& c = cfg_;
  return "gpt2 L=" + std::to_string(c.L) + " C=" + std::to_string(c.C) + " heads=" + std::to_string(c.NH) +
         " V=" + std::to_string(c.V) + " T=" + std::to_string(c.T);
}

void GPT2Arch::init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const {
  gpt2_init_params(cfg_, layout_, seed, begin, end, out);
}

int64_t GPT2Arch::matmul_parameters() const {
  // Everything but wpe, a lookup; the input embedding is the (tied) head's matrix.
  return num_parameters() - int64_t(cfg_.T) * cfg_.C;
}

double GPT2Arch::activation_bytes(int B, bool ckpt, const ActivationDevice& d) const {
  // Mirrors GPT2::GPT2's arena (gpt2.cpp): the same buffers in the same
  // sizes, each rounded up to 64 bytes.
  const ModelConfig& m = cfg_;
  const double es = d.act_bytes;
  const double N = double(B) * double(m.T), C = double(m.C), F = double(m.F);
  const double attn_saved = d.attention_probs ? double(B) * m.NH * double(m.T) * double(m.T)
                                              : double(B) * m.NH * double(m.T);
  const double qkv = 3 * C;
  double per_layer = 0;
  per_layer += r64(N * C * es);                       // ln1
  per_layer += 2 * r64(N * 4);                        // ln1 mean, rstd
  per_layer += r64(N * qkv * es);                     // qkv
  per_layer += r64(N * C * es);                       // attention output
  per_layer += r64(attn_saved * 4);                   // attention's saved state (fp32)
  per_layer += r64(N * C * es);                       // residual after attention
  per_layer += r64(N * C * es);                       // ln2
  per_layer += 2 * r64(N * 4);                        // ln2 mean, rstd
  per_layer += 2 * r64(N * F * es);                   // fc, gelu(fc)
  double total = 0;
  total += r64(N * C * es);                           // embeddings output
  total += double(m.L) * r64(N * C * es);             // block outputs (the checkpoints)
  total += double(ckpt ? 1 : m.L) * per_layer;        // per-layer sets, or one shared when recomputing
  total += r64(N * C * es);                           // lnf
  total += 2 * r64(N * 4);                            // its mean, rstd
  const double Vp = std::ceil(double(m.V) / d.logits_align) * d.logits_align;
  total += r64(N * Vp * es);                          // logits, rows padded (then dlogits in place)
  total += r64(N * 4);                                // per-token losses
  total += 2 * r64(N * C * es);                       // backward: dres, dbuf_c
  total += r64(N * qkv * es);                         // backward: dqkv
  total += r64(N * F * es);                           // backward: the MLP hidden grad
  return total;
}

// These keys are part of every GPT-2 checkpoint's header (its size fixes the
// data offsets): they must not change.
std::map<std::string, std::string> GPT2Arch::file_metadata() const {
  const ModelConfig& c = cfg_;
  return {{"format", "pt"},
          {"arch", "gpt2"},
          {"n_layer", std::to_string(c.L)},
          {"n_head", std::to_string(c.NH)},
          {"n_embd", std::to_string(c.C)},
          {"vocab_size", std::to_string(c.V)},
          {"seq_len", std::to_string(c.T)},
          {"init_std", std::to_string(c.init_std)}};
}

ModelConfig gpt2_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  auto meta_int = [&](const char* key) {
    auto it = meta.find(key);
    TR_CHECK(it != meta.end(), path, ": missing __metadata__ key '", key,
             "'; this file was not written by trainrun (or an older version)");
    try {
      return std::stoi(it->second);
    } catch (...) {
      TR_FAIL(path, ": __metadata__ key '", key, "' is not an integer: '", it->second, "'");
    }
  };
  ModelConfig cfg;
  cfg.arch = "gpt2";
  cfg.L = meta_int("n_layer");
  cfg.NH = meta_int("n_head");
  cfg.C = meta_int("n_embd");
  cfg.V = meta_int("vocab_size");
  cfg.T = meta_int("seq_len");
  TR_CHECK(cfg.L > 0 && cfg.NH > 0 && cfg.C > 0 && cfg.V > 0 && cfg.T > 0 && cfg.C % cfg.NH == 0, path,
           ": inconsistent model shape in __metadata__");
  // Written with std::to_string (6 decimals): kept when it survived that.
  auto std_it = meta.find("init_std");
  if (std_it != meta.end()) {
    try {
      const double v = std::stod(std_it->second);
      if (v > 0 && std::isfinite(v)) cfg.init_std = v;
    } catch (...) {
    }
  }
  return cfg;
}

nlohmann::ordered_json GPT2Arch::manifest_model() const {
  const ModelConfig& c = cfg_;
  return {{"arch", "gpt2"}, {"n_layer", c.L}, {"n_head", c.NH}, {"n_embd", c.C}, {"vocab_size", c.V}, {"seq_len", c.T}};
}

std::unique_ptr<Network> GPT2Arch::make_network(Backend* be, int maxB, bool activation_checkpointing,
                                                const TensorParallel* tp, const PipelineStage* stage,
                                                const ContextParallel* cp, const ExpertParallel* ep) const {
  TR_CHECK(!ep, "parallel.expert_parallel: gpt2 has a dense MLP, no experts to split; set expert_parallel to 1");
  return std::make_unique<GPT2>(cfg_, be, maxB, activation_checkpointing, tp, stage, cp);
}

std::unique_ptr<Decoder> GPT2Arch::make_decoder(Backend* be, int capacity) const {
  return std::make_unique<GPT2Decoder>(cfg_, be, capacity);
}

size_t GPT2Arch::decoder_bytes_needed(const Backend& be, int capacity) const {
  return GPT2Decoder::bytes_needed(cfg_, be, capacity);
}

}  // namespace trainrun
