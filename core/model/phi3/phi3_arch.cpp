// Phi-3's description (phi3_arch.h): Llama's layout and network, Phi-3's
// config.json (Phi3Config's keys and defaults, transformers 4.44) and its
// fused tensors in the files.
#include "core/model/phi3/phi3_arch.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/common/error.h"

using json = nlohmann::ordered_json;

namespace trainrun {

namespace {

bool ends_with(const std::string& n, const std::string& suf) {
  return n.size() >= suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0;
}

// "model.layers.3.self_attn.q_proj.weight" -> "model.layers.3."
std::string block_prefix(const std::string& name, const std::string& module) {
  return name.substr(0, name.size() - module.size());
}

}  // namespace

Phi3Arch::Phi3Arch(const ModelConfig& cfg) : LlamaArch(cfg, "phi3") {
  TR_CHECK(cfg.arch == "phi3", "model.arch: '", cfg.arch, "' given to the phi3 architecture (a bug)");
  TR_CHECK(cfg.sliding_window >= 0, "model.sliding_window must be 0 (none) or positive (got ", cfg.sliding_window, ")");
  // longrope's factor list, chosen once for the model (phi3_arch.h): the
  // long factors when its context passes the original one. This is
  // transformers' choice for a full-length forward (max(position_ids) + 1 =
  // T), so training matches it; the decoder uses the same table.
  if (cfg_.rope_scaling.longrope())
    cfg_.rope_scaling.use_long = cfg_.T > cfg_.rope_scaling.original_max_position_embeddings;
}

std::string longrope_factors_text(const std::vector<double>& v) {
  std::string out;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, "%.17g", x);
    out += (out.empty() ? "" : ",") + std::string(buf);
  }
  return out;
}

namespace {

// "1,1.5, 2" -> {1, 1.5, 2}; `key` names the list in every error.
std::vector<double> parse_factors(const std::string& text, const std::string& key, const std::string& what) {
  std::vector<double> v;
  TR_CHECK(!text.empty(), what, key, " is empty; longrope needs head_dim / 2 positive numbers (config.json's "
           "rope_scaling lists; model.init_from fills them)");
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    const std::string t = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    char* end = nullptr;
    const double x = t.empty() ? 0 : std::strtod(t.c_str(), &end);
    TR_CHECK(!t.empty() && end == t.c_str() + t.size() && std::isfinite(x) && x > 0, what, key, ": value ",
             v.size() + 1, " ('", t, "') is not a positive number; each factor divides a RoPE frequency");
    v.push_back(x);
    at = comma + 1;
  }
  return v;
}

}  // namespace

void longrope_from_spec(const ModelSpec& m, ModelConfig& c) {
  TR_CHECK(c.arch == "phi3", "model.rope_scaling.type: longrope; ", c.arch, " has no longrope scaling in trainrun "
           "(Phi-3's); use model.arch: phi3, or model.rope_scaling.type none / llama3");
  RopeScaling& r = c.rope_scaling;
  r.short_factor = parse_factors(m.rope_scaling.short_factor, "model.rope_scaling.short_factor", "");
  r.long_factor = parse_factors(m.rope_scaling.long_factor, "model.rope_scaling.long_factor", "");
  const size_t half = c.NH > 0 ? size_t(c.head_size() / 2) : 0;
  for (const auto& [key, list] : {std::make_pair("short_factor", &r.short_factor),
                                  std::make_pair("long_factor", &r.long_factor)})
    TR_CHECK(list->size() == half, "model.rope_scaling.", key, " has ", list->size(), " values; head_dim / 2 = ",
             half, " are needed (one per RoPE frequency of the ", c.head_size(), "-wide heads)");
  r.max_position_embeddings = m.rope_scaling.max_position_embeddings > 0 ? m.rope_scaling.max_position_embeddings
                                                                         : m.seq_len;
}

std::map<std::string, std::string> Phi3Arch::file_metadata() const {
  std::map<std::string, std::string> m = LlamaArch::file_metadata();
  if (cfg_.rope_scaling.longrope()) {  // the rest of rope_scaling.* is Llama's (type, original context)
    m["rope_scaling.short_factor"] = longrope_factors_text(cfg_.rope_scaling.short_factor);
    m["rope_scaling.long_factor"] = longrope_factors_text(cfg_.rope_scaling.long_factor);
    m["rope_scaling.max_position_embeddings"] = std::to_string(cfg_.rope_scaling.max_position_embeddings);
  }
  return m;
}

