// The trainer's side of parameter-efficient fine-tuning (model.adapter,
// docs/fine-tuning.md): the LoRA adapters (core/model/adapter), their own
// ParamStore (the only one the optimizer, the gradient norm and the clip
// see), and the UnitAccess the network computes through (the base's store
// for the frozen weights, the adapters' for the rest).
//
// The adapter store gets its own communicator (or communicators, for
// hybrid_shard: the factory's groups under an "adapter_" prefix): it runs
// its collectives on its own thread, and two threads never enqueue on one
// communicator. Both stores shard alike, so no rank holds the whole base
// under full_shard / hybrid_shard.
//
// Tensor parallelism: the adapters split with the linears they wrap
// (lora.h); their store is the data-parallel store of this rank's slice,
// wrapped by the TP store (parallel/tensor/tp_param_store.h) so that
// checkpoints, PEFT files and init_from stay global. Offload
// (parallel.offload) applies to the adapter store: it is the only one with
// optimizer state.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "core/config/job_spec.h"
#include "core/model/adapter/lora.h"
#include "core/model/tensor_parallel.h"
#include "core/train/adapter_pipeline.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/offload.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// How the adapters run beside the base (AdapterTraining's constructor).
struct AdapterParallel {
  const TensorParallel* tp = nullptr;
  OffloadOptions offload;
  std::function<void(int64_t local_total)> check_host_memory;
};

class AdapterTraining {
 public:
  // base: the base model's store (built as for a full fine-tune); world: the
  // all-ranks communicator, used from the caller's thread for the adapter's
  // files; own_world: a communicator over the same ranks for the adapter
  // store alone: with tensor parallelism, over this rank's data-parallel
  // group (the adapter store shards over dp, as the base's does). max_rows:
  // micro_batch_size x seq_len. par.tp: the network's tensor parallelism
  // (null: none); par.offload: where the adapters' optimizer state lives;
  // par.check_host_memory(elements of this rank's adapter slice) runs
  // before that state is allocated.
  using Parallel = AdapterParallel;
  AdapterTraining(const JobSpec& job, const ModelArch& arch, Backend* be, ParamStore& base, Communicator& world,
                  std::unique_ptr<Communicator> own_world, int shard_group_size, const CommFactory& factory,
                  int max_rows, const Parallel& par = Parallel());

  // Pipeline parallelism (adapter_pipeline.h): `base` is the frozen base's
  // stage store over base_plan; this rank holds the adapters of its stage's
  // blocks only, cut by the same `split`, in a stage store over `pp` (the
  // pipeline group, for the grad norm: null at pp 1) whose inner store
  // make_inner builds over their stage layout (the job's strategy over the
  // stage's dp group, with communicators of their own). Files and
  // checkpoints stay logical: every rank speaks the whole adapter layout.
  using InnerStoreFactory = std::function<std::unique_ptr<ParamStore>(const ParamLayout& stage_layout)>;
  AdapterTraining(const JobSpec& job, const ModelArch& arch, Backend* be, PipelineStageStore& base,
                  const PipelineStagePlan& base_plan, const std::vector<int>& split, Communicator& world,
                  Communicator* pp, const InnerStoreFactory& make_inner, int max_rows);
  ~AdapterTraining();

  // What the network computes through (pp 1), or the pipeline executor's
  // units (pipeline parallelism).
  UnitAccess& units() { return *units_; }
  PipelineUnits& pipeline_units() { return *pipe_; }
  ParamStore& store() { return *store_; }
  const LoraAdapters& adapters() const { return *adapters_; }
  // The adapters' initial values: model.adapter.init_from's PEFT directory,
  // else the counter-based init of train.seed (kaiming-uniform A, B zero;
  // DoRA's magnitudes the base's row norms, read in one pass over its
  // blocks: collective, after the base is loaded).
  void init_params();
  // Before each micro-batch's forward: training (dropout on) or not, the
  // step, and the global index of its first sample.
  void set_microbatch(bool training, int step, int64_t first_sample, int T);
  // adapter/adapter_config.json + adapter_model.safetensors under `dir`
  // (rank 0 writes; collective: every rank calls it).
  void write_peft(const std::string& dir);
  // What the run's checkpoints hold: the adapters and their AdamW state
  // (store()), never the base. The manifest's "model" block names the base
  // (its shape, model.init_from and a fingerprint of its files: rank 0
  // computes it here) and the adapter (type, r, alpha, targets); a resume
  // whose base or adapter differs is an error naming both values.
  CheckpointSubject checkpoint_subject() const;
  // Collective (every rank, before each save): the whole adapter, gathered
  // now; what rank 0 then writes into the checkpoint's directory (adapter/,
  // the PEFT files of that step).
  std::function<void(const std::string& dir)> checkpoint_files();
  // "trainable params: 65,536 || all params: 1,235,814,400 || trainable%: 0.0053", as peft prints it.
  std::string trainable_line() const;

 private:
  std::vector<float> gather_whole();  // the whole adapter on every rank (it is small)
  const JobSpec& job_;
  const ModelArch& arch_;
  Backend* be_;
  ParamStore& base_;
  Communicator& world_;
  std::unique_ptr<Communicator> own_world_;
  std::unique_ptr<LoraAdapters> adapters_;
  std::unique_ptr<PipelineStagePlan> plan_;  // pipeline: the adapters' stage layout (before store_, which reads it)
  std::unique_ptr<ParamStore> store_;
  std::unique_ptr<AdaptedUnitAccess> units_;  // pp 1
  std::unique_ptr<AdapterPipeline> pipe_;      // pipeline
};

}  // namespace trainrun
