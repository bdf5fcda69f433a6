#include "tests/support/hf_reference.h"

#include <catch2/catch.hpp>

#include "core/io/safetensors.h"
#include "kernels/backend_factory.h"
#include "tests/support/device_io.h"

namespace trainrun::test {

RunResult run_reference_script(const std::string& script, const std::string& args) {
  return run_command("OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 '" + hf_python() + "' '" +
                     source_dir() + "/scripts/reference/" + script + "' " + args);
}

std::vector<float> logits_of(const ModelArch& arch, const std::vector<float>& flat, const std::vector<int32_t>& in,
                             int B, int T) {
  auto be = make_cpu_backend();
  auto net = arch.make_network(be.get(), B, false);
  DeviceBuffer p = upload_act(be.get(), flat);
  DeviceBuffer g(be.get(), flat.size() * 4);
  DeviceBuffer din = upload_i32(be.get(), in);
  FlatUnitAccess units(arch.layout(), p.get(), g.as<float>(), be->act_dtype());
  net->forward(units, din.as<int32_t>(), nullptr, B, T, false, 0.0f);
  const int V = arch.config().V, ld = net->logits_stride();
  const std::vector<float> padded = download_act(be.get(), net->logits(), size_t(B) * T * ld);
  std::vector<float> out;
  for (int n = 0; n < B * T; ++n)
    out.insert(out.end(), padded.begin() + size_t(n) * ld, padded.begin() + size_t(n) * ld + V);
  return out;
}

std::vector<float> hf_logits_of(const std::string& script, const std::string& dir, const std::vector<int32_t>& in,
                                int B, int T, const TempDir& tmp) {
  SafeTensorFile f;
  f.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
  write_safetensors(tmp / "batch.safetensors", f);
  const auto r = run_reference_script(script, "logits --model '" + dir + "' --batch '" + tmp / "batch.safetensors" +
                                                  "' --out '" + tmp / "logits.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return read_safetensors(tmp / "logits.safetensors").find("logits")->as_f32();
}

}  // namespace trainrun::test
