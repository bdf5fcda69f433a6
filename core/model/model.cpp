// The model interface's shared parts (model.h): configs from a job spec,
// the common rules, layouts, and the registry of architectures: the one
// place where a name becomes an implementation.
#include "core/model/model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <utility>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/model/gpt2/gpt2_arch.h"
#include "core/model/llama/llama_arch.h"
#include "core/model/qwen2/qwen2_arch.h"
#include "core/model/qwen3/qwen3_arch.h"
#include "core/model/phi3/phi3_arch.h"
#include "core/model/gemma2/gemma2_arch.h"
#include "core/model/mixtral/mixtral_arch.h"
#include "core/model/qwen2_moe/qwen2_moe_arch.h"
#include "core/model/qwen3_moe/qwen3_moe_arch.h"
#include "core/model/mistral/mistral_arch.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace trainrun {

// ---- the registry ---------------------------------------------------------------------------

namespace {

struct ArchEntry {
  const char* name;           // model.arch
  const char* hf_model_type;  // config.json's model_type
  bool implemented;           // has a network: trains (else a description only: `trainrun plan`)
  bool loads_hf;              // Hugging Face directories load into it (model.init_from)
  std::unique_ptr<ModelArch> (*make)(const ModelConfig&);
  ModelConfig (*from_hf)(const json&, const std::string& path, const std::string& what);
  ModelConfig (*from_metadata)(const std::map<std::string, std::string>&, const std::string& path);
};

const std::vector<ArchEntry>& registry() {
  static const std::vector<ArchEntry> r = {
      {"gpt2", "gpt2", true, true, make_gpt2_arch, gpt2_config_from_hf, gpt2_config_from_metadata},
      {"llama", "llama", true, true, make_llama_arch, llama_config_from_hf, llama_config_from_metadata},
      {"qwen2", "qwen2", true, true, make_qwen2_arch, qwen2_config_from_hf, llama_config_from_metadata},
      {"qwen3", "qwen3", true, true, make_qwen3_arch, qwen3_config_from_hf, qwen3_config_from_metadata},
      {"phi3", "phi3", true, true, make_phi3_arch, phi3_config_from_hf, phi3_config_from_metadata},
      {"mixtral", "mixtral", true, true, make_mixtral_arch, mixtral_config_from_hf, mixtral_config_from_metadata},
      {"qwen2_moe", "qwen2_moe", true, true, make_qwen2_moe_arch, qwen2_moe_config_from_hf,
       qwen2_moe_config_from_metadata},
      {"qwen3_moe", "qwen3_moe", true, true, make_qwen3_moe_arch, qwen3_moe_config_from_hf,
       qwen3_moe_config_from_metadata},
      {"mistral", "mistral", true, true, make_mistral_arch, mistral_config_from_hf, mistral_config_from_metadata},
      {"gemma2", "gemma2", true, true, make_gemma2_arch, gemma2_config_from_hf, gemma2_config_from_metadata},
  };
  return r;
}

const ArchEntry* find_entry(const std::string& name) {
  for (const auto& e : registry())
    if (name == e.name) return &e;
  return nullptr;
}

std::string join_names(bool implemented_only, const char* quote = "") {
  std::string s;
  for (const auto& e : registry())
    if (!implemented_only || e.implemented) s += (s.empty() ? "" : ", ") + std::string(quote) + e.name + quote;
  return s;
}

// `only "gpt2" can be loaded`: the HF model types trainrun can import.
std::string loadable_types() {
  std::string s;
  for (const auto& e : registry())
    if (e.loads_hf) s += (s.empty() ? "\"" : ", \"") + std::string(e.hf_model_type) + "\"";
  return s;
}

}  // namespace

std::vector<std::string> model_arch_names() {
  std::vector<std::string> v;
  for (const auto& e : registry()) v.push_back(e.name);
  return v;
}

std::string arch_for_hf_model_type(const std::string& model_type) {
  for (const auto& e : registry())
    if (model_type == e.hf_model_type) return e.name;
  return "";
}

