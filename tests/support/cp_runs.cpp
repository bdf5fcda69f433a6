// Runs for the context-parallel tests (cp_runs.h).
#include "tests/support/cp_runs.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/model/model_io.h"
#include "kernels/backend_factory.h"
#include "parallel/context/sequence_split.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/cp_docs.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

Batch make_batch(int T, bool docs, uint64_t seed, int V) {
  Batch b;
  b.T = T;
  std::mt19937_64 gen(seed);
  b.in.resize(size_t(b.B) * T);
  b.tgt.resize(b.in.size());
  for (auto& x : b.in) x = int32_t(gen() % uint64_t(V));
  for (auto& x : b.tgt) x = int32_t(gen() % uint64_t(V));
  if (docs) {
    b.doc_start = make_cp_docs(b.B, T, seed + 1);
    b.pos.resize(b.in.size());
    for (size_t i = 0; i < b.pos.size(); ++i) b.pos[i] = int32_t(i % size_t(T)) - b.doc_start[i];
  }
  return b;
}

std::vector<float> init_params(const ModelArch& arch) {
  std::vector<float> p(size_t(arch.layout().total));
  arch.init_params(42, 0, arch.layout().total, p.data());
  return p;
}

namespace {

// One network's forward + backward on (B, rows) of `in` (its rows), loss
// scaled by the whole batch's tokens as the trainer does.
struct OneNet {
  std::vector<float> losses, grads;
  size_t act_bytes = 0;
  double waited = 0;
};
OneNet run_net(const ModelArch& arch, const std::vector<float>& params, const Batch& b, int rows,
               const std::vector<int32_t>& in, const std::vector<int32_t>& tgt, const std::vector<int32_t>& doc,
               const std::vector<int32_t>& pos, bool ckpt, const ContextParallel* cp) {
  auto be = make_cpu_backend(1);
  DeviceBuffer p = upload_f32(be.get(), params);
  DeviceBuffer g(be.get(), params.size() * 4);
  auto net = arch.make_network(be.get(), b.B, ckpt, nullptr, nullptr, cp);
  FlatUnitAccess units(arch.layout(), p.get(), g.as<float>(), DType::F32);
  DeviceBuffer din = upload_i32(be.get(), in), dtgt = upload_i32(be.get(), tgt);
  DeviceBuffer ddoc = upload_i32(be.get(), doc), dpos = upload_i32(be.get(), pos);
  DocumentMask docs;
  if (!doc.empty()) docs = DocumentMask{ddoc.as<int32_t>(), dpos.as<int32_t>(), cp ? b.doc_start.data() : nullptr};
  net->forward(units, din.as<int32_t>(), dtgt.as<int32_t>(), b.B, rows, true, 1.0f / float(b.B * b.T), docs);
  net->backward(units);
  OneNet r;
  r.losses = download_f32(be.get(), net->losses(), size_t(b.B) * rows);
  r.grads = download_f32(be.get(), g.get(), params.size());
  r.act_bytes = net->activation_bytes();
  return r;
}

}  // namespace

NetResult one_rank(const ModelArch& arch, const Batch& b, bool ckpt) {
  const OneNet r = run_net(arch, init_params(arch), b, b.T, b.in, b.tgt, b.doc_start, b.pos, ckpt, nullptr);
  return NetResult{r.losses, r.grads, r.act_bytes, 0};
}

NetResult cp_ranks(const ModelArch& arch, const Batch& b, int cp, const std::string& mode, bool ckpt) {
  const std::vector<float> params = init_params(arch);
  std::vector<OneNet> per(static_cast<size_t>(cp));
  const auto errors = run_gloo_group(cp, "cp0", std::chrono::seconds(30), [&](Communicator& comm) {
    const SequenceSplit split(b.T, cp, comm.rank());
    const int Tl = split.local_rows();
    std::vector<int32_t> in(size_t(b.B) * Tl), tgt(in.size()), doc, pos;
    split_rows(b.in.data(), in.data(), b.B, 4, split);
    split_rows(b.tgt.data(), tgt.data(), b.B, 4, split);
    if (!b.doc_start.empty()) {
      const LocalDocumentMask m = split_document_mask(b.doc_start.data(), b.B, split);
      doc = m.doc_start, pos = m.pos;
    }
    ContextParallel ctx;
    ctx.comm = &comm;
    ctx.mode = mode;
    per[size_t(comm.rank())] = run_net(arch, params, b, Tl, in, tgt, doc, pos, ckpt, &ctx);
  });
  for (const auto& e : errors) REQUIRE(e == "");
  NetResult r;
  std::vector<const void*> rows;
  for (const auto& o : per) rows.push_back(o.losses.data());
  r.losses.resize(size_t(b.B) * b.T);
  merge_rows(rows, r.losses.data(), b.B, 4, b.T, cp);
  r.grads.assign(params.size(), 0.f);
  for (const auto& o : per)  // the sum the stores' reduction over cp forms
    for (size_t i = 0; i < params.size(); ++i) r.grads[i] += o.grads[i];
  r.act_bytes = per[0].act_bytes;
  return r;
}

// max |got - ref| / max |ref|
double max_rel(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
}

// Accumulation on, gradient clipping on (the norm must count each element once).
std::string cp_job(const std::string& dir, const std::string& model, bool docs) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}" +
         (docs ? ", document_mask: true, document_separator: 3" : "") + "}\n"
         "train: {global_batch_size: 2, micro_batch_size: 1, max_steps: 5, lr: 3.0e-3,\n"
         "        min_lr: 3.0e-4, warmup_steps: 2, eval_interval: 0, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: no_shard, timeout_s: 60}\n";
}


Run run_job(const std::string& model, int world, bool docs, const std::vector<std::string>& sets) {
  TempDir dir("cp_train");
  const JobSpec job = parse_job_spec(cp_job(dir.path(), model, docs), "job.yaml", sets);
  Run out;
  out.losses = run_ranks_inprocess(job, world, /*omp_threads_per_rank=*/1)[0].losses;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

std::vector<std::string> cp_sets(int cp, const std::string& mode, std::vector<std::string> more) {
  more.push_back("parallel.context_parallel=" + std::to_string(cp));
  more.push_back("parallel.cp_mode=" + mode);
  return more;
}

}  // namespace trainrun::test
