// Preference tuning in the training loop (train.objective dpo | ipo | orpo).
//
// The data (core/data/preference_pairs.h) gives micro-batches of whole
// pairs, so each rank computes its pairs' losses alone. Per micro-batch:
//   1. the reference log-probs: train.reference precompute reads them from
//      a table made before step 1 (one forward pass over every pair with
//      the starting weights, kept in a sidecar in output.dir);
//      adapter_off runs a forward of the same network with its adapters
//      switched off (the frozen base: no second copy of the weights); orpo
//      needs none;
//   2. the policy forward with dloss_scale 1: each token's loss is
//      -log p(token), its gradient (softmax - onehot) is in the logits;
//   3. on the host, each sequence's summed response log-probs
//      (logp = -sum of its tokens' losses), the pair losses and dL/dlogp
//      (core/train/preference_loss.h); the weight of token t is
//      w[t] = -dL/dlogp[its sequence] / (pairs in the global batch) (orpo:
//      + 1 / (chosen targets in the global batch) on chosen tokens, the NLL
//      term), copied to the device;
//   4. Network::scale_loss_grad(w): the cross-entropy gradient is linear in
//      its scale, so the backward that follows differentiates the
//      preference loss exactly, through every layer, sharding and TP.
// Cost over SFT: the B*T losses to the host and the B*T weights back per
// micro-batch (small next to the B*T*V logits), plus with adapter_off one
// forward without backward.
//
// The sidecar (train.reference precompute): `<output.dir>/train.reference_logps`,
// in the run's own directory (another job on the same data never touches
// it), a header {"TRREFLP2", data hash, model hash, seq_len, pairs} and per
// pair two float64 (chosen, rejected summed log-probs). The data hash is
// xxh64 of the .pairs file, prepare.json and the name and size of each
// token shard; the model hash of the model section of the resolved spec
// (seq_len included), train.seed, and the name, size and mtime of every
// file in model.init_from and model.adapter.init_from. Written through a
// temp file, fsync'd, renamed, the directory fsync'd. A fresh run whose
// sidecar is missing or keyed to other data, another model or seq_len
// recomputes it (and says why); a resumed run, whose weights are no longer
// the starting ones, refuses to, with an error naming the file. A damaged
// one (short, no header, a non-finite value) is refused by name, always.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/config/job_spec.h"
#include "core/data/preference_pairs.h"
#include "core/model/model.h"
#include "core/train/preference_loss.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

// A UnitAccess that hides the adapters of another: the network computes the
// frozen base alone (train.reference adapter_off).
class AdaptersOff final : public UnitAccess {
 public:
  explicit AdaptersOff(UnitAccess& inner) : in_(inner) {}
  const void* acquire_params(int unit) override { return in_.acquire_params(unit); }
  void release_params(int unit) override { in_.release_params(unit); }
  float* unit_grads(int unit) override { return in_.unit_grads(unit); }
  void grads_done(int unit) override { in_.grads_done(unit); }
  void begin_pass(bool backward_pass, bool backward_follows) override { in_.begin_pass(backward_pass, backward_follows); }
  LinearAdapters* adapters() override { return nullptr; }
  bool base_frozen() const override { return true; }

 private:
  UnitAccess& in_;
};

class PreferenceTraining {
 public:
  struct Setup {
    const JobSpec* job = nullptr;
    Backend* be = nullptr;
    Network* net = nullptr;  // null under pipeline parallelism: the last stage's comes with each call
    const PreferenceSource* src = nullptr;
    Communicator* world = nullptr;  // the reference table's all-reduce
    int rank = 0, mb = 0, T = 0, dp_rank = 0, dp_size = 1;
    bool counts = true;  // this rank's figures count (TP rank 0): the others add zeros
  };
  // The job's refusals first (check_job), then the buffers.
  explicit PreferenceTraining(const Setup& s);
  // What a preference job cannot combine with yet, by name (before the model is built).
  static void check_job(const JobSpec& job);

  PreferenceObjective objective() const { return obj_; }
  bool adapter_off() const { return obj_ != PreferenceObjective::Orpo && job_.train.reference == "adapter_off"; }
  bool precompute() const { return obj_ != PreferenceObjective::Orpo && job_.train.reference == "precompute"; }
  // train.reference precompute, before step 1: the sidecar when it matches
  // this data and model, else one pass: run_chunk(base) runs forwards
  // without backward, with the starting weights, over rows [base, base +
  // chunk_rows) split over the dp ranks as training splits a batch, and
  // calls record_reference for each micro-batch where its losses are (the
  // last pipeline stage). Every rank ends with the whole table.
  void prepare_reference(const std::function<void(int64_t)>& run_chunk, int64_t chunk_rows, bool is_resume);
  void record_reference(int64_t first, int B, Network& net);
  const std::vector<double>& reference_table() const { return ref_table_; }  // 2 per pair
  std::string sidecar_path() const;

  void begin_step(int64_t cursor, int global_B);
  // Rows [first, first + B), read by the trainer: ref_forward (adapter_off:
  // a forward whose losses are the reference's) then policy_forward (the
  // forward with for_backward and dloss_scale 1), then the loss gradient's
  // weights. The trainer runs the backward.
  void micro_batch(int64_t first, int B, const std::function<void()>& ref_forward,
                   const std::function<void()>& policy_forward);
  // The part after the policy forward (pipeline parallelism: the last
  // stage's hook calls it with its network): the pair losses and the
  // weights on `net`'s loss gradient. live_ref: adapter_off's log-probs of
  // the micro-batch's sequences; null: the precomputed table (or none).
  void policy_done(int64_t first, int B, Network& net, const std::vector<double>* live_ref = nullptr);
  // The step's sums for the trainer's all-reduce: appended after v[0]
  // (which gets the loss), then read back: the step's loss, and metrics().
  void push_sums(std::vector<float>& v) const;
  double pop_sums(std::vector<float>& v);
  // rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
  // logps/chosen, logps/rejected (+ nll_loss, log_odds_ratio, log_odds_chosen for orpo), TRL's names.
  const std::vector<std::pair<std::string, double>>& metrics() const { return metrics_; }

  // Each of the micro-batch's 2 * pairs sequences' summed log-probs and
  // targets from the network's per-token losses (host copy).
  void sequence_logps(Network& net, int B, std::vector<double>& logp, std::vector<int64_t>& ntok);

 private:
  const JobSpec& job_;
  Setup s_;
  PreferenceObjective obj_;
  std::vector<int32_t> seq_;         // (B*T) the micro-batch's sequence of each target, -1 none
  std::vector<int64_t> pair_ids_;    // (pairs) global pair index
  std::vector<float> host_loss_, host_w_;
  DeviceBuffer dev_w_;
  std::vector<double> ref_table_;    // precompute: (pairs, 2) chosen, rejected
  int64_t ref_rows_ = 0;             // rows of one epoch: record_reference ignores wrapped ones
  int64_t pairs_global_ = 0, chosen_targets_global_ = 0;
  enum { kLoss, kRewardC, kRewardR, kAcc, kMargin, kLogpC, kLogpR, kNll, kLogOdds, kLogOddsRatio, kSums };
  double sums_[kSums] = {};
  std::vector<std::pair<std::string, double>> metrics_;
};

}  // namespace trainrun
