// Preference tuning in the training loop: see preference.h.
#include "core/train/preference.h"

#include <xxhash.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"

namespace fs = std::filesystem;

namespace trainrun {
namespace {

// Version 2 added seq_len to the header (version 1 files are refused as malformed).
constexpr char kRefMagic[8] = {'T', 'R', 'R', 'E', 'F', 'L', 'P', '2'};
constexpr size_t kRefHeader = 40;

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// The model section of the resolved spec: every model.* key, each on its own
// indented line under "model:".
std::string model_section(const JobSpec& job) {
  std::istringstream in(job_spec_to_yaml(job));
  std::string line, out;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != ' ' && line[0] != '#') inside = line.rfind("model:", 0) == 0;
    if (inside) out += line + "\n";
  }
  return out;
}

// Name, size and mtime of every file under `dir` (sorted): a changed
// checkpoint directory gives another hash without reading gigabytes.
std::string dir_fingerprint(const std::string& dir) {
  if (dir.empty()) return "";
  std::vector<std::string> rows;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const auto t = fs::last_write_time(it->path(), ec).time_since_epoch().count();
    rows.push_back(fs::relative(it->path(), dir, ec).string() + " " + std::to_string(it->file_size(ec)) + " " +
                   std::to_string(t));
  }
  std::sort(rows.begin(), rows.end());
  std::string s = dir + "\n";
  for (const auto& r : rows) s += r + "\n";
  return s;
}

uint64_t hash_text(const std::string& s) { return XXH64(s.data(), s.size(), 0); }

std::string hex(uint64_t h) {
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(h));
  return b;
}

fs::path data_dir(const JobSpec& job) { return fs::path(job.data.train).parent_path(); }

// The data's identity: the pair index and prepare.json byte for byte, and
// the name and size of every token shard beside them (reading the shards
// would cost a pass over the data set).
uint64_t data_hash(const JobSpec& job) {
  const fs::path d = data_dir(job);
  std::vector<std::string> shards;
  std::error_code ec;
  for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".bin" && it->is_regular_file(ec))
      shards.push_back(it->path().filename().string() + " " + std::to_string(it->file_size(ec)));
  std::sort(shards.begin(), shards.end());
  std::string s = file_bytes((d / "train.pairs").string()) + "\n" + file_bytes((d / "prepare.json").string()) + "\n";
  for (const auto& r : shards) s += r + "\n";
  return hash_text(s);
}

uint64_t model_hash(const JobSpec& job) {
  return hash_text(model_section(job) + "seed " + std::to_string(job.train.seed) + "\n" +
                   dir_fingerprint(job.model.init_from) + dir_fingerprint(job.model.adapter.init_from));
}

// What read_sidecar found. Stale: well formed but keyed to other data, another
// model or seq_len (a fresh run recomputes it). Corrupt: not a whole file
// of finite log-probs (refused: a torn write or a damaged disk, never used).
enum class Sidecar { Ok, Missing, Stale, Corrupt };