std::unique_ptr<ModelArch> make_model_arch(const ModelConfig& cfg) {
  const ArchEntry* e = find_entry(cfg.arch);
  TR_CHECK(e, "model.arch: unknown architecture '", cfg.arch, "'; known: ", join_names(false));
  return e->make(cfg);  // the arch checks the common rules and its own
}

// ---- configuration -------------------------------------------------------------------

namespace {
// model.arch auto: the model_type of model.init_from's config.json, else
// gpt2. A directory that cannot be read resolves to gpt2 and load_init_from
// then names what is wrong with it.
std::string resolve_arch(const ModelSpec& m) {
  if (m.arch != "auto") return m.arch;
  if (m.init_from.empty()) return "gpt2";
  const std::string path = (fs::path(m.init_from) / "config.json").string();
  std::ifstream f(path);
  if (!f) return "gpt2";
  json c;
  try {
    c = json::parse(f);
  } catch (const std::exception&) {
    return "gpt2";
  }
  if (!c.is_object() || !c.contains("model_type") || !c["model_type"].is_string()) return "gpt2";
  const std::string mt = c["model_type"].get<std::string>();
  const std::string arch = arch_for_hf_model_type(mt);
  TR_CHECK(!arch.empty(), "model.init_from: '", path, "' has model_type \"", mt,
           "\", an architecture trainrun does not know (model.arch: auto follows the directory); only ",
           loadable_types(), " can be loaded");
  const ArchEntry* e = find_entry(arch);
  TR_CHECK(e->loads_hf, "model.init_from: '", path, "' has model_type \"", mt, "\" (model.arch: auto): importing ",
           arch, " from Hugging Face is not implemented yet; only ", loadable_types(), " can be loaded");
  return arch;
}
}  // namespace

