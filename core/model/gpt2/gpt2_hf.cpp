// GPT-2's Hugging Face side (gpt2_arch.h): config.json both ways, tensor
// names and the Conv1D layouts, and the init_from shape check. The files
// themselves are read and written by core/checkpoint/hf_interop.cpp.
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/gpt2/gpt2_arch.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {
// The four matrices HF GPT-2 stores as Conv1D (in, out), the transpose of ours.
bool is_conv1d(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    const size_t n = std::strlen(s);
    if (name.size() >= n && name.compare(name.size() - n, n, s) == 0) return true;
  }
  return false;
}
}  // namespace

json GPT2Arch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c;
  c["architectures"] = {"GPT2LMHeadModel"};
  c["model_type"] = "gpt2";
  c["vocab_size"] = cfg.V;
  // Our position table has seq_len rows, so that is the longest context.
  c["n_positions"] = cfg.T;
  c["n_ctx"] = cfg.T;
  c["n_embd"] = cfg.C;
  c["n_layer"] = cfg.L;
  c["n_head"] = cfg.NH;
  c["n_inner"] = nullptr;                   // 4 * n_embd
  c["activation_function"] = "gelu_new";    // GELU, tanh approximation (ours)
  c["layer_norm_epsilon"] = 1e-5;
  c["initializer_range"] = cfg.init_std;
  // trainrun trains without dropout; 0 keeps a fine-tune in transformers the same regime.
  c["resid_pdrop"] = 0.0;
  c["embd_pdrop"] = 0.0;
  c["attn_pdrop"] = 0.0;
  c["scale_attn_weights"] = true;
  c["scale_attn_by_inverse_layer_idx"] = false;
  c["reorder_and_upcast_attn"] = false;
  c["tie_word_embeddings"] = true;
  c["use_cache"] = true;
  // GPT-2's BPE vocabulary (50257, or llm.c's padded 50304) has <|endoftext|>
  // at 50256; a byte-level or other vocabulary has no special tokens, and
  // GPT2Config's default 50256 would point outside it.
  if (cfg.V > 50256) {
    c["bos_token_id"] = 50256;
    c["eos_token_id"] = 50256;
  } else {
    c["bos_token_id"] = nullptr;
    c["eos_token_id"] = nullptr;
  }
  c["torch_dtype"] = "float32";
  return c;
}

ModelConfig gpt2_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  // Keys left out take transformers' GPT2Config defaults, as from_pretrained does.
  auto get_int = [&](const char* key, int dflt) {
    if (!c.contains(key) || c[key].is_null()) return dflt;
    TR_CHECK(c[key].is_number_integer(), what, ": '", path, "': ", key, " is not an integer: ", c[key].dump());
    return c[key].get<int>();
  };
  auto get_bool = [&](const char* key, bool dflt) {
    if (!c.contains(key) || c[key].is_null()) return dflt;
    TR_CHECK(c[key].is_boolean(), what, ": '", path, "': ", key, " is not true/false: ", c[key].dump());
    return c[key].get<bool>();
  };
  auto unsupported = [&](const std::string& key, const std::string& have, const std::string& need) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; trainrun's GPT-2 needs ", need,
            ", so these weights would compute a different function");
  };
  ModelConfig cfg;
  cfg.arch = "gpt2";
  cfg.V = get_int("vocab_size", 50257);
  cfg.T = get_int("n_positions", 1024);
  cfg.C = get_int("n_embd", 768);
  cfg.L = get_int("n_layer", 12);
  cfg.NH = get_int("n_head", 12);
  if (c.contains("initializer_range") && c["initializer_range"].is_number())
    cfg.init_std = c["initializer_range"].get<double>();
  TR_CHECK(cfg.V > 0 && cfg.T > 0 && cfg.C > 0 && cfg.L > 0 && cfg.NH > 0, what, ": '", path,
           "': vocab_size, n_positions, n_embd, n_layer and n_head must be positive");
  TR_CHECK(cfg.C % cfg.NH == 0, what, ": '", path, "': n_embd (", cfg.C, ") is not divisible by n_head (", cfg.NH,
           ")");
  const std::string act = c.contains("activation_function") && c["activation_function"].is_string()
                              ? c["activation_function"].get<std::string>()
                              : "gelu_new";
  // All three are GELU's tanh approximation (gelu_fast rounds sqrt(2/pi) to
  // 10 digits, far below fp32 resolution); "gelu" is the exact erf form.
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast")
    unsupported("activation_function", "\"" + act + "\"", "\"gelu_new\" (GELU, tanh approximation)");
  if (c.contains("layer_norm_epsilon") && !c["layer_norm_epsilon"].is_null()) {
    TR_CHECK(c["layer_norm_epsilon"].is_number(), what, ": '", path, "': layer_norm_epsilon is not a number: ",
             c["layer_norm_epsilon"].dump());
    const double eps = c["layer_norm_epsilon"].get<double>();
    if (std::fabs(eps - 1e-5) > 1e-11) unsupported("layer_norm_epsilon", c["layer_norm_epsilon"].dump(), "1e-05");
  }
  const int inner = get_int("n_inner", 4 * cfg.C);
  if (inner != 4 * cfg.C) unsupported("n_inner", std::to_string(inner), "null or 4 * n_embd = " + std::to_string(4 * cfg.C));
  if (!get_bool("scale_attn_weights", true)) unsupported("scale_attn_weights", "false", "true");
  if (get_bool("scale_attn_by_inverse_layer_idx", false)) unsupported("scale_attn_by_inverse_layer_idx", "true", "false");
  if (get_bool("add_cross_attention", false)) unsupported("add_cross_attention", "true", "false");
  if (!get_bool("tie_word_embeddings", true))
    unsupported("tie_word_embeddings", "false", "true (the LM head is transformer.wte)");
  return cfg;
}

