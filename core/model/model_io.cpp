#include "core/model/model_io.h"

#include <cstring>

#include "core/common/error.h"
#include "core/io/safetensors.h"

namespace trainrun {

std::map<std::string, std::string> gpt2_safetensors_metadata(const GPT2Config& c) {
  return {{"format", "pt"},
          {"arch", "gpt2"},
          {"n_layer", std::to_string(c.L)},
          {"n_head", std::to_string(c.NH)},
          {"n_embd", std::to_string(c.C)},
          {"vocab_size", std::to_string(c.V)},
          {"seq_len", std::to_string(c.T)},
          {"init_std", std::to_string(c.init_std)}};
}

std::string gpt2_model_file_header(const GPT2Config& cfg) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  std::vector<SafeTensorEntry> es;
  for (const auto& t : lay.tensors) es.push_back({t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, gpt2_safetensors_metadata(cfg));
}

void save_model_safetensors(const std::string& path, const GPT2Config& cfg, const std::vector<float>& flat) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  TR_CHECK(int64_t(flat.size()) == lay.total, "save_model_safetensors: ", flat.size(), " values for a model of ",
           lay.total);
  SafeTensorFile f;
  f.metadata = gpt2_safetensors_metadata(cfg);
  for (const auto& t : lay.tensors) f.tensors.push_back(make_f32_tensor(t.name, t.shape, flat.data() + t.offset));
  write_safetensors(path, f);
}

GPT2Config load_model_safetensors(const std::string& path, std::vector<float>& flat) {
  SafeTensorFile f = read_safetensors(path);
  auto meta_int = [&](const char* key) {
    auto it = f.metadata.find(key);
    TR_CHECK(it != f.metadata.end(), path, ": missing __metadata__ key '", key,
             "'; this file was not written by trainrun (or an older version)");
    try {
      return std::stoi(it->second);
    } catch (...) {
      TR_FAIL(path, ": __metadata__ key '", key, "' is not an integer: '", it->second, "'");
    }
  };
  auto arch = f.metadata.find("arch");
  TR_CHECK(arch == f.metadata.end() || arch->second == "gpt2", path, ": unsupported arch '", arch->second, "'");
  GPT2Config cfg;
  cfg.L = meta_int("n_layer");
  cfg.NH = meta_int("n_head");
  cfg.C = meta_int("n_embd");
  cfg.V = meta_int("vocab_size");
  cfg.T = meta_int("seq_len");
  TR_CHECK(cfg.L > 0 && cfg.NH > 0 && cfg.C > 0 && cfg.V > 0 && cfg.T > 0 && cfg.C % cfg.NH == 0, path,
           ": inconsistent model shape in __metadata__");
  const ParamLayout lay = make_gpt2_layout(cfg);
  flat.assign(lay.total, 0.0f);
  for (const auto& t : lay.tensors) {
    const SafeTensor* st = f.find(t.name);
    TR_CHECK(st, path, ": missing tensor '", t.name, "'");
    TR_CHECK(st->shape == t.shape, path, ": tensor '", t.name, "' has the wrong shape for the model in its metadata");
    std::vector<float> v = st->as_f32();
    std::memcpy(flat.data() + t.offset, v.data(), v.size() * 4);
  }
  return cfg;
}

}  // namespace trainrun