Sidecar read_sidecar(const std::string& path, uint64_t dh, uint64_t mh, int64_t seq_len, int64_t pairs,
                     std::vector<double>& table, std::string& why) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    why = "it does not exist";
    return Sidecar::Missing;
  }
  char head[kRefHeader];
  f.read(head, kRefHeader);
  if (f.gcount() != std::streamsize(kRefHeader) || std::memcmp(head, kRefMagic, 8) != 0) {
    why = "it is not a reference log-prob file (no whole TRREFLP2 header: " + std::to_string(f.gcount()) + " bytes)";
    return Sidecar::Corrupt;
  }
  uint64_t fdh, fmh, fsl, fp;
  std::memcpy(&fdh, head + 8, 8);
  std::memcpy(&fmh, head + 16, 8);
  std::memcpy(&fsl, head + 24, 8);
  std::memcpy(&fp, head + 32, 8);
  if (fdh != dh || fmh != mh || int64_t(fsl) != seq_len || int64_t(fp) != pairs) {
    why = "it was made for data " + hex(fdh) + " / model " + hex(fmh) + " / seq_len " + std::to_string(fsl) + " / " +
          std::to_string(fp) + " pairs, this job has data " + hex(dh) + " / model " + hex(mh) + " / seq_len " +
          std::to_string(seq_len) + " / " + std::to_string(pairs) + " pairs";
    return Sidecar::Stale;
  }
  table.assign(size_t(pairs) * 2, 0.0);
  f.read(reinterpret_cast<char*>(table.data()), std::streamsize(table.size() * 8));
  const int64_t got = int64_t(f.gcount());
  if (got != int64_t(table.size() * 8) || f.peek() != EOF) {
    why = "it holds " + std::to_string(got) + (got == int64_t(table.size() * 8) ? "+" : "") +
          " bytes of log-probs, the header's " + std::to_string(pairs) + " pairs need " +
          std::to_string(table.size() * 8) + " (truncated or changed)";
    return Sidecar::Corrupt;
  }
  for (size_t i = 0; i < table.size(); ++i)
    if (!std::isfinite(table[i])) {
      why = "pair " + std::to_string(i / 2) + "'s " + (i % 2 ? "rejected" : "chosen") + " log-prob is " +
            std::to_string(table[i]) + " (not finite)";
      return Sidecar::Corrupt;
    }
  return Sidecar::Ok;
}

// Through a temp name: the file is fsync'd before the rename and the
// directory after it (as checkpoints commit), so a crash leaves the old
// file or the whole new one, never a torn one under the final name.
void write_sidecar(const std::string& path, uint64_t dh, uint64_t mh, int64_t seq_len,
                   const std::vector<double>& table) {
  // The run's directory may not exist yet: the reference pass runs before
  // the first checkpoint or metrics line creates it.
  std::error_code mk;
  fs::create_directories(fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path(), mk);
  TR_CHECK(!mk, "train.reference precompute: cannot create the directory of '", path, "': ", mk.message(),
           "; check output.dir");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const uint64_t pairs = table.size() / 2, sl = uint64_t(seq_len);
  std::string bytes(kRefHeader + table.size() * 8, '\0');
  std::memcpy(&bytes[0], kRefMagic, 8);
  std::memcpy(&bytes[8], &dh, 8);
  std::memcpy(&bytes[16], &mh, 8);
  std::memcpy(&bytes[24], &sl, 8);
  std::memcpy(&bytes[32], &pairs, 8);
  std::memcpy(&bytes[kRefHeader], table.data(), table.size() * 8);
  write_file_synced(tmp, bytes);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TR_CHECK(!ec, "train.reference precompute: cannot rename '", tmp, "' to '", path, "': ", ec.message());
  fsync_path(fs::path(path).parent_path().string());
}

// Doubles through the float all-reduce, exactly enough: hi + lo carries 48
// bits of the mantissa, and every entry has one non-zero contributor.
void all_reduce_doubles(Communicator& comm, std::vector<double>& x) {
  std::vector<float> hl(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    hl[2 * i] = float(x[i]);
    hl[2 * i + 1] = float(x[i] - double(hl[2 * i]));
  }
  comm.all_reduce(hl.data(), int64_t(hl.size()), ReduceOp::Sum);
  for (size_t i = 0; i < x.size(); ++i) x[i] = double(hl[2 * i]) + double(hl[2 * i + 1]);
}

}  // namespace

