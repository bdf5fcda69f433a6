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

namespace trainrun {

namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// Presets: published shapes, so the common questions need no typing.
struct Preset {
  const char* name;
  const char* text;
};
const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"gpt2-124m", "gpt2:L=12,C=768,heads=12,V=50257,T=1024"},
      {"gpt2-350m", "gpt2:L=24,C=1024,heads=16,V=50257,T=1024"},
      {"gpt2-774m", "gpt2:L=36,C=1280,heads=20,V=50257,T=1024"},
      {"gpt2-1.5b", "gpt2:L=48,C=1600,heads=25,V=50257,T=1024"},
      {"llama2-7b", "llama:L=32,C=4096,heads=32,kv_heads=32,ffn=11008,V=32000,T=4096"},
      {"llama2-70b", "llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=32000,T=4096"},
      {"llama3-8b", "llama:L=32,C=4096,heads=32,kv_heads=8,ffn=14336,V=128256,T=8192"},
      {"llama3-70b", "llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=8192"},
  };
  return p;
}

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
      {"n_inner", "ffn"},  {"tied", "tied"},
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
      "a shape ARCH:KEY=VALUE,... with ARCH gpt2 or llama and keys L (layers), C (width), heads, kv_heads "
      "(llama, default heads), ffn (MLP width: gpt2 4C, llama required), V (vocab), T (context), tied (0/1), "
      "e.g. llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096; or a preset (";
  for (size_t i = 0; i < presets().size(); ++i) s += (i ? ", " : "") + std::string(presets()[i].name);
  return s + "), optionally with overrides: llama3-70b:T=4096";
}

namespace {
ModelConfig parse_shape(const std::string& text_in, const std::string& what, bool presets_allowed) {
  const std::string text = trim(text_in);
  TR_CHECK(!text.empty(), "--model: empty; give ", model_shape_help());
  const size_t colon = text.find(':');
  std::string head = lower(trim(text.substr(0, colon)));
  std::string body = colon == std::string::npos ? "" : text.substr(colon + 1);
  ModelConfig m;
  m.arch = "";
  std::map<std::string, int64_t> set;  // keys given explicitly
  // A bare architecture name means its best-known size.
  if (head == "gpt2" && body.empty()) head = "gpt2-124m";
  // A preset fills every key; the text after ':' overrides some of them.
  for (const auto& p : presets()) {
    if (presets_allowed && head == p.name) {
      // Later keys win, so the overrides simply follow the preset's text.
      std::string merged = std::string(p.text);
      if (!body.empty()) merged += "," + body;
      return parse_shape(merged, what, false);
    }
  }
  const std::vector<std::string> archs = model_arch_names();
  if (std::find(archs.begin(), archs.end(), head) != archs.end()) {
    m.arch = head;
  } else {
    std::string names;
    for (const auto& a : archs) names += (names.empty() ? "" : ", ") + a;
    for (const auto& p : presets()) names += std::string(", ") + p.name;
    std::string best;
    size_t bd = 3;
    std::vector<std::string> cands = archs;
    for (const auto& p : presets()) cands.push_back(p.name);
    for (const auto& c : cands)
      if (size_t d = edit_distance(head, c); d < bd) bd = d, best = c;
    TR_FAIL(what, ": unknown architecture or preset '", head, "'",
            best.empty() ? "" : "; did you mean '" + best + "'?", " (known: ", names, ")");
  }
  std::stringstream ss(body);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    TR_CHECK(eq != std::string::npos, what, ": '", item, "' is not KEY=VALUE (e.g. L=12)");
    const std::string key_raw = trim(item.substr(0, eq)), val = trim(item.substr(eq + 1));
    auto it = key_aliases().find(lower(key_raw));
    // L/C/V/T are case-sensitive letters in the docs but lowercase aliases
    // are accepted; "l" and "L" mean the same.
    if (it == key_aliases().end()) {
      std::string best;
      size_t bd = 3;
      for (const auto& [k, canon] : key_aliases())
        if (size_t d = edit_distance(lower(key_raw), k); d < bd) bd = d, best = canon;
      TR_FAIL(what, ": unknown key '", key_raw, "'", best.empty() ? "" : "; did you mean '" + best + "'?",
              " (keys: L, C, heads, kv_heads, ffn, V, T, tied)");
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
  const int64_t ffn = get("ffn", 4 * C, m.arch == "llama");
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
  TR_CHECK(m.C % m.NH == 0, what, ": C (", m.C, ") must be divisible by heads (", m.NH, ")");
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

ModelConfig parse_model_shape(const std::string& text) { return parse_shape(text, "--model '" + text + "'", true); }

}  // namespace trainrun
