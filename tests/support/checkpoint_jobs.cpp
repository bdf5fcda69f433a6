#include "tests/support/checkpoint_jobs.h"

#include <fstream>

#include "core/model/model_io.h"

namespace trainrun::test {

std::string checkpoint_job_yaml(const std::string& dir, const std::string& strategy, const std::string& extra) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 18, vocab_size: 23, seq_len: 12}\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 12, micro_batch_size: 3, max_steps: 20, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 4, eval_interval: 0, eval_steps: 1, log_interval: 1, grad_clip: 0.5}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", timeout_s: 60}\n" + extra;
}

JobSpec checkpoint_job(const std::string& dir, const std::string& strategy, int world, std::vector<std::string> sets) {
  // micro-batches that divide 12 sequences at every world size used here
  sets.push_back("train.micro_batch_size=" + std::to_string(world == 3 ? 2 : 3));
  return parse_job_spec(checkpoint_job_yaml(dir, strategy), "job.yaml", sets);
}

std::vector<double> losses_of(const std::string& run_dir) {
  std::vector<double> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  for (std::string l; std::getline(f, l);) {
    auto p = l.find("\"loss\":");
    if (p != std::string::npos) out.push_back(std::stod(l.substr(p + 7)));
  }
  return out;
}

std::vector<float> weights_of(const std::string& run_dir) {
  std::vector<float> w;
  load_model_safetensors(run_dir + "/model.safetensors", w);
  return w;
}

std::string latest_of(const std::string& run_dir) {
  std::ifstream f(run_dir + "/checkpoints/latest");
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace trainrun::test
