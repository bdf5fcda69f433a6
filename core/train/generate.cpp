#include "core/train/generate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include "core/common/error.h"
#include "kernels/backend.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {
inline uint64_t splitmix64(uint64_t& s) {
  uint64_t x = (s += 0x9E3779B97F4A7C15ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

std::vector<int32_t> sample_tokens(const GPT2Config& cfg, const std::vector<float>& flat,
                                   const std::vector<int32_t>& prompt, const SampleOptions& o) {
  TR_CHECK(!prompt.empty(), "generate: the prompt is empty; pass --prompt with at least one token");
  for (int32_t t : prompt)
    TR_CHECK(t >= 0 && t < cfg.V, "generate: prompt token ", t, " is outside the model's vocab of ", cfg.V);
  auto be = make_cpu_backend();
  GPT2 model(cfg, be.get(), 1, false);
  const ParamLayout& lay = model.layout();
  DeviceBuffer params(be.get(), lay.total * dtype_size(be->act_dtype()));
  {
    DeviceBuffer master(be.get(), lay.total * 4);
    be->copy_to_device(master.get(), flat.data(), flat.size() * 4);
    be->cast_from_f32(params.get(), master.as<float>(), lay.total);
  }
  FlatUnitAccess access(lay, params.get(), nullptr, be->act_dtype());
  DeviceBuffer tokens_dev(be.get(), size_t(cfg.T) * 4);
  std::vector<int32_t> seq = prompt;
  std::vector<float> logits(cfg.V);
  DeviceBuffer last_f32(be.get(), size_t(cfg.V) * 4);  // the last position's logits, fp32
  uint64_t rng = o.seed;
  const bool greedy = o.top_k == 1 || o.temperature <= 0.0;
  for (int i = 0; i < o.max_tokens; ++i) {
    const int T = std::min<int>(int(seq.size()), cfg.T);
    be->copy_to_device(tokens_dev.get(), seq.data() + seq.size() - T, size_t(T) * 4);
    model.forward(access, tokens_dev.as<int32_t>(), nullptr, 1, T, false, 0.0f);
    // Only the last position's logits are needed; logits are act dtype.
    const char* last = static_cast<const char*>(model.logits()) +
                       size_t(T - 1) * size_t(model.logits_stride()) * dtype_size(be->act_dtype());
    be->cast_to_f32(last_f32.as<float>(), last, cfg.V);
    be->copy_to_host(logits.data(), last_f32.get(), size_t(cfg.V) * 4);
    int next;
    if (greedy) {
      next = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      std::vector<int> idx(cfg.V);
      std::iota(idx.begin(), idx.end(), 0);
      int k = o.top_k > 0 ? std::min(o.top_k, cfg.V) : cfg.V;
      // Stable partial sort so ties resolve identically on every machine.
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                        [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
      double mx = logits[idx[0]];
      std::vector<double> p(k);
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += p[j] = std::exp((logits[idx[j]] - mx) / o.temperature);
      double u = double(splitmix64(rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
      next = idx[k - 1];
      for (int j = 0; j < k; ++j) {
        if (u < p[j]) {
          next = idx[j];
          break;
        }
        u -= p[j];
      }
    }
    seq.push_back(next);
  }
  return seq;
}

std::vector<int32_t> encode_prompt(const std::string& text, int vocab) {
  std::vector<int32_t> out;
  if (vocab == 256) {
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  std::istringstream is(text);
  std::string tok;
  while (is >> tok) {
    char* end = nullptr;
    long v = std::strtol(tok.c_str(), &end, 10);
    TR_CHECK(end && *end == 0 && v >= 0 && v < vocab, "generate: the model's vocab is ", vocab,
             " (not bytes), so --prompt must be whitespace-separated token ids in [0, ", vocab, "); got '", tok, "'");
    out.push_back(int32_t(v));
  }
  return out;
}

std::string decode_tokens(const std::vector<int32_t>& tokens, int vocab) {
  std::string s;
  if (vocab == 256) {
    for (int32_t t : tokens) s.push_back(char(t));
    return s;
  }
  for (size_t i = 0; i < tokens.size(); ++i) s += (i ? " " : "") + std::to_string(tokens[i]);
  return s;
}

std::string resolve_model_file(const std::string& path) {
  fs::path p(path);
  TR_CHECK(fs::exists(p), "--checkpoint: '", path, "' does not exist; pass a run directory, a checkpoint directory or a .safetensors file");
  if (fs::is_regular_file(p)) return p.string();
  // A run directory: prefer its latest checkpoint.
  fs::path latest = p / "checkpoints" / "latest";
  if (fs::exists(latest)) {
    std::ifstream f(latest);
    std::string name;
    std::getline(f, name);
    fs::path ck = p / "checkpoints" / name / "model.safetensors";
    if (!name.empty() && fs::exists(ck)) return ck.string();
  }
  if (fs::exists(p / "model.safetensors")) return (p / "model.safetensors").string();
  TR_FAIL("--checkpoint: '", path, "' holds neither checkpoints/latest nor model.safetensors; is it a trainrun run directory?");
}

}  // namespace trainrun