ModelConfig ModelConfig::from_spec(const ModelSpec& m) {
  ModelConfig c;
  c.arch = resolve_arch(m);
  const ArchEntry* e = find_entry(c.arch);
  TR_CHECK(e, "model.arch: unknown architecture '", c.arch, "'; known: ", join_names(false), " (or auto)");
  // The spec has GPT-2's shape fields only; Llama's come with its model.
  TR_CHECK(e->implemented, "model.arch: ", c.arch, " is not implemented yet; use model.arch: ", join_names(true),
           " (a ", c.arch, " shape can be planned: trainrun plan --model ", c.arch, ":...)");
  c.L = m.n_layer;
  c.NH = m.n_head;
  c.C = m.n_embd;
  c.V = m.vocab_size;
  c.T = m.seq_len;
  c.init_std = m.init_std;
  c.NKV = m.n_kv_head;
  c.F = m.ffn_dim;
  // A window is the model's, not a training choice: only an arch whose
  // config.json has one takes it from the spec (mistral, mixtral and phi3: every
  // layer; gemma2: its even layers).
  const bool windowed_arch = c.arch == "mistral" || c.arch == "phi3" || c.arch == "gemma2" || c.arch == "mixtral";
  TR_CHECK(m.sliding_window == 0 || windowed_arch, "model.sliding_window: ", m.sliding_window, "; ", c.arch,
           " has no sliding window in trainrun (0 = none); use model.arch: mistral, mixtral, phi3 or gemma2 for a windowed "
           "model");
  c.sliding_window = m.sliding_window;
  // Mixture of experts: the MoE families read these (their arch checks them); a dense family refuses experts.
  c.moe.n_experts = m.n_experts;
  c.moe.top_k = m.n_experts_per_tok;
  c.moe.aux_loss_coef = m.router_aux_loss_coef;
  c.moe.z_loss_coef = m.router_z_loss_coef;
  c.moe.ffn = m.moe_ffn_dim;
  c.moe.shared_ffn = m.shared_expert_ffn_dim;
  // auto: the arch's default (its constructor's); true/false set here and checked by the arch.
  c.moe.norm_topk_prob = m.norm_topk_prob == "true";
  c.moe.norm_topk_auto = m.norm_topk_prob == "auto";
  const bool moe_arch = c.arch == "mixtral" || c.arch == "qwen2_moe" || c.arch == "qwen3_moe";
  TR_CHECK(m.n_experts == 0 || moe_arch, "model.n_experts: ", m.n_experts, "; ", c.arch,
           " has a dense MLP (0); use model.arch: mixtral, qwen2_moe or qwen3_moe for a mixture of experts");
  TR_CHECK(m.moe_balance == "aux_loss" || m.n_experts > 0, "model.moe_balance: ", m.moe_balance, "; ", c.arch,
           " has no experts to balance (model.n_experts 0); use aux_loss, or a mixture of experts");
  c.moe.bias_rate = m.moe_balance == "bias" ? m.moe_bias_update_rate : 0.0;
  const bool scaled = m.rope_scaling.type != "none";
  if (c.arch == "gpt2") {
    // GPT-2 has none of Llama's knobs: a value that would change the model
    // is refused rather than ignored.
    TR_CHECK(m.n_kv_head == 0 || m.n_kv_head == m.n_head, "model.n_kv_head: ", m.n_kv_head,
             "; gpt2 has no grouped-query attention (0 or n_head = ", m.n_head, "); use model.arch: llama for GQA");
    TR_CHECK(m.ffn_dim == 0 || m.ffn_dim == 4 * m.n_embd, "model.ffn_dim: ", m.ffn_dim, "; gpt2's MLP is 4 * n_embd = ",
             4 * m.n_embd, " (0 = that)");
    TR_CHECK(m.tie_embeddings != "false", "model.tie_embeddings: false; gpt2's LM head is always the token embedding");
    TR_CHECK(!scaled, "model.rope_scaling.type: ", m.rope_scaling.type, "; gpt2 has learned positions, not RoPE");
    TR_CHECK(m.head_dim == 0 || m.head_dim * m.n_head == m.n_embd, "model.head_dim: ", m.head_dim,
             "; gpt2's heads are n_embd / n_head wide (0 = that)");
  } else {
    c.norm_eps = m.norm_eps;
    c.rope_theta = m.rope_theta;
    c.head_dim = m.head_dim;
    c.tied = m.tie_embeddings == "true";
    if (scaled) {
      c.rope_scaling_type = m.rope_scaling.type;
      c.rope_scaling.factor = m.rope_scaling.factor;
      c.rope_scaling.low_freq_factor = m.rope_scaling.low_freq_factor;
      c.rope_scaling.high_freq_factor = m.rope_scaling.high_freq_factor;
      c.rope_scaling.original_max_position_embeddings = m.rope_scaling.original_max_position_embeddings;
    }
    if (m.rope_scaling.type == "longrope") longrope_from_spec(m, c);  // Phi-3's lists (phi3_arch.h)
  }
  // Gemma 2's soft-caps and query scale: refused by name elsewhere rather than ignored.
  if (c.arch == "gemma2") {
    c.attn_softcap = float(m.attn_softcap);
    c.final_softcap = float(m.final_softcap);
    c.query_scale = m.query_scale;
  } else {
    const std::pair<const char*, double> gemma2_only[] = {
        {"attn_softcap", m.attn_softcap}, {"final_softcap", m.final_softcap}, {"query_scale", m.query_scale}};
    for (const auto& [key, v] : gemma2_only)
      TR_CHECK(v == 0, "model.", key, ": ", v, "; ", c.arch, " has no ", key,
               " (Gemma 2's: use model.arch: gemma2, or 0 = off)");
  }
  return c;
}