void PreferenceTraining::check_job(const JobSpec& job) {
  const auto obj = parse_preference_objective(job.train.objective);
  if (obj == PreferenceObjective::Sft) return;
  const std::string o = "train.objective " + job.train.objective;
  const int cp = job.parallel.context_parallel;
  TR_CHECK(cp == 1, "parallel.context_parallel ", cp, " with ", o, ": preference objectives under context "
           "parallelism are not implemented yet (a sequence's log-prob would be summed over the cp ranks' chunks); "
           "use parallel.context_parallel: 1");
  TR_CHECK(job.data.format == "llmc", o, " reads preference pairs (llm.c shards + .pairs from `trainrun prepare "
           "--format preference`); data.format is ", job.data.format, "; set data.format: llmc");
  TR_CHECK(job.parallel.pipeline_parallel == 1 || obj == PreferenceObjective::Orpo ||
               job.train.reference != "adapter_off",
           o, " with train.reference adapter_off and parallel.pipeline_parallel ", job.parallel.pipeline_parallel,
           " is not supported yet (the adapters-off forward would be a second pass through the schedule); use "
           "train.reference: precompute, or parallel.pipeline_parallel: 1");
  TR_CHECK(job.data.val.empty(), o, " with data.val: the validation of a preference objective (reference log-probs "
           "of the val pairs) is not implemented yet; leave data.val empty");
  TR_CHECK(job.train.micro_batch_size % (job.data.document_mask_on() ? 1 : 2) == 0, o,
           ": train.micro_batch_size ", job.train.micro_batch_size, " is odd; without data.document_mask each "
           "pair is two rows (chosen, rejected) that share a micro-batch, so it must be even");
  if (obj != PreferenceObjective::Orpo && job.train.reference == "adapter_off")
    TR_CHECK(job.model.adapter.on(), o, " with train.reference adapter_off needs model.adapter (the reference is the "
             "network with its adapters switched off); set model.adapter.type, or train.reference: precompute");
  TR_CHECK(obj == PreferenceObjective::Dpo || job.train.dpo_label_smoothing == 0, "train.dpo_label_smoothing: ",
           job.train.dpo_label_smoothing, " is for dpo (conservative DPO); ", o, " has none; set it to 0");
}

PreferenceTraining::PreferenceTraining(const Setup& s)
    : job_(*s.job), s_(s), obj_(parse_preference_objective(s.job->train.objective)) {
  check_job(job_);
  TR_CHECK(s_.src && s_.be, "PreferenceTraining: missing source or backend (a bug)");
  TR_CHECK(s_.net || job_.parallel.pipeline_parallel > 1, "PreferenceTraining: no network (a bug)");
  const size_t n = size_t(s_.mb) * s_.T;
  seq_.resize(n);
  pair_ids_.resize(size_t(s_.mb));
  host_loss_.resize(n);
  host_w_.resize(n);
  dev_w_ = DeviceBuffer(s_.be, n * 4);
}

// In the run's own directory: another job on the same data (another model,
// another seq_len) keeps its own, so a resumed run finds the one it made.
std::string PreferenceTraining::sidecar_path() const {
  return (fs::path(job_.output.dir) / "train.reference_logps").string();
}

void PreferenceTraining::sequence_logps(Network& net, int B, std::vector<double>& logp, std::vector<int64_t>& ntok) {
  const int npairs = B / s_.src->rows_per_pair();
  logp.assign(size_t(2 * npairs), 0.0);
  ntok.assign(size_t(2 * npairs), 0);
  const int64_t n = int64_t(B) * s_.T;
  s_.be->copy_to_host(host_loss_.data(), net.losses(), size_t(n) * 4);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t k = seq_[size_t(t)];
    if (k < 0) continue;
    logp[size_t(k)] -= double(host_loss_[size_t(t)]);
    ++ntok[size_t(k)];
  }
}

