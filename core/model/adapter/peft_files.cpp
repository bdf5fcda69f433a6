// PEFT adapter directories in and out (peft_files.h).
#include "core/model/adapter/peft_files.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "core/io/safetensors.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {
std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}
std::string list_text(const std::vector<std::string>& v) {
  std::string t = "[";
  for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + v[i];
  return t + "]";
}
}  // namespace

void write_peft_adapter(const std::string& dir, const ModelArch& arch, const LoraAdapters& adapters,
                        const std::vector<float>& flat, const std::string& base_model) {
  const ParamLayout& lay = adapters.layout();
  TR_CHECK(int64_t(flat.size()) == lay.total, "write_peft_adapter: ", flat.size(), " values for an adapter of ",
           lay.total, " (a bug)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TR_CHECK(!ec, "adapter: cannot create '", dir, "': ", ec.message());
  const LoraOptions& o = adapters.options();
  nlohmann::ordered_json c;
  c["peft_type"] = "LORA";
  c["task_type"] = "CAUSAL_LM";
  c["base_model_name_or_path"] = base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(base_model);
  c["r"] = o.rank;
  c["lora_alpha"] = o.alpha;
  c["lora_dropout"] = o.dropout;
  c["target_modules"] = adapters.target_names();
  c["bias"] = "none";
  // GPT-2's Conv1D stores its weight (in, out): peft must know to transpose the base (not the adapters).
  c["fan_in_fan_out"] = arch.hf_model_type() == "gpt2";
  c["use_rslora"] = false;
  c["use_dora"] = o.dora;
  c["modules_to_save"] = nullptr;
  c["init_lora_weights"] = true;
  c["layers_to_transform"] = nullptr;
  c["layers_pattern"] = nullptr;
  c["rank_pattern"] = nlohmann::ordered_json::object();
  c["alpha_pattern"] = nlohmann::ordered_json::object();
  c["inference_mode"] = true;
  c["revision"] = nullptr;
  const fs::path cfg = fs::path(dir) / "adapter_config.json", tmp = fs::path(dir) / ".adapter_config.json.tmp";
  {
    std::ofstream f(tmp);
    TR_CHECK(f, "adapter: cannot write '", tmp.string(), "'");
    f << c.dump(2) << "\n";
    TR_CHECK(f.good(), "adapter: cannot write '", tmp.string(), "' (disk full?)");
  }
  fs::rename(tmp, cfg, ec);
  TR_CHECK(!ec, "adapter: cannot replace '", cfg.string(), "': ", ec.message());
  SafeTensorFile st;
  st.metadata["format"] = "pt";  // what torch's save_file writes; peft does not read it
  for (const ParamTensor& t : lay.tensors)
    st.tensors.push_back(make_f32_tensor(peft_tensor_name(t.name), t.shape, flat.data() + t.offset));
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), st);  // atomic
}

LoraOptions peft_adapter_options(const std::string& dir, const std::string& what) {
  const fs::path cfg_path = fs::path(dir) / "adapter_config.json";
  std::ifstream f(cfg_path);
  TR_CHECK(f, what, ": '", cfg_path.string(), "' cannot be read; point it at a PEFT adapter directory");
  nlohmann::json c;
  try {
    f >> c;
  } catch (const std::exception& e) {
    TR_FAIL(what, ": '", cfg_path.string(), "' is not valid JSON: ", e.what());
  }
  TR_CHECK(c.contains("r") && c["r"].is_number_integer() && c.contains("lora_alpha") && c["lora_alpha"].is_number(),
           what, ": '", cfg_path.string(), "' has no integer r or numeric lora_alpha (not a LoRA adapter?)");
  LoraOptions o;
  o.rank = c["r"].get<int>();
  o.alpha = c["lora_alpha"].get<double>();
  if (c.contains("lora_dropout") && c["lora_dropout"].is_number()) o.dropout = c["lora_dropout"].get<double>();
  if (c.contains("target_modules") && c["target_modules"].is_array()) {
    o.target_modules.clear();
    for (const auto& e : c["target_modules"]) o.target_modules += (o.target_modules.empty() ? "" : ",") + e.get<std::string>();
  } else if (c.contains("target_modules") && c["target_modules"].is_string()) {
    o.target_modules = c["target_modules"].get<std::string>();  // all-linear (a regex is refused on read)
  }
  o.dora = c.contains("use_dora") && c["use_dora"].is_boolean() && c["use_dora"].get<bool>();
  return o;
}