ModelSpec ModelConfig::to_spec() const {
  ModelSpec m;
  m.arch = arch;
  m.n_layer = L;
  m.n_head = NH;
  m.n_kv_head = NKV;
  m.n_embd = C;
  m.ffn_dim = F;
  m.vocab_size = V;
  m.seq_len = T;
  m.init_std = init_std;
  m.norm_eps = norm_eps;
  m.rope_theta = rope_theta;
  m.head_dim = head_dim;
  // the others' windows are not the spec's (from_spec)
  m.sliding_window = arch == "mistral" || arch == "phi3" || arch == "gemma2" ? sliding_window : 0;
  m.tie_embeddings = tied ? "true" : "false";
  m.attn_softcap = attn_softcap;
  m.final_softcap = final_softcap;
  m.query_scale = query_scale;
  m.n_experts = moe.n_experts;
  m.n_experts_per_tok = moe.top_k;
  m.router_aux_loss_coef = moe.aux_loss_coef;
  m.moe_ffn_dim = moe.on() ? moe.ffn : 0;
  m.shared_expert_ffn_dim = moe.shared_ffn;
  m.norm_topk_prob = !moe.on() ? "auto" : moe.norm_topk_prob ? "true" : "false";
  m.router_z_loss_coef = moe.z_loss_coef;
  m.moe_balance = moe.bias_rate > 0 ? "bias" : "aux_loss";
  if (moe.bias_rate > 0) m.moe_bias_update_rate = moe.bias_rate;
  m.rope_scaling.type = rope_scaling_type.empty() ? "none" : rope_scaling_type;
  if (!rope_scaling_type.empty()) {
    m.rope_scaling.factor = rope_scaling.factor;
    m.rope_scaling.low_freq_factor = rope_scaling.low_freq_factor;
    m.rope_scaling.high_freq_factor = rope_scaling.high_freq_factor;
    m.rope_scaling.original_max_position_embeddings = rope_scaling.original_max_position_embeddings;
  }
  if (rope_scaling.longrope()) {
    m.rope_scaling.short_factor = longrope_factors_text(rope_scaling.short_factor);
    m.rope_scaling.long_factor = longrope_factors_text(rope_scaling.long_factor);
    m.rope_scaling.max_position_embeddings = rope_scaling.max_position_embeddings;
  }
  return m;
}

ModelConfig ModelConfig::of(int L, int NH, int C, int V, int T, double init_std) {
  ModelConfig c;
  c.arch = "gpt2";
  c.L = L;
  c.NH = NH;
  c.C = C;
  c.V = V;
  c.T = T;
  c.init_std = init_std;
  return c;
}

void ModelConfig::validate() const { (void)make_model_arch(*this); }

int64_t ModelConfig::num_parameters() const { return make_model_arch(*this)->num_parameters(); }

void check_model_config_common(const ModelConfig& c) {
  auto at_least_1 = [](const char* key, int v) {
    TR_CHECK(v >= 1, "model.", key, " must be at least 1 (got ", v, ")");
  };
  at_least_1("n_layer", c.L);
  at_least_1("n_head", c.NH);
  at_least_1("n_embd", c.C);
  at_least_1("vocab_size", c.V);
  at_least_1("seq_len", c.T);
  TR_CHECK(c.head_dim >= 0, "model.head_dim must be at least 1, or 0 for n_embd / n_head (got ", c.head_dim, ")");
  TR_CHECK(c.head_dim > 0 || c.C % c.NH == 0, "model.n_embd (", c.C, ") is not divisible by model.n_head (", c.NH,
           "); make n_embd a multiple of n_head, or set model.head_dim");
  TR_CHECK(c.NKV >= 0, "model.n_kv_head must be at least 1, or 0 for model.n_head (got ", c.NKV, ")");
  TR_CHECK(c.NH % c.kv_heads() == 0, "model.n_head (", c.NH, ") is not a multiple of model.n_kv_head (", c.NKV,
           "); each key/value head serves a whole group of query heads");
  TR_CHECK(c.F >= 0, "model.ffn_dim must be at least 1, or 0 for the architecture's default (got ", c.F, ")");
  TR_CHECK(c.init_std > 0 && std::isfinite(c.init_std), "model.init_std must be a positive number (got ", c.init_std,
           ")");
  TR_CHECK(c.norm_eps > 0 && std::isfinite(c.norm_eps), "model.norm_eps must be a positive number (got ", c.norm_eps,
           ")");
  TR_CHECK(c.rope_theta > 0 && std::isfinite(c.rope_theta), "model.rope_theta must be a positive number (got ",
           c.rope_theta, ")");
  TR_CHECK(c.rope_scaling_type.empty() || c.rope_scaling_type == "llama3" ||
               (c.rope_scaling_type == "longrope" && c.rope_scaling.longrope()),
           "model.rope_scaling.type: unknown type '", c.rope_scaling_type,
           "'; trainrun implements llama3 (or none: leave it empty), and longrope read from a Phi-3 config.json");
  if (c.rope_scaling_type == "longrope") {
    const RopeScaling& s = c.rope_scaling;
    const size_t half = size_t(c.head_size() / 2);
    TR_CHECK(s.short_factor.size() == half && s.long_factor.size() == half, "model.rope_scaling: longrope's "
             "short_factor and long_factor need head_size / 2 = ", half, " values each (got ", s.short_factor.size(),
             " and ", s.long_factor.size(), ")");
    TR_CHECK(s.original_max_position_embeddings >= 2, "model.rope_scaling.original_max_position_embeddings must be "
             "at least 2 for longrope (got ", s.original_max_position_embeddings, ")");
  }
  if (c.rope_scaling_type == "llama3") {
    const RopeScaling& s = c.rope_scaling;
    TR_CHECK(s.factor >= 1, "model.rope_scaling.factor must be at least 1 (got ", s.factor, ")");
    TR_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
             "model.rope_scaling.high_freq_factor (", s.high_freq_factor,
             ") must be above model.rope_scaling.low_freq_factor (", s.low_freq_factor, "), both positive");
    TR_CHECK(s.original_max_position_embeddings >= 1,
             "model.rope_scaling.original_max_position_embeddings must be at least 1 (got ",
             s.original_max_position_embeddings, ")");
  }
}

