// The preset table (model_presets.h). Values are those of each model's
// Hugging Face config.json; seq_len is the context the model was
// pre-trained at (Llama 3.x: 8192, the rope_scaling's
// original_max_position_embeddings, not the 131072 its config.json allows
// after long-context training; GPT-2: 1024), a context a fine-tune can
// afford. A job spec may set a longer one.
#include "core/config/model_presets.h"

namespace trainrun {

namespace {

ModelSpec gpt2(int L, int NH, int C) {
  ModelSpec m;
  m.arch = "gpt2";
  m.n_layer = L;
  m.n_head = NH;
  m.n_embd = C;
  m.vocab_size = 50257;  // HF's config.json (llm.c pads to 50304 for speed; the tokenizer has 50257)
  m.seq_len = 1024;
  m.tie_embeddings = "true";
  return m;
}

// Llama 3.1/3.2: rms_norm_eps 1e-5, rope_theta 500000, 128256 tokens,
// rope_scaling llama3 (low 1, high 4, original 8192) with its factor.
ModelSpec llama3(int L, int C, int NH, int F, bool tied, double factor) {
  ModelSpec m;
  m.arch = "llama";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = 8;
  m.ffn_dim = F;
  m.vocab_size = 128256;
  m.seq_len = 8192;
  m.norm_eps = 1e-5;
  m.rope_theta = 500000;
  m.tie_embeddings = tied ? "true" : "false";
  m.rope_scaling.type = "llama3";
  m.rope_scaling.factor = factor;
  m.rope_scaling.low_freq_factor = 1;
  m.rope_scaling.high_freq_factor = 4;
  m.rope_scaling.original_max_position_embeddings = 8192;
  return m;
}

// Llama 2: rope_theta 10000, no scaling, 32000 tokens, 4096 positions.
ModelSpec llama2(int L, int C, int NH, int NKV, int F) {
  ModelSpec m;
  m.arch = "llama";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = NKV;
  m.ffn_dim = F;
  m.vocab_size = 32000;
  m.seq_len = 4096;
  m.norm_eps = 1e-5;
  m.rope_theta = 10000;
  m.tie_embeddings = "false";
  return m;
}

// Qwen2.5 (Qwen/Qwen2.5-*'s config.json): rope_theta 1e6, no rope_scaling,
// use_sliding_window false, q/k/v biases (the arch's). seq_len 32768: the
// context of Qwen2.5's long-context pre-training stage (0.5B's
// max_position_embeddings; 7B's and 72B's say 131072, reached with YaRN,
// which trainrun does not implement).
ModelSpec qwen25(int L, int C, int NH, int NKV, int F, int V, bool tied, double eps) {
  ModelSpec m;
  m.arch = "qwen2";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = NKV;
  m.ffn_dim = F;
  m.vocab_size = V;
  m.seq_len = 32768;
  m.norm_eps = eps;
  m.rope_theta = 1000000;
  m.tie_embeddings = tied ? "true" : "false";
  return m;
}

// Qwen3 (Qwen/Qwen3-*'s config.json): heads of 128 (head_dim), 8 KV heads,
// 151936 tokens, rms_norm_eps 1e-6, rope_theta 1e6, no rope_scaling;
// max_position_embeddings 40960, of which seq_len takes the 32768 of the
// last pre-training stage (Qwen3 technical report).
ModelSpec qwen3(int L, int C, int NH, int F, bool tied) {
  ModelSpec m;
  m.arch = "qwen3";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = 8;
  m.head_dim = 128;
  m.ffn_dim = F;
  m.vocab_size = 151936;
  m.seq_len = 32768;
  m.norm_eps = 1e-6;
  m.rope_theta = 1000000;
  m.tie_embeddings = tied ? "true" : "false";
  return m;
}

// Phi-3-mini-4k-instruct: 32064 tokens, rms_norm_eps 1e-5, rope_theta
// 10000, untied, no rope_scaling; max_position_embeddings 4096 with
// sliding_window 2047 (every layer; core/model/phi3/phi3_arch.h says how
// the tools apply it).
ModelSpec phi3_mini() {
  ModelSpec m;
  m.arch = "phi3";
  m.n_layer = 32;
  m.n_embd = 3072;
  m.n_head = 32;
  m.n_kv_head = 32;
  m.ffn_dim = 8192;
  m.vocab_size = 32064;
  m.seq_len = 4096;
  m.sliding_window = 2047;
  m.norm_eps = 1e-5;
  m.rope_theta = 10000;
  m.tie_embeddings = "false";
  return m;
}

// Mistral-7B-v0.3 (mistralai/Mistral-7B-v0.3's config.json): 32 layers of
// 4096, 32 heads over 8 KV heads, intermediate 14336, vocab 32768 (v0.3's
// extended vocabulary), rms_norm_eps 1e-5, rope_theta 1e6, untied,
// max_position_embeddings 32768 and sliding_window null: v0.2 and v0.3
// attend over the whole context (v0.1 had a 4096 window; model.init_from
// a v0.1 directory sets it).
ModelSpec mistral_7b_v03() {
  ModelSpec m;
  m.arch = "mistral";
  m.n_layer = 32;
  m.n_embd = 4096;
  m.n_head = 32;
  m.n_kv_head = 8;
  m.ffn_dim = 14336;
  m.vocab_size = 32768;
  m.seq_len = 32768;
  m.norm_eps = 1e-5;
  m.rope_theta = 1000000;
  m.tie_embeddings = "false";
  m.sliding_window = 0;
  return m;
}

// Gemma 2 (google/gemma-2-{2b,9b,27b}'s config.json): 256000 tokens, tied,
// rms_norm_eps 1e-6, rope_theta 10000, attn_logit_softcapping 50,
// final_logit_softcapping 30, sliding_window 4096 on the even layers,
// max_position_embeddings 8192. query_pre_attn_scalar is head_dim (256) in
// 2B and 9B, but 144 in 27B (= n_embd / n_head, not its head_dim 128).
// seq_len is the window, 4096: the attention ops do not implement the
// window yet (the network refuses a longer sequence), and up to it local and
// global layers compute the same function.
ModelSpec gemma2(int L, int C, int NH, int NKV, int HD, int F, double query_scale) {
  ModelSpec m;
  m.arch = "gemma2";
  m.n_layer = L;
  m.n_embd = C;
  m.n_head = NH;
  m.n_kv_head = NKV;
  m.head_dim = HD;
  m.ffn_dim = F;
  m.vocab_size = 256000;
  m.seq_len = 4096;
  m.norm_eps = 1e-6;
  m.rope_theta = 10000;
  m.tie_embeddings = "true";
  m.attn_softcap = 50;
  m.final_softcap = 30;
  m.query_scale = query_scale;
  m.sliding_window = 4096;
  return m;
}

// Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1's config.json): Llama's
// attention (32 heads, 8 KV heads, rope_theta 1e6, rms_norm_eps 1e-5,
// untied, 32000 tokens) and in every block 8 experts of 14336, top-2;
// sliding_window null, max_position_embeddings 32768 (seq_len). 46.7B
// parameters, 12.9B active per token.
ModelSpec mixtral_8x7b() {
  ModelSpec m;
  m.arch = "mixtral";
  m.n_layer = 32;
  m.n_embd = 4096;
  m.n_head = 32;
  m.n_kv_head = 8;
  m.ffn_dim = 14336;
  m.vocab_size = 32000;
  m.seq_len = 32768;
  m.norm_eps = 1e-5;
  m.rope_theta = 1000000;
  m.tie_embeddings = "false";
  m.n_experts = 8;
  m.n_experts_per_tok = 2;
  return m;
}

// Qwen1.5-MoE-A2.7B (Qwen/Qwen1.5-MoE-A2.7B's config.json): Qwen2's
// attention (16 heads, no GQA, q/k/v biases, rope_theta 1e6, rms_norm_eps
// 1e-6, untied, 151936 tokens), in every block 60 experts of 1408, top-4
// without renormalisation (norm_topk_prob false), a shared expert of 5632;
// max_position_embeddings 8192 (seq_len). 14.3B parameters, 2.7B active
// per token (the embeddings included).
ModelSpec qwen15_moe_a27b() {
  ModelSpec m;
  m.arch = "qwen2_moe";
  m.n_layer = 24;
  m.n_embd = 2048;
  m.n_head = 16;
  m.n_kv_head = 16;
  m.ffn_dim = 5632;
  m.vocab_size = 151936;
  m.seq_len = 8192;
  m.norm_eps = 1e-6;
  m.rope_theta = 1000000;
  m.tie_embeddings = "false";
  m.n_experts = 60;
  m.n_experts_per_tok = 4;
  m.moe_ffn_dim = 1408;
  m.shared_expert_ffn_dim = 5632;
  m.norm_topk_prob = "false";
  return m;
}

// Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json): Qwen3's attention (32
// heads of head_dim 128, 4 KV heads, qk-norm, rope_theta 1e6, rms_norm_eps
// 1e-6, untied, 151936 tokens), 48 blocks of 128 experts of 768, top-8
// renormalised (norm_topk_prob true), no shared expert, every layer sparse;
// max_position_embeddings 40960, seq_len the 32768 of pre-training.
// 30.5B parameters, 3.3B active per token (the embeddings included).
ModelSpec qwen3_30b_a3b() {
  ModelSpec m;
  m.arch = "qwen3_moe";
  m.n_layer = 48;
  m.n_embd = 2048;
  m.n_head = 32;
  m.n_kv_head = 4;
  m.head_dim = 128;
  m.ffn_dim = 6144;
  m.vocab_size = 151936;
  m.seq_len = 32768;
  m.norm_eps = 1e-6;
  m.rope_theta = 1000000;
  m.tie_embeddings = "false";
  m.n_experts = 128;
  m.n_experts_per_tok = 8;
  m.moe_ffn_dim = 768;
  m.norm_topk_prob = "true";
  return m;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> p = {
      {"llama3.2-1b", "meta-llama/Llama-3.2-1B", llama3(16, 2048, 32, 8192, true, 32)},
      {"llama3.2-3b", "meta-llama/Llama-3.2-3B", llama3(28, 3072, 24, 8192, true, 32)},
      {"llama3.1-8b", "meta-llama/Llama-3.1-8B", llama3(32, 4096, 32, 14336, false, 8)},
      {"llama3.1-70b", "meta-llama/Llama-3.1-70B", llama3(80, 8192, 64, 28672, false, 8)},
      {"llama2-7b", "meta-llama/Llama-2-7b-hf", llama2(32, 4096, 32, 32, 11008)},
      {"llama2-70b", "meta-llama/Llama-2-70b-hf", llama2(80, 8192, 64, 8, 28672)},
      {"qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", qwen25(24, 896, 14, 2, 4864, 151936, true, 1e-6)},
      {"qwen2.5-7b", "Qwen/Qwen2.5-7B", qwen25(28, 3584, 28, 4, 18944, 152064, false, 1e-6)},
      {"qwen2.5-72b", "Qwen/Qwen2.5-72B", qwen25(80, 8192, 64, 8, 29568, 152064, false, 1e-5)},
      {"qwen3-0.6b", "Qwen/Qwen3-0.6B", qwen3(28, 1024, 16, 3072, true)},
      {"qwen3-8b", "Qwen/Qwen3-8B", qwen3(36, 4096, 32, 12288, false)},
      {"qwen3-32b", "Qwen/Qwen3-32B", qwen3(64, 5120, 64, 25600, false)},
      {"phi3-mini", "microsoft/Phi-3-mini-4k-instruct", phi3_mini()},
      {"mistral-7b-v0.3", "mistralai/Mistral-7B-v0.3", mistral_7b_v03()},
      {"gemma2-2b", "google/gemma-2-2b", gemma2(26, 2304, 8, 4, 256, 9216, 256)},
      {"gemma2-9b", "google/gemma-2-9b", gemma2(42, 3584, 16, 8, 256, 14336, 256)},
      {"gemma2-27b", "google/gemma-2-27b", gemma2(46, 4608, 32, 16, 128, 36864, 144)},
      {"mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", mixtral_8x7b()},
      {"qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", qwen15_moe_a27b()},
      {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", qwen3_30b_a3b()},
      {"gpt2-124m", "openai-community/gpt2", gpt2(12, 12, 768)},
      {"gpt2-350m", "openai-community/gpt2-medium", gpt2(24, 16, 1024)},
      {"gpt2-774m", "openai-community/gpt2-large", gpt2(36, 20, 1280)},
      {"gpt2-1.5b", "openai-community/gpt2-xl", gpt2(48, 25, 1600)},
  };
  return p;
}

const ModelPreset* find_model_preset(const std::string& name) {
  for (const ModelPreset& p : model_presets())
    if (name == p.name) return &p;
  return nullptr;
}

std::string ambiguous_preset_message(const std::string& name) {
  if (name.empty() || find_model_preset(name)) return "";
  // "family-size" or "family": a preset matches when its family is the
  // name's or a point release of it (llama3 -> llama3.1, llama3.2) and, if
  // the name has a size, its size is that size.
  const size_t dash = name.rfind('-');
  const std::string family = dash == std::string::npos ? name : name.substr(0, dash);
  const std::string size = dash == std::string::npos ? "" : name.substr(dash + 1);
  std::string matches;
  int n = 0;
  for (const ModelPreset& p : model_presets()) {
    const std::string pn = p.name;
    const size_t pd = pn.rfind('-');
    const std::string pf = pn.substr(0, pd), ps = pn.substr(pd + 1);
    const bool family_fits = pf == family || pf.rfind(family + ".", 0) == 0;
    if (!family_fits || (!size.empty() && ps != size)) continue;
    matches += std::string(n++ ? ", " : "") + pn + " (" + p.source + ")";
  }
  if (n == 0) return "";
  // A family name without a point release has several (Meta's Llama 3 and
  // 3.1 differ in RoPE scaling and context at the same size); a bare family
  // has several sizes.
  const bool release_missing = family.find('.') == std::string::npos && family.rfind("llama3", 0) == 0;
  std::string why = size.empty() ? "it names a family, not one model"
                    : release_missing
                        ? "it does not say which Llama 3 release (3, 3.1 and 3.2 differ in RoPE scaling: "
                          "meta-llama/Meta-Llama-3-8B has none, Llama-3.1-8B scales x8)"
                        : "it names more than one release";
  return "'" + name + "' is ambiguous: " + why + "; presets are named exactly for the release they copy. Write one of: " +
         matches + " (for a model no preset names, point model.init_from at its Hugging Face directory)";
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> v;
  for (const ModelPreset& p : model_presets()) v.push_back(p.name);
  return v;
}

std::string model_presets_markdown() {
  std::string out =
      "| preset | arch | n_layer | n_embd | n_head | n_kv_head | head_dim | ffn_dim | vocab_size | seq_len | tied | "
      "rope_theta | rope_scaling | from |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const ModelPreset& p : model_presets()) {
    const ModelSpec& m = p.spec;
    const bool llama = m.arch != "gpt2";  // the Llama-shaped families' columns
    auto num = [](double v) {
      std::string s = std::to_string(v);
      s.erase(s.find_last_not_of('0') + 1);
      if (!s.empty() && s.back() == '.') s.pop_back();
      return s;
    };
    const std::string name = std::string("`") + p.name + "`";
    const std::string scaling = m.rope_scaling.type == "none"
                                    ? "none"
                                    : m.rope_scaling.type + " x" + num(m.rope_scaling.factor) + " (low " +
                                          num(m.rope_scaling.low_freq_factor) + ", high " +
                                          num(m.rope_scaling.high_freq_factor) + ", original " +
                                          std::to_string(m.rope_scaling.original_max_position_embeddings) + ")";
    // A mixture of experts: its experts in the arch column (ffn_dim is each expert's width).
    const std::string arch = m.n_experts > 0 ? m.arch + " (" + std::to_string(m.n_experts) + " experts, top-" +
                                                   std::to_string(m.n_experts_per_tok) + ")"
                                             : m.arch;
    out += "| " + name + " | " + arch + " | " + std::to_string(m.n_layer) + " | " + std::to_string(m.n_embd) +
           " | " + std::to_string(m.n_head) + " | " + (llama ? std::to_string(m.n_kv_head) : "-") + " | " +
           (m.head_dim ? std::to_string(m.head_dim) : "C/n_head") + " | " +
           (llama ? std::to_string(m.ffn_dim) : "4C") + " | " + std::to_string(m.vocab_size) + " | " +
           std::to_string(m.seq_len) + " | " + m.tie_embeddings + " | " + (llama ? num(m.rope_theta) : "-") +
           " | " + (llama ? scaling : "-") + " | " + p.source + " |\n";
  }
  return out;
}

}  // namespace trainrun