std::vector<float> read_peft_adapter(const std::string& dir, const ModelArch& arch, const LoraAdapters& adapters,
                                     const std::string& what) {
  const fs::path cfg_path = fs::path(dir) / "adapter_config.json";
  std::ifstream f(cfg_path);
  TR_CHECK(f, what, ": '", cfg_path.string(), "' cannot be read; point it at a PEFT adapter directory "
           "(adapter_config.json + adapter_model.safetensors)");
  nlohmann::json c;
  try {
    f >> c;
  } catch (const std::exception& e) {
    TR_FAIL(what, ": '", cfg_path.string(), "' is not valid JSON: ", e.what());
  }
  const std::string file = cfg_path.string();
  auto str_or = [&](const char* k, const std::string& d) {
    return c.contains(k) && c[k].is_string() ? c[k].get<std::string>() : d;
  };
  const std::string type = str_or("peft_type", "");
  TR_CHECK(type == "LORA", what, ": '", file, "': peft_type is '", type,
           "' but trainrun reads LORA adapters only (model.adapter.type: lora, or dora with use_dora)");
  const LoraOptions& o = adapters.options();
  TR_CHECK(c.contains("r") && c["r"].is_number_integer(), what, ": '", file, "' has no integer r");
  const int r = c["r"].get<int>();
  TR_CHECK(r == o.rank, what, ": '", file, "' has r = ", r, " but model.adapter.rank is ", o.rank,
           "; set model.adapter.rank to ", r);
  TR_CHECK(c.contains("lora_alpha") && c["lora_alpha"].is_number(), what, ": '", file, "' has no lora_alpha");
  const double alpha = c["lora_alpha"].get<double>();
  TR_CHECK(std::fabs(alpha - o.alpha) <= 1e-9 * std::fabs(o.alpha), what, ": '", file, "' has lora_alpha = ", alpha,
           " but model.adapter.alpha is ", o.alpha, "; set model.adapter.alpha to ", alpha);
  // What trainrun does not implement: refused, never silently dropped.
  auto refuse_true = [&](const char* k, const char* why) {
    if (c.contains(k) && c[k].is_boolean() && c[k].get<bool>())
      TR_FAIL(what, ": '", file, "' sets ", k, " = true, which trainrun does not implement (", why,
              "); the adapter would compute another function");
  };
  refuse_true("use_rslora", "rank-stabilised scaling alpha/sqrt(r)");
  // DoRA: the file and the job must agree (a LoRA adapter read as DoRA would lack its magnitudes, and the
  // reverse would drop them).
  if (c.contains("use_dora") && !c["use_dora"].is_boolean() && !c["use_dora"].is_null())
    TR_FAIL(what, ": '", file, "' has use_dora = ", c["use_dora"].dump(), "; it must be true or false");
  const bool file_dora = c.contains("use_dora") && c["use_dora"].is_boolean() && c["use_dora"].get<bool>();
  auto type_of = [](bool dora) { return std::string(dora ? "dora" : "lora"); };
  TR_CHECK(file_dora == o.dora, what, ": '", file, "' has use_dora = ", file_dora ? "true" : "false",
           " (a ", file_dora ? "DoRA" : "LoRA", " adapter) but model.adapter.type is ", type_of(o.dora),
           "; set model.adapter.type: ", type_of(file_dora));
  auto refuse_set = [&](const char* k) {
    if (c.contains(k) && !c[k].is_null() && !(c[k].is_object() && c[k].empty()) && !(c[k].is_array() && c[k].empty()))
      TR_FAIL(what, ": '", file, "' sets ", k, " = ", c[k].dump(), ", which trainrun does not implement; "
              "train an adapter without it");
  };
  refuse_set("modules_to_save");
  refuse_set("layers_to_transform");
  refuse_set("rank_pattern");
  refuse_set("alpha_pattern");
  const std::string bias = str_or("bias", "none");
  TR_CHECK(bias == "none", what, ": '", file, "' has bias = '", bias,
           "', which trainrun does not implement (the base's biases stay frozen); use bias 'none'");
  // target_modules: a list of short names, or a string (all-linear, or a regex peft would full-match).
  std::vector<std::string> theirs;
  if (c.contains("target_modules") && c["target_modules"].is_array()) {
    for (const auto& e : c["target_modules"]) theirs.push_back(e.get<std::string>());
  } else if (c.contains("target_modules") && c["target_modules"].is_string()) {
    const std::string t = c["target_modules"].get<std::string>();
    TR_CHECK(t == "all-linear", what, ": '", file, "' has target_modules = '", t,
             "' (a regex), which trainrun does not read; list the module names");
    theirs = resolve_target_modules(arch, "all-linear");
  }
  std::set<std::string> a(theirs.begin(), theirs.end()), b(adapters.target_names().begin(), adapters.target_names().end());
  TR_CHECK(a == b, what, ": '", file, "' adapts target_modules ", list_text(theirs), " but model.adapter.target_modules is ",
           list_text(adapters.target_names()), "; make them the same");

  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  TR_CHECK(fs::exists(st_path), what, ": '", st_path, "' is missing (peft's .bin adapters are not read; "
           "save with safe_serialization=True)");
  MappedSafeTensors m(st_path);
  const ParamLayout& lay = adapters.layout();
  std::vector<float> flat(size_t(lay.total), 0.0f);
  std::set<std::string> used;
  for (const ParamTensor& t : lay.tensors) {
    const std::string name = peft_tensor_name(t.name);
    const MappedSafeTensors::View* v = m.find(name);
    TR_CHECK(v, what, ": '", st_path, "' has no tensor ", name, " (module ", t.name.substr(0, t.name.rfind(".lora_")),
             "); the adapter was trained for another model or other target_modules");
    TR_CHECK(v->shape == t.shape, what, ": '", st_path, "': tensor ", name, " has shape ", shape_text(v->shape),
             " but this model's module needs ", shape_text(t.shape),
             " (model.adapter.rank and the base's shape); the adapter belongs to another base");
    convert_to_f32(v->dtype, v->data, size_t(t.numel), flat.data() + t.offset);
    used.insert(name);
  }
  for (const auto& v : m.tensors())
    TR_CHECK(used.count(v.name), what, ": '", st_path, "' holds ", v.name,
             ", which this job's adapter does not have (another model, layer count or target_modules)");
  return flat;
}

}  // namespace trainrun
