// Model shapes as text (model_shape.h).
#include "core/model/model_shape.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <vector>

#include "core/common/error.h"
#include "core/common/text.h"
#include "core/config/model_presets.h"

namespace trainrun {

namespace {

// Accepted spellings of each key (the HF / job-spec names too).
const std::map<std::string, std::string>& key_aliases() {
  static const std::map<std::string, std::string> a = {
      {"l", "L"},          {"layers", "L"},       {"n_layer", "L"},        {"num_hidden_layers", "L"},
      {"c", "C"},          {"n_embd", "C"},       {"hidden", "C"},         {"hidden_size", "C"},
      {"d_model", "C"},    {"heads", "heads"},    {"n_head", "heads"},     {"num_attention_heads", "heads"},
      {"kv_heads", "kv_heads"}, {"n_kv_heads", "kv_heads"}, {"num_key_value_heads", "kv_heads"},
      {"ffn", "ffn"},      {"intermediate_size", "ffn"}, {"v", "V"},      {"vocab", "V"},
      {"vocab_size", "V"}, {"t", "T"},            {"seq_len", "T"},        {"context", "T"},
      {"n_positions", "T"}, {"n_ctx", "T"},       {"max_position_embeddings", "T"},
      {"n_inner", "ffn"},  {"tied", "tied"},      {"head_dim", "head_dim"}, {"hd", "head_dim"},
  };
  return a;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> d(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) d[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = d[0];
    d[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cur = d[j];
      d[j] = std::min({d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return d[b.size()];
}

}  // namespace

std::string model_shape_help() {
  std::string s =
      "a shape ARCH:KEY=VALUE,... with ARCH gpt2, llama or qwen3 and keys L (layers), C (width), heads, kv_heads "
      "(llama, default heads), head_dim (llama, default C/heads), ffn (MLP width: gpt2 4C, llama required), V (vocab), "
      "T (context), tied (0/1), "
      "e.g. llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096; or a preset (";
  const std::vector<std::string> names = model_preset_names();
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s + ", the model.preset names), optionally with overrides: llama3.1-70b:T=4096";
}

namespace {
// The --model keys of a config, so a preset's values and the text's
// overrides go through one path.
std::map<std::string, int64_t> shape_keys_of(const ModelConfig& c) {
  std::map<std::string, int64_t> k = {{"L", c.L}, {"C", c.C}, {"heads", c.NH}, {"V", c.V}, {"T", c.T},
                                      {"tied", c.tied ? 1 : 0}};
  // 0 = the arch's default (gpt2: kv_heads = heads, ffn = 4C), which must
  // follow an override of heads or C.
  if (c.NKV > 0) k["kv_heads"] = c.NKV;
  if (c.F > 0) k["ffn"] = c.F;
  if (c.head_dim > 0) k["head_dim"] = c.head_dim;
  return k;
}

ModelConfig parse_shape(const std::string& text_in, const std::string& what) {
  const std::string text = trim_blanks(text_in);
  TR_CHECK(!text.empty(), "--model: empty; give ", model_shape_help());
  const size_t colon = text.find(':');
  std::string head = ascii_lower(trim_blanks(text.substr(0, colon)));
  std::string body = colon == std::string::npos ? "" : text.substr(colon + 1);
  ModelConfig m;
  m.arch = "";
  std::map<std::string, int64_t> set;  // keys given explicitly
  // A bare architecture name means its best-known size.
  if (head == "gpt2" && body.empty()) head = "gpt2-124m";
  const std::vector<std::string> archs = model_arch_names();
  if (const ModelPreset* p = find_model_preset(head)) {
    // A preset (the job spec's model.preset table, by its exact name)
    // fills every key, and its Llama details (RoPE, norm eps); the text
    // after ':' overrides some of them.
    m = ModelConfig::from_spec(p->spec);
    set = shape_keys_of(m);
  } else if (std::find(archs.begin(), archs.end(), head) != archs.end()) {
    m.arch = head;
  } else if (const std::string amb = ambiguous_preset_message(head); !amb.empty()) {
    TR_FAIL(what, ": ", amb);
  } else {
    std::string names;
    for (const auto& a : archs) names += (names.empty() ? "" : ", ") + a;
    for (const auto& n : model_preset_names()) names += ", " + n;
    std::string best;
    size_t bd = 3;
    std::vector<std::string> cands = archs;
    for (const auto& p : model_presets()) cands.push_back(p.name);
    for (const auto& c : cands)
      if (size_t d = edit_distance(head, c); d < bd) bd = d, best = c;
    TR_FAIL(what, ": unknown architecture or preset '", head, "'",
            best.empty() ? "" : "; did you mean '" + best + "'?", " (known: ", names, ")");
  }
  std::stringstream ss(body);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim_blanks(item);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    TR_CHECK(eq != std::string::npos, what, ": '", item, "' is not KEY=VALUE (e.g. L=12)");
    const std::string key_raw = trim_blanks(item.substr(0, eq)), val = trim_blanks(item.substr(eq + 1));
    auto it = key_aliases().find(ascii_lower(key_raw));
    // L/C/V/T are case-sensitive letters in the docs but lowercase aliases
    // are accepted; "l" and "L" mean the same.
    if (it == key_aliases().end()) {
      std::string best;
      size_t bd = 3;
      for (const auto& [k, canon] : key_aliases())
        if (size_t d = edit_distance(ascii_lower(key_raw), k); d < bd) bd = d, best = canon;
      TR_FAIL(what, ": unknown key '", key_raw, "'", best.empty() ? "" : "; did you mean '" + best + "'?",
              " (keys: L, C, heads, kv_heads, head_dim, ffn, V, T, tied)");
    }
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(val.c_str(), &end, 10);
    TR_CHECK(!val.empty() && end && *end == 0 && errno == 0, what, ": ", it->second, "='", val,
             "' is not a whole number");
    set[it->second] = v;
  }
  auto get = [&](const char* k, int64_t dflt, bool required) {
    auto f = set.find(k);
    if (f == set.end()) {
      TR_CHECK(!required, what, ": ", k, " is required for ", m.arch, " (", model_shape_help(), ")");
      return dflt;
    }
    return int64_t(f->second);
  };
  const int64_t L = get("L", 0, true), C = get("C", 0, true), heads = get("heads", 0, true);
  const int64_t V = get("V", 0, true), T = get("T", 0, true);
  const int64_t kv_heads = get("kv_heads", heads, false);
  const int64_t ffn = get("ffn", 4 * C, m.arch != "gpt2");  // the Llama-shaped archs have no default
  m.tied = get("tied", m.arch == "gpt2" ? 1 : 0, false) != 0;
  auto positive = [&](const char* k, int64_t v) {
    TR_CHECK(v >= 1, what, ": ", k, " must be at least 1 (got ", v, ")");
    TR_CHECK(v <= INT32_MAX, what, ": ", k, " is too large (got ", v, "; at most ", INT32_MAX, ")");
    return int(v);
  };
  m.L = positive("L", L);
  m.C = positive("C", C);
  m.NH = positive("heads", heads);
  m.NKV = positive("kv_heads", kv_heads);
  m.F = positive("ffn", ffn);
  m.T = positive("T", T);
  TR_CHECK(V >= 2, what, ": V must be at least 2 (got ", V, ")");
  m.V = positive("V", V);
  const int64_t head_dim = get("head_dim", 0, false);
  TR_CHECK(head_dim >= 0 && head_dim <= INT32_MAX, what, ": head_dim must be at least 1 (got ", head_dim, ")");
  m.head_dim = int(head_dim);
  TR_CHECK(m.head_dim > 0 || m.C % m.NH == 0, what, ": C (", m.C, ") must be divisible by heads (", m.NH,
           "), or give head_dim");
  TR_CHECK(m.NH % m.NKV == 0, what, ": heads (", m.NH, ") must be a multiple of kv_heads (", m.NKV, ")");
  if (m.arch == "gpt2") {
    TR_CHECK(m.NKV == m.NH, what, ": gpt2 has no grouped-query attention; drop kv_heads or use llama");
    TR_CHECK(int64_t(m.F) == 4 * int64_t(m.C), what, ": gpt2's MLP is 4C wide (", 4 * int64_t(m.C),
             "); drop ffn or use llama");
    TR_CHECK(m.tied, what, ": gpt2 ties the LM head to the token embedding; drop tied=0 or use llama");
  }
  // Whatever else the architecture requires (e.g. llama's even head size for RoPE).
  try {
    m.validate();
  } catch (const Error& e) {
    TR_FAIL(what, ": ", e.what());
  }
  return m;
}
}  // namespace

ModelConfig parse_model_shape(const std::string& text) { return parse_shape(text, "--model '" + text + "'"); }

}  // namespace trainrun
