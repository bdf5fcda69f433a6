#include "tests/support/hf_reference.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>

#include "core/io/safetensors.h"
#include "kernels/backend_factory.h"
#include "tests/support/device_io.h"

namespace trainrun::test {

RunResult run_reference_script(const std::string& script, const std::string& args) {
  // Families transformers 4.44 lacks run in the peer venv with the newer one (scripts/install-deps.sh --test).
  const std::string py = script == "hf_qwen3_moe.py" ? source_dir() + "/.venv-hf-next/bin/python" : hf_python();
  return run_command("OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 '" + py + "' '" +
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

std::vector<float> tensor_f32(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

std::vector<int32_t> random_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

void write_token_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tg,
                       int B, int T) {
  REQUIRE(in.size() == size_t(B) * size_t(T));
  REQUIRE(tg.size() == in.size());
  SafeTensorFile batch;
  batch.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
  batch.tensors.push_back(make_tensor("targets", "I32", {B, T}, tg.data()));
  write_safetensors(path, batch);
}

std::vector<float> flat_from_hf(const ModelArch& arch, const std::string& dir) {
  const std::string path = dir + "/model.safetensors";
  const SafeTensorFile w = read_safetensors(path);
  std::vector<float> flat(size_t(arch.layout().total));
  for (const auto& t : arch.layout().tensors) {
    const HfTensor h = arch.hf_tensor(t);
    const SafeTensor* s = w.find(h.name);
    if (!s) FAIL(path << " has no tensor '" << h.name << "' (ours: " << t.name << ")");
    INFO(h.name);
    REQUIRE(s->shape == h.hf_shape(t.shape));
    const std::vector<float> v = s->as_f32();
    float* dst = flat.data() + t.offset;
    if (h.fused()) {  // our rows [fused_row, fused_row + rows) of HF's tensor
      const size_t row = size_t(t.numel / t.shape[0]);
      std::copy(v.begin() + h.fused_row * row, v.begin() + (h.fused_row + t.shape[0]) * row, dst);
    } else if (h.transposed) {  // HF (in, out) -> ours (out, in)
      const int64_t R = t.shape[0], K = t.shape[1];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < K; ++k) dst[r * K + k] = v[size_t(k * R + r)];
    } else {
      std::copy(v.begin(), v.end(), dst);
    }
  }
  return flat;
}

NetworkRun run_network(const ModelArch& arch, const std::vector<float>& flat, const std::vector<int32_t>& in,
                       const std::vector<int32_t>& tg, int B, int T, bool activation_checkpointing) {
  auto be = make_cpu_backend(2);
  const ParamLayout& lay = arch.layout();
  const int V = arch.config().V;
  auto net = arch.make_network(be.get(), B, activation_checkpointing);
  DeviceBuffer p = upload_act(be.get(), flat);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  be->zero(g.get(), size_t(lay.total) * 4);
  DeviceBuffer din = upload_i32(be.get(), in), dtg = upload_i32(be.get(), tg);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  NetworkRun r;
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
  const int ld = net->logits_stride();
  const std::vector<float> padded = download_act(be.get(), net->logits(), size_t(B) * T * ld);
  for (int n = 0; n < B * T; ++n)
    r.logits.insert(r.logits.end(), padded.begin() + size_t(n) * ld, padded.begin() + size_t(n) * ld + V);
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
  net->backward(units);
  r.losses = download_f32(be.get(), net->losses(), size_t(B) * T);
  for (float x : r.losses) r.loss += x;
  r.loss /= double(r.losses.size());
  r.grads = download_f32(be.get(), g.get(), size_t(lay.total));
  return r;
}

std::vector<int32_t> greedy_ids(const ModelArch& arch, const std::vector<float>& flat, std::vector<int32_t> ids,
                                int n) {
  auto be = make_cpu_backend(1);
  auto dec = arch.make_decoder(be.get(), int(ids.size()) + n);
  DeviceBuffer p = upload_act(be.get(), flat);
  FlatUnitAccess units(arch.layout(), p.get(), nullptr, be->act_dtype());
  std::vector<float> logits;
  dec->feed(units, ids.data(), int(ids.size()), logits);
  for (int i = 0; i < n; ++i) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ids.push_back(next);
    if (i + 1 < n) dec->feed(units, &next, 1, logits);
  }
  return ids;
}

void check_cli_generate_equals_hf(const std::string& script, const std::string& hf_dir, const std::string& run,
                                  const std::string& prompt, int n) {
  const RunResult theirs = run_reference_script(
      script, "generate --model '" + hf_dir + "' --prompt '" + prompt + "' --max-new-tokens " + std::to_string(n));
  INFO(theirs.err);
  REQUIRE(theirs.exit_code == 0);
  const RunResult ours = run_trainrun("generate --checkpoint '" + run + "/model.safetensors' --prompt '" + prompt +
                                      "' --max-tokens " + std::to_string(n) + " --top-k 1");
  INFO(ours.err);
  REQUIRE(ours.exit_code == 0);
  std::printf("generate: ours '%s' transformers '%s'\n", ours.out.c_str(), theirs.out.c_str());
  CHECK(ours.out == theirs.out);
}

nlohmann::json check_cli_export_equals_hf(const std::string& script, const ModelArch& arch,
                                          const std::vector<float>& trained, const std::string& run,
                                          const std::string& out, int V, const TempDir& tmp) {
  const RunResult ex = run_trainrun("export --checkpoint '" + run + "/model.safetensors' --out '" + out + "'");
  INFO(ex.err);
  REQUIRE(ex.exit_code == 0);
  const int B = 2, T = 12;
  const std::vector<int32_t> in = random_tokens(size_t(B) * T, V, 3);
  const double e = rel_err(logits_of(arch, trained, in, B, T), hf_logits_of(script, out, in, B, T, tmp));
  std::printf("export: logits rel err %.3e\n", e);
  CHECK(e <= 1e-5);
  std::ifstream cf(out + "/config.json");
  REQUIRE(cf.good());
  return nlohmann::json::parse(cf);
}

}  // namespace trainrun::test
