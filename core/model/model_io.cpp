#include "core/model/model_io.h"

#include <cstring>

#include "core/common/error.h"
#include "core/io/safetensors.h"

namespace trainrun {

std::string model_file_header(const ModelArch& arch) {
  std::vector<SafeTensorEntry> es;
  for (const auto& t : arch.layout().tensors) es.push_back({t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, arch.file_metadata());
}

void save_model_safetensors(const std::string& path, const ModelConfig& cfg, const std::vector<float>& flat) {
  const auto arch = make_model_arch(cfg);
  const ParamLayout& lay = arch->layout();
  TR_CHECK(int64_t(flat.size()) == lay.total, "save_model_safetensors: ", flat.size(), " values for a model of ",
           lay.total);
  SafeTensorFile f;
  f.metadata = arch->file_metadata();
  for (const auto& t : lay.tensors) f.tensors.push_back(make_f32_tensor(t.name, t.shape, flat.data() + t.offset));
  write_safetensors(path, f);
}

ModelConfig load_model_safetensors(const std::string& path, std::vector<float>& flat) {
  SafeTensorFile f = read_safetensors(path);
  const ModelConfig cfg = config_from_file_metadata(f.metadata, path);
  std::unique_ptr<ModelArch> arch;
  try {
    arch = make_model_arch(cfg);
  } catch (const Error& e) {
    TR_FAIL(path, ": inconsistent model shape in __metadata__ (", e.what(), ")");
  }
  const ParamLayout& lay = arch->layout();
  flat.assign(lay.total, 0.0f);
  for (const auto& t : lay.tensors) {
    const SafeTensor* st = f.find(t.name);
    TR_CHECK(st, path, ": missing tensor '", t.name, "'");
    TR_CHECK(st->shape == t.shape, path, ": tensor '", t.name, "' has the wrong shape for the model in its metadata");
    std::vector<float> v = st->as_f32();
    std::memcpy(flat.data() + t.offset, v.data(), v.size() * 4);
  }
  return arch->config();
}

}  // namespace trainrun