void PreferenceTraining::prepare_reference(const std::function<void(int64_t)>& run_chunk, int64_t chunk_rows,
                                           bool is_resume) {
  if (!precompute()) return;
  const int64_t pairs = s_.src->num_pairs();
  const std::string path = sidecar_path();
  const uint64_t dh = data_hash(job_), mh = model_hash(job_);
  // Rank 0 decides and shares the table, so every rank takes the same branch.
  std::vector<double> table(size_t(pairs) * 2, 0.0);
  std::string why;
  std::vector<double> state(1, 0.0);  // rank 0's Sidecar
  if (s_.rank == 0) state[0] = double(int(read_sidecar(path, dh, mh, s_.T, pairs, table, why)));
  if (s_.rank != 0) std::fill(table.begin(), table.end(), 0.0);
  all_reduce_doubles(*s_.world, state);
  const auto found = Sidecar(int(state[0]));
  if (found == Sidecar::Corrupt)
    TR_FAIL("train.reference precompute: the reference log-probs '", path, "' are damaged: ",
            s_.rank == 0 ? why : "see rank 0's log",
            ". Delete the file to recompute them with the starting weights (a fresh run does that; a resumed run "
            "cannot: start it afresh in a new output.dir)");
  if (found == Sidecar::Ok) {
    all_reduce_doubles(*s_.world, table);
    ref_table_ = std::move(table);
    if (s_.rank == 0) TR_LOG_INFO("reference: ", pairs, " pairs' log-probs from ", path, " (data ", hex(dh), ", model ", hex(mh), ")");
    return;
  }
  if (is_resume)
    TR_FAIL("train.reference precompute: resuming, but the reference log-probs '", path, "' cannot be used: ",
            s_.rank == 0 ? why : "see rank 0's log",
            ". They come from the starting weights, which a resumed run no longer has; restore the file that the "
            "first attempt wrote in output.dir, or start the run afresh (a new output.dir)");
  if (s_.rank == 0)
    TR_LOG_INFO("reference: computing ", pairs, " pairs' log-probs with the starting weights (", path, ": ", why, ")");
  // Every rank runs the same number of forwards (a sharded forward's
  // gathers are collectives); rows past the end wrap and are not recorded.
  ref_table_.assign(size_t(pairs) * 2, 0.0);
  ref_rows_ = pairs * s_.src->rows_per_pair();
  for (int64_t base = 0; base < ref_rows_; base += chunk_rows) run_chunk(base);
  all_reduce_doubles(*s_.world, ref_table_);
  if (s_.rank == 0) write_sidecar(path, dh, mh, s_.T, ref_table_);
}

void PreferenceTraining::record_reference(int64_t first, int B, Network& net) {
  if (!s_.counts) return;  // the TP ranks of a dp index saw the same losses: one adds them
  const int rpp = s_.src->rows_per_pair();
  std::vector<double> logp;
  std::vector<int64_t> ntok;
  s_.src->read_segments(first, B, s_.T, seq_.data(), pair_ids_.data());
  sequence_logps(net, B, logp, ntok);
  for (int i = 0; i < B / rpp; ++i) {
    if (first + int64_t(i) * rpp >= ref_rows_) break;
    ref_table_[size_t(pair_ids_[size_t(i)]) * 2] = logp[size_t(2 * i)];
    ref_table_[size_t(pair_ids_[size_t(i)]) * 2 + 1] = logp[size_t(2 * i + 1)];
  }
}

void PreferenceTraining::begin_step(int64_t cursor, int global_B) {
  pairs_global_ = global_B / s_.src->rows_per_pair();
  chosen_targets_global_ =
      obj_ == PreferenceObjective::Orpo ? s_.src->count_chosen_targets(cursor, global_B, s_.T) : 0;
  std::fill(std::begin(sums_), std::end(sums_), 0.0);
}

void PreferenceTraining::micro_batch(int64_t first, int B, const std::function<void()>& ref_forward,
                                     const std::function<void()>& policy_forward) {
  std::vector<double> live;
  std::vector<int64_t> ntok;
  if (adapter_off()) {
    s_.src->read_segments(first, B, s_.T, seq_.data(), pair_ids_.data());
    ref_forward();
    sequence_logps(*s_.net, B, live, ntok);
  }
  policy_forward();
  policy_done(first, B, *s_.net, adapter_off() ? &live : nullptr);
}

