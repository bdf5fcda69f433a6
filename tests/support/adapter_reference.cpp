// adapter_reference.h
#include "tests/support/adapter_reference.h"

#include <catch2/catch.hpp>

#include "core/checkpoint/hf_interop.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/peft_files.h"
#include "kernels/backend_factory.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"

namespace trainrun::test {

std::vector<float> adapted_logits_of(const std::string& base_dir, const std::string& adapter_dir,
                                     const LoraOptions& options, const std::vector<int32_t>& in, int B, int T) {
  auto arch = make_model_arch(read_hf_model_config(base_dir, "test"));
  auto be = make_cpu_backend(1);
  std::vector<float> base(size_t(arch->layout().total));
  open_hf_source(base_dir, "test")->read(0, int64_t(base.size()), base.data());
  LoraAdapters ad(*arch, options, be.get(), B * T);
  const std::vector<float> a = read_peft_adapter(adapter_dir, *arch, ad, "test");
  DeviceBuffer bp = upload_act(be.get(), base), bg(be.get(), base.size() * 4);
  DeviceBuffer ap = upload_act(be.get(), a), ag(be.get(), a.size() * 4);
  FlatUnitAccess base_units(arch->layout(), bp.get(), bg.as<float>(), be->act_dtype());
  FlatUnitAccess ad_units(ad.layout(), ap.get(), ag.as<float>(), be->act_dtype());
  AdaptedUnitAccess units(base_units, arch->layout(), ad, ad_units, be.get());
  ad.set_training(false);
  auto net = arch->make_network(be.get(), B, false);
  DeviceBuffer din = upload_i32(be.get(), in);
  net->forward(units, din.as<int32_t>(), nullptr, B, T, false, 0.0f);
  const int V = arch->config().V, ld = net->logits_stride();
  const std::vector<float> padded = download_act(be.get(), net->logits(), size_t(B) * T * ld);
  std::vector<float> out;
  for (int n = 0; n < B * T; ++n)
    out.insert(out.end(), padded.begin() + size_t(n) * ld, padded.begin() + size_t(n) * ld + V);
  return out;
}

std::vector<float> peft_logits_of(const std::string& base_dir, const std::string& adapter_dir,
                                  const std::vector<int32_t>& in, int B, int T, const TempDir& tmp) {
  SafeTensorFile f;
  f.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
  f.tensors.push_back(make_tensor("targets", "I32", {B, T}, in.data()));
  write_safetensors(tmp / "peft_batch.safetensors", f);
  const auto r = run_reference_script("peft_lora.py", "logits --base '" + base_dir + "' --adapter '" + adapter_dir +
                                                          "' --batch '" + tmp / "peft_batch.safetensors" +
                                                          "' --out '" + tmp / "peft_logits.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return read_safetensors(tmp / "peft_logits.safetensors").find("logits")->as_f32();
}

}  // namespace trainrun::test
