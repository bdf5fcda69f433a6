#include "core/train/generate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include "core/common/error.h"
#include "core/data/tokenizer/tokenizer.h"
#include "core/model/adapter/lora.h"
#include "core/model/adapter/peft_files.h"
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

// One token from fp32 logits: greedy, or top-k (0: all) at a temperature.
// A stable order, so ties resolve identically on every machine.
int pick_token(const std::vector<float>& logits, const SampleOptions& o, uint64_t& rng) {
  const int V = o.vocab_limit > 0 ? std::min(o.vocab_limit, int(logits.size())) : int(logits.size());
  if (o.top_k == 1 || o.temperature <= 0.0)
    return int(std::max_element(logits.begin(), logits.begin() + V) - logits.begin());
  std::vector<int> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  const int k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  const double mx = logits[idx[0]];
  std::vector<double> p(k);
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += p[j] = std::exp((logits[idx[j]] - mx) / o.temperature);
  double u = double(splitmix64(rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
  for (int j = 0; j < k; ++j) {
    if (u < p[j]) return idx[j];
    u -= p[j];
  }
  return idx[k - 1];
}
}  // namespace

int sample_cache_positions(const ModelConfig& cfg, size_t prompt_tokens, const SampleOptions& o) {
  return int(std::min<int64_t>(cfg.T, int64_t(prompt_tokens) + std::max(o.max_tokens, 0)));
}

std::vector<int32_t> sample_tokens(Backend* be, UnitAccess& units, const ModelArch& arch,
                                   const std::vector<int32_t>& prompt, const SampleOptions& o, Communicator* comm) {
  const ModelConfig& cfg = arch.config();
  TR_CHECK(!prompt.empty(), "generate: the prompt is empty; pass --prompt with at least one token");
  for (int32_t t : prompt)
    TR_CHECK(t >= 0 && t < cfg.V, "generate: prompt token ", t, " is outside the model's vocab of ", cfg.V);
  std::vector<int32_t> seq = prompt;
  if (o.max_tokens <= 0) return seq;
  const int cap = sample_cache_positions(cfg, prompt.size(), o);
  const std::unique_ptr<Decoder> decoder = arch.make_decoder(be, cap);
  Decoder& dec = *decoder;
  std::vector<float> logits;
  // (Re)fill the cache from the newest `keep` tokens of the sequence.
  auto refill = [&](int keep) {
    dec.reset();
    dec.feed(units, seq.data() + seq.size() - size_t(keep), keep, logits);
  };
  refill(std::min<int>(int(seq.size()), cap));
  uint64_t rng = o.seed;
  const bool lead = !comm || comm->rank() == 0;
  for (int i = 0; i < o.max_tokens; ++i) {
    int32_t next = lead ? pick_token(logits, o, rng) : 0;
    if (comm && comm->world_size() > 1) comm->broadcast(&next, sizeof next, 0);
    seq.push_back(next);
    if (i + 1 == o.max_tokens) break;
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) break;
    if (dec.position() == cap)
      refill(std::max(1, cap / 2));  // outgrew the model's T (cap == T here)
    else
      dec.feed(units, &next, 1, logits);
  }
  return seq;
}

std::vector<int32_t> sample_tokens(const ModelArch& arch, const std::vector<float>& flat,
                                   const std::vector<int32_t>& prompt, const SampleOptions& o,
                                   const std::string& adapter_dir) {
  auto be = make_cpu_backend();
  const ParamLayout& lay = arch.layout();
  TR_CHECK(int64_t(flat.size()) == lay.total, "generate: ", flat.size(), " weights for a model of ", lay.total);
  auto to_device = [&](const std::vector<float>& host) {
    DeviceBuffer params(be.get(), host.size() * dtype_size(be->act_dtype()));
    DeviceBuffer master(be.get(), host.size() * 4);
    be->copy_to_device(master.get(), host.data(), host.size() * 4);
    be->cast_from_f32(params.get(), master.as<float>(), int64_t(host.size()));
    return params;
  };
  const DeviceBuffer params = to_device(flat);
  FlatUnitAccess access(lay, params.get(), nullptr, be->act_dtype());
  if (adapter_dir.empty()) return sample_tokens(be.get(), access, arch, prompt, o, nullptr);
  // The adapter applied unmerged, as peft's PeftModel computes: the base's
  // GEMMs as they are, and s B A x (DoRA: the magnitude's rescale) added by
  // the decoder's adapter hooks. Its rows: at most one prompt chunk, which
  // is at most the cache.
  const LoraOptions opt = peft_adapter_options(adapter_dir, "generate --adapter");
  const int rows = std::max(1, sample_cache_positions(arch.config(), prompt.size(), o));
  LoraAdapters adapters(arch, opt, be.get(), rows);
  const DeviceBuffer adapter_params = to_device(read_peft_adapter(adapter_dir, arch, adapters, "generate --adapter"));
  FlatUnitAccess adapter_access(adapters.layout(), adapter_params.get(), nullptr, be->act_dtype());
  adapters.set_training(false);  // peft's dropout is off in eval
  AdaptedUnitAccess adapted(access, lay, adapters, adapter_access, be.get());
  return sample_tokens(be.get(), adapted, arch, prompt, o, nullptr);
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

std::vector<int32_t> encode_text_prompt(const Tokenizer& tok, const std::string& text, bool allow_special) {
  std::vector<uint32_t> u;
  if (tok.bos_id() >= 0) u.push_back(uint32_t(tok.bos_id()));
  TokenEncoder enc(tok);
  enc.encode(text, allow_special, u);
  return std::vector<int32_t>(u.begin(), u.end());
}

std::string decode_text(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  for (int32_t t : ids)
    TR_CHECK(t >= 0 && uint32_t(t) < tok.vocab_size(), "generate: the model sampled token ", t,
             ", which the tokenizer has no text for (its vocab is ", tok.vocab_size(), ")");
  return utf8_lossy(tok.decode(std::vector<uint32_t>(ids.begin(), ids.end())));
}

std::string run_tokenizer_of_model_file(const std::string& model_file) {
  // <run>/model.safetensors, or <run>/checkpoints/<step>/model.safetensors.
  const fs::path dir = fs::path(model_file).parent_path();
  for (const fs::path& run : {dir, dir.parent_path().filename() == "checkpoints" ? dir.parent_path().parent_path() : fs::path()})
    if (!run.empty() && fs::is_regular_file(run / "tokenizer.json") && fs::exists(run / "job.resolved.yaml"))
      return (run / "tokenizer.json").string();
  return "";
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