void PreferenceTraining::policy_done(int64_t first, int B, Network& net, const std::vector<double>* live_ref) {
  const int rpp = s_.src->rows_per_pair(), npairs = B / rpp, T = s_.T;
  s_.src->read_segments(first, B, T, seq_.data(), pair_ids_.data());
  std::vector<double> ref(size_t(2 * npairs), 0.0), pi;
  std::vector<int64_t> ntok;
  if (live_ref) {
    ref = *live_ref;
  } else if (precompute()) {
    for (int i = 0; i < npairs; ++i) {
      ref[size_t(2 * i)] = ref_table_[size_t(pair_ids_[size_t(i)]) * 2];
      ref[size_t(2 * i + 1)] = ref_table_[size_t(pair_ids_[size_t(i)]) * 2 + 1];
    }
  }
  sequence_logps(net, B, pi, ntok);
  // dL/dloss_t = -dL/dlogp of t's sequence, over the global batch's pairs.
  std::vector<double> w(size_t(2 * npairs), 0.0);
  const double inv_pairs = 1.0 / double(std::max<int64_t>(pairs_global_, 1));
  for (int i = 0; i < npairs; ++i) {
    PairLogps p;
    p.chosen = pi[size_t(2 * i)];
    p.rejected = pi[size_t(2 * i + 1)];
    p.ref_chosen = ref[size_t(2 * i)];
    p.ref_rejected = ref[size_t(2 * i + 1)];
    p.n_chosen = ntok[size_t(2 * i)];
    p.n_rejected = ntok[size_t(2 * i + 1)];
    const PairLoss l = preference_pair_loss(obj_, p, job_.train.dpo_beta, job_.train.dpo_label_smoothing);
    w[size_t(2 * i)] = -l.d_chosen * inv_pairs;
    w[size_t(2 * i + 1)] = -l.d_rejected * inv_pairs;
    sums_[kLoss] += l.loss * inv_pairs;
    sums_[kRewardC] += l.reward_chosen * inv_pairs;
    sums_[kRewardR] += l.reward_rejected * inv_pairs;
    sums_[kAcc] += (l.reward_chosen > l.reward_rejected ? 1.0 : 0.0) * inv_pairs;
    sums_[kMargin] += (l.reward_chosen - l.reward_rejected) * inv_pairs;
    sums_[kLogpC] += l.logp_chosen * inv_pairs;
    sums_[kLogpR] += l.logp_rejected * inv_pairs;
    sums_[kLogOdds] += l.log_odds * inv_pairs;
    sums_[kLogOddsRatio] += l.log_sigmoid_log_odds * inv_pairs;
    if (obj_ == PreferenceObjective::Orpo) {
      // The chosen responses' NLL, a mean over their tokens in the global batch.
      const double inv_tok = 1.0 / double(std::max<int64_t>(chosen_targets_global_, 1));
      w[size_t(2 * i)] += inv_tok;
      sums_[kNll] += -p.chosen * inv_tok;
      sums_[kLoss] += -p.chosen * inv_tok;
    }
  }
  const int64_t n = int64_t(B) * T;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t k = seq_[size_t(t)];
    host_w_[size_t(t)] = k < 0 ? 0.0f : float(w[size_t(k)]);
  }
  s_.be->copy_to_device(dev_w_.get(), host_w_.data(), size_t(n) * 4);
  net.scale_loss_grad(dev_w_.as<float>());
}

void PreferenceTraining::push_sums(std::vector<float>& v) const {
  v[0] = s_.counts ? float(sums_[kLoss]) : 0.0f;
  for (int k = 1; k < kSums; ++k) v.push_back(s_.counts ? float(sums_[k]) : 0.0f);
}

double PreferenceTraining::pop_sums(std::vector<float>& v) {
  const size_t at = v.size() - (kSums - 1);
  double s[kSums];
  s[kLoss] = v[0];
  for (int k = 1; k < kSums; ++k) s[k] = v[at + size_t(k - 1)];
  v.resize(at);
  metrics_ = {{"rewards/chosen", s[kRewardC]},     {"rewards/rejected", s[kRewardR]},
              {"rewards/accuracies", s[kAcc]},     {"rewards/margins", s[kMargin]},
              {"logps/chosen", s[kLogpC]},         {"logps/rejected", s[kLogpR]}};
  if (obj_ == PreferenceObjective::Orpo) {
    metrics_.push_back({"nll_loss", s[kNll]});
    // TRL's ORPOTrainer: log_odds_ratio is the mean of log sigmoid(log odds),
    // log_odds_chosen the mean of the log odds themselves.
    metrics_.push_back({"log_odds_ratio", s[kLogOddsRatio]});
    metrics_.push_back({"log_odds_chosen", s[kLogOdds]});
  }
  return s[kLoss];
}

}  // namespace trainrun