// The block's GEMMs as GPT2 numbers them: 0 c_attn (q|k|v), 1 attn.c_proj,
// 2 mlp.c_fc, 3 mlp.c_proj (gpt2.cpp's block_forward). HF's Conv1D stores
// the weights (in, out), but an adapter's A (r, in) and B (out, r) are the
// same as on a Linear (peft's fan_in_fan_out only transposes the base).
std::vector<BlockLinear> GPT2Arch::block_linears() const {
  const int64_t C = cfg_.C;
  return {{"attn.c_attn", 0, C, 3 * C, 0}, {"attn.c_proj", 1, C, C, 0}, {"mlp.c_fc", 2, C, 4 * C, 0},
          {"mlp.c_proj", 3, 4 * C, C, 0}};
}
std::string GPT2Arch::hf_block_prefix(int layer) const { return "transformer.h." + std::to_string(layer) + "."; }

HfTensor GPT2Arch::hf_tensor(const ParamTensor& t) const {
  if (is_conv1d(t.name)) return {t.name, true, "Hugging Face Conv1D layout: in, out"};
  return {t.name, false, ""};
}

// GPT2LMHeadModel writes the "transformer." prefix, GPT2Model (and the
// original OpenAI-converted files) do not, and from_pretrained accepts both.
std::string GPT2Arch::hf_canonical_name(const std::string& n) const {
  return n.rfind("transformer.", 0) == 0 ? n.substr(12) : n;
}

// The causal-mask buffers older transformers versions saved with the weights.
bool GPT2Arch::hf_ignored_buffer(const std::string& key) const {
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return key.size() >= n && key.compare(key.size() - n, n, s) == 0;
  };
  return ends(".attn.bias") || ends(".attn.masked_bias");
}

void GPT2Arch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  const std::string what = "model.init_from";
  auto same = [&](const char* field, int job, const char* key, int have) {
    TR_CHECK(job == have, what, ": '", dir, "' holds a GPT-2 with ", key, " = ", have, " (config.json) but model.",
             field, " is ", job, "; set model.", field, ": ", have,
             " (the job's model.* must describe the weights it starts from)");
  };
  same("n_layer", cfg_.L, "n_layer", hf.L);
  same("n_head", cfg_.NH, "n_head", hf.NH);
  same("n_embd", cfg_.C, "n_embd", hf.C);
  same("vocab_size", cfg_.V, "vocab_size", hf.V);
  // Fine-tuning GPT-2 at a shorter context keeps the first seq_len rows of the position table.
  TR_CHECK(cfg_.T <= hf.T, what, ": '", dir, "' holds a GPT-2 with n_positions = ", hf.T,
           " (config.json) but model.seq_len is ", cfg_.T, "; set model.seq_len to at most ", hf.T,
           " (its position table has no rows beyond that)");
}

}  // namespace trainrun
