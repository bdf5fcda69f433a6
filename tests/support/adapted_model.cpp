// AdaptedModel and the peft cases (adapted_model.h).
#include "tests/support/adapted_model.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "core/checkpoint/hf_interop.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/peft_files.h"
#include "core/model/adapter/qlora.h"
#include "parallel/sharding/frozen_store.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"

namespace trainrun::test {

PeftCase llama_case(bool dora) {
  return {"llama", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", dora};
}
PeftCase gpt2_case(bool dora) { return {"gpt2", "c_attn,c_proj,c_fc", dora}; }
std::vector<PeftCase> all_cases() { return {llama_case(), gpt2_case(), llama_case(true), gpt2_case(true)}; }

std::vector<float> adapter_file(const std::string& dir) {
  const SafeTensorFile f = read_safetensors(dir + "/adapter_model.safetensors");
  std::vector<float> out;
  for (const SafeTensor& t : f.tensors) {
    const std::vector<float> v = t.as_f32();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<int32_t> tokens(int seed, int V) {
  std::vector<int32_t> t(size_t(kB) * kT);
  for (size_t i = 0; i < t.size(); ++i) t[i] = int32_t((i * 7 + size_t(seed) * 13 + 3) % size_t(V));
  return t;
}

AdaptedModel::AdaptedModel(const std::string& base_dir, const LoraOptions& o, const std::vector<float>* adapter_flat,
                           const std::string& adapter_dir, const std::string& base_dtype) {
  arch = make_model_arch(read_hf_model_config(base_dir, "test"));
  ad = std::make_unique<LoraAdapters>(*arch, o, be.get(), kB * kT);
  std::vector<float> a = adapter_flat ? *adapter_flat : read_peft_adapter(adapter_dir, *arch, *ad, "test");
  UnitAccess* base = nullptr;
  if (base_dtype.empty()) {
    auto src = open_hf_source(base_dir, "test");
    std::vector<float> flat(size_t(arch->layout().total));
    src->read(0, int64_t(flat.size()), flat.data());
    base_p = upload_act(be.get(), flat);
    base_g = DeviceBuffer(be.get(), flat.size() * 4);
    base_units = std::make_unique<FlatUnitAccess>(arch->layout(), base_p.get(), base_g.as<float>(), be->act_dtype());
    base = base_units.get();
  } else {
    comm = make_single_communicator();
    base_store = make_frozen_param_store("no_shard", arch->layout(), be.get(), comm.get(), 1, CommFactory(),
                                         frozen_format(*arch, base_dtype));
    load_init_from_ranges(*arch, base_dir, *base_store, false);
    base_store->params_updated();
    base = base_store.get();
  }
  ad_p = upload_act(be.get(), a);
  ad_g = DeviceBuffer(be.get(), a.size() * 4);
  ad_units = std::make_unique<FlatUnitAccess>(ad->layout(), ad_p.get(), ad_g.as<float>(), be->act_dtype());
  units = std::make_unique<AdaptedUnitAccess>(*base, arch->layout(), *ad, *ad_units, be.get());
}

std::vector<float> AdaptedModel::adapter_params() const {
  return download_act(be.get(), ad_p.get(), size_t(ad->layout().total));
}

std::vector<float> AdaptedModel::logits(const std::vector<int32_t>& in, bool ckpt) {
  auto net = arch->make_network(be.get(), kB, ckpt);
  DeviceBuffer din = upload_i32(be.get(), in);
  net->forward(*units, din.as<int32_t>(), nullptr, kB, kT, false, 0.0f);
  const int V = arch->config().V, ld = net->logits_stride();
  const std::vector<float> padded = download_act(be.get(), net->logits(), size_t(kB) * kT * ld);
  std::vector<float> out;
  for (int n = 0; n < kB * kT; ++n)
    out.insert(out.end(), padded.begin() + size_t(n) * ld, padded.begin() + size_t(n) * ld + V);
  return out;
}

double AdaptedModel::loss_and_grads(const std::vector<int32_t>& in, const std::vector<int32_t>& tgt, bool ckpt) {
  auto net = arch->make_network(be.get(), kB, ckpt);
  DeviceBuffer din = upload_i32(be.get(), in), dt = upload_i32(be.get(), tgt);
  be->zero(ad_g.get(), size_t(ad->layout().total) * 4);
  net->forward(*units, din.as<int32_t>(), dt.as<int32_t>(), kB, kT, true, 1.0f / float(kB * kT));
  const std::vector<float> l = download_f32(be.get(), net->losses(), size_t(kB) * kT);
  net->backward(*units);
  double s = 0;
  for (float x : l) s += x;
  return s / double(l.size());
}

std::vector<float> AdaptedModel::adapter_grads() const {
  return download_f32(be.get(), ad_g.get(), size_t(ad->layout().total));
}

void AdaptedModel::set_adapter_params(const std::vector<float>& a) {
  REQUIRE(int64_t(a.size()) == ad->layout().total);
  be->copy_to_device(ad_p.get(), a.data(), a.size() * 4);  // fp32 is the CPU backend's act dtype
}

double AdaptedModel::loss(const std::vector<int32_t>& in, const std::vector<int32_t>& tgt) {
  auto net = arch->make_network(be.get(), kB, false);
  DeviceBuffer din = upload_i32(be.get(), in), dt = upload_i32(be.get(), tgt);
  net->forward(*units, din.as<int32_t>(), dt.as<int32_t>(), kB, kT, false, 0.0f);
  double s = 0;
  for (float x : download_f32(be.get(), net->losses(), size_t(kB) * kT)) s += x;
  return s / double(kB * kT);
}

void write_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tgt) {
  SafeTensorFile f;
  f.tensors.push_back(make_tensor("inputs", "I32", {kB, kT}, in.data()));
  f.tensors.push_back(make_tensor("targets", "I32", {kB, kT}, tgt.data()));
  write_safetensors(path, f);
}

void make_peft_case(const PeftCase& c, int rank, double alpha, const TempDir& tmp, const std::string& base_dtype,
                    int layers, int kv_heads) {
  const auto r = run_reference_script("peft_lora.py", "make --arch " + c.arch + " --out '" + tmp.path() + "' --r " +
                                                          std::to_string(rank) + " --alpha " + std::to_string(alpha) +
                                                          " --targets " + c.targets + (c.dora ? " --dora" : "") +
                                                          (base_dtype.empty() ? "" : " --base-dtype " + base_dtype) +
                                                          " --layers " + std::to_string(layers) +
                                                          " --kv-heads " + std::to_string(kv_heads));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

LoraOptions options_for(const PeftCase& c, int rank, double alpha) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.target_modules = c.targets;
  o.dora = c.dora;
  return o;
}

std::vector<float> peft_logits(const std::string& base_dir, const std::string& adapter_dir,
                               const std::vector<int32_t>& in, const TempDir& tmp) {
  write_batch(tmp / "peft_batch.safetensors", in, in);
  const auto r = run_reference_script("peft_lora.py", "logits --base '" + base_dir + "' --adapter '" + adapter_dir +
                                                          "' --batch '" + tmp / "peft_batch.safetensors" +
                                                          "' --out '" + tmp / "peft_logits.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return read_safetensors(tmp / "peft_logits.safetensors").find("logits")->as_f32();
}

int check_equals_peft(AdaptedModel& m, const std::string& base_dir, const std::string& adapter_dir,
                      const TempDir& tmp, const std::vector<int32_t>& in, const std::vector<int32_t>& tgt) {
  write_batch(tmp / "batch.safetensors", in, tgt);
  const auto r = run_reference_script("peft_lora.py", "grads --base '" + base_dir + "' --adapter '" + adapter_dir +
                                                          "' --batch '" + tmp / "batch.safetensors" + "' --out '" +
                                                          tmp / "ref.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const SafeTensorFile ref = read_safetensors(tmp / "ref.safetensors");
  CHECK(max_abs_diff(m.logits(in), ref.find("logits")->as_f32()) <= 1e-5f);
  const double loss = m.loss_and_grads(in, tgt);
  CHECK(std::fabs(loss - ref.find("loss")->as_f32()[0]) <= 1e-5);
  const std::vector<float> g = m.adapter_grads();
  int compared = 0;
  for (const ParamTensor& t : m.ad->layout().tensors) {
    const SafeTensor* want = ref.find("grad." + peft_tensor_name(t.name));
    INFO(t.name);
    REQUIRE(want);
    const std::vector<float> w = want->as_f32();
    CHECK(max_abs_diff(std::vector<float>(g.begin() + t.offset, g.begin() + t.offset + t.numel), w) <= 1e-5f);
    CHECK(*std::max_element(w.begin(), w.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }) != 0);
    ++compared;
  }
  CHECK(compared == int(std::count_if(ref.tensors.begin(), ref.tensors.end(),
                                      [](const SafeTensor& t) { return t.name.rfind("grad.", 0) == 0; })));
  return compared;
}

}  // namespace trainrun::test