json Phi3Arch::manifest_model() const {
  json m = LlamaArch::manifest_model();
  m["sliding_window"] = cfg_.sliding_window;
  if (cfg_.rope_scaling.longrope()) {
    m["rope_scaling"]["short_factor"] = cfg_.rope_scaling.short_factor;
    m["rope_scaling"]["long_factor"] = cfg_.rope_scaling.long_factor;
    m["rope_scaling"]["max_position_embeddings"] = cfg_.rope_scaling.max_position_embeddings;
  }
  return m;
}

std::unique_ptr<ModelArch> make_phi3_arch(const ModelConfig& cfg) { return std::make_unique<Phi3Arch>(cfg); }

ModelConfig phi3_config_from_hf(const json& c, const std::string& path, const std::string& what) {
  auto has = [&](const char* key) { return c.contains(key) && !c[key].is_null(); };
  auto refuse = [&](const std::string& key, const std::string& have, const std::string& why) {
    TR_FAIL(what, ": '", path, "' has ", key, " = ", have, "; ", why);
  };
  // Phi-3's RoPE scaling, read here: Llama's reader would call it an
  // unknown Llama scaling.
  RopeScaling longrope;
  if (has("rope_scaling")) {
    const json& s = c["rope_scaling"];
    TR_CHECK(s.is_object(), what, ": '", path, "': rope_scaling is not an object: ", s.dump());
    const char* tkey = s.contains("type") ? "type" : "rope_type";
    const std::string type = s.contains(tkey) && s[tkey].is_string() ? s[tkey].get<std::string>() : s.dump();
    if (type == "yarn")
      refuse("rope_scaling.type", "\"yarn\"",
             "transformers 4.44 computes it as \"longrope\" (sqrt attention factor) although Phi-3's YaRN uses "
             "0.1 ln(s) + 1; trainrun does not guess which was meant: set \"longrope\" if that is the model");
    if (type != "longrope" && type != "su")
      refuse("rope_scaling.type", "\"" + type + "\"",
             "trainrun's Phi-3 implements \"longrope\" (also read from its older name \"su\") or none, so these "
             "weights would compute a different function");
    auto factors = [&](const char* key) {
      TR_CHECK(s.contains(key) && s[key].is_array(), what, ": '", path, "': rope_scaling (longrope) has no list ", key);
      std::vector<double> v;
      for (const auto& x : s[key]) {
        TR_CHECK(x.is_number() && x.get<double>() > 0, what, ": '", path, "': rope_scaling.", key,
                 " holds a value that is not a positive number: ", x.dump());
        v.push_back(x.get<double>());
      }
      return v;
    };
    longrope.short_factor = factors("short_factor");
    longrope.long_factor = factors("long_factor");
    longrope.original_max_position_embeddings = 4096;  // Phi3Config's default
    if (has("original_max_position_embeddings")) {
      TR_CHECK(c["original_max_position_embeddings"].is_number_integer() &&
                   c["original_max_position_embeddings"].get<int64_t>() >= 2 &&
                   c["original_max_position_embeddings"].get<int64_t>() < (int64_t(1) << 31),
               what, ": '", path, "': original_max_position_embeddings is not an integer >= 2: ",
               c["original_max_position_embeddings"].dump());
      longrope.original_max_position_embeddings = c["original_max_position_embeddings"].get<int>();
    }
  }
  // Phi3Config's defaults where they are not LlamaConfig's; the rest is Llama's reading.
  json l = c;
  l.erase("rope_scaling");
  auto dflt = [&](const char* key, json v) {
    if (!l.contains(key) || l[key].is_null()) l[key] = std::move(v);
  };
  dflt("vocab_size", 32064);
  dflt("hidden_size", 3072);
  dflt("intermediate_size", 8192);
  dflt("num_hidden_layers", 32);
  dflt("num_attention_heads", 32);
  dflt("max_position_embeddings", 4096);
  dflt("rms_norm_eps", 1e-5);
  dflt("rope_theta", 10000.0);
  dflt("tie_word_embeddings", false);
  ModelConfig cfg = llama_config_from_hf(l, path, what);
  cfg.arch = "phi3";
  if (longrope.longrope()) {
    const size_t half = size_t(cfg.C / cfg.NH / 2);
    for (const auto* key : {"short_factor", "long_factor"}) {
      const size_t n = (key[0] == 's' ? longrope.short_factor : longrope.long_factor).size();
      TR_CHECK(n == half, what, ": '", path, "': rope_scaling.", key, " has ", n,
               " values; hidden_size / num_attention_heads / 2 = ", half, " are needed (one per RoPE frequency)");
    }
    longrope.max_position_embeddings = cfg.T;  // the attention factor's numerator
    cfg.rope_scaling_type = "longrope";
    cfg.rope_scaling = longrope;
  }
  if (has("sliding_window")) {
    TR_CHECK(c["sliding_window"].is_number_integer() && c["sliding_window"].get<int64_t>() > 0 &&
                 c["sliding_window"].get<int64_t>() < (int64_t(1) << 31),
             what, ": '", path, "': sliding_window is not a positive integer: ", c["sliding_window"].dump());
    cfg.sliding_window = c["sliding_window"].get<int>();
  }
  return cfg;
}