// ---- layouts -------------------------------------------------------------------------------

void Network::not_a_stage(const char* what) {
  TR_FAIL("model.", what, ": this network is not a pipeline stage (make_network without a PipelineStage; a bug)");
}

const char* split_name(ParamTensor::Split s) {
  switch (s) {
    case ParamTensor::Split::Replicated: return "replicated";
    case ParamTensor::Split::Column: return "column";
    case ParamTensor::Split::Row: return "row";
    case ParamTensor::Split::Vocab: return "vocab";
  }
  return "?";
}

const ParamTensor* ParamLayout::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const ParamTensor& ParamLayout::get(const std::string& name) const {
  const ParamTensor* t = find(name);
  TR_CHECK(t, "model: no parameter named '", name, "'");
  return *t;
}

void LayoutBuilder::begin_unit(const std::string& name) { lay_.units.push_back({name, off_, 0}); }

void LayoutBuilder::add(const std::string& name, std::vector<int64_t> shape, bool decay, ParamTensor::Split split,
                        int split_blocks, int split_units) {
  TR_CHECK(!lay_.units.empty(), "LayoutBuilder: tensor '", name, "' outside a unit (a bug)");
  ParamTensor t;
  t.name = name;
  t.shape = std::move(shape);
  t.numel = 1;
  for (auto d : t.shape) t.numel *= d;
  t.offset = off_;
  t.unit = int(lay_.units.size()) - 1;
  t.decay = decay;
  t.split = split;
  t.split_blocks = split_blocks;
  t.split_units = split_units;
  off_ += t.numel;
  lay_.tensors.push_back(std::move(t));
}

void LayoutBuilder::end_unit() { lay_.units.back().numel = off_ - lay_.units.back().offset; }

ParamLayout LayoutBuilder::finish() {
  lay_.total = off_;
  for (const auto& tie : lay_.ties) (void)lay_.get(tie.tensor);
  return std::move(lay_);
}

// ---- the architecture's shared formulas ------------------------------------------------------

double ModelArch::flops_per_token() const {
  return 6.0 * double(matmul_parameters()) + 12.0 * double(cfg_.L) * double(cfg_.q_dim()) * double(cfg_.T);
}

// ---- configs read back from files ----------------------------------------------------------

std::vector<const ParamTensor*> ModelArch::hf_save_order() const {
  std::vector<const ParamTensor*> order;
  for (const auto& t : layout_.tensors) order.push_back(&t);
  return order;
}

void ModelArch::hf_carry_over(const nlohmann::ordered_json& source, nlohmann::ordered_json& out) const {
  // Ids outside our vocabulary would make generate() stop on nothing (or crash).
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (!source.contains(key)) continue;
    const auto& v = source[key];
    auto in_vocab = [&](const nlohmann::ordered_json& id) {
      return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < cfg_.V;
    };
    bool ok = v.is_null() || in_vocab(v);
    if (v.is_array()) {
      ok = true;
      for (const auto& id : v) ok = ok && in_vocab(id);
    }
    if (ok) out[key] = v;
  }
}

