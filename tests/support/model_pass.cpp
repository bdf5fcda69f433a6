#include "tests/support/model_pass.h"

#include <catch2/catch.hpp>
#include <random>

#include "kernels/backend.h"
#include "tests/support/device_io.h"

namespace trainrun::test {

std::vector<int32_t> seeded_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

std::vector<float> tensor_f32(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

std::vector<float> hf_flat_params(const ModelArch& arch, const std::string& dir) {
  const std::string path = dir + "/model.safetensors";
  const SafeTensorFile w = read_safetensors(path);
  std::vector<float> flat(size_t(arch.layout().total));
  for (const auto& t : arch.layout().tensors) {
    const SafeTensor* s = w.find(arch.hf_tensor(t).name);
    if (!s) FAIL(path << " has no tensor '" << t.name << "'");
    REQUIRE(s->shape == t.shape);
    const std::vector<float> v = s->as_f32();
    std::copy(v.begin(), v.end(), flat.begin() + t.offset);
  }
  return flat;
}

ModelPass model_pass(const ModelArch& arch, const std::vector<float>& params, const std::vector<int32_t>& in,
                     const std::vector<int32_t>& tg, int B, int T, bool ckpt) {
  const ParamLayout& lay = arch.layout();
  auto be = make_cpu_backend(2);
  auto net = arch.make_network(be.get(), B, ckpt);
  DeviceBuffer p = upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  be->zero(g.get(), size_t(lay.total) * 4);
  DeviceBuffer din = upload_i32(be.get(), in), dtg = upload_i32(be.get(), tg);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  const int N = B * T, V = arch.config().V;
  ModelPass r;
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
  r.logits = download_act(be.get(), net->logits(), size_t(N) * V);
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(N));
  net->backward(units);
  for (float x : download_f32(be.get(), net->losses(), size_t(N))) r.loss += x;
  r.loss /= N;
  r.grads = download_f32(be.get(), g.get(), size_t(lay.total));
  return r;
}

void write_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tg, int B, int T) {
  SafeTensorFile batch;
  batch.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
  batch.tensors.push_back(make_tensor("targets", "I32", {B, T}, tg.data()));
  write_safetensors(path, batch);
}

}  // namespace trainrun::test