ModelConfig phi3_config_from_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  ModelConfig c = llama_config_from_metadata(meta, path);
  c.arch = "phi3";
  if (c.rope_scaling_type == "longrope") {
    auto text = [&](const char* key) -> const std::string& {
      auto it = meta.find(key);
      TR_CHECK(it != meta.end(), path, ": missing __metadata__ key '", key, "' of a longrope Phi-3; this file was "
               "not written by trainrun (or an older version)");
      return it->second;
    };
    const std::string what = path + ": __metadata__ ";
    c.rope_scaling.short_factor = parse_factors(text("rope_scaling.short_factor"), "rope_scaling.short_factor", what);
    c.rope_scaling.long_factor = parse_factors(text("rope_scaling.long_factor"), "rope_scaling.long_factor", what);
    const std::string& mp = text("rope_scaling.max_position_embeddings");
    c.rope_scaling.max_position_embeddings = std::atoi(mp.c_str());
    TR_CHECK(c.rope_scaling.max_position_embeddings >= 1 && std::to_string(c.rope_scaling.max_position_embeddings) == mp,
             what, "key 'rope_scaling.max_position_embeddings' is not a positive integer: '", mp, "'");
  }
  return c;
}

json Phi3Arch::hf_config_json() const {
  const ModelConfig& cfg = cfg_;
  json c;
  c["architectures"] = {"Phi3ForCausalLM"};
  c["model_type"] = "phi3";
  c["vocab_size"] = cfg.V;
  c["hidden_size"] = cfg.C;
  c["intermediate_size"] = cfg.F;
  c["num_hidden_layers"] = cfg.L;
  c["num_attention_heads"] = cfg.NH;
  c["num_key_value_heads"] = cfg.kv_heads();
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = cfg.norm_eps;
  c["rope_theta"] = cfg.rope_theta;
  c["rope_scaling"] = nullptr;
  if (cfg.rope_scaling.longrope())
    c["rope_scaling"] = {{"type", "longrope"},
                         {"short_factor", cfg.rope_scaling.short_factor},
                         {"long_factor", cfg.rope_scaling.long_factor}};
  c["tie_word_embeddings"] = cfg.tied;
  c["resid_pdrop"] = 0.0;
  c["embd_pdrop"] = 0.0;
  c["attention_dropout"] = 0.0;
  // Our seq_len is the context we trained at (a fine-tune keeps its
  // source's longer one: hf_carry_over). Unscaled, the original context is
  // the same (Phi-3-mini-4k has 4096 for both).
  c["max_position_embeddings"] = cfg.T;
  c["original_max_position_embeddings"] = cfg.T;
  if (cfg.rope_scaling.longrope()) {
    // Both set the attention factor (rope_table.h): the ones read.
    c["max_position_embeddings"] = cfg.rope_scaling.max_position_embeddings;
    c["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings;
  }
  // The window (model.sliding_window) or null: full causal attention.
  c["sliding_window"] = cfg.sliding_window > 0 ? json(cfg.sliding_window) : json(nullptr);
  c["initializer_range"] = cfg.init_std;
  c["use_cache"] = true;
  // Phi3Config's defaults name Phi-3's tokenizer's ids (1, 32000); a model
  // trained here from scratch has none known, a fine-tune carries its source's.
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["pad_token_id"] = nullptr;
  c["torch_dtype"] = "float32";
  return c;
}

void Phi3Arch::hf_carry_over(const json& source, json& out) const {
  LlamaArch::hf_carry_over(source, out);  // token ids, a longer max_position_embeddings
  for (const char* key : {"original_max_position_embeddings", "sliding_window"})
    if (source.contains(key)) out[key] = source[key];
}

HfTensor Phi3Arch::hf_tensor(const ParamTensor& t) const {
  const int64_t C = cfg_.C, F = cfg_.F, KV = int64_t(cfg_.kv_heads()) * cfg_.head_size();
  const std::string qkv_note =
      "Phi-3's fused q|k|v: (num_attention_heads + 2 * num_key_value_heads) * head_dim rows, hidden_size columns";
  const std::string mlp_note = "Phi-3's fused gate|up: 2 * intermediate_size rows, hidden_size columns";
  struct Part {
    const char* ours;
    const char* fused;
    int64_t row, rows;
    const std::string& note;
  };
  const Part parts[] = {{"self_attn.q_proj.weight", "self_attn.qkv_proj.weight", 0, C + 2 * KV, qkv_note},
                        {"self_attn.k_proj.weight", "self_attn.qkv_proj.weight", C, C + 2 * KV, qkv_note},
                        {"self_attn.v_proj.weight", "self_attn.qkv_proj.weight", C + KV, C + 2 * KV, qkv_note},
                        {"mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0, 2 * F, mlp_note},
                        {"mlp.up_proj.weight", "mlp.gate_up_proj.weight", F, 2 * F, mlp_note}};
  for (const Part& p : parts)
    if (ends_with(t.name, std::string(".") + p.ours)) {
      HfTensor h;
      h.name = block_prefix(t.name, p.ours) + p.fused;
      h.layout_note = p.note;
      h.fused_row = p.row;
      h.fused_rows = p.rows;
      return h;
    }
  return {t.name, false, ""};
}

// Phi3DecoderLayer registers self_attn (o_proj before qkv_proj), mlp
// (gate_up_proj, down_proj), then the two norms. q, k, v (gate, up) are
// adjacent in row order: export writes them as one fused tensor.
std::vector<const ParamTensor*> Phi3Arch::hf_save_order() const {
  std::vector<const ParamTensor*> order = {&layout_.get("model.embed_tokens.weight")};
  for (int l = 0; l < cfg_.L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* n : {"self_attn.o_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                          "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"})
      order.push_back(&layout_.get(p + n));
  }
  order.push_back(&layout_.get("model.norm.weight"));
  if (!cfg_.tied) order.push_back(&layout_.get("lm_head.weight"));
  TR_CHECK(order.size() == layout_.tensors.size(), "phi3: hf_save_order misses a layout tensor (a bug)");
  return order;
}

std::vector<ShapeKey> Phi3Arch::shape_keys() const {
  std::vector<ShapeKey> k;
  for (const ShapeKey& s : LlamaArch::shape_keys()) {
    const std::string f = s.field;
    // longrope has no llama3 factors; its type key is config.json's "type" (or "su").
    if (f == "model.rope_scaling.factor" || f == "model.rope_scaling.low_freq_factor" ||
        f == "model.rope_scaling.high_freq_factor")
      continue;
    if (f == "model.rope_scaling.type") {
      k.push_back({s.field, "rope_scaling.type"});
      continue;
    }
    if (f == "model.rope_scaling.original_max_position_embeddings") {
      k.push_back({s.field, "original_max_position_embeddings"});
      continue;
    }
    k.push_back(s);
  }
  if (cfg_.rope_scaling.longrope())
    k.insert(k.end(), {{"model.rope_scaling.short_factor", "rope_scaling.short_factor"},
                       {"model.rope_scaling.long_factor", "rope_scaling.long_factor"},
                       {"model.rope_scaling.max_position_embeddings", "max_position_embeddings"}});
  k.push_back({"model.sliding_window", "sliding_window"});
  return k;
}

void Phi3Arch::check_init_from(const ModelConfig& hf, const std::string& dir) const {
  LlamaArch::check_init_from(hf, dir);  // model.sliding_window, rope_scaling.type and the original context included
  if (!hf.rope_scaling.longrope()) return;
  const RopeScaling &mine = cfg_.rope_scaling, &theirs = hf.rope_scaling;
  for (const auto& [key, a, b] : {std::make_tuple("short_factor", &mine.short_factor, &theirs.short_factor),
                                  std::make_tuple("long_factor", &mine.long_factor, &theirs.long_factor)})
    TR_CHECK(*a == *b, "model.init_from: '", dir, "' holds a Phi-3 whose rope_scaling.", key, " is [",
             longrope_factors_text(*b), "] (config.json) but model.rope_scaling.", key, " is [",
             longrope_factors_text(*a), "]; remove model.rope_scaling.", key,
             " to take the directory's (the job's model.* must describe the weights it starts from)");
  TR_CHECK(mine.max_position_embeddings == theirs.max_position_embeddings, "model.init_from: '", dir,
           "' holds a longrope Phi-3 with max_position_embeddings = ", theirs.max_position_embeddings,
           " (config.json; its attention factor) but model.rope_scaling.max_position_embeddings is ",
           mine.max_position_embeddings, "; remove it to take the directory's");
}

}  // namespace trainrun