ModelConfig read_hf_model_config(const std::string& dir, const std::string& what, const std::string& want_arch) {
  const std::string hint =
      "; expected a Hugging Face model directory (config.json + model.safetensors), as written by `trainrun "
      "export` or save_pretrained(dir, safe_serialization=True)";
  TR_CHECK(fs::exists(dir), what, ": '", dir, "' does not exist", hint);
  TR_CHECK(fs::is_directory(dir), what, ": '", dir, "' is not a directory", hint);
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream f(path);
  TR_CHECK(f, what, ": '", dir, "' has no config.json", hint);
  json c;
  try {
    c = json::parse(f);
  } catch (const std::exception& e) {
    TR_FAIL(what, ": '", path, "' is not valid JSON (", e.what(), ")");
  }
  TR_CHECK(c.is_object(), what, ": '", path, "' is not a JSON object");
  TR_CHECK(c.contains("model_type") && c["model_type"].is_string(), what, ": '", path,
           "' has no model_type; only Hugging Face ", loadable_types(), " models can be loaded");
  const std::string mt = c["model_type"].get<std::string>();
  const std::string arch = arch_for_hf_model_type(mt);
  TR_CHECK(!arch.empty(), what, ": '", path, "' has model_type \"", mt, "\"; only ", loadable_types(),
           " can be loaded (trainrun implements ", join_names(true), ")");
  TR_CHECK(want_arch.empty() || arch == want_arch, what, ": '", path, "' has model_type \"", mt,
           "\" but model.arch is ", want_arch, "; only \"", (find_entry(want_arch) ? find_entry(want_arch)->hf_model_type : want_arch.c_str()),
           "\" can be loaded into it (model.arch: auto follows the directory)");
  const ArchEntry* e = find_entry(arch);
  TR_CHECK(e->loads_hf, what, ": '", path, "' has model_type \"", mt, "\": importing ", arch,
           " from Hugging Face is not implemented yet; only ", loadable_types(), " can be loaded");
  ModelConfig cfg = e->from_hf(c, path, what);
  cfg.arch = arch;
  return cfg;
}

ModelConfig config_from_file_metadata(const std::map<std::string, std::string>& meta, const std::string& path) {
  // An adapter run's checkpoint (core/train/adapter_training) holds the
  // adapters only: the base is its model.init_from.
  TR_CHECK(!meta.count("trainrun_adapter"), path,
           ": holds LoRA adapters (", meta.at("trainrun_adapter"), "), not a whole model; use the PEFT directory "
           "beside it with the base: generate --adapter <checkpoint>/adapter, or export --merge");
  auto it = meta.find("arch");
  const std::string arch = it == meta.end() ? "gpt2" : it->second;  // files from before "arch" are GPT-2
  const ArchEntry* e = find_entry(arch);
  TR_CHECK(e, path, ": unsupported arch '", arch, "' (trainrun knows ", join_names(false), ")");
  TR_CHECK(e->from_metadata, path, ": arch '", arch, "': reading its files is not implemented yet");
  ModelConfig cfg = e->from_metadata(meta, path);
  cfg.arch = arch;
  return cfg;
}

std::string manifest_model_mismatch(const ModelArch& arch, const json& saved) {
  const json now = arch.manifest_model();
  if (saved.contains("adapter"))
    return "model.adapter (the checkpoint holds adapters on a frozen base, not a whole model; resume it with the "
           "same model.adapter and model.init_from)";
  auto text = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  for (const auto& [key, have] : now.items()) {
    json was;
    if (saved.contains(key)) was = saved.at(key);
    else if (key == "arch") was = "gpt2";  // format-2 manifests before the arch was recorded
    if (was.is_null()) return "model." + key + " is not recorded but this job has " + text(have);
    if (was != have) return "model." + key + " = " + text(was) + " but this job has " + text(have);
  }
  // Written only when set (the default leaves older manifests as they were).
  if (saved.contains("head_dim") && !now.contains("head_dim"))
    return "model.head_dim = " + text(saved.at("head_dim")) + " but this job has 0 (n_embd / n_head)";
  return "";
}

}  // namespace trainrun
