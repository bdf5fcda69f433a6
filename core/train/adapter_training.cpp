// AdapterTraining (adapter_training.h).
#include "core/train/adapter_training.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/checkpoint/base_fingerprint.h"
#include "core/checkpoint/format.h"
#include "core/common/error.h"
#include "core/common/log.h"
#include "core/io/safetensors.h"
#include "core/model/adapter/peft_files.h"
#include "core/model/init_rng.h"
#include "core/model/model_io.h"
#include "parallel/tensor/tp_param_store.h"

namespace fs = std::filesystem;

namespace trainrun {

AdapterTraining::AdapterTraining(const JobSpec& job, const ModelArch& arch, Backend* be, ParamStore& base,
                                 Communicator& world, std::unique_ptr<Communicator> own_world, int shard_group_size,
                                 const CommFactory& factory, int max_rows, const Parallel& par)
    : job_(job), arch_(arch), be_(be), base_(base), world_(world), own_world_(std::move(own_world)) {
  adapters_ = std::make_unique<LoraAdapters>(arch, LoraOptions::from_spec(job.model.adapter), be, max_rows, par.tp);
  const TensorParallelPlan* plan = adapters_->tp_plan();
  if (par.check_host_memory) par.check_host_memory(adapters_->local_layout().total);
  // hybrid_shard's groups for the adapters: the same ranks as the base's,
  // under their own rendezvous keys.
  CommFactory own = [factory](const std::string& prefix, int rank, int world) {
    return factory("adapter_" + prefix, rank, world);
  };
  store_ = make_param_store(job.parallel.sharding, adapters_->local_layout(), be, own_world_.get(), shard_group_size,
                            own, nullptr, par.offload);
  // The TP store's own collective (the grad norm's sum) runs on the
  // network's TP communicator: from the compute thread, between steps.
  if (plan) store_ = make_tensor_parallel_store(std::move(store_), *plan, par.tp->comm);
  units_ = std::make_unique<AdaptedUnitAccess>(base, plan ? par.tp->plan->local_layout() : arch.layout(), *adapters_,
                                               *store_, be);
}

AdapterTraining::AdapterTraining(const JobSpec& job, const ModelArch& arch, Backend* be, PipelineStageStore& base,
                                 const PipelineStagePlan& base_plan, const std::vector<int>& split,
                                 Communicator& world, Communicator* pp, const InnerStoreFactory& make_inner,
                                 int max_rows)
    : job_(job), arch_(arch), be_(be), base_(base), world_(world) {
  adapters_ = std::make_unique<LoraAdapters>(arch, LoraOptions::from_spec(job.model.adapter), be, max_rows);
  plan_ = std::make_unique<PipelineStagePlan>(adapters_->layout(), base_plan.ranks(), int(base_plan.chunks().size()),
                                              base_plan.rank(), split);
  // Held for the whole step, reduced once after it (no pipeline_reshard:
  // the adapters are small).
  auto stage = make_pipeline_stage_store(make_inner(plan_->stage_layout()), *plan_, pp, be, false);
  pipe_ = std::make_unique<AdapterPipeline>(base, base_plan, *adapters_, *stage, *plan_, be);
  store_ = std::move(stage);
}

AdapterTraining::~AdapterTraining() = default;

void AdapterTraining::init_params() {
  const ParamLayout& lay = adapters_->layout();
  std::vector<float> flat(size_t(lay.total));
  const std::string& from = job_.model.adapter.init_from;
  if (!from.empty()) {
    // Every rank reads the (small) file; the ranks agree on any rank's error.
    std::string why;
    try {
      flat = read_peft_adapter(from, arch_, *adapters_, "model.adapter.init_from");
    } catch (const std::exception& e) {
      why = e.what();
    }
    why = first_error_of_ranks(world_, why);
    if (!why.empty()) TR_FAIL(why);
  } else {
    adapters_->init_params(job_.train.seed, 0, lay.total, flat.data());
    if (adapters_->options().dora) {
      // The magnitudes need the frozen base: its blocks one at a time, in the
      // same order on every rank (full_shard gathers each as the network
      // would), so no rank holds more than one block of it. A pipeline
      // stage inits its own blocks (the others' magnitudes stay zero here
      // and are not this rank's to write).
      if (pipe_)
        pipe_->for_each_base_block([&](int l, const void* p) { adapters_->init_magnitudes(l, p, flat.data()); });
      for (int l = 0; l < arch_.config().L && !pipe_; ++l) {
        const void* p = base_.acquire_params(1 + l);
        adapters_->init_magnitudes(l, p, flat.data());
        base_.release_params(1 + l);
      }
      adapters_->finish_magnitudes(flat.data());  // TP: the group's partial norms summed
    }
  }
  std::vector<float> rows;
  for (const ParamStore::Range& r : store_->held_ranges()) {
    if (r.reps == 1) {
      store_->write_state_range(0, r, flat.data() + r.global);
      continue;
    }
    // Strided (a row-parallel A's columns under TP): its runs back to back.
    rows.resize(size_t(r.numel()));
    for (int64_t i = 0; i < r.reps; ++i)
      std::copy_n(flat.data() + r.global + i * r.stride, r.count, rows.data() + i * r.count);
    store_->write_state_range(0, r, rows.data());
  }
  store_->params_updated();
}

void AdapterTraining::set_microbatch(bool training, int step, int64_t first_sample, int T) {
  adapters_->set_training(training);
  adapters_->set_dropout_rows(splitmix64(job_.train.seed ^ splitmix64(0x64726f70ull + uint64_t(step))),
                              first_sample * int64_t(T));
}

std::vector<float> AdapterTraining::gather_whole() {
  // write_ranges() partition the adapter over the ranks: each fills its
  // own, one all-reduce sums them (every other element is zero).
  std::vector<float> flat(size_t(adapters_->layout().total), 0.0f), rows;
  for (const ParamStore::Range& r : store_->write_ranges()) {
    if (r.reps == 1) {
      store_->copy_state_range(0, r, flat.data() + r.global);
      continue;
    }
    // Strided (a row-parallel A's columns under TP): its runs back to back.
    rows.resize(size_t(r.numel()));
    store_->copy_state_range(0, r, rows.data());
    for (int64_t i = 0; i < r.reps; ++i)
      std::copy_n(rows.data() + i * r.count, r.count, flat.data() + r.global + i * r.stride);
  }
  world_.all_reduce(flat.data(), int64_t(flat.size()), ReduceOp::Sum);
  return flat;
}

void AdapterTraining::write_peft(const std::string& dir) {
  const std::vector<float> flat = gather_whole();
  std::string why;
  if (world_.rank() == 0) {
    try {
      write_peft_adapter(dir, arch_, *adapters_, flat, job_.model.init_from);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  why = first_error_of_ranks(world_, why);
  if (!why.empty()) TR_FAIL(why);
}

CheckpointSubject AdapterTraining::checkpoint_subject() const {
  using json = nlohmann::ordered_json;
  const LoraOptions& o = adapters_->options();
  json targets = json::array();
  for (const std::string& n : adapters_->target_names()) targets.push_back(n);
  // base_dtype: the function the adapters were trained against (an NF4 or
  // bf16 base is another model); auto is the backend's act dtype (fp32 on
  // the CPU, bf16 on CUDA), so a CPU checkpoint resumed on CUDA says so.
  const std::string base_dtype = job_.model.base_dtype == "auto" ? dtype_name(be_->act_dtype()) : job_.model.base_dtype;
  json adapter = {{"type", job_.model.adapter.type}, {"r", o.rank}, {"lora_alpha", o.alpha},
                  {"target_modules", targets}, {"numel", adapters_->layout().total}, {"base_dtype", base_dtype}};
  std::string fingerprint = "none (the base is the random init of train.seed)";
  const std::string& base = job_.model.init_from;
  if (world_.rank() == 0 && !base.empty()) {
    // Only rank 0 writes and checks manifests. A base it cannot read fails
    // the load of model.init_from just after, with the reader's message.
    try {
      fingerprint = fingerprint_base(base).describe();
    } catch (const std::exception& e) {
      fingerprint = std::string("unreadable (") + e.what() + ")";
    }
  }
  CheckpointSubject s;
  s.layout = &adapters_->layout();
  // The adapter tensors under our (peft-like) names; the base's metadata
  // plus "trainrun_adapter", so a tool that takes a model file refuses this
  // one by name instead of missing the base's tensors (model_io.h).
  std::vector<SafeTensorEntry> es;
  for (const auto& t : adapters_->layout().tensors) es.push_back({t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  std::map<std::string, std::string> meta = arch_.file_metadata();
  meta["trainrun_adapter"] = adapter.dump();
  s.model_header = encode_safetensors_header(es, meta);
  s.manifest_model = json{{"base", arch_.manifest_model()}, {"base_init_from", base}, {"base_fingerprint", fingerprint},
                      {"adapter", adapter}}.dump();
  const ModelArch* arch = &arch_;
  s.mismatch = [arch, adapter, base, fingerprint](const json& saved) -> std::string {
    if (!saved.contains("adapter") || !saved.contains("base"))
      return "a whole model (no model.adapter); this job trains adapters on a frozen base";
    const std::string shape = manifest_model_mismatch(*arch, saved.at("base"));
    if (!shape.empty()) return "a base whose " + shape;
    const json& was = saved.at("adapter");
    for (const char* key : {"type", "r", "lora_alpha", "target_modules", "base_dtype"}) {
      // A checkpoint from before base_dtype was recorded had an fp32 base.
      const json w = was.contains(key) ? was.at(key) : std::string(key) == "base_dtype" ? json("fp32") : json();
      if (w != adapter.at(key))
        return (std::string(key) == "base_dtype" ? std::string("model.base_dtype") : std::string("model.adapter ") + key) +
               " = " + w.dump() + " but this job has " + adapter.at(key).dump();
    }
    const std::string fp = saved.value("base_fingerprint", std::string());
    if (fp != fingerprint)
      return "the base model.init_from '" + saved.value("base_init_from", std::string()) + "' (" + fp +
             ") but this job's base '" + base + "' is " + fingerprint +
             " (the adapters were trained on other weights; point model.init_from at the original base)";
    return "";
  };
  return s;
}

std::function<void(const std::string&)> AdapterTraining::checkpoint_files() {
  auto flat = std::make_shared<std::vector<float>>(gather_whole());
  if (world_.rank() != 0) return {};
  const ModelArch* arch = &arch_;
  const LoraAdapters* ad = adapters_.get();
  const std::string base = job_.model.init_from;
  return [flat, arch, ad, base](const std::string& dir) {
    write_peft_adapter(dir + "/adapter", *arch, *ad, *flat, base);
  };
}

std::string AdapterTraining::trainable_line() const {
  const int64_t trainable = adapters_->layout().total;
  const int64_t all = trainable + arch_.num_parameters();
  auto grouped = [](int64_t v) {
    std::string s = std::to_string(v), out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (i && (s.size() - i) % 3 == 0) out += ',';
      out += s[i];
    }
    return out;
  };
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.4f", 100.0 * double(trainable) / double(all));
  return "trainable params: " + grouped(trainable) + " || all params: " + grouped(all) + " || trainable%: " + pct;
}

}  // namespace trainrun
